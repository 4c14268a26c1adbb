"""``wcache serve --prime-compile``: once the daemon serves, run ONE engine against
it with private, empty start-up caches, and keep what that engine's compile wrote
as the daemon's start-up artifact bundle (:mod:`wcache.store.artifacts`), so the
first engine on a node that gets this daemon's arena (here, from its snapshot, or
from it as a peer) does not pay a cold compile.

The engine is ``python -m wcache.vllm.prime_engine`` (the serve's own vLLM engine
arguments, compiled, ``load_format="wcache"``) in a child process with ``fallback: false`` (a priming run that loaded from disk
would prove nothing about this daemon) and the loader option ``artifacts_record``
(the engine writes the compile factors its vLLM computed: the bundle records
those). Imports no vLLM; the bundle is packed by :mod:`wcache.vllm.startup`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["PRIME_TIMEOUT_S", "ROOT_ENV", "priming_args", "priming_command", "prime_compile", "PrimingFailed"]

logger = logging.getLogger("wcache.daemon")

#: How long the priming engine may take (seconds): an 8B model's cold
#: torch.compile + CUDA-graph capture takes minutes; a tiny model on 2 loaded CPU
#: cores about 2-3 minutes (measured here: 105 s of compile in a 205 s start).
PRIME_TIMEOUT_S = 1800.0
#: Bundle root name -> the environment variable pointing that cache of the
#: priming engine at its private directory.
ROOT_ENV = {"vllm": "VLLM_CACHE_ROOT", "triton": "TRITON_CACHE_DIR",
            "inductor": "TORCHINDUCTOR_CACHE_DIR"}
#: Characters of the priming engine's output kept in a failure message.
OUTPUT_TAIL_CHARS = 2000


from wcache.errors import PrimingFailed  # noqa: E402


def priming_args(rest: list[str]) -> list[str]:
    """The serve's vLLM engine arguments ``rest`` as the priming engine gets them: the
    same, less ``--enforce-eager`` (the daemon itself need not compile; the engines
    priming is for do).

    Raises:
        PrimingFailed: more than one rank (priming runs one engine).
    """
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    known, _ = ap.parse_known_args(rest)
    if known.tensor_parallel_size * known.pipeline_parallel_size != 1:
        raise PrimingFailed("priming runs one engine of one rank; this daemon serves "
                            f"TP={known.tensor_parallel_size} x PP={known.pipeline_parallel_size}")
    return [a for a in rest if a != "--enforce-eager"]


def priming_command(model: str, rest: list[str], *, socket_dir: str | None, job: str,
                    record: str) -> list[str]:
    """The priming engine's command line: :mod:`wcache.vllm.prime_engine` with the
    serve's vLLM engine arguments ``rest`` verbatim (the compile-cache key covers
    them), restored from this daemon with fallback off and its factors recorded.

    Raises:
        PrimingFailed: more than one rank.
    """
    extra = {"fallback": False, "socket_dir": socket_dir, "job": job, "artifacts_record": record}
    return [sys.executable, "-m", "wcache.vllm.prime_engine", "--model", model,
            "--extra", json.dumps(extra), "--", *priming_args(rest)]


def prime_compile(model: str, rest: list[str], *, socket_dir: str | None, job: str = "",
                  timeout_s: float = PRIME_TIMEOUT_S) -> Any:
    """Run the priming engine and return the bundle of what it wrote.

    Returns:
        A :class:`wcache.store.artifacts.Bundle` (fd owned by the caller).

    Raises:
        PrimingFailed: the engine failed, timed out or recorded no factors
            (its output's tail in the message).
        ArtifactsMissing: it wrote no compile artifact.
    """
    from wcache.vllm.startup import compile_dirs, pack_primed  # noqa: PLC0415

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wcache-prime-") as root:
        dirs = {name: Path(root) / name for name in ROOT_ENV}
        for d in dirs.values():
            d.mkdir()
        record = os.path.join(root, "factors.json")
        cmd = priming_command(model, rest, socket_dir=socket_dir, job=job, record=record)
        env = {**os.environ, **{ROOT_ENV[n]: str(d) for n, d in dirs.items()}}
        logger.info("wcache: priming the start-up caches: one engine against this daemon "
                    "(torch.compile, private cache root %s)", root)
        print("wcache: priming: compiling once (one engine against this daemon)", flush=True)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PrimingFailed(f"the priming engine did not finish within {timeout_s:.0f} s") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout or "")[-OUTPUT_TAIL_CHARS:]
            raise PrimingFailed(f"the priming engine exited {done.returncode}: ...{tail}")
        try:
            with open(record) as f:
                factors = json.load(f)
        except (OSError, ValueError) as e:
            raise PrimingFailed(f"the priming engine recorded no compile factors ({e}); did it "
                                f"restore from this daemon?") from None
        bundle = pack_primed(dirs, factors)
    seconds = time.perf_counter() - t0
    print(f"wcache: primed: {len(bundle.manifest['entries'])} entries, "
          f"{bundle.nbytes / 2**20:.1f} MiB, compile dirs "
          f"{[p.rsplit('/', 1)[-1][:16] for p in compile_dirs(bundle.manifest)]} "
          f"in {seconds:.1f} s", flush=True)
    return bundle
