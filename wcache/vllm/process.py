"""Start and stop a ``wcache serve`` daemon and run engines in child processes.

Used by the demo, the e2e tests (as fixtures) and the benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: A SmolLM2-sized daemon loads and prepares in ~15-40 s on 2 cores; 600 s
#: leaves room for a cold page cache and a busy machine.
DAEMON_READY_TIMEOUT_S = 600.0
#: One vLLM CPU engine start plus 2x16 greedy tokens takes ~30-60 s here.
ENGINE_TIMEOUT_S = 900.0
#: Grace period for a daemon to exit after SIGTERM before SIGKILL (seconds).
STOP_GRACE_S = 20.0
#: Engine arguments shared by daemons and engines in demos and tests, so the
#: cache key (dtype, quantization) matches on both sides.
ENGINE_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class DaemonProcess:
    """``wcache serve`` in a child process; ``start()`` returns once it is ready.

    Args:
        model: checkpoint directory.
        socket_dir: socket directory (a temporary one in tests).
        extra_args: more ``wcache serve`` / vLLM engine arguments.
    """

    def __init__(self, model: str | Path, socket_dir: str | Path,
                 extra_args: Sequence[str] = (), tensor_parallel_size: int = 1,
                 env: dict[str, str] | None = None):
        self.model = str(model)
        self.socket_dir = str(socket_dir)
        self.args = [sys.executable, "-m", "wcache.cli", "serve", "--model", self.model,
                     "--socket-dir", self.socket_dir, "--no-progress",
                     "--tensor-parallel-size", str(tensor_parallel_size),
                     *ENGINE_ARGS, *extra_args]
        self.env = {**_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=400)
        self.ready_lines: list[str] = []
        self.tensor_parallel_size = tensor_parallel_size

    def start(self, timeout_s: float = DAEMON_READY_TIMEOUT_S) -> "DaemonProcess":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env, start_new_session=True)
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

        threading.Thread(target=pump, daemon=True).start()
        t0 = time.monotonic()
        ready.wait(timeout_s)
        if self.proc.poll() is not None or not ready.is_set() or not self.ready_lines:
            tail = "\n".join(list(self.lines)[-40:])
            self.stop()
            raise RuntimeError(f"wcache serve did not become ready within "
                               f"{time.monotonic() - t0:.0f} s (exit {self.proc.returncode}):\n{tail}")
        self.ready_s = time.monotonic() - t0
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(STOP_GRACE_S)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the whole daemon process group (tests of a dead daemon)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "DaemonProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run_engine(model: str | Path, load_format: str = "auto", extra: dict | None = None,
               prompts: Sequence[str] | None = None, max_tokens: int = 16,
               dump_state: bool = False, tensor_parallel_size: int = 1,
               env: dict[str, str] | None = None, dtype: str = "bfloat16",
               timeout_s: float = ENGINE_TIMEOUT_S) -> dict:
    """Run one engine in a child process and return its JSON result.

    Raises:
        RuntimeError: the engine failed; the message holds its output tail and
            ``.output`` the whole output.
    """
    cmd = [sys.executable, "-m", "wcache.vllm.run_engine", "--model", str(model),
           "--load-format", load_format, "--extra", json.dumps(extra or {}),
           "--max-tokens", str(max_tokens), "--tensor-parallel-size", str(tensor_parallel_size),
           "--dtype", dtype]
    for p in prompts or ():
        cmd += ["--prompt", p]
    if dump_state:
        cmd.append("--dump-state")
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), **(env or {})},
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        output = proc.stdout + proc.stderr
        err = RuntimeError(f"engine ({load_format}) failed with exit {proc.returncode}:\n"
                           + "\n".join(output.splitlines()[-30:]))
        err.output = output  # type: ignore[attr-defined]
        raise err
    result = json.loads(lines[-1])
    result["log"] = proc.stderr
    return result
