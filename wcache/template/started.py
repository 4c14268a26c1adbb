"""When a command started through ``wcache run`` really started: the client's launch.

A template child is forked when the request arrives, so its own process start
(``/proc/self/stat``) is after ``wcache run``'s interpreter start, connect and request.
A timer of "process start to first token" (``wcache.vllm.run_engine``'s marks, the
phases benchmark) must start where a direct start's does: at the launch of the
command the user typed, here ``wcache run``. The client sends its own process start
in the request; the child puts it in its environment as ``PID:SECONDS`` under
:data:`RUN_STARTED_ENV`, naming its own pid, so a process that inherits the variable
(the engine core vLLM forks, a subprocess) does not take it for its own start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from wcache.store import paths

__all__ = ["RUN_STARTED_ENV", "process_start_epoch", "run_started", "run_started_value"]

#: ``PID:SECONDS``: the ``wcache run`` client's process start (seconds since the
#: epoch) for the template child PID.
RUN_STARTED_ENV = "WCACHE_RUN_STARTED"


def process_start_epoch(pid: int | None = None) -> float | None:
    """A process's start as wall-clock seconds since the epoch (``/proc/PID/stat``
    field 22 against ``CLOCK_BOOTTIME``: the clock tick's resolution, 10 ms at the
    usual ``CLK_TCK`` of 100), or None where it cannot be read (not Linux, gone)."""
    try:
        ticks = paths.process_start_time(os.getpid() if pid is None else pid)
        if ticks is None:
            return None
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    return time.time() - age


def run_started_value(pid: int, client_start: float) -> str:
    """The :data:`RUN_STARTED_ENV` value for child ``pid`` of a client started at
    ``client_start`` (seconds since the epoch)."""
    return f"{pid}:{client_start:.6f}"


def run_started(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """The ``wcache run`` client's start when this process (``pid``, default this
    one) is the template child it ran, else None (no variable, another pid's, or
    unreadable)."""
    env = os.environ if environ is None else environ
    value = env.get(RUN_STARTED_ENV, "")
    owner, _, seconds = value.partition(":")
    try:
        if int(owner) != (os.getpid() if pid is None else pid):
            return None
        return float(seconds)
    except ValueError:
        return None
