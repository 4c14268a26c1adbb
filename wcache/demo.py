"""The main job (`make demo`): SmolLM2 AWQ from disk vs from the wcache daemon.

1. Build (or reuse) the SmolLM2-135M-Instruct AWQ int4 checkpoint.
2. Start a daemon (`wcache serve`) for it on a temporary socket directory.
3. Run vLLM (CPU) once from disk and once from the daemon (fallback disabled).
4. Print both generated texts, whether they are identical, and the
   weight-load phase time of each with the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from wcache.vllm.process import DaemonProcess, run_engine

PROMPT = "The capital of France is"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="awq",
                    help="fixture format: bf16, awq, gptq, ct_w4a16, ct_w8a8_int8 (default awq)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    from wcache.testing.fixtures import build  # noqa: PLC0415

    print(f"[1/4] building the SmolLM2 {args.format} checkpoint (cached after the first run)",
          flush=True)
    model = build(args.format)
    print(f"      {model}")
    with tempfile.TemporaryDirectory(prefix="wcache-demo-") as sock_dir:
        print("[2/4] starting the wcache daemon", flush=True)
        with DaemonProcess(model, sock_dir) as daemon:
            print(f"      {daemon.ready_lines[-1]}  ({daemon.ready_s:.1f} s)")
            print("[3/4] vLLM from disk (load_format=auto, timed)", flush=True)
            disk = run_engine(model, "wcache_timed_auto", prompts=[PROMPT],
                              max_tokens=args.max_tokens)
            print("[4/4] vLLM from the daemon (load_format=wcache, fallback=false)", flush=True)
            restored = run_engine(model, "wcache", {"socket_dir": sock_dir, "fallback": False},
                                  prompts=[PROMPT], max_tokens=args.max_tokens)
    t_disk = disk["load"][-1]["seconds"]
    t_rest = restored["load"][-1]["seconds"]
    same = disk["token_ids"] == restored["token_ids"]
    print()
    print(f"prompt:               {PROMPT!r}")
    print(f"from disk:            {disk['texts'][0]!r}")
    print(f"from the daemon:      {restored['texts'][0]!r}")
    print(f"outputs:              {'identical' if same else 'DIFFERENT'}")
    print(f"weight-load phase:    disk {t_disk:.3f} s, daemon {t_rest:.3f} s, "
          f"ratio {t_disk / t_rest:.1f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
