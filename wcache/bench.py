"""`wcache bench`: restore vs ordinary load, arena vs per-tensor IPC handles.

Two modes:

* default: synthetic Llama-shaped layer stacks (:mod:`wcache.benchmarks.synthetic`) in
  bf16, AWQ int4 and online FP8; per format and size the ordinary load, the
  daemon's prepare, the restore in a fresh process and the vLLM-style
  per-tensor IPC restore (:mod:`wcache.benchmarks.bench_restore`); then the handles
  measurement (N tensors: one arena vs N handles) and the restore-cost curve
  (:mod:`wcache.benchmarks.plot`).
* ``--cpu-engine``: the real vLLM CPU engine on the SmolLM2 fixtures; weight-load
  phase from disk vs from a ``wcache serve`` daemon, per format.

Prints markdown tables and writes JSON (``--out``) from which
docs/benchmarks.md is written. The benchmark code is part of the package
(:mod:`wcache.benchmarks`), so an installed ``wcache bench`` runs anywhere. The
GPU path imports no vLLM.

On the H200 (about 6-8 minutes):

    python -m wcache.bench --device cuda --sizes 1b,8b,30b --formats bf16,awq,fp8 \\
        --out $OUT/gpu.json --plot $OUT/restore_cost.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wcache.benchmarks.plot import plot_restore_cost
from wcache.cli_args import csv_values, refuse_unknown_or_missing
from wcache.testing.isa import build_env, probe, unservable_reason

__all__ = ["main", "build_parser", "run_cpu_engine", "engine_table"]

_REPO_ROOT = Path(__file__).resolve().parents[1]
#: Engine starts per format and side in --cpu-engine mode: one start costs 30-60 s
#: on 2 cores, and the load phase varies far less than that between starts.
DEFAULT_ENGINE_REPS = 1
#: Sizes generated in memory by default: the 1B point needs no ordinary load, and
#: a 30B bf16 checkpoint (~55 GB) would not fit next to the 8B one on a 64 GB disk.
DEFAULT_NO_DISK = "1b,30b"
DEFAULT_GPU_SIZES = "1b,8b,30b"
DEFAULT_CPU_SIZES = "tiny"
DEFAULT_PLOT = "docs/restore_cost.png"

HELP_EPILOG = """\
targets (docs/benchmarks.md records what was reached):
  GPU restore of the 8B-shaped stack (attach + replay) < 50 ms and >= 100x faster
  than its ordinary load from page cache, for every format; arena attach >= 3x
  faster than per-tensor IPC for 2000 tensors; restore time roughly flat from
  1B to 30B; CPU vLLM weight-load phase >= 20x faster from the daemon.

other modes (each has its own --help, e.g. `wcache bench --phases --help`):
  wcache bench --server    time to first completion of vLLM's API server, disk vs daemon
  wcache bench --soak      attach/release soak against a real daemon: attaches/s, latency, RSS, fds
  wcache bench --phases    a whole engine start phase by phase (disk vs daemon, fresh node)

examples:
  wcache bench --device cpu --sizes tiny --layers 2 --formats bf16,awq --reps 1
  wcache bench --device cuda --sizes 1b,8b,30b --out results/gpu.json --plot docs/restore_cost.png
  wcache bench --cpu-engine --engine-formats bf16,awq
  wcache bench --cpu-engine --cpu-build native,avx2 --engine-formats bf16,ct_w8a8_int8
"""


def _results_dir() -> Path:
    """Where results go by default: the checkout's ``benchmarks/results`` when this
    package runs from a source tree, else ``./benchmarks/results`` (an installed
    package has no checkout next to it)."""
    checkout = _REPO_ROOT / "benchmarks"
    return (checkout if checkout.is_dir() else Path.cwd() / "benchmarks") / "results"


def _check_store_deps() -> None:
    missing = [
        m for m in ("blake3", "msgpack", "safetensors") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise SystemExit(
            f"wcache bench needs {', '.join(missing)} (the store imports blake3 "
            f"for its key digest); pip install {' '.join(missing)}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wcache bench",
        description=__doc__,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where weights live and plans run: cuda (cuda:0, cuda_ipc transport) "
        "or cpu (shm transport). Default: cuda when available, else cpu.",
    )
    p.add_argument(
        "--sizes",
        type=csv_values,
        default=None,
        help="comma-separated model shapes: tiny (smoke tests), 1b, 8b (Llama-3.1-8B: "
        "32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads), 30b "
        f"(LLaMA-30B-like with GQA). Default: {DEFAULT_GPU_SIZES} on cuda, "
        f"{DEFAULT_CPU_SIZES} on cpu. Each size is one point of the restore-cost "
        "curve.",
    )
    p.add_argument(
        "--formats",
        type=csv_values,
        default=("bf16", "awq", "fp8"),
        help="comma-separated formats: bf16 (unquantized), awq (AutoAWQ int4, group "
        "128; Marlin plan on cuda, CPUWNA16 on cpu), fp8 (bf16 checkpoint + "
        "online fp8_per_tensor plan, CUTLASS layout; no CPU plan). Default: all.",
    )
    p.add_argument(
        "--no-disk",
        type=csv_values,
        default=csv_values(DEFAULT_NO_DISK),
        help="sizes measured without a checkpoint on disk: the export is synthesized "
        "in memory (one prepared layer per distinct shape, replicated) and only "
        "the restore is measured (no ordinary load, no per-tensor IPC). "
        f"Default: {DEFAULT_NO_DISK}. Pass '' to put every size on disk; an unknown size "
        "is refused (exit 2).",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override every shape's layer count (e.g. 2 for a smoke test).",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="restore repetitions per format and size, each in a fresh spawned "
        "process; the median is reported (default 3).",
    )
    p.add_argument(
        "--load-reps",
        type=int,
        default=2,
        help="ordinary-load repetitions (one fresh process, page cache warm; "
        "median reported; default 2).",
    )
    p.add_argument(
        "--handle-tensors",
        type=int,
        default=None,
        help="tensors of the arena-vs-per-tensor-handles measurement (default 2000 "
        "on cuda, 200 on cpu; 0 skips it).",
    )
    p.add_argument(
        "--handle-mib",
        type=float,
        default=None,
        help="MiB per tensor of the handles measurement (default 12 on cuda, so each "
        "is its own cudaMalloc segment like real weights; 0.0625 on cpu).",
    )
    p.add_argument(
        "--bench-dir",
        default=None,
        help="where synthetic checkpoints are written once and reused (default "
        "$WCACHE_BENCH_DIR or /tmp/wcache-bench). An 8B bf16 file is 13 GiB, "
        "AWQ 3.4 GiB; fp8 reuses the bf16 file. Writing stops with an error "
        "when the disk lacks the space.",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic values.")
    p.add_argument(
        "--out",
        default=None,
        help="JSON results path (default benchmarks/results/<device>.json, or "
        "benchmarks/results/cpu-engine.json with --cpu-engine).",
    )
    p.add_argument(
        "--plot",
        default=None,
        help=f"PNG of restore time vs model size (default {DEFAULT_PLOT} when more "
        "than one size is measured on cuda; otherwise only when given).",
    )
    p.add_argument("--no-plot", action="store_true", help="never draw the PNG.")
    p.add_argument(
        "--simulate-cuda-target",
        action="store_true",
        help="resolve the CUDA plans (kernels none/marlin/cutlass, capability 9.0) "
        "while running on --device; a smoke-test aid that exercises the GPU "
        "code path's plans on a CPU host. Not a performance measurement.",
    )
    p.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how the fresh worker processes start: spawn (default; a new "
        "interpreter per worker) or forkserver (forked from a server that "
        "imported torch and wcache but never touched the device: still no "
        "CUDA context, IPC handle or mapping shared, and start-up in ~0.1 s "
        "instead of seconds; used by the CPU smoke test).",
    )
    p.add_argument(
        "--cpu-engine",
        action="store_true",
        help="instead: run the vLLM CPU engine on the SmolLM2 fixtures "
        "(wcache.testing.fixtures) and compare its weight-load phase from disk "
        "(load format wcache_timed_auto) with the restore from a `wcache serve` "
        "daemon (load format wcache), per format. Needs vLLM (CPU build).",
    )
    p.add_argument(
        "--engine-formats",
        type=csv_values,
        default=None,
        help="fixture formats for --cpu-engine (default: every fixture format: "
        "bf16, awq, gptq, ct_w4a16, ct_w8a8_int8).",
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="instead: time from vLLM's OpenAI-compatible server start to its first "
        "answered completion, from disk vs from a daemon "
        "(wcache.benchmarks.bench_server; its own options follow, see "
        "`wcache bench --server --help`).",
    )
    p.add_argument(
        "--cpu-build",
        type=csv_values,
        default=("native",),
        help="vLLM CPU kernel libraries for --cpu-engine, comma-separated: native "
        "(what vLLM loads on this host) and/or avx2 (vLLM's AVX2 build, "
        "emulated on AVX512 hosts by capping torch, oneDNN and ATen to AVX2); "
        "default native.",
    )
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="instead: daemon ready time from the checkpoint vs from a prepared "
        "snapshot (warm and cold page cache) vs from a peer daemon, with the "
        "raw read/copy bandwidth of the same bytes "
        "(wcache/benchmarks/bench_coldstart.py); synthetic --sizes/--formats on "
        "--device, or with --cpu-engine real `wcache serve` daemons on the "
        "SmolLM2 fixtures (--engine-formats, default bf16,awq).",
    )
    p.add_argument(
        "--snapshot-dir",
        default=None,
        help="--cold-start: where snapshots are written (default: the temp dir); "
        "an 8B bf16 arena needs 13 GiB free.",
    )
    p.add_argument(
        "--engine-reps",
        type=int,
        default=DEFAULT_ENGINE_REPS,
        help="engine starts per format and side for --cpu-engine (median; default 1; "
        "an engine start takes 30-60 s on 2 cores).",
    )
    return p


def _log(msg: str) -> None:
    print(f"wcache bench: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- cpu engine


def run_cpu_engine(
    formats: tuple[str, ...], reps: int, log=_log, cpu_build: str = "native"
) -> list[dict[str, Any]]:
    """Weight-load phase of the vLLM CPU engine from disk vs from a daemon.

    Args:
        cpu_build: ``native`` or ``avx2`` (vLLM's AVX2 kernel library, emulated on
            AVX512 hosts; :mod:`wcache.testing.isa`). Formats that build's vLLM
            cannot serve are skipped with the reason in their row.

    Returns:
        One row per format: ``disk_s``, ``restore_s`` (medians), all samples, the
        load phases seen and ``ratio`` (``None`` with ``skipped`` for a skipped one).

    Raises:
        RuntimeError: an engine or daemon failed, or the restore fell back to disk.
    """

    from wcache.daemon.process import DaemonProcess, run_engine  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess, run_engine)
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    env = build_env(cpu_build)
    library = probe(cpu_build)["kernels"]["cpu.kernel_library"]
    rows = []
    for fmt in formats:
        reason = unservable_reason(fmt, probe(cpu_build)["kernels"])
        if reason:
            log(f"[engine {fmt} {library}] skipped: {reason}")
            rows.append(
                {
                    "format": fmt,
                    "build": cpu_build,
                    "kernel_library": library,
                    "skipped": reason,
                    "ratio": None,
                }
            )
            continue
        path = build(fmt)
        disk = []
        for _ in range(reps):
            res = run_engine(path, "wcache_timed_auto", max_tokens=1, env=env)
            disk.append(res["load"][-1]["seconds"])
        log(f"[engine {fmt} {library}] disk load phase {statistics.median(disk):.3f} s")
        restore, phases = [], []
        with tempfile.TemporaryDirectory(prefix="wcb-engine-") as sd:
            with DaemonProcess(path, sd, env=env):
                for _ in range(reps):
                    res = run_engine(
                        path,
                        "wcache",
                        extra={"socket_dir": sd, "fallback": False},
                        max_tokens=1,
                        env=env,
                    )
                    rec = res["load"][-1]
                    if rec.get("phase") != "restore":
                        raise RuntimeError(
                            f"{fmt}: the engine did not restore from the daemon "
                            f"(phase {rec.get('phase')!r})"
                        )
                    phases.append(rec["phase"])
                    restore.append(rec["seconds"])
        d, r = statistics.median(disk), statistics.median(restore)
        log(f"[engine {fmt} {library}] daemon restore phase {r:.3f} s ({d / r:.1f}x)")
        rows.append(
            {
                "format": fmt,
                "build": cpu_build,
                "kernel_library": library,
                "fixture": str(path),
                "disk_s": d,
                "restore_s": r,
                "disk_s_all": disk,
                "restore_s_all": restore,
                "phases": phases,
                "ratio": d / r if r > 0 else None,
            }
        )
    return rows


def engine_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| vLLM kernel library | format | disk weight-load s | daemon restore s | disk/restore |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lib = r.get("kernel_library", "?")
        if r.get("skipped"):
            lines.append(f"| {lib} | {r['format']} | - | - | skipped: {r['skipped']} |")
            continue
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        lines.append(
            f"| {lib} | {r['format']} | {r['disk_s']:.3f} | {r['restore_s']:.3f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _cold_start(args: argparse.Namespace) -> int:
    """``--cold-start``: see :mod:`wcache.benchmarks.bench_coldstart`."""

    from wcache.benchmarks import bench_coldstart as cold  # noqa: PLC0415 (torch import ~2 s: only when called)

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("wcache.store").setLevel(logging.INFO)  # arena fill / snapshot timings
    if args.cpu_engine:
        rows = cold.run_engine_daemons(args.engine_formats or ("bf16", "awq"), _log)
        sys.stdout.write(cold.engine_table(rows))
        out = Path(args.out or _results_dir() / "coldstart-cpu-engine.json")
        _write_json(out, {"mode": "cold-start-engine", "rows": rows, "time": time.time()})
        _log(f"results written to {out}")
        return 0
    _check_store_deps()
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    device = torch.device(
        "cuda:0"
        if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        else "cpu"
    )
    sizes = args.sizes or csv_values(DEFAULT_CPU_SIZES if device.type == "cpu" else "8b")
    with tempfile.TemporaryDirectory(prefix="wcb-cold-") as socket_dir:
        rows = cold.run_synthetic(
            device,
            sizes,
            args.formats,
            bench_dir=args.bench_dir,
            snap_dir=args.snapshot_dir,
            seed=args.seed,
            layers=args.layers,
            socket_dir=socket_dir,
            log=_log,
        )
    sys.stdout.write(cold.synthetic_table(rows))
    out = Path(args.out or _results_dir() / f"coldstart-{device.type}.json")
    _write_json(
        out,
        {
            "mode": "cold-start",
            "device": str(device),
            "rows": rows,
            "torch": torch.__version__,
            "time": time.time(),
        },
    )
    _log(f"results written to {out}")
    return 0


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work (exit status 2 through ``parser.error``, with the reason
    and the values it takes): a repetition or layer count under 1, a negative
    ``--handle-tensors`` or a ``--handle-mib`` not over 0; for the synthetic
    suites (the plain one and ``--cold-start``), ``--sizes`` or ``--formats`` naming no
    value or an unknown one, and ``--no-disk`` naming an unknown size; for ``--cpu-engine``, such a ``--cpu-build``; and such an
    ``--engine-formats`` (the fixture formats)."""
    for flag, value in (
        ("--reps", args.reps),
        ("--load-reps", args.load_reps),
        ("--engine-reps", args.engine_reps),
    ):
        if value < 1:
            parser.error(f"{flag} {value}: give 1 or more repetitions")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: give 1 or more layers")
    if args.handle_tensors is not None and args.handle_tensors < 0:
        parser.error(f"--handle-tensors {args.handle_tensors}: give 0 (skip it) or more tensors")
    if args.handle_mib is not None and not args.handle_mib > 0:
        parser.error(f"--handle-mib {args.handle_mib:g}: give a size over 0 MiB")
    if args.cpu_engine:
        from wcache.testing.isa import BUILDS as CPU_BUILDS  # noqa: PLC0415 (imported at call time, as the fixtures below)

        refuse_unknown_or_missing(
            parser,
            "--cpu-build",
            [b for b in args.cpu_build if b not in CPU_BUILDS],
            not args.cpu_build,
            f"CPU builds: {', '.join(CPU_BUILDS)}",
        )
    else:  # the synthetic suites: the plain one and --cold-start
        from wcache.benchmarks.synthetic import FORMATS, SHAPES  # noqa: PLC0415 (torch import ~2 s: only when called)

        sizes = () if args.sizes is None else args.sizes
        refuse_unknown_or_missing(
            parser,
            "--sizes/--formats",
            [s for s in sizes if s not in SHAPES] + [f for f in args.formats if f not in FORMATS],
            not args.formats or args.sizes == (),
            f"sizes: {', '.join(SHAPES)}, formats: {', '.join(FORMATS)}",
        )
        # an unknown name was dropped: `--no-disk 8B` put the 8b stack on disk (GiBs,
        # minutes), the very thing --no-disk avoids; '' (every size on disk) stays valid
        refuse_unknown_or_missing(
            parser,
            "--no-disk",
            [s for s in args.no_disk if s not in SHAPES],
            False,
            f"sizes: {', '.join(SHAPES)} ('' puts every size on disk)",
        )
    if args.engine_formats is not None:
        from wcache.testing.fixtures import FORMATS as FIXTURE_FORMATS  # noqa: PLC0415 (torch import ~2 s: only when called)

        refuse_unknown_or_missing(
            parser,
            "--engine-formats",
            [f for f in args.engine_formats if f not in FIXTURE_FORMATS],
            not args.engine_formats,
            f"fixture formats: {', '.join(FIXTURE_FORMATS)}",
        )


def main(argv: list[str] | None = None) -> int:
    """`wcache bench` entry point; returns the exit status (2, before any work, for an
    argument it refuses)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    _check_args(parser, args)
    if args.cold_start:
        return _cold_start(args)
    if args.cpu_engine:
        from wcache.testing.fixtures import FORMATS as FIXTURE_FORMATS  # noqa: PLC0415 (torch import ~2 s: only when called)

        rows = [
            row
            for cpu_build in args.cpu_build
            for row in run_cpu_engine(
                args.engine_formats or tuple(FIXTURE_FORMATS), args.engine_reps, cpu_build=cpu_build
            )
        ]
        sys.stdout.write(engine_table(rows))
        out = Path(args.out or _results_dir() / "cpu-engine.json")
        _write_json(out, {"mode": "cpu-engine", "rows": rows, "time": time.time()})
        _log(f"results written to {out}")
        return 0

    _check_store_deps()
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.benchmarks.bench_restore import (  # noqa: PLC0415 (torch import ~2 s: only when called)
        DEFAULT_HANDLE_MIB,
        DEFAULT_HANDLE_TENSORS,
        BenchOptions,
        handles_table,
        markdown_table,
        run_suite,
    )

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    sizes = args.sizes or csv_values(DEFAULT_GPU_SIZES if device == "cuda" else DEFAULT_CPU_SIZES)
    cuda = device == "cuda"
    opts = BenchOptions(
        device=device,
        sizes=sizes,
        formats=args.formats,
        no_disk=tuple(s for s in args.no_disk if s in sizes),
        layers=args.layers,
        reps=args.reps,
        load_reps=args.load_reps,
        handle_tensors=(
            args.handle_tensors
            if args.handle_tensors is not None
            else DEFAULT_HANDLE_TENSORS
            if cuda
            else 200
        ),
        handle_mib=(
            args.handle_mib
            if args.handle_mib is not None
            else DEFAULT_HANDLE_MIB
            if cuda
            else 0.0625
        ),
        bench_dir=args.bench_dir,
        seed=args.seed,
        simulate_cuda_target=args.simulate_cuda_target,
        start_method=args.start_method,
    )
    results = run_suite(opts, _log)
    sys.stdout.write(markdown_table(results["rows"]))
    if results["handles"]:
        sys.stdout.write("\n" + handles_table(results["handles"]))
    sys.stdout.flush()
    out = Path(args.out or _results_dir() / f"{device}.json")
    _write_json(out, results)
    _log(f"results written to {out}")
    plot = args.plot or (str(_REPO_ROOT / DEFAULT_PLOT) if cuda and len(sizes) > 1 else None)
    if plot and not args.no_plot:
        _log(f"restore-cost curve written to {plot_restore_cost(results, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
