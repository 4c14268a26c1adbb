"""Prepared snapshots: a rank's arena on disk, so a daemon restarts without
vLLM's load and without any TRANSFORM stage.

Layout of a snapshot directory (one sub-directory per rank, named by the
caller: ``tp0of2-pp0of1-dp0of1`` from the vLLM side)::

    DIR/<name>/arena.safetensors   one tensor "arena": U8 [arena_nbytes], the arena's bytes
    DIR/<name>/manifest.json       the arena's versioned Manifest (wcache.store.manifest), verbatim
    DIR/<name>/key.json            the full CacheKey (canonical JSON)
    DIR/<name>/digests.json        blake3 of each of the three files above (and, for a CUDA
                                   arena, its device-side digest), written last
    DIR/.tmp-<name>-*/             a write in progress (or one that crashed): never read
    DIR/.startup/<name>/           the rank's start-up artifact bundle (wcache.daemon.serve)

Why one flat uint8 tensor per arena rather than one safetensors tensor per
exported tensor: the arena already is the exported layout (shared storages
stored once, strided views, aliases, alignment), and the manifest describes it
exactly; one tensor makes loading one large sequential read straight into the
arena at offset 0, with no per-tensor seek, copy or re-layout, and the file
stays an ordinary safetensors file (``safetensors.safe_open`` reads it) whose
bytes are meaningful together with ``manifest.json``.

Writing is atomic: every file goes into a fresh temp dir beside the target,
each file and the dir are fsynced, then the dir is renamed into place (an older
snapshot of the same name and key is renamed aside first and removed after; one
of another key, or one that does not open, is removed before the write, so a
volume sized for one snapshot takes its replacement). Writers of one directory
take turns (``flock`` on it), and each removes what a killed writer of its rank
left. The directory, its rank folders and their files must belong to this
process's user and be writable by no one else (:func:`check_snapshot_dir`), as a
socket dir: the digests prove a file intact, not who wrote it. Reading
checks every file's digest; a digest that differs, a missing file, a temp dir
or a manifest whose key disagrees with ``key.json`` is refused with a reason
code, and a key that differs from the daemon's is refused naming the fields.

Source: safetensors format (huggingface/safetensors, "Format": 8-byte LE header
size, JSON header, data); rename(2) for atomic replacement.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import blake3
import torch
from attrs import frozen
from safetensors import safe_open

from wcache.errors import (  # re-exported: their old home
    SnapshotCorrupt,
    SnapshotMissing,
    SnapshotStale,
    SnapshotWriteFailed,
)
from wcache.store.arena_digest import CUDA_ALGORITHM, arena_digest
from wcache.store.errors import StoreError, UnsafePath
from wcache.store.manifest import CacheKey, Manifest, canonical_json
from wcache.store.prebuilt import PrebuiltArena

__all__ = [
    "SNAPSHOT_FORMAT_VERSION",
    "ARENA_FILE",
    "MANIFEST_FILE",
    "KEY_FILE",
    "DIGESTS_FILE",
    "SnapshotMissing",
    "SnapshotCorrupt",
    "SnapshotStale",
    "SnapshotWriteFailed",
    "Snapshot",
    "write_snapshot",
    "open_snapshot",
    "check_key",
    "snapshot_arena",
    "read_bytes_into",
    "list_snapshots",
    "check_snapshot_dir",
    "not_a_directory_hint",
    "leftovers",
    "remove_leftovers",
    "TEMP_PREFIX",
    "STARTUP_DIR",
]

log = logging.getLogger("wcache.store")

#: Bumped when the directory layout or a file's meaning changes.
SNAPSHOT_FORMAT_VERSION = 1
ARENA_FILE = "arena.safetensors"
MANIFEST_FILE = "manifest.json"
KEY_FILE = "key.json"
DIGESTS_FILE = "digests.json"
#: The one tensor name inside ``arena.safetensors``.
ARENA_TENSOR = "arena"
#: In-progress writes live in ``DIR/.tmp-<name>-*``; readers never look there.
TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
#: Each rank's start-up artifact bundle: ``DIR/.startup/<name>/`` (hidden: not a
#: rank's arena dir); written and read by :mod:`wcache.daemon.serve`.
STARTUP_DIR = ".startup"
#: Mode bits that let another user (group or others) write a snapshot's directory
#: or file, and so replace what the daemon serves.
_FOREIGN_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH
#: Bytes per read request: large enough that each ``preadv`` runs at the
#: device's sequential bandwidth, small enough that several threads share the
#: arena evenly (a 270 MiB SmolLM2 arena is ~4 requests).
READ_CHUNK_BYTES = 64 << 20
#: Reader threads: NVMe and network file systems need several requests in
#: flight to reach their bandwidth; 8 threads read 13 GiB from the H200 host's
#: page cache at 26.7 GiB/s (docs/benchmarks.md, raw read).
MAX_READ_THREADS = 8
#: Chunks per wave on CUDA (each READ_CHUNK_BYTES, pinned, two waves: 1 GiB):
#: one chunk per reader thread, so a wave is read with every thread busy while
#: the previous wave's copies to the device run.
CUDA_STAGING_CHUNKS = 8


@frozen
class Snapshot:
    """One rank's snapshot, opened and checked for consistency (not yet read).

    Attributes:
        path: the rank's directory.
        manifest: the arena layout.
        key: the key the arena was prepared for.
        digests: file name -> blake3 hex digest, from ``digests.json``.
        data_offset: byte offset of the arena bytes in ``arena.safetensors``.
        header: the safetensors header bytes (``[0, data_offset)``), hashed with the data.
        device_digest: ``{"algorithm", "digest"}`` of the arena bytes computed on the
            device (:func:`wcache.store.arena_digest.arena_digest`), recorded for CUDA
            arenas; a CUDA load checks it on the GPU instead of hashing the file
            on the host. None for CPU arenas.
        folder_id: ``(st_dev, st_ino)`` of ``path`` when opened: which write of the
            rank's folder this is (a later write renames a new folder into place).
    """

    path: str
    manifest: Manifest
    key: CacheKey
    digests: dict
    data_offset: int
    header: bytes
    device_digest: dict | None = None
    folder_id: tuple[int, int] | None = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return blake3.blake3(data).hexdigest()


def _memview(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor's bytes (no copy)."""
    n = t.numel()
    return (
        memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
        if n
        else memoryview(b"")
    )


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name != os.path.basename(name):
        raise StoreError(f"snapshot name {name!r} must be a plain, non-hidden directory name")


def _refuse_unless_ours(path: str, what: str) -> None:
    """Refuse ``path`` unless this process's user or root owns it (a read-only
    volume of root's, a baked image layer) and neither group nor others can write
    it (after a symlink, which itself must be this user's or root's); a missing
    path passes (the reads and writes say so).

    Raises:
        UnsafePath: naming the owner or the mode, and the fix.
    """
    euid = os.geteuid()
    try:
        lst = os.lstat(path)
        st = os.stat(path) if stat.S_ISLNK(lst.st_mode) else lst
    except FileNotFoundError:
        return
    except OSError as e:
        raise UnsafePath(
            f"snapshot {what} {path} cannot be inspected ({e.strerror}); give "
            f"--snapshot/--from-snapshot a directory of your own"
        ) from None
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (euid, 0):
        raise UnsafePath(
            f"snapshot {what} {path} is a symlink owned by uid {lst.st_uid}, not by you "
            f"(uid {euid}) or root; refusing it: whoever owns it chooses what is served. "
            f"Give --snapshot/--from-snapshot a directory of your own"
        )
    if st.st_uid not in (euid, 0):  # root could replace anything anyway (sshd's rule)
        raise UnsafePath(
            f"snapshot {what} {path} is owned by uid {st.st_uid}, not by you (uid {euid}) "
            f"or root; "
            f"refusing it: its owner can replace what the daemon serves (the digests prove "
            f"a file intact, not who wrote it). Give --snapshot/--from-snapshot a "
            f"directory of your own (`mkdir -m 700 DIR`), or, if you trust its contents, "
            f"`chown -R {euid} {os.path.realpath(path)}`"
        )
    if st.st_mode & _FOREIGN_WRITE_BITS:
        raise UnsafePath(
            f"snapshot {what} {path} has mode {stat.S_IMODE(st.st_mode):o}: group or "
            f"others can write it, and so replace what the daemon serves; refusing it. "
            f"Fix: `chmod -R go-w {os.path.realpath(path)}` if you trust its contents, else "
            f"delete it and "
            f"write the snapshot again"
        )


def check_snapshot_dir(root: str, names: Iterable[str] | None = None) -> None:
    """Refuse a snapshot directory someone other than this process's user could
    have written: ``root``, each rank folder of ``names`` (default: every rank
    folder in ``root``) and every file in it, and the ranks' start-up bundles
    (``root/.startup/<name>/`` and their files) must each belong to this user (or
    root) and be
    writable by neither group nor others, the rule of a socket dir (whose mode must
    be 0700). A parent of ``root`` (``/tmp``) is not checked. What is missing
    passes; a ``root`` that is not a directory is left to the caller.

    Raises:
        UnsafePath: the first entry that fails, naming its owner or mode and the fix.
    """
    _refuse_unless_ours(root, "directory")
    if not os.path.isdir(root):
        return
    if names is None:
        names = list_snapshots(root)
    startup = os.path.join(root, STARTUP_DIR)
    _refuse_unless_ours(startup, "folder")
    for name in names:
        for folder in (os.path.join(root, name), os.path.join(startup, name)):
            _refuse_unless_ours(folder, "folder")
            if os.path.isdir(folder):
                for entry in sorted(os.listdir(folder)):
                    _refuse_unless_ours(os.path.join(folder, entry), "file")


def not_a_directory_hint(root: str) -> str:
    """What to give instead of ``root``, a path that is not a directory: the
    directory above a rank's folder when ``root`` is a file of one, else the
    snapshot directory."""
    parent = os.path.dirname(os.path.abspath(root))
    if os.path.exists(os.path.join(parent, DIGESTS_FILE)):  # a file of one rank's folder
        return (
            f"{root} is a file of one rank's folder of a snapshot: give the "
            f"directory that holds that folder, `--from-snapshot {os.path.dirname(parent)}`"
        )
    return f"{root} is a file: give the snapshot directory, the one `--snapshot` wrote into"


def write_snapshot(
    root: str,
    name: str,
    arena: torch.Tensor,
    manifest: Manifest,
    key: CacheKey,
    *,
    unusable: Snapshot | None = None,
) -> str:
    """Write one rank's arena atomically as ``root/name``.

    The rank's folder already there is removed before the write, under the
    directory's write lock, when it can never be served to ``key``: it opens as a
    snapshot of another key, it does not open (corrupt, unfinished), or it is
    still the very write ``unusable`` names (the caller found its arena corrupt).
    So a volume sized for one snapshot takes the replacement. A snapshot of
    ``key`` that opens (another writer's, meanwhile) stays until the new one is
    complete.

    Args:
        root: snapshot directory (created 0700 when missing; one that exists must
            be this user's and writable by no one else, as its rank's folder).
        name: the rank's sub-directory name (e.g. ``tp0of1-pp0of1-dp0of1``).
        arena: ``[>= arena_nbytes]`` uint8, CPU or CUDA (CUDA is copied to host
            memory once, since safetensors writes from host memory).
        manifest: the arena's layout; its key must be ``key``.
        key: the cache key the bytes were prepared for.
        unusable: the rank's snapshot as opened when the caller found it unusable
            (stale or corrupt), or None.

    Returns:
        The rank's directory.

    Raises:
        StoreError: the manifest's key differs from ``key``, or the arena is
            not ``[>= arena_nbytes]`` uint8.
        UnsafePath: ``root`` or the rank's folder (or a file in it) is another
            user's, or group or others can write it (:func:`check_snapshot_dir`);
            nothing is written.
        SnapshotWriteFailed: (an ``OSError``) a write, fsync or rename fails
            (disk full, file-size limit, permissions), including safetensors'
            own serialization errors; the temp dir is removed, and the message
            names the rank's folder that still holds space, if any.

    Source: safetensors.torch.save_file (the file), rename(2) (atomicity).
    """
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    _check_name(name)
    if CacheKey(manifest.key) != key:
        raise StoreError(
            "the manifest's key is not the key given; refusing to write a snapshot "
            "that would be served under another key"
        )
    n = manifest.arena_nbytes
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() < n:
        raise StoreError(f"arena must be [>= {n}] uint8, got {arena.dtype} {tuple(arena.shape)}")
    t0 = time.perf_counter()
    try:
        final = _write_snapshot(root, name, arena, manifest, key, save_file, unusable)
    except StoreError:
        raise
    except (
        Exception
    ) as e:  # OSError, and safetensors' SafetensorError (not an OSError) on EFBIG/ENOSPC
        raise SnapshotWriteFailed(
            f"cannot write the snapshot {os.path.join(root, name)}: "
            f"{type(e).__name__}: {e}; nothing of this write was left behind "
            f"({_what_stays(root, name)}). Free space or fix the permissions of "
            f"{root}, or give --snapshot another directory"
        ) from e
    dt = time.perf_counter() - t0
    log.info(
        "snapshot %s written: %.1f MiB in %.2f s (%.2f GiB/s)",
        final,
        n / 2**20,
        dt,
        n / 2**30 / max(dt, 1e-9),
    )
    return final


def _tree_nbytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _what_stays(root: str, name: str) -> str:
    """After a failed write: what of ``name`` still holds space in ``root`` (the
    rank's folder, whatever its key, and the leftovers of a write or of a removal
    that did not finish), each with its size, or that nothing does."""
    held = [p for p in (os.path.join(root, name), *leftovers(root, name)) if os.path.lexists(p)]
    if not held:
        return f"nothing of {name} remains in {root}"
    sizes = ", ".join(f"{p} ({_tree_nbytes(p) / 2**20:.1f} MiB)" for p in held)
    return f"still in {root}: {sizes}; deleting what you do not need frees that space"


def leftovers(root: str, name: str) -> list[str]:
    """Paths of ``name``'s temp and replaced dirs in ``root`` (``.tmp-<name>-*``,
    ``.old-<name>-*``): a write in progress, or what a killed write left, each as
    large as the arena. Other ranks' are not listed; none when ``root`` is gone."""
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    return [
        os.path.join(root, e)
        for e in entries
        if e.startswith((f"{TEMP_PREFIX}{name}-", f"{OLD_PREFIX}{name}-"))
    ]


def _rmtree_logged(path: str) -> bool:
    """``shutil.rmtree(path)``, each entry that cannot be removed (a read-only mount,
    an immutable file, another user's) logged with its error instead of raised.
    Returns True when ``path`` is gone."""
    failed: list[str] = []

    def note(_func: Any, where: str, exc: BaseException) -> None:
        failed.append(f"{where} ({exc.strerror if isinstance(exc, OSError) else exc})")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:  # onexc is 3.12's; onerror (deprecated there) gets sys.exc_info()
        shutil.rmtree(path, onerror=lambda func, where, info: note(func, where, info[1]))
    if failed:
        log.warning(
            "could not remove %s: %s%s; remove it by hand",
            path,
            ", ".join(failed[:3]),
            f" (and {len(failed) - 3} more)" if len(failed) > 3 else "",
        )
    return not os.path.lexists(path)


def _remove_leftovers(root: str, name: str) -> None:
    """Remove ``name``'s temp and replaced dirs that a killed writer left (each
    as large as the arena). Called with ``root``'s write lock held, so no live
    writer of ``name`` owns them; other ranks' dirs are left alone. What cannot be
    removed is logged, not raised."""
    for path in leftovers(root, name):
        log.warning(
            "removing %s (%.1f MiB), left by a snapshot write that did not finish",
            path,
            _tree_nbytes(path) / 2**20,
        )
        _rmtree_logged(path)


def remove_leftovers(root: str, name: str) -> bool:
    """Remove what a killed write of ``name`` left in ``root`` (as a write does
    first), under the directory's write lock; for a daemon that starts from its
    snapshot and so never writes. A writer at work holds the lock: nothing is
    removed then (that writer removes them itself), and no wait.

    Returns:
        True when the lock was free and the leftovers (if any) are gone.

    Raises:
        OSError: ``root`` cannot be opened.
    """
    lock_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        _remove_leftovers(root, name)
        return True
    finally:
        os.close(lock_fd)


def _discard_unusable(root: str, name: str, key: CacheKey, unusable: Snapshot | None) -> None:
    """Remove the rank's folder before a write replaces it when it can never be
    served to ``key`` (see :func:`write_snapshot`). Called with the write lock held,
    so it is the folder now in place that is judged, not one another writer
    replaced since the caller looked."""
    final = os.path.join(root, name)
    if not os.path.lexists(final):
        return
    try:
        snap = open_snapshot(root, name)
    except (SnapshotMissing, SnapshotCorrupt) as e:
        why = f"it is not a usable snapshot ({e.code})"
    else:
        if snap.key != key:
            why = "it was made for another key"
        elif unusable is not None and (snap.folder_id, snap.digests) == (
            unusable.folder_id,
            unusable.digests,
        ):
            why = "its arena failed its digest check"
        else:
            return  # a snapshot of this key: kept until the new one is complete
    log.warning(
        "removing the snapshot %s (%.1f MiB) before writing its replacement: %s, so "
        "it cannot serve this daemon's key",
        final,
        _tree_nbytes(final) / 2**20,
        why,
    )
    old = tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{name}-", dir=root)
    try:
        os.rename(final, os.path.join(old, name))  # atomic: never a half-removed folder
    except OSError:
        os.rmdir(old)  # empty: nothing moved (a read-only folder, an immutable one)
        raise
    _fsync_dir(root)
    _rmtree_logged(old)  # what stays (immutable files) is named by a failed write


def _write_snapshot(
    root: str,
    name: str,
    arena: torch.Tensor,
    manifest: Manifest,
    key: CacheKey,
    save_file,
    unusable: Snapshot | None,
) -> str:
    os.makedirs(root, mode=0o700, exist_ok=True)
    # a directory that was there (exist_ok) must be ours, not taken over from its owner
    check_snapshot_dir(root, [name])
    # One writer per directory at a time (two daemons of one rank, e.g. under two
    # --socket-dir or --job): flock(2) on the directory itself, released when the
    # fd closes, also when the writer is killed.
    lock_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        _remove_leftovers(root, name)
        _discard_unusable(root, name, key, unusable)
        return _write_locked(root, name, arena, manifest, key, save_file)
    finally:
        os.close(lock_fd)


def _write_locked(
    root: str, name: str, arena: torch.Tensor, manifest: Manifest, key: CacheKey, save_file
) -> str:
    n = manifest.arena_nbytes
    final = os.path.join(root, name)
    tmp = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{name}-", dir=root)
    try:
        data = arena[:n]
        device_digest = None
        if data.device.type != "cpu":
            algo, hexd = arena_digest(data)
            device_digest = {"algorithm": algo, "digest": hexd}
            data = data.cpu()
        apath = os.path.join(tmp, ARENA_FILE)
        save_file(
            {ARENA_TENSOR: data},
            apath,
            metadata={
                "format": "wcache-arena",
                "snapshot_format": str(SNAPSHOT_FORMAT_VERSION),
                "key_digest": key.digest,
                "arena_nbytes": str(n),
            },
        )
        with open(apath, "rb+") as f:
            header_len = int.from_bytes(f.read(8), "little")
            f.seek(0)
            header = f.read(8 + header_len)
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        if size != len(header) + n:
            raise SnapshotWriteFailed(
                f"safetensors wrote {size} bytes to {apath}, expected "
                f"{len(header) + n}; check the file system of {root}"
            )
        h = blake3.blake3(header, max_threads=blake3.blake3.AUTO)
        h.update(_memview(data.contiguous()))
        digests = {
            ARENA_FILE: h.hexdigest(),
            MANIFEST_FILE: _write_file(
                os.path.join(tmp, MANIFEST_FILE), manifest.to_json().encode()
            ),
            KEY_FILE: _write_file(os.path.join(tmp, KEY_FILE), key.to_json().encode()),
        }
        _write_file(
            os.path.join(tmp, DIGESTS_FILE),
            canonical_json(
                {
                    "snapshot_format": SNAPSHOT_FORMAT_VERSION,
                    "algorithm": "blake3",
                    "files": digests,
                    "key_digest": key.digest,
                    "arena_nbytes": n,
                    "device_digest": device_digest,
                }
            ).encode(),
        )
        _fsync_dir(tmp)
        old = None
        if os.path.lexists(final):
            old = tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{name}-", dir=root)
            os.rename(final, os.path.join(old, name))
        try:
            os.rename(tmp, final)
        except BaseException:
            if old is not None:  # put the previous snapshot back
                os.rename(os.path.join(old, name), final)
                os.rmdir(old)
            raise
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _refuse_unless_regular(path: str, fname: str) -> None:
    """Refuse a snapshot file that exists and is not a regular file (after symlinks):
    a FIFO would block its open forever, a device or a directory is no snapshot.

    Raises:
        SnapshotCorrupt: naming the file and what it is.
    """
    try:
        mode = os.stat(os.path.join(path, fname)).st_mode
    except FileNotFoundError:
        return  # missing: the reads below say so
    except OSError as e:
        raise SnapshotCorrupt(
            f"snapshot {path}: cannot stat {fname}: {e}; delete {path} and write it again"
        ) from e
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device or other special file"
        )
        raise SnapshotCorrupt(
            f"snapshot {path}: {fname} is {kind}, not a regular file; delete {path} "
            f"and write the snapshot again"
        )


def _read_small(path: str, digests: dict, fname: str) -> bytes:
    try:
        with open(os.path.join(path, fname), "rb") as f:
            data = f.read()
    except OSError as e:
        raise SnapshotCorrupt(
            f"snapshot {path}: cannot read {fname}: {e}; delete {path} and write the snapshot again"
        ) from e
    if blake3.blake3(data).hexdigest() != digests.get(fname):
        raise SnapshotCorrupt(
            f"snapshot {path}: {fname} does not match its digest; delete {path} "
            f"and write the snapshot again"
        )
    return data


def open_snapshot(root: str, name: str) -> Snapshot:
    """Open ``root/name`` and check its small files (digests, manifest, key, the
    safetensors header); the arena bytes are checked when read.

    Raises:
        UnsafePath: ``root``, the rank's folder or a file of either is not this
            user's, or group or others can write it (:func:`check_snapshot_dir`).
        SnapshotMissing: no complete snapshot of that name (temp dirs are not read).
        SnapshotCorrupt: a file is missing, malformed, or differs from its digest.
    """
    _check_name(name)
    check_snapshot_dir(root, [name])
    path = os.path.join(root, name)
    dpath = os.path.join(path, DIGESTS_FILE)
    try:
        folder = os.stat(path)  # before the reads: the write they come from
    except OSError:
        folder = None
    if folder is None or not stat.S_ISDIR(folder.st_mode) or not os.path.exists(dpath):
        what = (
            "no directory"
            if not os.path.isdir(path)
            else f"no {DIGESTS_FILE} (an unfinished write?)"
        )
        if os.path.exists(os.path.join(root, DIGESTS_FILE)):
            hint = (
                f"{root} is itself one rank's folder of a snapshot: give the directory "
                f"that holds it, `--from-snapshot {os.path.dirname(os.path.normpath(root))}`"
            )
        elif os.path.isfile(root):
            hint = not_a_directory_hint(root)
        else:
            hint = f"start the daemon from the checkpoint with `--snapshot {root}` to write one"
        raise SnapshotMissing(f"no snapshot at {path} ({what}); {hint}")
    for fname in (DIGESTS_FILE, KEY_FILE, MANIFEST_FILE, ARENA_FILE):
        _refuse_unless_regular(path, fname)
    try:
        with open(dpath, "rb") as f:
            index = json.loads(f.read())
        digests = dict(index["files"])
        fmt = index["snapshot_format"]
        device_digest = index.get("device_digest")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SnapshotCorrupt(
            f"snapshot {path}: {DIGESTS_FILE} is unreadable ({e}); delete {path} and write it again"
        ) from e
    if fmt != SNAPSHOT_FORMAT_VERSION:
        raise SnapshotCorrupt(
            f"snapshot {path} has format {fmt!r}, this wcache reads "
            f"{SNAPSHOT_FORMAT_VERSION}; write it again with this wcache"
        )
    try:
        key = CacheKey.from_json(_read_small(path, digests, KEY_FILE).decode())
        manifest = Manifest.from_json(_read_small(path, digests, MANIFEST_FILE).decode())
    except SnapshotCorrupt:
        raise
    except (StoreError, UnicodeDecodeError) as e:
        raise SnapshotCorrupt(f"snapshot {path}: {e}") from e
    if CacheKey(manifest.key) != key:
        raise SnapshotCorrupt(f"snapshot {path}: manifest.json and key.json name different keys")
    apath = os.path.join(path, ARENA_FILE)
    n = manifest.arena_nbytes
    try:
        with safe_open(apath, framework="pt") as f:
            names = list(f.keys())
            meta = f.metadata() or {}
            sl = f.get_slice(ARENA_TENSOR) if names == [ARENA_TENSOR] else None
            shape, dtype = (sl.get_shape(), sl.get_dtype()) if sl is not None else (None, None)
        with open(apath, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            f.seek(0)
            header = f.read(8 + header_len)
            size = os.fstat(f.fileno()).st_size
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise SnapshotCorrupt(
            f"snapshot {path}: {ARENA_FILE} is not a readable safetensors file "
            f"({type(e).__name__}: {e}); delete {path} and write it again"
        ) from e
    if (
        names != [ARENA_TENSOR]
        or shape is None
        or list(shape) != [n]
        or dtype != "U8"
        or size != len(header) + n
        or meta.get("key_digest") != key.digest
    ):
        raise SnapshotCorrupt(
            f"snapshot {path}: {ARENA_FILE} holds {names} {shape} {dtype} in "
            f"{size} bytes, expected one U8 [{n}] tensor of key {key.digest[:16]}; "
            f"delete {path} and write it again"
        )
    if device_digest is not None and not (
        isinstance(device_digest, dict) and {"algorithm", "digest"} <= device_digest.keys()
    ):
        raise SnapshotCorrupt(f"snapshot {path}: {DIGESTS_FILE} has a malformed device_digest")
    return Snapshot(
        path,
        manifest,
        key,
        digests,
        len(header),
        header,
        device_digest,
        (folder.st_dev, folder.st_ino),
    )


def check_key(snap: Snapshot, key: CacheKey) -> None:
    """Refuse a snapshot made for another key.

    Raises:
        SnapshotStale: naming every differing field and both values.
    """
    if snap.key == key:
        return
    diff = key.diff(snap.key)
    raise SnapshotStale(
        f"snapshot {snap.path} was prepared for another key; differing fields: "
        f"{key.describe_diff(snap.key, 'now', 'snapshot')}. Start from the "
        f"checkpoint with `--snapshot DIR` to replace it.",
        fields=diff,
        theirs={k: snap.key.fields.get(k) for k in diff},
    )


def _ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, n - off)) for off in range(0, n, chunk)]


def _read_range(fd: int, path: str, dst: memoryview, file_offset: int) -> None:
    """``preadv`` until ``dst`` is full (a read may return fewer bytes)."""
    got, length = 0, len(dst)
    while got < length:
        r = os.preadv(fd, [dst[got:]], file_offset + got)
        if r <= 0:
            raise SnapshotCorrupt(
                f"{path} ends {length - got} bytes early at offset {file_offset + got}"
            )
        got += r


def _open_arena(path: str) -> int:
    """``open(path, O_RDONLY)``; a file gone or unreadable since it was checked is
    :class:`SnapshotCorrupt` (so ``--snapshot`` falls back to the checkpoint)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SnapshotCorrupt(
            f"cannot open {path}: {e}; delete {os.path.dirname(path)} and write the snapshot again"
        ) from e


def read_bytes_into(
    path: str,
    file_offset: int,
    dst: memoryview,
    *,
    threads: int | None = None,
    chunk: int = READ_CHUNK_BYTES,
    hasher=None,
) -> None:
    """Read ``len(dst)`` bytes of ``path`` from ``file_offset`` into ``dst`` with
    ``preadv`` from several threads (large sequential requests, no staging).
    With ``hasher`` (a blake3 object), each chunk is hashed in file order as
    soon as it and every chunk before it have arrived, overlapping the reads.

    Raises:
        SnapshotCorrupt: the file is shorter than expected or a read fails.
    """
    n = len(dst)
    threads = threads or min(MAX_READ_THREADS, os.cpu_count() or 1)
    fd = _open_arena(path)
    try:
        os.posix_fadvise(fd, file_offset, n, os.POSIX_FADV_SEQUENTIAL)
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wcache-read") as ex:
            futures = [
                (
                    off,
                    length,
                    ex.submit(_read_range, fd, path, dst[off : off + length], file_offset + off),
                )
                for off, length in _ranges(n, chunk)
            ]
            for off, length, fut in futures:
                fut.result()
                if hasher is not None:
                    hasher.update(dst[off : off + length])
    except OSError as e:
        raise SnapshotCorrupt(
            f"cannot read {path}: {e}; delete {os.path.dirname(path)} and write the snapshot again"
        ) from e
    finally:
        os.close(fd)


def _fill_cpu(snap: Snapshot, dst: torch.Tensor, threads: int | None) -> str:
    h = blake3.blake3(snap.header, max_threads=blake3.blake3.AUTO)
    read_bytes_into(
        os.path.join(snap.path, ARENA_FILE),
        snap.data_offset,
        _memview(dst),
        threads=threads,
        hasher=h,
    )
    return h.hexdigest()


def _fill_cuda(
    snap: Snapshot, dst: torch.Tensor, threads: int | None, hash_file: bool
) -> str | None:
    """Stage through pinned host buffers in two halves: while one wave of
    chunks is copied to the device asynchronously (and, with ``hash_file``,
    hashed in file order on the host), the next wave is read into the other
    half by the reader threads. Returns the file's blake3 with ``hash_file``."""
    n = snap.manifest.arena_nbytes
    threads = threads or min(MAX_READ_THREADS, os.cpu_count() or 1)
    chunk, depth = READ_CHUNK_BYTES, CUDA_STAGING_CHUNKS
    ranges = _ranges(n, chunk)
    waves = [ranges[i : i + depth] for i in range(0, len(ranges), depth)]
    nbuf = 2 * depth if len(waves) > 1 else max(1, len(ranges))
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    views = [_memview(b) for b in bufs]
    h = blake3.blake3(snap.header, max_threads=blake3.blake3.AUTO)
    stream = torch.cuda.Stream(dst.device)
    apath = os.path.join(snap.path, ARENA_FILE)
    fd = _open_arena(apath)
    events: list = [None, None]
    try:
        os.posix_fadvise(fd, snap.data_offset, n, os.POSIX_FADV_SEQUENTIAL)
        with concurrent.futures.ThreadPoolExecutor(
            min(threads, depth), thread_name_prefix="wcache-read"
        ) as ex:

            def submit(w: int) -> list:
                base = (w % 2) * depth
                return [
                    ex.submit(
                        _read_range, fd, apath, views[base + i][:length], snap.data_offset + off
                    )
                    for i, (off, length) in enumerate(waves[w])
                ]

            pending = submit(0)
            for w, wave in enumerate(waves):
                nxt: list[concurrent.futures.Future[None]] = []  # none after the last wave
                if w + 1 < len(waves):
                    if events[(w + 1) % 2] is not None:
                        events[(w + 1) % 2].synchronize()  # that half's copies are done
                    nxt = submit(w + 1)
                for f in pending:
                    f.result()
                base = (w % 2) * depth
                with torch.cuda.stream(stream):
                    for i, (off, length) in enumerate(wave):
                        if hash_file:
                            h.update(views[base + i][:length])
                        dst[off : off + length].copy_(bufs[base + i][:length], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[w % 2] = ev
                pending = nxt
            stream.synchronize()
    except BaseException as e:
        # A read failed (or anything else) with copies still queued on `stream`: let
        # them land before the staging buffers and `dst` can be freed by the caller.
        # If the stream cannot be drained, the caller's drain_before_free keeps `dst`.
        try:
            stream.synchronize()
        except Exception:  # a sticky CUDA error; the caller keeps dst
            log.exception("cannot drain the snapshot copy stream after a failed fill")
        if isinstance(e, OSError):
            raise SnapshotCorrupt(f"cannot read {apath}: {e}") from e
        raise
    finally:
        os.close(fd)
    return h.hexdigest() if hash_file else None


def snapshot_arena(snap: Snapshot, *, threads: int | None = None) -> PrebuiltArena:
    """A :class:`PrebuiltArena` that reads the snapshot's bytes into the daemon's
    arena (CPU: straight into the memfd mapping, blake3 of the file computed as
    the chunks arrive; CUDA: through pinned staging buffers, then the recorded
    device-side digest checked on the GPU, or the file's blake3 on the host when
    none was recorded).

    Raises (from ``fill``):
        SnapshotCorrupt: a short or failed read, or a digest that differs (the
            arena is then dropped and nothing is served).
    """

    def fill(dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        got: str | None
        if dst.device.type == "cpu":
            got = _fill_cpu(snap, dst, threads)
        else:
            device_digest = snap.device_digest or {}
            on_device = device_digest.get("algorithm") == CUDA_ALGORITHM
            got = _fill_cuda(snap, dst, threads, hash_file=not on_device)
            if on_device:
                algo, hexd = arena_digest(dst[: snap.manifest.arena_nbytes])
                if hexd != device_digest["digest"]:
                    raise SnapshotCorrupt(
                        f"snapshot {snap.path}: the arena read from {ARENA_FILE} "
                        f"does not match its digest ({algo} on the device: read "
                        f"{hexd[:16]}, recorded {device_digest['digest'][:16]}); "
                        f"delete {snap.path} and write it again"
                    )
                got = snap.digests.get(ARENA_FILE)
        if got != snap.digests.get(ARENA_FILE):
            raise SnapshotCorrupt(
                f"snapshot {snap.path}: {ARENA_FILE} does not match its digest "
                f"(read {str(got)[:16]}, recorded {str(snap.digests.get(ARENA_FILE))[:16]}); "
                f"delete {snap.path} and write it again"
            )
        log.info("snapshot %s read and verified in %.3f s", snap.path, time.perf_counter() - t0)

    return PrebuiltArena(snap.manifest, fill, f"snapshot {snap.path}")


def list_snapshots(root: str) -> Iterable[str]:
    """Names of the complete-looking rank directories under ``root`` (temp and
    replaced directories are left out)."""
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [e for e in entries if not e.startswith(".") and os.path.isdir(os.path.join(root, e))]
