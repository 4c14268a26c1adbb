"""Arenas whose layout is already known: filled from a snapshot file or a peer
daemon instead of from an :class:`~wcache.store.manifest.Export`.

A :class:`PrebuiltArena` carries a :class:`~wcache.store.manifest.Manifest` (the
layout, copied verbatim from where the bytes come from) and a ``fill`` callable
that writes the ``arena_nbytes`` bytes into a writable ``[arena_nbytes]`` uint8
tensor: a shared mapping of the memfd on CPU, the device allocation on CUDA.
:class:`~wcache.store.server.DaemonServer` accepts one in place of an export
and serves it with the usual transports: ``shm`` (the memfd is sealed after the
fill, as for an export), ``cuda_vmm`` or ``cuda_ipc``.

:func:`served_arena` is the reverse: a read-only uint8 view of what a running
server holds, for writing a snapshot or seeding a peer.

The allocations are the export builders' own (``wcache.store.arena.sealed_memfd``,
``wcache.store.transport_vmm.allocate_vmm_arena``; ``torch.empty`` for
``cuda_ipc``), with the copy from the export replaced by ``fill``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen

from wcache.store import paths, transport_vmm
from wcache.store.arena import frombuffer_readonly, map_shm_readonly, sealed_memfd
from wcache.store.errors import StoreError
from wcache.store.manifest import Manifest
from wcache.store.server import Serving, build_cuda_serving
from wcache.store.transport_cuda import CudaServing, drain_before_free
from wcache.store.transport_shm import TRANSPORT, ShmServing

__all__ = ["PrebuiltArena", "served_arena"]

log = logging.getLogger("wcache.store")

#: ``fill(dst)`` writes every byte of ``dst`` (``[arena_nbytes]`` uint8, CPU or CUDA).
Fill = Callable[[torch.Tensor], None]


@frozen
class PrebuiltArena:
    """An arena layout plus the function that fills it.

    Attributes:
        manifest: the layout (``device`` must match the daemon's device type).
        fill: writes all ``manifest.arena_nbytes`` bytes into a writable
            ``[arena_nbytes]`` uint8 tensor; raises to abort (nothing is served).
        origin: where the bytes come from, for logs (``snapshot /x``, ``peer /y``).
    """

    manifest: Manifest
    fill: Fill
    origin: str

    def build(
        self, device_type: str, index: int | None, transport: str | None
    ) -> tuple[Serving, Manifest, str, str | None]:
        """Allocate the arena for ``device_type``, fill it, and return
        ``(serving, manifest, transport name, why cuda_vmm was not used or None)``
        for :class:`DaemonServer` (CUDA: its policy,
        :func:`wcache.store.server.build_cuda_serving`).

        Raises:
            StoreError: the manifest is for another device type, or the memfd
                cannot be created/sealed.
            TransportFailed: ``transport="cuda_vmm"`` was asked for and is unavailable.
        """
        if self.manifest.device != device_type:
            raise StoreError(
                f"{self.origin} holds a {self.manifest.device} arena; this daemon serves "
                f"{device_type}. Start it with the device the arena was made on."
            )
        t0 = time.perf_counter()
        out: tuple[Serving, Manifest, str, str | None]
        if device_type == "cpu":
            out = (*self._build_shm(), TRANSPORT, None)
        else:
            cuda_index = paths.cuda_index(index)
            out = build_cuda_serving(
                transport, lambda: self._build_vmm(cuda_index), lambda: self._build_ipc(cuda_index)
            )
        nbytes = self.manifest.arena_nbytes
        dt = time.perf_counter() - t0
        log.info(
            "arena (%s) filled from %s: %.1f MiB in %.3f s (%.2f GiB/s)",
            out[2],
            self.origin,
            nbytes / 2**20,
            dt,
            nbytes / 2**30 / max(dt, 1e-9),
        )
        return out

    def _build_shm(self) -> tuple[Serving, Manifest]:

        nbytes = self.manifest.arena_nbytes

        def fill_mapping(mm: mmap.mmap) -> None:
            # The tensor wraps the mapping's address through a ctypes array, not
            # the mmap's buffer, so closing the mmap never waits for a garbage
            # collection (gc.collect() cost ~0.5 s in a daemon with vLLM imported);
            # fill() keeps no reference to ``dst`` past its return.
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                dst = torch.frombuffer(
                    (ctypes.c_uint8 * nbytes).from_address(ctypes.addressof(anchor)),
                    dtype=torch.uint8,
                )
                try:
                    self.fill(dst)
                finally:
                    del dst
            finally:
                del anchor

        fd = sealed_memfd(nbytes, fill_mapping, f"the shm arena from {self.origin}")
        return ShmServing(fd, nbytes), self.manifest

    def _build_ipc(self, index: int) -> tuple[Serving, Manifest]:

        arena = torch.empty(self.manifest.arena_nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        try:
            self.fill(arena)
            torch.cuda.synchronize(index)
        except BaseException:
            # the block returns to the caching allocator when `arena` goes; not before
            # the copies a failed fill queued into it (on any stream) have landed
            drain_before_free(index, f"the cuda_ipc arena from {self.origin}", arena)
            raise
        return CudaServing(arena), self.manifest

    def _build_vmm(self, index: int) -> tuple[Serving, Manifest]:

        serving, _ = transport_vmm.allocate_vmm_arena(self.manifest.arena_nbytes, index, self.fill)
        return serving, self.manifest


class _DeviceView:
    """The arena's bytes as one tensor (:func:`served_arena`); released on close()."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor: torch.Tensor | None = tensor

    @property
    def tensor(self) -> torch.Tensor:
        """``[arena_nbytes]`` uint8.

        Raises:
            StoreError: the view was closed.
        """
        if self._tensor is None:
            raise StoreError("this arena view was closed; take a new one (served_arena)")
        return self._tensor

    def close(self) -> None:
        self._tensor = None


class _ShmView(_DeviceView):
    """A read-only mapping of a server's memfd, as a tensor; unmapped on close()."""

    def __init__(self, fd: int, nbytes: int):
        self._mm = map_shm_readonly(fd, nbytes)
        super().__init__(frombuffer_readonly(self._mm))

    def close(self) -> None:
        super().close()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass


def served_arena(server: Any) -> _ShmView | _DeviceView:
    """A view of the bytes a running :class:`DaemonServer` serves.

    Returns:
        An object with ``.tensor`` (``[arena_nbytes]`` uint8; on CPU a read-only
        mapping of the sealed memfd, on CUDA the daemon's own allocation, which
        callers must only read) and ``.close()``.

    Raises:
        StoreError: the server's transport is unknown or already stopped.
    """
    serving = server._serving
    nbytes = server.manifest.arena_nbytes
    fd = getattr(serving, "fd", -1)
    if server.transport == "shm":
        if fd < 0:
            raise StoreError("the daemon was stopped; its arena is gone")
        return _ShmView(fd, nbytes)
    arena = getattr(serving, "arena", None)
    if arena is None:
        raise StoreError(
            f"cannot read the arena of a stopped daemon or of transport {server.transport!r}"
        )
    return _DeviceView(arena[:nbytes])
