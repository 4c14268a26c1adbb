"""The ``shm`` transport (CPU): one sealed memfd, passed with SCM_RIGHTS and
mapped ``PROT_READ``/``MAP_PRIVATE`` by the client: a write faults until the
client turns the mapping copy-on-write (:func:`wcache.store.arena.allow_private_writes_`,
after a restore, so that weight updates land in the engine's own pages).

Source: vllm-cpu-restore-notes.md section 7; memfd_create(2), fcntl(2) seals.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any

from wcache.store.errors import TransportFailed

if TYPE_CHECKING:  # the client side views the arena as a tensor; the serving side needs no torch
    import torch

__all__ = ["TRANSPORT", "ShmServing", "open_shm"]

TRANSPORT = "shm"


class ShmServing:
    """Daemon side: owns the sealed memfd and hands a duplicate to each client."""

    def __init__(self, fd: int, nbytes: int):
        self.fd = fd
        self.nbytes = nbytes

    def export(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """(handle, fds) for one client: the fd travels as SCM_RIGHTS data."""
        return {"kind": TRANSPORT, "nbytes": self.nbytes}, (self.fd,)

    def close(self) -> None:
        """Close the daemon's fd; clients that mapped the memfd keep their pages."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_shm(
    handle: dict[str, Any], fds: list[int], arena_nbytes: int
) -> tuple[mmap.mmap, torch.Tensor]:
    """Client side: map the received memfd read-only and wrap it without a copy.

    The fd is closed once mapped (the mapping keeps the memfd alive).

    Returns:
        (the mmap, a ``[arena_nbytes]`` uint8 tensor over it). A write through
        the tensor faults (SIGSEGV).

    Raises:
        TransportFailed: no fd, wrong handle, unsealed memfd or wrong size.
    """
    from wcache.store.arena import frombuffer_readonly, map_shm_readonly  # noqa: PLC0415 (torch import ~2 s: only when called)

    try:
        if handle.get("kind") != TRANSPORT or len(fds) != 1:
            raise TransportFailed(
                f"expected one memfd with an shm handle, got {len(fds)} fds "
                f"and handle kind {handle.get('kind')!r}"
            )
        if handle.get("nbytes") != arena_nbytes:
            raise TransportFailed(
                f"handle says {handle.get('nbytes')} bytes, manifest {arena_nbytes}"
            )
        mm = map_shm_readonly(fds[0], arena_nbytes, private=True)
    finally:
        for fd in fds:
            os.close(fd)
    return mm, frombuffer_readonly(mm)
