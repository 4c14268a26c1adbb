"""A child process that dies with its parent: Linux ``PR_SET_PDEATHSIG``.

``wcache serve`` uses it twice: each rank process of a several-rank serve is SIGTERMed
when the serve process dies, even by SIGKILL (it then stops as for ``wcache stop``,
instead of serving on orphaned and holding its socket), and the priming engine is
SIGKILLed when its rank dies (:mod:`wcache.daemon.prime`).

Source: prctl(2), ``PR_SET_PDEATHSIG``: the signal is sent when the thread that
created the child ends; ``wcache serve`` starts both kinds of children from its main
thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "prctl_function"]

#: ``prctl`` option: the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def prctl_function() -> Callable[..., int] | None:
    """libc's ``prctl`` (load it before a fork: a child of a threaded process should
    call nothing that takes locks), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl


def die_with_parent(sig: int, parent: int, prctl: Callable[..., int] | None = None) -> None:
    """Have this process get ``sig`` when its parent (pid ``parent``) dies; if that
    parent is gone already (it died before this took effect), ``os._exit(1)`` at once.
    No-op off Linux.

    Args:
        sig: the signal (``signal.SIGTERM`` for a clean stop, ``SIGKILL``).
        parent: the pid the parent had when it started this process.
        prctl: :func:`prctl_function`'s result, loaded before a fork; loaded here when
            None (a spawned process).
    """
    prctl = prctl or prctl_function()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
