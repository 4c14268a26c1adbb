"""`wcache bench --phases`: where the time of a whole engine start goes, phase by phase.

For one model, each row is one vLLM engine started in its own process
(:func:`wcache.daemon.process.run_engine`), timed from process start to the first
token of its first request, and split into the phases of
:data:`wcache.benchmarks.phases.PHASES`: process start, vLLM import, model build,
weights, compile, graph capture, KV-cache profiling/other engine init, other, first
token (how each is measured: :mod:`wcache.benchmarks.phases`). The rows (run in
this order, whatever order ``--rows`` gives):

  disk-eager            weights from disk, enforce_eager
  daemon-eager          weights from a `wcache serve` daemon, enforce_eager
  disk-compiled-cold    from disk, torch.compile (+ CUDA graphs), empty compile caches
  disk-compiled-warm    the same on the caches the cold row left (a restart)
  daemon-compiled-cold  from the daemon, compiled, empty caches
  daemon-compiled-warm  the same on the caches its cold row left
  fresh-node            empty caches, against a daemon started --from-snapshot of a
                        snapshot written by a daemon started with --prime-compile (it
                        carries vLLM's compile artifacts; the engine installs them at
                        attach); reported as not run when `wcache serve` has no
                        --prime-compile

Caches: every "node" is one root of :func:`wcache.testing.caches.cache_env`
(vLLM's torch.compile cache, Triton, Inductor, the CUDA JIT cache). A cold row gets
an empty root; a warm row the root its cold row filled (or one filled by an
unrecorded warm-up start when its cold row is not asked for). Eager rows each get an
empty root too.

Model: on CUDA the 8B-shaped bf16 Llama of
:mod:`wcache.benchmarks.bench_engine_cuda` (written once under --root), production
defaults (vLLM's max_model_len and max_num_seqs, so its CUDA graph sizes; KV cache by
profiling 0.3 of the GPU, as the other 8B benchmarks, with the daemon's copy beside
it; attention TRITON_ATTN); on CPU the SmolLM2-135M bf16 fixture with the small-host
settings of wcache.vllm.run_engine (max_model_len 512, one sequence).

Output: JSON (--out: every row, phase, figure, command, versions, device), a markdown
table (stdout, and --markdown) with the ratio disk-compiled-cold / fresh-node for the
target and the phases that remain, and a PNG of stacked bars (--plot; matplotlib).
Timings come from one run; nothing asserts them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from wcache.benchmarks.phases import (
    NEGLIGIBLE_S,
    PHASES,
    breakdown,
    parse_log,
    phase_lines,
    total_s,
)
from wcache.benchmarks.plot import pyplot_for
from wcache.daemon.process import engine_failure_cause
from wcache.testing.caches import (
    CACHE_ENV_DIRS,
    cache_env,
    cache_states,
    cache_writes,
    host_cache_dirs,
)
from wcache.vllm.run_engine import vllm_engine_args

__all__ = [
    "ROWS",
    "Row",
    "run",
    "table",
    "plot_phases",
    "main",
    "merge_results",
    "prime_compile_supported",
]

HELP_EPILOG = """\
target (issue 24; docs/benchmarks.md records what was reached):
  one run, 8B-shaped, production defaults: on a fresh node (empty compile cache) an
  engine against a daemon seeded from a snapshot reaches its first token at least 3x
  faster than the same engine from disk (disk-compiled-cold / fresh-node >= 3).

examples:
  wcache bench --phases                                   # every row; cuda if present
  wcache bench --phases --rows disk-eager,daemon-eager --model-kind tiny
  wcache bench --phases --device cuda --out $OUT/phases.json --plot $OUT/phases.png
  wcache bench --phases --from-json a.json b.json --out all.json --markdown all.md
"""


@attrs.frozen
class Row:
    """One row of the benchmark.

    Attributes:
        name: the row's id (``--rows``).
        source: ``disk``, ``daemon`` (a `wcache serve` from the checkpoint) or
            ``snapshot`` (the fresh node: a daemon --from-snapshot of a primed one).
        compiled: torch.compile and CUDA graphs (run_engine ``--compile``).
        caches: ``cold`` (an empty cache root) or ``warm`` (the root of its cold row).
    """

    name: str
    source: str
    compiled: bool
    caches: str

    @property
    def node(self) -> str:
        """The cache root's name: a warm row shares its cold row's."""
        return f"{self.source}-{'compiled' if self.compiled else 'eager'}"


ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        Row("disk-eager", "disk", False, "cold"),
        Row("daemon-eager", "daemon", False, "cold"),
        Row("disk-compiled-cold", "disk", True, "cold"),
        Row("disk-compiled-warm", "disk", True, "warm"),
        Row("daemon-compiled-cold", "daemon", True, "cold"),
        Row("daemon-compiled-warm", "daemon", True, "warm"),
        Row("fresh-node", "snapshot", True, "cold"),
    )
}
#: The target's two rows and its ratio (issue 24).
TARGET_DISK_ROW, TARGET_ROW, TARGET_RATIO = "disk-compiled-cold", "fresh-node", 3.0
#: The closest measured row when the fresh node cannot run (said so in the table).
SUBSTITUTE_ROW = "daemon-compiled-warm"
PROMPT = "The capital of France is"
#: Tokens generated after the first-token request (the same for every row, compared).
MAX_TOKENS = 8
#: The `wcache serve` option the fresh-node row needs (the prime-compile branch).
PRIME_COMPILE_FLAG = "--prime-compile"
#: One engine start with a cold Inductor compile: minutes on 2 CPU cores, ~75 s for
#: the 8B shape on the H200; room for a busy machine.
ENGINE_TIMEOUT_S = 1800.0
#: `wcache serve --help` answers in a few seconds (it imports no vLLM).
HELP_TIMEOUT_S = 120.0
#: Share of the H200 an 8B engine may claim (bench_engine_cuda's, with the daemon's copy).
CUDA_GPU_MEMORY_UTILIZATION = 0.3
CUDA_ATTENTION_BACKEND = "TRITON_ATTN"
#: CPU engines: run_engine's small-host defaults (the daemon's ENGINE_ARGS match them).
CPU_MAX_MODEL_LEN = 512
#: vLLM logs to stdout by default; run_engine returns stderr as ``log`` and keeps
#: stdout for its JSON line, so the engines of this benchmark log to stderr.
LOG_ENV = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
#: run_engine's value for "vLLM's default" (max_num_seqs).
VLLM_DEFAULT = 0
MODEL_KINDS = ("8b", "smol", "tiny")
#: Figure size (inches) and resolution of the PNG: readable at GitHub's page width.
FIGSIZE_IN = (8.0, 4.2)
DPI = 150
#: The meta fields two runs' JSON must share to be merged into one table.
COMPARABLE_META = (
    "device_name",
    "vllm",
    "torch",
    "model_kind",
    "engine_args",
    "serve_args",
    "engine_env",
    "stack_samples_s",
)
#: The directory --stack-samples puts first on the engines' PYTHONPATH (its sitecustomize).
STACK_SAMPLER_DIR = str(Path(__file__).resolve().parent / "_stack_sampler")


def _log(msg: str) -> None:
    print(f"wcache bench --phases: {msg}", file=sys.stderr, flush=True)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def prime_compile_supported() -> tuple[bool, str]:
    """Whether `wcache serve` knows :data:`PRIME_COMPILE_FLAG` (from its ``--help``).

    Returns:
        ``(supported, reason)``; ``reason`` says why not.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "wcache.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    if PRIME_COMPILE_FLAG in proc.stdout:
        return True, ""
    return False, (
        f"`wcache serve` has no {PRIME_COMPILE_FLAG} option on this checkout (the "
        f"prime-compile branch is not merged): the fresh-node row needs a snapshot "
        f"that carries vLLM's compile artifacts"
    )


def model_setup(
    kind: str, device: str, root: Path, model: str | None = None
) -> tuple[Path, list[str], list[str]]:
    """The checkpoint, the run_engine options and the `wcache serve` options of a kind.

    Returns:
        ``(checkpoint, engine_args, serve_args)``; both argument lists set the same
        max_model_len (it is part of the cache key).
    """
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    if model is not None:
        path = Path(model)
    elif kind == "8b":
        from wcache.benchmarks.bench_engine_cuda import write_llama_checkpoint  # noqa: PLC0415 (torch import ~2 s: only when called)

        path = write_llama_checkpoint(root / "llama-8b-bf16", "bf16", Path(build("bf16")))
    elif kind == "tiny":
        from wcache.testing.tiny import build_tiny  # noqa: PLC0415 (torch import ~2 s: only when called)

        path = Path(build_tiny("bf16"))
    else:
        path = Path(build("bf16"))
    if device == "cuda":
        cfg = json.loads((path / "config.json").read_text())
        max_len = str(cfg["max_position_embeddings"])  # vLLM's default for the model
        engine = [
            "--attention-backend",
            CUDA_ATTENTION_BACKEND,
            "--gpu-memory-utilization",
            str(CUDA_GPU_MEMORY_UTILIZATION),
            "--max-model-len",
            max_len,
            "--max-num-seqs",
            str(VLLM_DEFAULT),
        ]
        serve = ["--attention-backend", CUDA_ATTENTION_BACKEND, "--max-model-len", max_len]
    else:
        engine = ["--max-model-len", str(CPU_MAX_MODEL_LEN)]
        serve = []
    return path, engine, serve


def _error_lines(exc: BaseException) -> list[str]:

    lines = [ln.strip() for ln in engine_failure_cause(exc).splitlines() if ln.strip()]
    return lines[-6:]


class _Runner:
    """Runs the rows: owns the cache roots, the daemons and the engine calls."""

    def __init__(
        self,
        ckpt: Path,
        engine_args: Sequence[str],
        serve_args: Sequence[str],
        device: str,
        work: Path,
        log: Callable[[str], None],
        log_dir: Path | None = None,
        stack_samples_s: float = 0.0,
        engine_env: Mapping[str, str] | None = None,
    ):
        self.ckpt, self.device, self.work, self.log = ckpt, device, work, log
        self.log_dir, self.stack_samples_s = log_dir, stack_samples_s
        self.engine_env = dict(engine_env or {})
        self.engine_args, self.serve_args = list(engine_args), list(serve_args)
        self.nodes: dict[str, Path] = {}
        self.warmed: set[str] = set()
        self.daemon: Any = None
        self.daemon_info: dict[str, Any] = {}
        self.fresh = 0

    def node(self, name: str, fresh: bool) -> Path:
        """The cache root of ``name``: a new empty one when ``fresh``."""

        if fresh or name not in self.nodes:
            self.fresh += 1
            root = self.work / f"node-{self.fresh}-{name}"
            shutil.rmtree(root, ignore_errors=True)
            cache_env(root)
            self.nodes[name] = root
        return self.nodes[name]

    def engine(self, load_format: str, extra: dict, compiled: bool, root: Path, name: str) -> dict:
        """One engine of row ``name``; its whole log goes to ``log_dir/name.log``, what
        it wrote into each cache (its node's and the host's) to ``res["cache_writes"]``."""
        from wcache.daemon.process import run_engine  # noqa: PLC0415 (imported at call time: tests patch run_engine)

        args = self.engine_args + (["--compile"] if compiled else [])
        watched = {
            **{f"node/{sub}": root / sub for sub in CACHE_ENV_DIRS.values()},
            **host_cache_dirs(),
        }
        before = cache_states(watched)
        t0 = time.time()
        try:
            res = run_engine(
                self.ckpt,
                load_format,
                extra,
                prompts=[PROMPT],
                max_tokens=MAX_TOKENS,
                env={**cache_env(root), **LOG_ENV, **self.engine_env, **self._sampler_env(name)},
                timeout_s=ENGINE_TIMEOUT_S,
                engine_args=args,
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out = getattr(exc, "output", None)
            self._keep_log(
                name, (out.decode(errors="replace") if isinstance(out, bytes) else out) or str(exc)
            )
            raise
        self._keep_log(name, res.get("output") or res.get("log") or "")
        res["wall_s"] = time.time() - t0
        res["cache_writes"] = cache_writes(before, cache_states(watched))
        res["spawn_time"] = t0
        res["command"] = {
            "module": "wcache.vllm.run_engine",
            "model": str(self.ckpt),
            "load_format": load_format,
            "extra": extra,
            "engine_args": args,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "env": {**cache_env(root), **self.engine_env},
        }
        return res

    def _sampler_env(self, name: str) -> dict[str, str]:
        """With --stack-samples: the environment that makes every Python process of the
        engine sample its stacks into ``log_dir/name.stacks.{pid}``
        (wcache/benchmarks/_stack_sampler, read by wcache.benchmarks.stacks)."""
        if not self.stack_samples_s or self.log_dir is None:
            return {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONPATH": STACK_SAMPLER_DIR + (os.pathsep + path if path else ""),
            "WCACHE_STACK_SAMPLES": str(self.log_dir / f"{name}.stacks"),
            "WCACHE_STACK_SAMPLE_S": str(self.stack_samples_s),
        }

    def _keep_log(self, name: str, text: str) -> None:
        """The engine's whole output (stdout and stderr) in ``log_dir/name.log``."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{name}.log").write_text(text)

    def disk_format(self) -> str:
        # CPU: vLLM's default loader timed by wcache (vLLM's CPU model runner logs no
        # "Model loading took"); CUDA: plain "auto", timed by vLLM's own line
        return "wcache_timed_auto" if self.device == "cpu" else "auto"

    def daemon_socket(self) -> str:
        from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

        if self.daemon is None:
            sock = tempfile.mkdtemp(prefix="wcb-phases-")
            self.daemon = DaemonProcess(
                self.ckpt,
                sock,
                extra_args=self.serve_args,
                env=cache_env(self.node("daemon", fresh=True)),
            )
            self.daemon.start()
            self.daemon_info = {
                "ready_s": self.daemon.ready_s,
                "command": self.daemon.args,
                "ready_line": self.daemon.ready_lines[-1:],
            }
            self.log(f"daemon ready in {self.daemon.ready_s:.1f} s")
        return self.daemon.socket_dir

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            shutil.rmtree(self.daemon.socket_dir, ignore_errors=True)
            self.daemon = None

    def fresh_node(self, row: Row) -> dict[str, Any]:
        """The fresh-node row: prime, snapshot, a daemon --from-snapshot, an engine."""
        from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

        ok, reason = prime_compile_supported()
        if not ok:
            return {"not_run": reason}
        snap = self.work / "snapshot-primed"
        shutil.rmtree(snap, ignore_errors=True)
        info: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="wcb-prime-") as sock:
            # the priming engine is built from the serve's arguments: give it the
            # engines' (vLLM's compile key covers max_model_len and max_num_seqs; the
            # memory share lets it start beside the daemon)
            prime = DaemonProcess(
                self.ckpt,
                sock,
                env=cache_env(self.node("prime", True)),
                extra_args=[
                    *self.serve_args,
                    *vllm_engine_args(list(self.engine_args)),
                    # its engines are run_engine's LLM()
                    PRIME_COMPILE_FLAG,
                    "llm",
                    "--snapshot",
                    str(snap),
                ],
            )
            with prime:
                t0 = time.time()
                info["prime_daemon"] = {
                    "ready_s": prime.ready_s,
                    "command": prime.args,
                    "primed": prime.wait_primed(),
                    "priming_s": time.time() - t0,
                }
        root = self.node(row.node, fresh=True)
        with tempfile.TemporaryDirectory(prefix="wcb-fresh-") as sock:
            served = DaemonProcess(
                self.ckpt,
                sock,
                env=cache_env(root),
                extra_args=[*self.serve_args, "--from-snapshot", str(snap)],
            )
            with served:
                info["snapshot_daemon"] = {
                    "ready_s": served.ready_s,
                    "command": served.args,
                    "ready_line": served.ready_lines[-1:],
                }
                res = self.engine(
                    "wcache", {"socket_dir": sock, "fallback": False}, True, root, row.name
                )
        return {**info, "result": res, "cache_root": str(root)}

    def row(self, row: Row) -> dict[str, Any]:
        out: dict[str, Any] = {
            "row": row.name,
            "source": row.source,
            "compiled": row.compiled,
            "caches": row.caches,
        }
        try:
            if row.source == "snapshot":
                got = self.fresh_node(row)
                if "not_run" in got:
                    return {**out, **got}
                res = got.pop("result")
                out.update(got)
            else:
                warm = row.caches == "warm"
                root = self.node(row.node, fresh=not warm)
                extra = (
                    {"socket_dir": self.daemon_socket(), "fallback": False}
                    if row.source == "daemon"
                    else {}
                )
                fmt = "wcache" if row.source == "daemon" else self.disk_format()
                if warm and row.node not in self.warmed:
                    self.log(f"{row.name}: warming its caches with one unrecorded start")
                    out["warmup_wall_s"] = self.engine(
                        fmt, extra, row.compiled, root, f"{row.name}-warmup"
                    )["wall_s"]
                res = self.engine(fmt, extra, row.compiled, root, row.name)
                out["cache_root"] = str(root)
                if row.compiled:
                    self.warmed.add(row.node)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out["error"] = _error_lines(exc) if isinstance(exc, RuntimeError) else [str(exc)]
            return out
        loads = res.get("load") or []
        if row.source != "disk" and not any(r.get("phase") == "restore" for r in loads):
            out["error"] = [f"the engine did not restore from the daemon (load records: {loads})"]
            return out
        out.update(
            {
                **_phase_fields(
                    res["phases"]["marks"], res["log"], loads, row.compiled, self.device
                ),
                "wall_s": res["wall_s"],
                "marks": res["phases"]["marks"],
                "log_lines": phase_lines(res["log"]),
                "process_start_source": res["phases"]["process_start_source"],
                "load": loads,
                "token_ids": res["token_ids"],
                "command": res["command"],
                "cache_writes": res.get("cache_writes"),
            }
        )
        return out


def _phase_fields(
    marks: Mapping[str, float],
    log: str,
    loads: Sequence[Mapping[str, Any]],
    compiled: bool,
    device: str,
) -> dict[str, Any]:
    """A row's ``phases``, ``total_s`` and ``figures`` from its evidence (run_engine's
    marks, vLLM's log or its phase lines, the loader's records)."""
    phases = breakdown(marks, log, loads, compiled=compiled, device=device)
    return {
        "phases": [p.to_json() for p in phases],
        "total_s": total_s(phases),
        "figures": parse_log(log),
    }


def _same_tokens(row: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> bool | None:
    """Whether ``row`` gave the tokens of the first of ``earlier`` that has any (None
    when none has: ``row`` is the first)."""
    first = next((r for r in earlier if "token_ids" in r), None)
    return None if first is None else first["token_ids"] == row["token_ids"]


def run(
    rows: Sequence[str],
    ckpt: Path,
    engine_args: Sequence[str],
    serve_args: Sequence[str],
    device: str,
    work: Path,
    log: Callable[[str], None] = _log,
    on_row: Callable[[list[dict[str, Any]], Mapping[str, Any]], None] = lambda rows, daemon: None,
    log_dir: Path | None = None,
    stack_samples_s: float = 0.0,
    engine_env: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``rows`` (names of :data:`ROWS`) in :data:`ROWS` order. After each row
    ``on_row`` gets the rows so far and the shared daemon's info (results survive a
    timeout); with ``log_dir`` every engine's whole output is kept there, and with
    ``stack_samples_s`` > 0 its processes' stack samples (every that many seconds).
    ``engine_env`` goes into every engine's environment (``--startup-plan``).

    Returns:
        ``(results, daemon)``: one dict per row (``phases``, ``total_s``, ``figures``,
        ``command``, ...; or ``error``; or ``not_run`` with the reason), and the shared
        daemon's ready time and command (empty when no daemon row ran).
    """
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    runner = _Runner(
        ckpt, engine_args, serve_args, device, work, log, log_dir, stack_samples_s, engine_env
    )
    results: list[dict[str, Any]] = []
    try:
        for name in (n for n in ROWS if n in rows):
            log(f"{name}: starting")
            res = runner.row(ROWS[name])
            if "total_s" in res:
                res["same_tokens_as_first_row"] = _same_tokens(res, results)
                log(
                    f"{name}: first token at {res['total_s']:.2f} s ("
                    + ", ".join(f"{p['name']} {p['seconds']:.2f}" for p in res["phases"])
                    + ")"
                )
            else:
                log(f"{name}: {res.get('error') or res.get('not_run')}")
            results.append(res)
            on_row(results, runner.daemon_info)
    finally:
        runner.stop()
    return results, runner.daemon_info


# --------------------------------------------------------------------------- rendering


def merge_results(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """Several runs' JSON (``--out`` of one device call each) as one result.

    A row that ran is recomputed from the evidence it saved (its marks, vLLM's phase
    lines and the loader's records), so a later fix of the parser applies to an
    earlier run. Where files hold the same row, the last file's wins, unless it did
    not run (an error, not run) and an earlier one did; rows come in :data:`ROWS`
    order.

    A file that is itself a merge contributes its own runs, so merges nest: ``meta.runs``
    lists every device call once, and each row's ``run`` is the index in it of the call
    that measured the row (None for a row of a merge written before rows recorded it).

    Returns:
        ``{"meta", "daemon", "rows", "target"}`` as :func:`main` writes; ``meta`` is
        the first file's, with ``runs`` (each run's path, date, git and command) and
        ``measured`` (how one run was measured: its device and that it is one run).

    Raises:
        ValueError: no file given, or the files differ in one of
            :data:`COMPARABLE_META` (their rows do not compare).
    """
    runs = [json.loads(Path(p).read_text()) for p in paths]
    if not runs:
        raise ValueError("merge_results: no results file given")
    seen = {
        json.dumps({k: _meta_value(r["meta"], k) for k in COMPARABLE_META}, sort_keys=True)
        for r in runs
    }
    if len(seen) > 1:
        raise ValueError(
            f"merge_results: the files differ in {', '.join(COMPARABLE_META)} "
            f"({sorted(seen)}): rows of different setups do not compare"
        )
    device = runs[0]["meta"]["device"]
    rows: dict[str, dict[str, Any]] = {}
    daemon_of: dict[str, Mapping[str, Any]] = {}  # row -> its file's shared daemon
    leaves: list[dict[str, Any]] = []  # every device call, once (a merged file's own runs)
    for path, run_ in zip(paths, runs):
        offset = len(leaves)
        own = run_["meta"].get("runs")
        leaves += (
            own
            if own
            else [
                {
                    "path": str(path),
                    **{k: run_["meta"].get(k) for k in ("date", "git", "git_dirty", "command")},
                }
            ]
        )
        for r in run_["rows"]:
            if "marks" not in r and "marks" in rows.get(r["row"], {}):
                continue  # a later failed or skipped try does not hide a row that ran
            if "marks" in r:
                r = {
                    **r,
                    **_phase_fields(
                        r["marks"],
                        "\n".join(r["log_lines"]),
                        r.get("load") or [],
                        r["compiled"],
                        device,
                    ),
                }
            known = r.get("run") if own else 0
            rows[r["row"]] = {**r, "run": None if known is None else offset + known}
            daemon_of[r["row"]] = run_.get("daemon") or {}
    ordered = [rows[n] for n in ROWS if n in rows]
    for i, r in enumerate(ordered):  # as run() sets it, in the merged order
        if "token_ids" in r:
            r["same_tokens_as_first_row"] = _same_tokens(r, ordered[:i])
    meta = {**runs[0]["meta"], "runs": leaves, "measured": _measured(runs[0]["meta"])}
    meta["provenance"] = (
        f"merged from {len(leaves)} runs of wcache.benchmarks.bench_phases "
        f"(meta.runs); each row measured in one of them (its run); "
        f"{meta['measured']}"
    )
    daemon = next(
        (
            daemon_of[r["row"]]
            for r in ordered
            if r.get("source") == "daemon" and daemon_of[r["row"]]
        ),
        {},
    )
    return {"meta": meta, "daemon": daemon, "rows": ordered, "target": target_summary(ordered)}


def _measured(meta: Mapping[str, Any]) -> str:
    """How one run of ``meta`` was measured: its ``measured`` (a merge), else its
    provenance less any "merged from ..." prefixes (a merge written before ``measured``)."""
    if meta.get("measured"):
        return str(meta["measured"])
    return str(meta.get("provenance", "")).rsplit("each row measured in one of them; ", 1)[-1]


def startup_plan_env() -> dict[str, str]:
    """The engines' environment of --startup-plan: vLLM's switch
    (:data:`wcache.vllm.startup.STARTUP_PLAN_ENV`) on."""
    from wcache.vllm.startup import STARTUP_PLAN_ENV  # noqa: PLC0415 (torch import ~2 s: only when called)

    return {STARTUP_PLAN_ENV: "1"}


def _meta_value(meta: Mapping[str, Any], key: str) -> Any:
    """``meta[key]`` for the comparison of merged runs; a run from before --startup-plan
    or --stack-samples has no ``engine_env`` / ``stack_samples_s``: it set none (the
    sampler runs inside the timed processes, so sampled rows do not merge with others)."""
    value = meta.get(key)
    if value is None:  # written before the field existed: the default
        return {"engine_env": {}, "stack_samples_s": 0.0}.get(key)
    return value


def _by_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {r["row"]: r for r in rows}


def target_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The target's figures: ``ratio`` (disk-compiled-cold / fresh-node totals, or None),
    ``one_run`` (both rows measured in one run: always in a run's own result; in a
    merge, when both rows' ``run`` is the same), ``reached`` (the ratio is at least
    :data:`TARGET_RATIO` and ``one_run``: the target is one run's ratio), ``remaining``
    (the fresh node's phases above :data:`NEGLIGIBLE_S`, longest first), and, when the
    fresh node did not run, the same against :data:`SUBSTITUTE_ROW`
    (``substitute_ratio``; not the target's row)."""
    by = _by_row(rows)
    disk = by.get(TARGET_DISK_ROW, {}).get("total_s")
    out: dict[str, Any] = {
        "disk_row": TARGET_DISK_ROW,
        "row": TARGET_ROW,
        "target_ratio": TARGET_RATIO,
        "ratio": None,
        "reached": None,
    }
    fresh = by.get(TARGET_ROW, {})
    if fresh.get("total_s") and disk:
        out["ratio"] = disk / fresh["total_s"]
        # the target is one run's ratio; merged rows (with ``run``) may come from two
        runs_ = (by[TARGET_DISK_ROW].get("run", 0), fresh.get("run", 0))
        out["one_run"] = None not in runs_ and runs_[0] == runs_[1]
        out["reached"] = out["ratio"] >= TARGET_RATIO and out["one_run"]
        out["remaining"] = [
            [p["name"], p["seconds"]]
            for p in sorted(fresh["phases"], key=lambda p: -p["seconds"])
            if p["seconds"] > NEGLIGIBLE_S
        ]
    else:
        out["why_not"] = (
            fresh.get("not_run")
            or (fresh.get("error") and "fresh-node failed: " + " ".join(fresh["error"]))
            or ("not requested" if not fresh else "")
            or f"{TARGET_DISK_ROW} did not run"
        )
        sub = by.get(SUBSTITUTE_ROW, {})
        if sub.get("total_s") and disk:
            out["substitute_row"] = SUBSTITUTE_ROW
            out["substitute_ratio"] = disk / sub["total_s"]
            out["substitute_remaining"] = [
                [p["name"], p["seconds"]]
                for p in sorted(sub["phases"], key=lambda p: -p["seconds"])
                if p["seconds"] > NEGLIGIBLE_S
            ]
    return out


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per row, one column per phase (seconds), the total to the first
    token and the compile cache; then the target's ratio and the phases that remain."""
    head = ["row", *PHASES, "to first token", "compile cache"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(PHASES) + 1) + "---|"]
    for r in rows:
        if "phases" not in r:
            why = r.get("not_run") or "failed: " + " ".join(r.get("error", []))
            out.append(f"| {r['row']} | not run: {why[:300]} |" + " |" * (len(PHASES) + 1))
            continue
        secs = {p["name"]: p["seconds"] for p in r["phases"]}
        cells = [f"{secs[n]:.2f}" for n in PHASES]
        cache = r["figures"].get("compile_cache", "none") if r["compiled"] else "-"
        cache = "not logged" if cache == "none" else cache  # vLLM CPU logs no compile lines
        out.append(
            f"| {r['row']} | " + " | ".join(cells) + f" | **{r['total_s']:.2f}** | {cache} |"
        )
    s = target_summary(rows)
    out.append("")
    if s["ratio"] is not None:
        out.append(
            f"Target: {TARGET_DISK_ROW} / {TARGET_ROW} = **{s['ratio']:.2f}x** (target "
            f">= {TARGET_RATIO:.0f}x: {'reached' if s['reached'] else 'NOT reached'}"
            + (
                ""
                if s["one_run"]
                else "; the two rows were measured in different "
                "runs (meta.runs), and the target is one run's ratio"
            )
            + "). "
            "Phases that remain on the fresh node: "
            + ", ".join(f"{n} {v:.2f} s" for n, v in s["remaining"])
            + "."
        )
    else:
        out.append(
            f"Target ({TARGET_DISK_ROW} / {TARGET_ROW} >= {TARGET_RATIO:.0f}x): not "
            f"measured: {s['why_not']}."
        )
        if "substitute_ratio" in s:
            out.append(
                f"For scale only (not the target's row): {TARGET_DISK_ROW} / "
                f"{SUBSTITUTE_ROW} = {s['substitute_ratio']:.2f}x; its phases: "
                + ", ".join(f"{n} {v:.2f} s" for n, v in s["substitute_remaining"])
                + "."
            )
    return "\n".join(out) + "\n"


def plot_phases(results: Mapping[str, Any], png: str | Path) -> Path:
    """Stacked horizontal bars: one bar per row that ran, one segment per phase.

    Args:
        results: what :func:`main` writes as JSON (``rows`` and ``meta``).
        png: output path; parent dirs are created.

    Returns:
        The path written.
    """

    plt, png = pyplot_for(png)
    ran = [r for r in results["rows"] if "phases" in r][::-1]  # first row on top
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(ran)
    for i, name in enumerate(PHASES):
        widths = [next(p["seconds"] for p in r["phases"] if p["name"] == name) for r in ran]
        ax.barh(
            [r["row"] for r in ran], widths, left=left, color=colors[i % len(colors)], label=name
        )
        left = [a + b for a, b in zip(left, widths)]
    for y, (r, x) in enumerate(zip(ran, left)):
        ax.annotate(
            f"{r['total_s']:.1f} s", (x, y), textcoords="offset points", xytext=(3, -3), fontsize=7
        )
    meta = results.get("meta", {})
    ax.set_xlabel("seconds from process start to the first token")
    ax.set_title(
        f"engine start by phase: {meta.get('model_kind', '')} on "
        f"{meta.get('device_name', meta.get('device', ''))}, vLLM "
        f"{meta.get('vllm', '?')}",
        fontsize=9,
    )
    ax.set_xlim(0, max(left, default=1.0) * 1.12)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wcache bench --phases",
        description=__doc__,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda (the engines' vLLM CUDA build) or cpu (vLLM-CPU). Default: cuda "
        "when torch sees a GPU, else cpu.",
    )
    p.add_argument(
        "--rows",
        type=_csv,
        default=tuple(ROWS),
        help=f"comma-separated subset of {','.join(ROWS)} (default: all; always "
        "run in that order).",
    )
    p.add_argument(
        "--model-kind",
        choices=MODEL_KINDS,
        default=None,
        help="8b (bench_engine_cuda's 8B-shaped bf16 Llama, written under --root; "
        "default on cuda), smol (the SmolLM2-135M bf16 fixture; default on "
        "cpu) or tiny (wcache.testing.tiny's 2-layer bf16 Llama; tests).",
    )
    p.add_argument(
        "--model", default=None, help="a bf16 checkpoint directory instead of --model-kind's"
    )
    p.add_argument(
        "--root",
        default=os.environ.get("WCACHE_BENCH_DIR", "/tmp/wcache-phases"),
        help="work dir: the 8B checkpoint (~16 GB), cache roots, the snapshot "
        "(default $WCACHE_BENCH_DIR or /tmp/wcache-phases)",
    )
    p.add_argument("--out", default=None, help="JSON results (rewritten after every row)")
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.add_argument("--plot", default=None, help="PNG of the stacked phases (matplotlib)")
    p.add_argument(
        "--startup-plan",
        action="store_true",
        help="set VLLM_ENABLE_STARTUP_PLAN=1 on every engine (vLLM 0.33+, off by "
        "default): a warm cache root or a fresh node's start-up artifacts then "
        "give the KV-cache memory its profiling arrived at, and the engine "
        "skips that profiling. Recorded in the JSON (meta.engine_env)",
    )
    p.add_argument(
        "--stack-samples",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="a diagnostic: every SECONDS, sample the Python stacks of every "
        "engine process into {--out}.logs/ROW.stacks.PID (needs --out; read "
        "them with python -m wcache.benchmarks.stacks). Default 0: off",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: merge these --out files (rows split over device "
        "calls; the last file's row wins unless it failed), recompute each row's phases "
        "from its saved evidence, and write --out/--markdown/--plot",
    )
    return p


def _meta(device: str, kind: str, ckpt: Path, argv: Sequence[str]) -> dict[str, Any]:

    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.vllm.compat import vllm_version  # noqa: PLC0415 (torch import ~2 s: only when called)

    meta = {
        "device": device,
        "model_kind": kind,
        "checkpoint": str(ckpt),
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "command": ["wcache", "bench", "--phases", *argv],
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "provenance": (
            "measured by wcache.benchmarks.bench_phases in one run; "
            f"{'a CUDA GPU' if device == 'cuda' else 'CPU only, no GPU'}"
        ),
    }
    if device == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(0)
    else:
        meta["device_name"] = f"CPU ({os.cpu_count()} cores)"
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=HELP_TIMEOUT_S,
        )
        meta["git"] = rev.stdout.strip() or None
        # a copied checkout (the device machine's) can carry stale git metadata: say
        # whether the files differ from the commit named
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=HELP_TIMEOUT_S,
            cwd=Path(__file__).resolve().parent,
        )
        meta["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        meta["git"] = meta["git_dirty"] = None
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (`wcache bench --phases ...`); returns 0 unless a row failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.from_json:
        return _write_merged(args)
    if args.stack_samples < 0 or (args.stack_samples and not args.out):
        raise SystemExit(
            "--stack-samples: give a positive interval in seconds, and --out "
            "(the samples go to {--out}.logs/)"
        )
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    kind = args.model_kind or ("8b" if device == "cuda" else "smol")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    ckpt, engine_args, serve_args = model_setup(kind, device, root, args.model)
    meta = _meta(device, kind if args.model is None else "custom", ckpt, argv)
    engine_env = startup_plan_env() if args.startup_plan else {}
    meta.update(
        engine_args=engine_args,
        serve_args=serve_args,
        engine_env=engine_env,
        stack_samples_s=args.stack_samples,
    )

    def results(rows: list[dict[str, Any]], daemon: Mapping[str, Any]) -> dict[str, Any]:
        return {"meta": meta, "daemon": dict(daemon), "rows": rows, "target": target_summary(rows)}

    with tempfile.TemporaryDirectory(prefix="nodes-", dir=root) as work:
        rows, daemon = run(
            args.rows,
            ckpt,
            engine_args,
            serve_args,
            device,
            Path(work),
            on_row=lambda rows, daemon: _save(args.out, results(rows, daemon)),
            log_dir=_log_dir(args.out),
            stack_samples_s=args.stack_samples,
            engine_env=engine_env,
        )
    return _write_outputs(args, results(rows, daemon))


def _save(out: str | None, results: Mapping[str, Any]) -> None:
    """``results`` as JSON at ``out`` (nothing without --out)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str))


def _write_outputs(args: argparse.Namespace, results: Mapping[str, Any]) -> int:
    """--out, the table (stdout and --markdown) and --plot of ``results``; returns 0
    unless a row failed."""
    _save(args.out, results)
    text = table(results["rows"])
    sys.stdout.write(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot:
        _log(f"phases written to {plot_phases(results, args.plot)}")
    return 1 if any("error" in r for r in results["rows"]) else 0


def _log_dir(out: str | None) -> Path | None:
    """Where the engines' whole output goes: ``{--out without its suffix}.logs/ROW.log``
    (none without --out). The JSON keeps only vLLM's phase lines; a phase nobody
    expected needs the rest."""
    return None if not out else Path(out).with_name(Path(out).stem + ".logs")


def _write_merged(args: argparse.Namespace) -> int:
    try:
        merged = merge_results(args.from_json)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise SystemExit(f"wcache bench --phases --from-json: {exc}") from exc
    return _write_outputs(args, merged)


if __name__ == "__main__":
    sys.exit(main())
