"""The ``cuda_vmm`` transport: the arena as one CUDA virtual-memory allocation,
exported as a POSIX file descriptor and mapped **read-only** by every client.

Daemon side (:func:`build_vmm_arena`): ``cuMemCreate`` with
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, mapped read-write into the daemon
(``cuMemMap`` + ``cuMemSetAccess``) to fill it, then exported once with
``cuMemExportToShareableHandle``; the fd travels to each client as SCM_RIGHTS
data, as the ``shm`` memfd does.

Client side (:func:`open_vmm`): ``cuMemImportFromShareableHandle``, a fresh
virtual address range, ``cuMemMap`` and ``cuMemSetAccess`` with
``CU_MEM_ACCESS_FLAGS_PROT_READ``: a kernel that writes the arena faults (an
illegal-address error in that engine) instead of rewriting every engine's
weights. The imported handle holds its own reference to the physical memory,
so a client keeps its weights when the daemon dies (even by SIGKILL).

Private writes keep the address (:meth:`VmmMapping.privatize_`): on the first
weight update the engine maps a private physical allocation, holding a copy of
the daemon's bytes, at the *same* virtual address range, read-write. Tensors,
CUDA graphs captured on them and torch.compile'd code keep reading and writing
the same addresses; the daemon's memory is never written. ``cuMemMap``'s
``offset`` must be zero, so the whole mapping (the whole arena) is privatized at
once, costing the arena's size in this engine's device memory.

The mapping is wrapped as a ``[size]`` uint8 torch tensor through
``__cuda_array_interface__``; torch keeps the wrapping :class:`VmmMapping`
alive for as long as any storage made from it lives, and the mapping is
unmapped and released only when that object dies, so a view never outlives
its memory.

Needs NVIDIA's ``cuda-python`` bindings (``pip install wcache[cuda]``); where
they are missing or the driver does not support POSIX-fd handles,
:func:`build_vmm_arena` raises :class:`TransportFailed` and the daemon falls
back to ``cuda_ipc``.

Source: CUDA Driver API, Virtual Memory Management (cuMemCreate,
cuMemExportToShareableHandle, cuMemImportFromShareableHandle, cuMemSetAccess,
cuMemMap/cuMemUnmap: "the offset ... must be zero");
NVIDIA cuda-samples ``memMapIPCDrv``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from wcache.store.arena import CUDA_ALIGNMENT, _fill, make_manifest, plan_layout
from wcache.store.errors import TransportFailed
from wcache.store.transport_cuda import drain_before_free

__all__ = [
    "TRANSPORT",
    "VmmMapping",
    "VmmServing",
    "build_vmm_arena",
    "allocate_vmm_arena",
    "open_vmm",
    "available",
]

log = logging.getLogger("wcache.store")

TRANSPORT = "cuda_vmm"
_lock = threading.Lock()
#: Milliseconds of each step of the last :func:`open_vmm` in this process (benchmarks).
last_open_ms: dict[str, float] = {}


def _driver():
    try:
        from cuda.bindings import driver as cu  # noqa: PLC0415 (the optional cuda extra: its absence is reported below)
    except ImportError as e:  # the optional dependency (wcache[cuda])
        raise TransportFailed(
            f"cuda_vmm needs NVIDIA's cuda-python bindings (pip install 'wcache[cuda]'): {e}"
        ) from e
    return cu


def _check(cu, result: tuple, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, values...)`` tuple; raise on an error."""
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise TransportFailed(
            f"{what} failed: {name.decode() if isinstance(name, bytes) else name}"
        )
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@contextlib.contextmanager
def _in_context(cu, device_index: int):
    """Run driver calls in the device's primary context (torch's), then restore
    the thread's previous context, so attaching never changes the caller's
    current device."""
    with torch.cuda.device(device_index):
        torch.empty(0, device=f"cuda:{device_index}")  # creates the primary context
    prev = _check(cu, cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = _check(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
    ctx = _check(cu, cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(cu, cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        yield
    finally:
        cu.cuCtxSetCurrent(prev)
        cu.cuDevicePrimaryCtxRelease(dev)


def _prop(cu, device_index: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def _access(cu, device_index: int, read_only: bool):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    desc.flags = (
        cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        if read_only
        else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    return desc


def available(device_index: int) -> tuple[bool, str]:
    """(ok, reason): whether this host can serve ``cuda_vmm`` on the device."""
    try:
        cu = _driver()
        _check(cu, cu.cuInit(0), "cuInit")
        dev = _check(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        vmm = _check(
            cu,
            cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev
            ),
            "cuDeviceGetAttribute",
        )
        fd = _check(
            cu,
            cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
            ),
            "cuDeviceGetAttribute",
        )
    except TransportFailed as e:
        return False, str(e)
    if not vmm:
        return False, "the driver reports no virtual memory management on this device"
    if not fd:
        return False, "the driver cannot export VMM allocations as POSIX file descriptors"
    return True, ""


class VmmMapping:
    """One mapping of a VMM allocation into this process; exposes
    ``__cuda_array_interface__`` (``[size]`` uint8). Unmapped, its address range
    freed and its handle released when the object dies (torch holds it for as
    long as any tensor storage made from it lives) or on :meth:`release`.

    Attributes:
        ptr: device address of the mapping.
        size: bytes mapped (a multiple of the allocation granularity).
        read_only: mapped with ``PROT_READ``.
    """

    def __init__(self, cu, handle, ptr: int, size: int, device_index: int, read_only: bool):
        self._cu = cu
        self._handle = handle
        self.ptr = int(ptr)
        self.size = size
        self.device_index = device_index
        self.read_only = read_only
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "strides": None,
            "data": (self.ptr, False),
            "version": 3,
        }

    def tensor(self) -> torch.Tensor:
        """The whole mapping as a ``[size]`` uint8 tensor (no copy; holds ``self``)."""
        t = torch.as_tensor(self, device=f"cuda:{self.device_index}")
        if t.data_ptr() != self.ptr or t.numel() != self.size:
            raise TransportFailed("torch copied the VMM mapping instead of wrapping it")
        return t

    def privatize_(self) -> int:
        """Replace the read-only import at this mapping's address by a private,
        writable copy, *keeping the address*: later writes land in this process's
        own memory, and every tensor view, captured CUDA graph and compiled kernel
        that holds the address sees them. The daemon's memory is never written.

        ``cuMemMap`` maps a physical allocation only as a whole (its ``offset``
        must be zero), so the whole mapping is privatized at once: ``size`` bytes
        of device memory allocated and copied (device to device), once.
        Idempotent: a private mapping returns 0 and copies nothing.

        Steps (:func:`_remap_private`): synchronize the context; ``cuMemCreate``
        a private allocation of ``size`` bytes; map it at a temporary address
        range (read-write) and copy the mapping's bytes into it; synchronize;
        ``cuMemUnmap`` the import at the real address; ``cuMemMap`` the private
        allocation there, ``cuMemSetAccess`` read-write; drop the temporary range;
        release the imported handle.

        Returns:
            bytes copied (``size``; 0 when already private).

        Raises:
            TransportFailed: the mapping was released, or a driver call failed.
                Every failure before the real address is unmapped leaves the
                read-only import mapped there, untouched; a failure after it
                maps the import back (the message says if even that failed).
        """
        if not self.read_only:
            return 0
        cu = self._cu
        if cu is None:
            raise TransportFailed("this cuda_vmm mapping was released; attach again")
        t0 = time.perf_counter()
        with _lock, _in_context(cu, self.device_index):
            self._handle = _remap_private(cu, self._handle, self.ptr, self.size, self.device_index)
        self.read_only = False
        log.info(
            "cuda_vmm: privatized the mapping at 0x%x in place: %.1f MiB copied into "
            "this process's own device memory in %.3f s (the address is unchanged)",
            self.ptr,
            self.size / 2**20,
            time.perf_counter() - t0,
        )
        return self.size

    def release(self) -> None:
        cu, self._cu = self._cu, None
        if cu is None:
            return
        try:
            # Kernels queued on any stream may still read the range (a copy-mode
            # clone, the last use of a view): unmapping under them is an illegal
            # address, so wait for the device first.
            torch.cuda.synchronize(self.device_index)
            cu.cuMemUnmap(self.ptr, self.size)
            cu.cuMemAddressFree(self.ptr, self.size)
            cu.cuMemRelease(self._handle)
        except Exception:  # noqa: BLE001 (interpreter shutdown: the driver frees everything at exit anyway)
            pass

    def __del__(self) -> None:
        self.release()


def _map(cu, handle, size: int, device_index: int, read_only: bool) -> VmmMapping:
    ptr = _check(cu, cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        _check(cu, cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        try:
            _check(
                cu,
                cu.cuMemSetAccess(ptr, size, [_access(cu, device_index, read_only)], 1),
                "cuMemSetAccess",
            )
        except TransportFailed:
            cu.cuMemUnmap(ptr, size)
            raise
    except TransportFailed:
        cu.cuMemAddressFree(ptr, size)
        raise
    return VmmMapping(cu, handle, int(ptr), size, device_index, read_only)


def _remap_private(cu, imported, ptr: int, size: int, device_index: int):
    """The driver calls of :meth:`VmmMapping.privatize_`, in the device's context.

    Args:
        cu: the driver bindings (``cuda.bindings.driver``).
        imported: the handle mapped read-only at ``[ptr, ptr + size)``.
        ptr, size: the mapping (``size`` a multiple of the granularity the
            daemon allocated with, which :func:`_prop` reproduces).
        device_index: the mapping's device.

    Returns:
        The private allocation's handle, now mapped read-write at ``ptr``
        (``imported`` was released).

    Raises:
        TransportFailed: a driver call failed; ``ptr`` still maps ``imported``
            read-only (or the message says that restoring it failed).
    """
    # kernels queued on any stream may still read the range: nothing may run on it
    # while it is remapped
    _check(cu, cu.cuCtxSynchronize(), "cuCtxSynchronize")
    private = _check(cu, cu.cuMemCreate(size, _prop(cu, device_index), 0), "cuMemCreate")
    tmp = None
    tmp_mapped = False
    swapped = False
    try:
        tmp = _check(cu, cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
        _check(cu, cu.cuMemMap(tmp, size, 0, private, 0), "cuMemMap (temporary range)")
        tmp_mapped = True
        _check(
            cu,
            cu.cuMemSetAccess(tmp, size, [_access(cu, device_index, read_only=False)], 1),
            "cuMemSetAccess (temporary range)",
        )
        _check(cu, cu.cuMemcpyDtoD(tmp, ptr, size), "cuMemcpyDtoD")
        _check(cu, cu.cuCtxSynchronize(), "cuCtxSynchronize")
        _check(cu, cu.cuMemUnmap(ptr, size), "cuMemUnmap (the read-only import)")
        try:
            _check(cu, cu.cuMemMap(ptr, size, 0, private, 0), "cuMemMap (the private copy)")
            try:
                _check(
                    cu,
                    cu.cuMemSetAccess(ptr, size, [_access(cu, device_index, False)], 1),
                    "cuMemSetAccess (the private copy)",
                )
            except TransportFailed:
                cu.cuMemUnmap(ptr, size)
                raise
        except TransportFailed as e:
            _restore_import(cu, imported, ptr, size, device_index, e)
            raise
        swapped = True
    finally:
        if tmp is not None:
            if tmp_mapped:
                cu.cuMemUnmap(tmp, size)
            cu.cuMemAddressFree(tmp, size)
        if not swapped:
            cu.cuMemRelease(private)
    cu.cuMemRelease(imported)  # the daemon's memory: this process no longer maps it
    return private


def _restore_import(
    cu, imported, ptr: int, size: int, device_index: int, cause: TransportFailed
) -> None:
    """Map ``imported`` back read-only at ``ptr`` after a failed swap.

    Raises:
        TransportFailed: that failed too: the range is unmapped (this engine must
            restart), chained to ``cause``.
    """
    try:
        _check(cu, cu.cuMemMap(ptr, size, 0, imported, 0), "cuMemMap (restoring the import)")
        _check(
            cu,
            cu.cuMemSetAccess(ptr, size, [_access(cu, device_index, True)], 1),
            "cuMemSetAccess (restoring the import)",
        )
    except TransportFailed as e:
        raise TransportFailed(
            f"privatizing the cuda_vmm mapping failed ({cause}) and mapping "
            f"the daemon's memory back failed too ({e}): the weights at "
            f"0x{ptr:x} are unmapped; restart this engine"
        ) from cause


class VmmServing:
    """Daemon side: owns the allocation (its own read-write mapping) and one
    exported fd, duplicated to each client with SCM_RIGHTS."""

    def __init__(self, mapping: VmmMapping, fd: int, arena: torch.Tensor):
        #: the allocation and the daemon's view of it; None once closed
        self.mapping: VmmMapping | None = mapping
        self.fd = fd
        self.arena: torch.Tensor | None = arena
        self.nbytes = mapping.size

    def export(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        return {"kind": TRANSPORT, "nbytes": self.nbytes}, (self.fd,)

    def close(self) -> None:
        """Drop the daemon's fd and mapping; clients that imported keep the memory."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.arena = None
        mapping, self.mapping = self.mapping, None
        if mapping is not None:
            mapping.release()


def allocate_vmm_arena(
    nbytes: int, device_index: int, fill: Callable[[torch.Tensor], None]
) -> tuple[VmmServing, int]:
    """One VMM allocation of at least ``nbytes`` on ``cuda:<device_index>``, exportable
    as a POSIX fd, filled by ``fill(arena[:nbytes])`` (a writable uint8 view).

    Returns:
        (:class:`VmmServing`, mapped size in bytes: ``nbytes`` rounded up to the
        allocation granularity).

    Raises:
        TransportFailed: no cuda-python, or the driver cannot allocate or
            export a POSIX-fd VMM allocation (the daemon then uses cuda_ipc).
            ``fill``'s own errors propagate, with the allocation released once
            every copy queued on the device has finished
            (:func:`wcache.store.transport_cuda.drain_before_free`).
    """
    ok, why = available(device_index)
    if not ok:
        raise TransportFailed(why)
    cu = _driver()
    with _lock, _in_context(cu, device_index):
        prop = _prop(cu, device_index)
        gran = _check(
            cu,
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        size = -(-nbytes // gran) * gran
        handle = _check(cu, cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        try:
            mapping = _map(cu, handle, size, device_index, read_only=False)
        except TransportFailed:
            cu.cuMemRelease(handle)
            raise
        fd = _check(
            cu,
            cu.cuMemExportToShareableHandle(
                handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
            "cuMemExportToShareableHandle",
        )
    arena = mapping.tensor()
    try:
        fill(arena[:nbytes])
        torch.cuda.synchronize(device_index)
    except BaseException:
        os.close(int(fd))
        del arena
        if drain_before_free(device_index, "a cuda_vmm arena whose fill failed", mapping):
            mapping.release()  # only once no queued copy can still write it
        raise
    return VmmServing(mapping, int(fd), arena), size


def build_vmm_arena(export, key, device_index: int):
    """Lay out and copy ``export`` into one VMM allocation on ``cuda:<device_index>``
    (:func:`allocate_vmm_arena`).

    Returns:
        (:class:`VmmServing`, manifest).

    Raises:
        TransportFailed: as :func:`allocate_vmm_arena`.
    """
    t0 = time.perf_counter()
    blocks, placed, nbytes = plan_layout(export.tensors, CUDA_ALIGNMENT)
    manifest = make_manifest(export, key, "cuda", CUDA_ALIGNMENT, placed, nbytes)
    serving, size = allocate_vmm_arena(nbytes, device_index, lambda dst: _fill(dst, export, blocks))
    log.info(
        "arena (cuda_vmm, cuda:%d): %d tensors, %.1f MiB (%.1f MiB mapped) in %.3f s",
        device_index,
        len(manifest.tensors),
        nbytes / 2**20,
        size / 2**20,
        time.perf_counter() - t0,
    )
    return serving, manifest


def open_vmm(
    handle: dict[str, Any], fds: list[int], arena_nbytes: int, device_index: int
) -> tuple[torch.Tensor, VmmMapping]:
    """Client side: import the daemon's fd and map it read-only.

    The fd is closed once imported (the imported handle keeps the memory).

    Returns:
        (``[size]`` uint8 tensor on ``cuda:<device_index>`` (``size`` >=
        ``arena_nbytes``, rounded to the granularity), whose storage holds the
        mapping; the :class:`VmmMapping`, for :meth:`VmmMapping.privatize_`).
        A kernel writing the tensor faults until the mapping is privatized.

    Raises:
        TransportFailed: no fd, a bad handle, no cuda-python, or a driver error.
    """
    marks = [("start", time.perf_counter())]
    try:
        if handle.get("kind") != TRANSPORT or len(fds) != 1:
            raise TransportFailed(f"expected one fd with a cuda_vmm handle, got {len(fds)} fds")
        size = handle.get("nbytes")
        if not isinstance(size, int) or size < arena_nbytes:
            raise TransportFailed(
                f"cuda_vmm handle of {size!r} bytes, the manifest needs {arena_nbytes}"
            )
        cu = _driver()
        marks.append(("import", time.perf_counter()))
        with _lock, _in_context(cu, device_index):
            marks.append(("context", time.perf_counter()))
            mem = _check(
                cu,
                cu.cuMemImportFromShareableHandle(
                    fds[0], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
                "cuMemImportFromShareableHandle",
            )
            marks.append(("import_handle", time.perf_counter()))
            try:
                mapping = _map(cu, mem, size, device_index, read_only=True)
            except TransportFailed:
                cu.cuMemRelease(mem)
                raise
            marks.append(("map_and_access", time.perf_counter()))
    finally:
        for fd in fds:
            os.close(fd)
    base = mapping.tensor()
    marks.append(("tensor", time.perf_counter()))
    last_open_ms.clear()
    last_open_ms.update(
        {name: round((t - prev) * 1e3, 3) for (_, prev), (name, t) in itertools.pairwise(marks)}
    )
    log.debug("open_vmm steps (ms): %s", last_open_ms)
    return base, mapping
