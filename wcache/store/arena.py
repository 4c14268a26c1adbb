"""The arena: every exported tensor of one rank in one aligned allocation.

Layout is computed once (:func:`plan_layout`, pure): tensors that share a
storage are stored once as one block (the storage span they use), each block
starts on an ``alignment`` boundary (the page size on CPU, so consumed ranges
can be released with madvise; 256 bytes on CUDA), and every tensor is a view
``arena[offset : offset + nbytes].view(dtype).as_strided(shape, stride)``.

Builders fill one sealed memfd (CPU, :func:`build_shm_arena`) or one device
allocation (CUDA, :func:`build_cuda_arena`); :func:`tensor_views` rebuilds the
named tensors from an arena base tensor on either side.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import time
import warnings
from collections.abc import Callable, Mapping

import torch
from attrs import frozen

from wcache.store.errors import StoreError, TransportFailed
from wcache.store.manifest import (
    KIND_BUFFER,
    MANIFEST_FORMAT_VERSION,
    AliasEntry,
    CacheKey,
    Export,
    Manifest,
    TensorEntry,
    dtype_from_name,
    dtype_name,
    span_elements,
)
from wcache.store.transport_cuda import drain_before_free

__all__ = [
    "CPU_ALIGNMENT",
    "CUDA_ALIGNMENT",
    "SEALS",
    "Block",
    "plan_layout",
    "make_manifest",
    "build_shm_arena",
    "build_cuda_arena",
    "sealed_memfd",
    "tensor_views",
    "map_shm_readonly",
    "frombuffer_readonly",
    "allow_private_writes_",
]

log = logging.getLogger("wcache.store")

# Page size: madvise works on whole pages, and mmap offsets must be page aligned.
CPU_ALIGNMENT = mmap.PAGESIZE
# cudaMalloc returns 256-byte aligned pointers; vectorized kernels assume at least that.
CUDA_ALIGNMENT = 256
# Start of a shared-storage span inside its block is rounded down to this many
# bytes so that every dtype's view (itemsize <= 8 for real dtypes) stays aligned.
SPAN_START_ALIGNMENT = 64
# Seals applied once the daemon has filled the memfd: no writes, no resizing, no more seals.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Log copy progress every this many bytes (large arenas take seconds).
PROGRESS_EVERY_BYTES = 1 << 30


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@frozen
class Block:
    """One storage span copied into the arena once.

    Attributes:
        offset: byte offset in the arena (a multiple of the alignment).
        nbytes: bytes copied.
        source: name of a tensor whose storage the bytes come from.
        source_start: byte offset of the span in that storage.
    """

    offset: int
    nbytes: int
    source: str
    source_start: int


def plan_layout(
    tensors: Mapping[str, torch.Tensor], alignment: int
) -> tuple[tuple[Block, ...], dict[str, tuple[int, int]], int]:
    """Place the storage spans of ``tensors`` in one arena.

    Args:
        tensors: canonical name -> tensor (any strides; meta tensors are fine,
            since only shapes, strides, offsets and storage identity are read).
        alignment: block alignment in bytes.

    Returns:
        (blocks, name -> (offset, nbytes), arena_nbytes). ``nbytes`` of a tensor
        is its storage span; empty tensors get ``(0, 0)``. ``arena_nbytes`` is a
        multiple of ``alignment`` and at least ``alignment`` (a memfd must not be
        empty to be mapped).
    """
    groups: dict[object, list[tuple[str, int, int]]] = {}
    placed: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        itemsize = t.element_size()
        span = span_elements(tuple(t.shape), tuple(t.stride())) * itemsize
        if span == 0:
            placed[name] = (0, 0)
            continue
        start = int(t.storage_offset()) * itemsize  # int: torch types it int | SymInt
        # Storage identity: a live storage has a unique data pointer per device
        # (meta storages have none, so each meta tensor is its own storage).
        sid = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else (name,)
        groups.setdefault(sid, []).append((name, start, span))
    blocks = []
    cursor = 0
    for members in groups.values():
        lo = min(s for _, s, _ in members) // SPAN_START_ALIGNMENT * SPAN_START_ALIGNMENT
        hi = max(s + n for _, s, n in members)
        cursor = _align_up(cursor, alignment)
        blocks.append(Block(cursor, hi - lo, members[0][0], lo))
        for name, start, span in members:
            placed[name] = (cursor + start - lo, span)
        cursor += hi - lo
    return tuple(blocks), placed, max(_align_up(cursor, alignment), alignment)


def make_manifest(
    export: Export,
    key: CacheKey,
    device: str,
    alignment: int,
    placed: Mapping[str, tuple[int, int]],
    arena_nbytes: int,
) -> Manifest:
    """The manifest of an export laid out by :func:`plan_layout`."""

    def persistent(name: str) -> bool:
        return name not in export.nonpersistent

    entries = [
        TensorEntry(
            name,
            placed[name][0],
            placed[name][1],
            dtype_name(t.dtype),
            tuple(t.shape),
            tuple(t.stride()),
            export.kinds[name],
            persistent(name) if export.kinds[name] == KIND_BUFFER else True,
        )
        for name, t in export.tensors.items()
    ]
    aliases = []
    for alias, target in export.aliases.items():
        kind = export.kinds.get(alias, export.kinds[target])
        aliases.append(
            AliasEntry(alias, target, kind, persistent(alias) if kind == KIND_BUFFER else True)
        )
    return Manifest(
        MANIFEST_FORMAT_VERSION,
        key.fields,
        device,
        alignment,
        arena_nbytes,
        entries,
        aliases,
        dict(export.layers),
        dict(export.extra),
    )


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's whole storage (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def _fill(dst, export: Export, blocks: tuple[Block, ...]) -> None:
    """Copy every block into ``dst``: a writable ``mmap`` (CPU arena) or a uint8
    device tensor (CUDA arena).

    CPU blocks are copied with one ``memmove`` each, not with ``Tensor.copy_``:
    torch's intra-op threads make many small copies into fresh shmem pages tens
    of times slower on a loaded host (5.4 s vs 0.24 s for 160 MiB in 80 KiB
    blocks on 2 busy cores).
    """
    done = next_log = 0
    t0 = time.perf_counter()
    anchor = ctypes.c_char.from_buffer(dst) if isinstance(dst, mmap.mmap) else None
    try:
        base_addr = ctypes.addressof(anchor) if anchor is not None else 0
        for b in blocks:
            src = _storage_bytes(export.tensors[b.source].detach())[
                b.source_start : b.source_start + b.nbytes
            ]
            if anchor is not None:
                src = src.cpu()  # no-op for CPU tensors; keeps a device tensor's copy alive
                ctypes.memmove(base_addr + b.offset, src.data_ptr(), b.nbytes)
            else:
                dst[b.offset : b.offset + b.nbytes].copy_(src)
            done += b.nbytes
            if done >= next_log + PROGRESS_EVERY_BYTES:
                next_log = done
                log.info("arena: copied %.2f GiB in %.2f s", done / 2**30, time.perf_counter() - t0)
    finally:
        del anchor  # the mmap can only be closed once no buffer export remains


def frombuffer_readonly(buf) -> torch.Tensor:
    """``torch.frombuffer(buf, uint8)`` without the warning about a read-only
    buffer: the mapping is read-only on purpose, and a write faults."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(buf, dtype=torch.uint8)


def sealed_memfd(nbytes: int, fill: Callable[[mmap.mmap], None], what: str) -> int:
    """A memfd of ``nbytes`` filled by ``fill`` through a writable shared mapping,
    then unmapped and sealed (:data:`SEALS`): afterwards no process can write it
    or map it writable-shared.

    Every page is allocated before ``fill`` runs (``posix_fallocate``), so a host
    without the memory fails here with ENOSPC rather than with SIGBUS mid-fill.
    ``fill`` must keep no reference to the mapping past its return.

    Returns:
        The sealed memfd; the caller owns it.

    Raises:
        StoreError: the kernel refuses memfd, the memory or sealing (``what``
            names the arena in the message); ``fill``'s own errors propagate.

    Source: vllm-cpu-restore-notes.md section 7 (memfd sealing, read-only mapping).
    """
    fd = os.memfd_create("wcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fill(mm)
        finally:
            mm.close()  # the writable mapping must be gone before F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise StoreError(f"cannot build {what}: {e}") from e
        raise
    return fd


def build_shm_arena(export: Export, key: CacheKey) -> tuple[int, Manifest]:
    """Fill one memfd with the export and seal it.

    The memfd is created with ``MFD_ALLOW_SEALING``, filled through a writable
    shared mapping, that mapping is unmapped, and the fd is sealed with
    ``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: afterwards no
    process can write it or map it writable-shared.

    Returns:
        (memfd, manifest). The caller owns the fd.

    Raises:
        StoreError: the kernel refuses memfd or sealing.

    Source: vllm-cpu-restore-notes.md section 7 (memfd sealing, read-only mapping).
    """
    t0 = time.perf_counter()
    blocks, placed, nbytes = plan_layout(export.tensors, CPU_ALIGNMENT)
    manifest = make_manifest(export, key, "cpu", CPU_ALIGNMENT, placed, nbytes)
    fd = sealed_memfd(nbytes, lambda mm: _fill(mm, export, blocks), "the shm arena")
    log.info(
        "arena (shm): %d tensors, %d aliases, %.1f MiB in %.3f s",
        len(manifest.tensors),
        len(manifest.aliases),
        nbytes / 2**20,
        time.perf_counter() - t0,
    )
    return fd, manifest


def build_cuda_arena(
    export: Export, key: CacheKey, device_index: int
) -> tuple[torch.Tensor, Manifest]:
    """Copy the export into one uint8 allocation on ``cuda:<device_index>``.

    Returns:
        (arena ``[arena_nbytes]`` uint8 on the device, manifest).
    """
    t0 = time.perf_counter()
    blocks, placed, nbytes = plan_layout(export.tensors, CUDA_ALIGNMENT)
    manifest = make_manifest(export, key, "cuda", CUDA_ALIGNMENT, placed, nbytes)
    arena = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device_index}")
    try:
        _fill(arena, export, blocks)
        torch.cuda.synchronize(device_index)
    except BaseException:
        drain_before_free(device_index, "a cuda_ipc arena whose copy failed", arena)
        raise
    log.info(
        "arena (cuda:%d): %d tensors, %.1f MiB in %.3f s",
        device_index,
        len(manifest.tensors),
        nbytes / 2**20,
        time.perf_counter() - t0,
    )
    return arena, manifest


def tensor_views(base: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Rebuild every named tensor as a view of ``base`` (``[arena_nbytes]`` uint8).

    Aliases map to the SAME tensor object as their target.

    Raises:
        TransportFailed: the base is smaller than the manifest's arena.
    """
    if base.dtype != torch.uint8 or base.dim() != 1 or base.numel() < manifest.arena_nbytes:
        raise TransportFailed(
            f"arena base has {base.numel()} bytes, the manifest needs {manifest.arena_nbytes}"
        )
    out: dict[str, torch.Tensor] = {}
    # One typed view of the whole arena per dtype, then one as_strided per
    # tensor (offsets are multiples of the itemsize, arena_nbytes of the alignment).
    if base.storage_offset() % manifest.alignment:
        raise TransportFailed(
            f"arena base starts {base.storage_offset()} bytes into its storage, "
            f"not on a {manifest.alignment}-byte boundary"
        )
    typed: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        if e.dtype not in typed:
            typed[e.dtype] = base[: manifest.arena_nbytes].view(dtype_from_name(e.dtype))
        flat = typed[e.dtype]
        # as_strided's offset counts elements from the start of the storage.
        out[e.name] = flat.as_strided(
            e.shape, e.stride, (base.storage_offset() + e.offset) // flat.element_size()
        )
    for a in manifest.aliases:
        out[a.name] = out[a.target]
    return out


def map_shm_readonly(fd: int, nbytes: int, *, private: bool = False) -> mmap.mmap:
    """Check that ``fd`` is a sealed memfd of ``nbytes`` bytes and map it
    ``PROT_READ``, ``MAP_SHARED`` (or ``MAP_PRIVATE`` with ``private``).

    Read-only either way: a write faults. ``private`` lets the mapping later be
    made writable with :func:`allow_private_writes_`, each written page becoming
    this process's own copy (the sealed memfd itself can never be written).

    Raises:
        TransportFailed: the fd is not sealed against writes/resizing, or its
            size differs from the manifest's.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise TransportFailed(f"the arena fd cannot be sealed (not a memfd?): {e}") from e
    need = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    if seals & need != need:
        raise TransportFailed(
            f"the arena memfd is not sealed (seals {seals:#x}); refusing a writable arena"
        )
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise TransportFailed(f"the arena memfd has {size} bytes, the manifest says {nbytes}")
    flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)


def allow_private_writes_(base: torch.Tensor, nbytes: int) -> None:
    """Make a ``MAP_PRIVATE`` mapping of a sealed memfd writable (``mprotect``
    ``PROT_READ|PROT_WRITE``): a later write copies the touched page into this
    process (copy on write); untouched pages stay the memfd's shared pages and the
    memfd's bytes never change (``F_SEAL_WRITE``; a private mapping never writes back).

    Args:
        base: the ``[nbytes]`` uint8 tensor over the mapping (page-aligned start).
        nbytes: length of the mapping in bytes.

    Raises:
        TransportFailed: ``mprotect`` refused (e.g. a ``MAP_SHARED`` mapping of a
            sealed memfd: EACCES).

    Source: mprotect(2); memfd_create(2) on F_SEAL_WRITE and private mappings.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.mprotect(base.data_ptr(), nbytes, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        err = ctypes.get_errno()
        raise TransportFailed(f"cannot make the arena mapping copy-on-write: {os.strerror(err)}")
