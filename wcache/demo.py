"""The main job (`make demo`): SmolLM2 from disk vs from the wcache daemon.

For each format (default: AWQ int4, then bf16):

1. build (or reuse) the SmolLM2-135M-Instruct checkpoint;
2. start a daemon (`wcache serve`) for it on a temporary socket directory;
3. run vLLM (CPU) once from disk and once from the daemon (fallback disabled);
4. print both generated texts, whether they are identical, and the
   weight-load phase time of each with the ratio.

The weight-load phase is the worker's ``load_model`` call: vLLM's
``DefaultModelLoader.load_model`` timed as is (``wcache_timed_auto``) against
wcache's restore (meta build, plan resolution, key, attach, install, replay).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from wcache.vllm.process import DaemonProcess, run_engine

PROMPT = "The capital of France is"
DEFAULT_FORMATS = ("awq", "bf16")


def run_format(fmt: str, max_tokens: int) -> dict:
    from wcache.testing.fixtures import build  # noqa: PLC0415

    print(f"[{fmt}] building the SmolLM2 {fmt} checkpoint (cached after the first run)",
          flush=True)
    model = build(fmt)
    with tempfile.TemporaryDirectory(prefix="wcache-demo-") as sock_dir:
        print(f"[{fmt}] starting the wcache daemon", flush=True)
        with DaemonProcess(model, sock_dir) as daemon:
            print(f"[{fmt}] {daemon.ready_lines[-1]}  ({daemon.ready_s:.1f} s)", flush=True)
            print(f"[{fmt}] vLLM from disk (load_format=auto, timed)", flush=True)
            disk = run_engine(model, "wcache_timed_auto", prompts=[PROMPT], max_tokens=max_tokens)
            print(f"[{fmt}] vLLM from the daemon (load_format=wcache, fallback=false)", flush=True)
            restored = run_engine(model, "wcache", {"socket_dir": sock_dir, "fallback": False},
                                  prompts=[PROMPT], max_tokens=max_tokens)
    return {"disk": disk, "restored": restored}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                    help="comma-separated fixture formats: bf16, awq, gptq, ct_w4a16, "
                         "ct_w8a8_int8 (default: awq,bf16)")
    ap.add_argument("--max-tokens", type=int, default=2,
                    help="greedy tokens to generate (default 2: ' Paris.' for bf16)")
    args = ap.parse_args(argv)

    results = {fmt: run_format(fmt, args.max_tokens) for fmt in args.formats.split(",")}
    ok = True
    print()
    print(f"prompt: {PROMPT!r}")
    for fmt, r in results.items():
        t_disk = r["disk"]["load"][-1]["seconds"]
        t_rest = r["restored"]["load"][-1]["seconds"]
        same = r["disk"]["token_ids"] == r["restored"]["token_ids"]
        ok &= same
        print(f"\n[{fmt}]")
        print(f"  from disk:          {r['disk']['texts'][0]!r}")
        print(f"  from the daemon:    {r['restored']['texts'][0]!r}")
        print(f"  outputs:            {'identical' if same else 'DIFFERENT'}")
        print(f"  weight-load phase:  disk {t_disk:.3f} s, daemon {t_rest:.3f} s, "
              f"ratio {t_disk / t_rest:.1f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
