"""A daemon under one vLLM version and an engine under another, on one machine.

``python -m wcache.testing.cross_version --model DIR --daemon 0.33.0 --engine 0.32.0``
(on the H200, with a bundle of both versions: tools/gpu/build-bundle.sh 0.32.0,0.33.0;
each version's tree is ``/tmp/vllm-VERSION``, tools/gpu/env.sh).

Starts ``wcache serve`` with the daemon version's tree on ``PYTHONPATH``, then two
engines with the engine version's: ``fallback=false`` (must be refused, the message
naming both versions) and ``fallback=true`` (must load from disk and give the disk
engine's tokens, the fallback reason recorded). Prints one JSON line; exit 0 only when
both hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from wcache.errors import KeyMismatch
from wcache.testing.engine_acceptance import ATTENTION_BACKEND, CUDA_ENGINE_ARGS

#: Where tools/gpu/device-setup.sh installs each vLLM version's tree.
TREE = "/tmp/vllm-{version}"
PROMPT = "The capital of France is"
MAX_TOKENS = 8


def env_for(
    version: str, pythonpath: str | None = None, tree_pattern: str = TREE
) -> dict[str, str]:
    """The environment with ``PYTHONPATH``'s vLLM tree (a ``vllm-*`` entry) replaced by
    ``version``'s, placed after the checkout (the first entry).

    Raises:
        FileNotFoundError: that version's tree is not installed.
    """
    tree = tree_pattern.format(version=version)
    if not Path(tree, "vllm").is_dir():
        raise FileNotFoundError(
            f"no vLLM {version} at {tree}: build the bundle with it "
            f"(tools/gpu/build-bundle.sh 0.32.0,0.33.0)"
        )
    parts = (pythonpath if pythonpath is not None else os.environ.get("PYTHONPATH", "")).split(":")
    parts = [p for p in parts if p and not Path(p).name.startswith("vllm-")]
    at = 1 if parts else 0  # after the checkout, before the shared site
    return {"PYTHONPATH": ":".join(parts[:at] + [tree] + parts[at:]), "WCACHE_GPU_VLLM": version}


def main(argv: list[str] | None = None) -> int:
    from wcache.daemon.process import DaemonProcess, engine_failure_cause, run_engine  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess, run_engine)

    ap = argparse.ArgumentParser(
        prog="python -m wcache.testing.cross_version", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", required=True, help="checkpoint directory (SmolLM2 bf16)")
    ap.add_argument("--daemon", required=True, help="vLLM version the daemon runs")
    ap.add_argument("--engine", required=True, help="vLLM version the engines run")
    args = ap.parse_args(argv)
    d_env, e_env = env_for(args.daemon), env_for(args.engine)
    common: dict[str, Any] = dict(  # run_engine's keywords, shared by every run
        prompts=[PROMPT], max_tokens=MAX_TOKENS, env=e_env, engine_args=list(CUDA_ENGINE_ARGS)
    )
    out: dict = {"daemon_vllm": args.daemon, "engine_vllm": args.engine}

    def step(name: str) -> None:  # progress on stderr: a run cut short still says where
        print(
            f"[cross-version] {name}: {json.dumps(out.get(name), default=str)[:2000]}",
            file=sys.stderr,
            flush=True,
        )

    out["disk_tokens"] = run_engine(args.model, "auto", {}, **common)["token_ids"]
    step("disk_tokens")
    with tempfile.TemporaryDirectory(prefix="wcx-") as sock:
        with DaemonProcess(
            args.model, sock, env=d_env, extra_args=("--attention-backend", ATTENTION_BACKEND)
        ):
            try:
                run_engine(args.model, "wcache", {"fallback": False, "socket_dir": sock}, **common)
                out["strict"] = {"refused": False}
            except RuntimeError as exc:
                root = engine_failure_cause(exc)
                lines = [
                    ln.strip()
                    for ln in root.splitlines()
                    if "vLLM" in ln or "Error" in ln or "key-mismatch" in ln
                ]
                out["strict"] = {
                    "refused": True,
                    "message": "\n".join(lines[-6:]),
                    "key_mismatch": is_key_mismatch(root),
                    "names_both": versions_named(root, args.engine, args.daemon),
                }
            step("strict")
            fb = run_engine(args.model, "wcache", {"fallback": True, "socket_dir": sock}, **common)
            reasons = [r.get("reason") for r in fb.get("load", []) if r.get("phase") == "fallback"]
            out["fallback"] = {
                "identical": fb["token_ids"] == out["disk_tokens"],
                "reasons": reasons,
                "load": fb.get("load"),
            }
    print(json.dumps(out, default=str), flush=True)
    return 0 if passed(out) else 1


def is_key_mismatch(message: str) -> bool:
    """The engine's failure is wcache's key mismatch: its reason code, or (in a traceback,
    which shows the class, not the code) :class:`wcache.errors.KeyMismatch`."""

    return KeyMismatch.code in message or f"wcache.errors.{KeyMismatch.__name__}" in message


def versions_named(message: str, engine: str, daemon: str) -> bool:
    """The refusal names both releases the way the key mismatch does
    (``CacheKey.versions_note``: "vLLM <engine> (engine) vs <daemon> (daemon)"), not
    merely both version strings somewhere (tracebacks show the tree's path)."""
    return f"vLLM {engine} (engine) vs {daemon} (daemon)" in message


def passed(out: dict) -> bool:
    """The strict engine was refused for a key mismatch naming both releases, and the
    fallback engine loaded from disk for that reason with the disk load's tokens."""
    strict, fb = out.get("strict", {}), out.get("fallback", {})
    return bool(
        strict.get("refused")
        and strict.get("key_mismatch")
        and strict.get("names_both")
        and fb.get("identical")
        and fb.get("reasons") == ["key-mismatch"]
    )


if __name__ == "__main__":
    sys.exit(main())
