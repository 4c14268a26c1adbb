"""``wcache serve --prime-compile``: once the daemon serves, run ONE engine against
it with private, empty start-up caches, and keep what that engine's compile wrote
as the daemon's start-up artifact bundle (:mod:`wcache.store.artifacts`), so the
first engine on a node that gets this daemon's arena (here, from its snapshot, or
from it as a peer) does not pay a cold compile.

The engine is ``python -m wcache.vllm.prime_engine`` (the serve's own vLLM engine
arguments, compiled, ``load_format="wcache"``, the usage context of the engines it
primes for: ``serve`` for ``vllm serve``, ``llm`` for ``LLM()``) in a child process
with ``fallback: false`` (a priming run that loaded from disk would prove nothing
about this daemon) and the loader option ``artifacts_record`` (the engine writes
the compile factors its vLLM computed: the bundle records those). The child runs
in its own process group, dies with the rank (``PR_SET_PDEATHSIG`` on Linux), and
is killed when the daemon is asked to stop meanwhile. Imports no vLLM; the bundle
is packed by :mod:`wcache.vllm.startup`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wcache.daemon.parent_death import die_with_parent, prctl_function
from wcache.daemon.tracebacks import first_traceback
from wcache.errors import PrimingFailed

__all__ = [
    "PRIME_TIMEOUT_S",
    "ROOT_ENV",
    "USAGE_CONTEXTS",
    "priming_args",
    "priming_command",
    "priming_env",
    "prime_compile",
    "PrimingFailed",
]

logger = logging.getLogger("wcache.daemon")

#: How long the priming engine may take (seconds): an 8B model's cold
#: torch.compile + CUDA-graph capture takes minutes; a tiny model on 2 loaded CPU
#: cores about 2-3 minutes (measured here: 105 s of compile in a 205 s start).
PRIME_TIMEOUT_S = 1800.0
#: Bundle root name -> the environment variable pointing that cache of the
#: priming engine at its private directory.
ROOT_ENV = {
    "vllm": "VLLM_CACHE_ROOT",
    "triton": "TRITON_CACHE_DIR",
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
}
#: The start of the line a primed daemon prints (``wcache.daemon.process.DaemonProcess
#: .wait_primed`` and scripts wait for it).
PRIMED_PREFIX = "wcache: primed:"
#: Characters of the priming engine's output kept in a failure message.
OUTPUT_TAIL_CHARS = 2000
#: How often the rank checks, while the priming engine runs, whether it was asked to
#: stop (seconds): a stop (``wcache stop``, SIGTERM) ends the engine within this.
STOP_POLL_S = 0.2
#: How long the priming engine's process group gets to exit after SIGTERM before
#: SIGKILL (seconds): vLLM's engine core shuts down its workers on SIGTERM in well
#: under this; a wedged compile does not, and its GPU memory must come back.
STOP_GRACE_S = 10.0

from wcache.vllm.prime_engine import USAGE_CONTEXTS  # noqa: E402  (no vLLM import)


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
        raise PrimingFailed(
            "priming runs one engine of one rank; this daemon serves "
            f"TP={known.tensor_parallel_size} x PP={known.pipeline_parallel_size}"
        )
    return [a for a in rest if a != "--enforce-eager"]


def priming_command(
    model: str,
    rest: list[str],
    *,
    socket_dir: str | None,
    job: str,
    record: str,
    usage: str = "serve",
) -> list[str]:
    """The priming engine's command line: :mod:`wcache.vllm.prime_engine` for the
    ``usage`` context (one of :data:`USAGE_CONTEXTS`) with the serve's vLLM engine
    arguments ``rest`` verbatim (the compile-cache key covers them), restored from
    this daemon with fallback off and its factors recorded.

    Raises:
        PrimingFailed: more than one rank, or an unknown ``usage``.
    """
    if usage not in USAGE_CONTEXTS:
        raise PrimingFailed(f"unknown priming usage {usage!r}; use one of {USAGE_CONTEXTS}")
    extra = {"fallback": False, "socket_dir": socket_dir, "job": job, "artifacts_record": record}
    return [
        sys.executable,
        "-m",
        "wcache.vllm.prime_engine",
        "--model",
        model,
        "--usage-context",
        usage,
        "--extra",
        json.dumps(extra),
        "--",
        *priming_args(rest),
    ]


def _die_with_parent_fn() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGKILLed when the rank dies (Linux
    ``PR_SET_PDEATHSIG``), so a SIGKILLed rank leaves no priming engine holding its
    device; None elsewhere (the stop path still kills the group). libc is loaded
    here, in the parent: the child, forked from a threaded daemon, only calls
    ``prctl`` and ``getppid`` before exec.

    The signal follows the forking thread: the rank's main thread, which lives as
    long as the rank.
    """
    prctl = prctl_function()
    if prctl is None:
        return None
    parent = os.getpid()
    return functools.partial(die_with_parent, signal.SIGKILL, parent, prctl)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left of it once the
    child exited or :data:`STOP_GRACE_S` passed (vLLM's engine-core processes are in
    the group too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def priming_env(dirs: dict[str, Path], environ: dict[str, str] | None = None) -> dict[str, str]:
    """The priming engine's environment: this process's (``environ``), with each start-up
    cache of :data:`ROOT_ENV` pointed at ``dirs`` (the private roots packed afterwards)
    and vLLM's startup plan on (``VLLM_ENABLE_STARTUP_PLAN=1``: the engine writes the
    KV-cache memory its profiling arrived at, and the bundle carries it; vLLM < 0.33
    ignores the variable, and it is not a compile factor, so the compile key stays
    the engines'). Source: vllm/v1/worker/startup_plan.py, vllm/envs.py.
    """
    from wcache.vllm.startup import STARTUP_PLAN_ENV  # noqa: PLC0415 (torch import ~2 s: only when called)

    base = dict(os.environ if environ is None else environ)
    return {**base, **{ROOT_ENV[n]: str(d) for n, d in dirs.items()}, STARTUP_PLAN_ENV: "1"}


def _run_until_stopped(
    cmd: list[str],
    env: dict[str, str],
    timeout_s: float,
    stop_requested: Callable[[], bool],
    out_dir: str,
) -> tuple[int, str]:
    """Run ``cmd`` in its own session, dying with this process, until it exits; kill its
    group when ``stop_requested()`` turns true or ``timeout_s`` passes.

    Returns:
        ``(returncode, output tail)`` (stdout and stderr, the last
        :data:`OUTPUT_TAIL_CHARS` characters).

    Raises:
        PrimingFailed: stopped (reason "stopped") or timed out.
    """
    log_path = os.path.join(out_dir, "prime-engine.log")
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent_fn(),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    rc = proc.wait(STOP_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if stop_requested():
                    raise PrimingFailed("stopped")
                if time.monotonic() > deadline:
                    raise PrimingFailed(
                        f"the priming engine did not finish within {timeout_s:.0f} s"
                    )
        finally:
            if proc.returncode is None:
                _kill_group(proc)
        # the tail only: bytes enough for OUTPUT_TAIL_CHARS characters of UTF-8
        log.seek(max(0, os.fstat(log.fileno()).st_size - 4 * OUTPUT_TAIL_CHARS))
        tail = log.read().decode(errors="replace")[-OUTPUT_TAIL_CHARS:]
    return rc, tail


#: How much of the priming engine's log is searched for its first traceback (the root
#: cause: vLLM's engine core prints it long before the generic error that ends the log).
ROOT_CAUSE_SCAN_BYTES = 16 * 2**20


def _engine_failure(rc: int, tail: str, out_dir: str) -> str:
    """Why the priming engine failed: its exit status, the first traceback of its log
    under ``out_dir`` (the root cause, e.g. vLLM's "Free memory on device ... is less
    than desired GPU memory utilization"; its client's last lines only say "Engine
    core initialization failed. See root cause above") and the log's tail."""
    try:
        with open(os.path.join(out_dir, "prime-engine.log"), "rb") as f:
            cause = first_traceback(f.read(ROOT_CAUSE_SCAN_BYTES).decode(errors="replace"))
    except OSError:
        cause = None
    if cause and cause not in tail:
        return (
            f"the priming engine exited {rc}; its first traceback:\n{cause}\n"
            f"... its output tail: ...{tail}"
        )
    return f"the priming engine exited {rc}: ...{tail}"


def prime_compile(
    model: str,
    rest: list[str],
    *,
    socket_dir: str | None,
    job: str = "",
    usage: str = "serve",
    timeout_s: float = PRIME_TIMEOUT_S,
    stop_requested: Callable[[], bool] = lambda: False,
) -> Any:
    """Run the priming engine and return the bundle of what it wrote.

    Args:
        usage: the engines primed for, one of :data:`USAGE_CONTEXTS`.
        stop_requested: polled every :data:`STOP_POLL_S` while the engine runs; when
            it returns true the engine's process group is killed.

    Returns:
        A :class:`wcache.store.artifacts.Bundle` (fd owned by the caller).

    Raises:
        PrimingFailed: the engine failed, timed out, was stopped (reason
            "stopped") or recorded no factors (its output's tail in the message).
        ArtifactsMissing: it wrote no compile artifact.
    """
    from wcache.vllm.startup import compile_dirs, pack_primed, unused_compile_hint  # noqa: PLC0415 (torch import ~2 s: only when called)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wcache-prime-") as root:
        dirs = {name: Path(root) / name for name in ROOT_ENV}
        for d in dirs.values():
            d.mkdir()
        record = os.path.join(root, "factors.json")
        cmd = priming_command(
            model, rest, socket_dir=socket_dir, job=job, record=record, usage=usage
        )
        env = priming_env(dirs)
        logger.info(
            "wcache: priming the start-up caches: one engine against this daemon "
            "(torch.compile, private cache root %s)",
            root,
        )
        print("wcache: priming: compiling once (one engine against this daemon)", flush=True)
        rc, tail = _run_until_stopped(cmd, env, timeout_s, stop_requested, root)
        if rc != 0:
            raise PrimingFailed(_engine_failure(rc, tail, root))
        try:
            with open(record) as f:
                factors = json.load(f)
        except (OSError, ValueError) as e:
            raise PrimingFailed(
                f"the priming engine recorded no compile factors ({e}); did it "
                f"restore from this daemon?"
            ) from None
        bundle = pack_primed(dirs, factors)
    seconds = time.perf_counter() - t0
    try:
        print(
            f"{PRIMED_PREFIX} {len(bundle.manifest['entries'])} entries for {usage}, "
            f"{bundle.nbytes / 2**20:.1f} MiB, compile dirs "
            f"{[p.rsplit('/', 1)[-1][:16] for p in compile_dirs(bundle.manifest)]} "
            f"in {seconds:.1f} s",
            flush=True,
        )
        hint = unused_compile_hint(factors)
        if hint is not None:
            logger.warning("wcache: priming: %s", hint)
    except BaseException:
        bundle.close()
        raise
    return bundle
