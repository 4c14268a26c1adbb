"""When a command started through ``wcache run`` really started: the client's launch.

A template child is forked when the request arrives, so its own process start
(``/proc/self/stat``) is after ``wcache run``'s interpreter start, connect and request.
A timer of "process start to first token" (``wcache.vllm.run_engine``'s marks, the
phases benchmark) must start where a direct start's does: at the launch of the
command the user typed, here ``wcache run``. The client sends its own process start
in the request; the child records it here with its own pid (:func:`set_run_started`),
in this module rather than the environment, so the command's environment stays the
client's, and a process forked from the child (vLLM's engine core) that reads it sees
another pid and does not take it for its own start.
"""

from __future__ import annotations

import os
import time

from wcache.store import paths

__all__ = ["process_start_epoch", "run_started", "set_run_started"]

#: ``(pid, seconds since the epoch)``: the ``wcache run`` client's start, for the
#: template child ``pid`` (set in the child only).
_RUN_STARTED: tuple[int, float] | None = None


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


def set_run_started(client_start: float) -> None:
    """Record, in a template child, its client's start (seconds since the epoch)."""
    global _RUN_STARTED
    _RUN_STARTED = (os.getpid(), float(client_start))


def run_started() -> float | None:
    """The ``wcache run`` client's start when this process is the template child it
    ran, else None (not a template child, or a process forked from one)."""
    if _RUN_STARTED is None or _RUN_STARTED[0] != os.getpid():
        return None
    return _RUN_STARTED[1]
