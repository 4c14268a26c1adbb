"""Checkpoint content identity: a blake3 digest per weight/config file.

Two checkpoints with the same tensor names and shapes but different values get
different digests (the bytes are hashed, not the safetensors header; compare
vllm#59647 in reference/anchors.md). Digests are cached per user, keyed by
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``, so the engine's check
on a second call costs one ``stat`` per file. Files are read with ``pread`` into
one reused buffer, never mapped, so a file truncated while it is hashed is a
:class:`CheckpointChanged` error (reason code ``checkpoint-changed``), not a SIGBUS.

The daemon's key must describe the bytes it loaded. vLLM's loaders open the
files themselves (safetensors maps them), so the daemon cannot hash as they
read; it takes :func:`checkpoint_stats` and the digests *before* the load and
calls :func:`verify_checkpoint_unchanged` *after* prepare: any file written,
replaced (new inode, e.g. an atomic rename of the shard or of its directory),
added or removed in between is refused.
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import stat
import time
from typing import Any, TypeGuard

import blake3

from wcache.store.errors import CheckpointChanged, StoreError
from wcache.store.manifest import canonical_json

__all__ = [
    "WEIGHT_SUFFIXES",
    "CONFIG_SUFFIXES",
    "checkpoint_digest",
    "checkpoint_files",
    "digest_file",
    "DigestCache",
    "DigestingReader",
    "read_file_digest",
    "default_digest_cache_path",
    "checkpoint_key_fields",
    "checkpoint_stats",
    "verify_checkpoint_unchanged",
]

log = logging.getLogger("wcache.store")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_SUFFIXES = (".json",)
# Read size when streaming a file: large enough to amortize syscalls and let
# blake3 use its SIMD lanes, small enough to stay in cache.
CHUNK_BYTES = 8 << 20
DIGEST_ALGORITHM = "blake3"


def default_digest_cache_path() -> str:
    """``$XDG_CACHE_HOME/wcache/digests.json`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "wcache", "digests.json")


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hits(entry: Any, st: os.stat_result) -> TypeGuard[list]:
    """Whether a cache entry ``[dev, ino, size, mtime_ns, ctime_ns, digest]`` describes
    a file of stat ``st``."""
    return isinstance(entry, list) and len(entry) == 6 and entry[:5] == _stat_key(st)


def _still_hits(real: str, entry: Any) -> bool:
    """Whether a cache entry still describes the file at ``real`` (:func:`_hits` on
    its stat now); False for a file removed, replaced or unreadable."""
    try:
        return _hits(entry, os.stat(real))
    except (OSError, ValueError, TypeError):  # gone, or a junk key (NUL, not a path)
        return False


class DigestCache:
    """Per-user cache: real path -> (dev, ino, size, mtime_ns, ctime_ns, digest).

    A hit needs every stat field to match; a changed file (even with a restored
    mtime, since ctime moves) is hashed again. Saves merge with concurrent
    writers under an flock and replace the file atomically.
    """

    def __init__(self, path: str | None = None):
        self.path = path or default_digest_cache_path()
        self._entries: dict[str, list] = self._load()
        self._dirty: dict[str, list] = {}

    def _load(self) -> dict[str, list]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                log.warning("ignoring digest cache %s: not a regular file of yours", self.path)
                return {}
            with os.fdopen(fd, "r") as f:
                fd = -1
                data = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable digest cache %s: %s", self.path, e)
            return {}
        finally:
            if fd >= 0:
                os.close(fd)
        if not isinstance(data, dict) or data.get("algorithm") != DIGEST_ALGORITHM:
            return {}
        files = data.get("files")
        return files if isinstance(files, dict) else {}

    def get(self, real: str, st: os.stat_result) -> str | None:
        entry = self._dirty.get(real) or self._entries.get(real)
        if _hits(entry, st):
            return entry[5]
        return None

    def put(self, real: str, st: os.stat_result, digest: str) -> None:
        self._dirty[real] = _stat_key(st) + [digest]

    def save(self) -> None:
        """Merge new entries into the cache file (no-op when nothing is new),
        dropping the entries that can no longer hit: a file gone or changed since
        (the cache only grew: break14 #6, 240 of 457 entries for deleted files)."""
        if not self._dirty:
            return
        d = os.path.dirname(self.path)
        os.makedirs(d, mode=0o700, exist_ok=True)
        lock_fd = os.open(
            self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            merged = {p: e for p, e in self._load().items() if _still_hits(p, e)}
            merged.update(self._dirty)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"algorithm": DIGEST_ALGORITHM, "files": merged}, f)
            os.replace(tmp, self.path)
            self._entries, self._dirty = merged, {}
        finally:
            os.close(lock_fd)


def _read_chunk(fd: int, buf: memoryview, offset: int) -> int:
    """``pread`` into ``buf`` at ``offset``; the byte count (0 at end of file)."""
    return os.preadv(fd, [buf], offset)


def _hash_fd(fd: int, size: int, path: str) -> str:
    """blake3 of the first ``size`` bytes of an open file, read with ``pread``
    into one reused buffer (never ``mmap``: a file truncated under a mapping
    kills the reader with SIGBUS, and network filesystems fail the same way).

    Raises:
        CheckpointChanged: the file ended before ``size`` bytes (it shrank).
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buf = memoryview(bytearray(min(CHUNK_BYTES, max(size, 1))))
    offset = 0
    while offset < size:
        n = _read_chunk(fd, buf[: min(len(buf), size - offset)], offset)
        if n <= 0:
            raise CheckpointChanged(
                f"{path} shrank from {size} to {offset} bytes while it was "
                f"hashed; retry once it is fully written"
            )
        h.update(buf[:n])
        offset += n
    return h.hexdigest()


def _hash_path(path: str) -> str:
    """blake3 hex digest of a whole file (no cache, no stat checks)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _hash_fd(fd, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


def digest_file(path: str, cache: DigestCache | None = None) -> str:
    """blake3 hex digest of one file's bytes, from the cache when its stat matches.

    Raises:
        CheckpointChanged: the file vanished, shrank, changed or could not be
            read while it was hashed (reason code ``checkpoint-changed``).
    """
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CheckpointChanged(f"{path} vanished before it could be hashed") from e
    except OSError as e:
        raise CheckpointChanged(f"{path} cannot be opened for hashing: {e}") from e
    try:
        st = os.fstat(fd)
        if cache is not None and (hit := cache.get(real, st)) is not None:
            return hit
        try:
            digest = _hash_fd(fd, st.st_size, path)
        except OSError as e:  # EIO from a network filesystem, a disk error
            raise CheckpointChanged(f"{path} could not be read while it was hashed: {e}") from e
        try:
            after = os.stat(real)
        except FileNotFoundError as e:
            raise CheckpointChanged(f"{path} vanished while it was hashed") from e
        if _stat_key(after) != _stat_key(st) or _stat_key(os.fstat(fd)) != _stat_key(st):
            raise CheckpointChanged(
                f"{path} changed while it was hashed; retry once it is fully written"
            )
    finally:
        os.close(fd)
    if cache is not None:
        cache.put(real, st, digest)
    return digest


def checkpoint_files(model_dir: str) -> list[str]:
    """Weight files (*.safetensors, *.bin, *.pt, *.pth, *.gguf) and *.json files
    under ``model_dir`` (recursive, hidden dirs skipped, file symlinks followed
    as in a Hugging Face snapshot), as sorted paths relative to ``model_dir``.

    Raises:
        StoreError: ``model_dir`` is not a directory, or holds no weight file.
    """
    if not os.path.isdir(model_dir):
        raise StoreError(f"checkpoint dir {model_dir} does not exist")
    out = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in files:
            if f.endswith(WEIGHT_SUFFIXES + CONFIG_SUFFIXES) and not f.startswith("."):
                out.append(os.path.relpath(os.path.join(root, f), model_dir))
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in out):
        raise StoreError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) under {model_dir}")
    return sorted(out)


def checkpoint_digest(
    model_dir: str, cache_path: str | None = None, *, use_cache: bool = True
) -> dict[str, str]:
    """Per-file blake3 digest of a checkpoint.

    Args:
        model_dir: the checkpoint directory.
        cache_path: the digest cache file (default :func:`default_digest_cache_path`).
        use_cache: False hashes every file and leaves the cache alone.

    Returns:
        relative path -> blake3 hex digest, for every file of :func:`checkpoint_files`.

    Raises:
        StoreError: see :func:`checkpoint_files` and :func:`digest_file`.
    """
    t0 = time.perf_counter()
    cache = DigestCache(cache_path) if use_cache else None
    out = {
        rel: digest_file(os.path.join(model_dir, rel), cache) for rel in checkpoint_files(model_dir)
    }
    if cache is not None:
        try:
            cache.save()
        except OSError as e:  # a read-only home must not stop a load; the digests are still right
            log.warning("could not save the digest cache %s: %s", cache.path, e)
    log.info(
        "checkpoint digest of %s: %d files in %.3f s", model_dir, len(out), time.perf_counter() - t0
    )
    return out


def checkpoint_key_fields(model_dir: str, cache_path: str | None = None) -> dict[str, str]:
    """Key fields for a checkpoint: ``{"checkpoint": <blake3 of the per-file digests>}``."""
    files = checkpoint_digest(model_dir, cache_path)
    return {"checkpoint": blake3.blake3(canonical_json(files).encode()).hexdigest()}


def checkpoint_stats(model_dir: str) -> dict[str, list[int]]:
    """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of every checkpoint file
    (symlinks followed, as the loader opens them), by relative path.

    Raises:
        StoreError: see :func:`checkpoint_files`.
        CheckpointChanged: a file vanished while the list was taken.
    """
    out = {}
    for rel in checkpoint_files(model_dir):
        try:
            out[rel] = _stat_key(os.stat(os.path.join(model_dir, rel)))
        except FileNotFoundError as e:
            raise CheckpointChanged(
                f"{os.path.join(model_dir, rel)} vanished while the checkpoint was listed"
            ) from e
    return out


def verify_checkpoint_unchanged(model_dir: str, before: dict[str, list[int]]) -> None:
    """Refuse when any checkpoint file differs from ``before`` (from
    :func:`checkpoint_stats`): added, removed, replaced (another inode, as after an
    atomic rename of the file or of its directory), or written (size, mtime or
    ctime moved; ctime moves on every write, even when mtime is restored).

    Raises:
        CheckpointChanged: names the changed files.
    """
    try:
        now = checkpoint_stats(model_dir)
    except StoreError as e:
        raise CheckpointChanged(f"checkpoint {model_dir} changed while it was loaded: {e}") from e
    changed = sorted(rel for rel in before.keys() | now.keys() if before.get(rel) != now.get(rel))
    if changed:
        raise CheckpointChanged(
            f"checkpoint {model_dir} changed while it was loaded (files {changed[:5]}"
            f"{' ...' if len(changed) > 5 else ''}): the loaded weights may not be the bytes "
            f"the key describes, so they are not served. Start again once the checkpoint is "
            f"fully written."
        )


class DigestingReader(io.RawIOBase):
    """A read-only file that hashes what it reads; for a daemon that streams a
    checkpoint file anyway. When the file was read to its end, in order, and did
    not change meanwhile, :meth:`close` stores the digest in the cache.

    Example::

        with DigestingReader(path, cache) as f:
            data = f.read()
        digest = f.digest  # None when the read was not sequential and complete
    """

    def __init__(self, path: str, cache: DigestCache | None = None):
        super().__init__()
        self._real = os.path.realpath(path)
        self._f = open(self._real, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        self._st = os.fstat(self._f.fileno())
        self._cache = cache
        self._hasher = blake3.blake3()
        self._pos = 0
        self._sequential = True
        self.digest: str | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        if n:
            self._hasher.update(memoryview(b)[:n])
            self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = self._f.seek(offset, whence)
        if pos != self._pos:
            self._sequential = False  # the hash no longer covers the bytes in order
        return pos

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if self.closed:
            return
        try:
            complete = self._sequential and self._pos == self._st.st_size
            if complete and _stat_key(os.fstat(self._f.fileno())) == _stat_key(self._st):
                self.digest = self._hasher.hexdigest()
                if self._cache is not None:
                    self._cache.put(self._real, self._st, self.digest)
        finally:
            self._f.close()
            super().close()


def read_file_digest(path: str, cache: DigestCache | None = None) -> tuple[bytes, str]:
    """Read a whole file and hash it in the same pass.

    Returns:
        (the file's bytes, its blake3 hex digest).

    Raises:
        StoreError: the file changed while it was read.
    """
    with DigestingReader(path, cache) as f:
        chunks = []
        while chunk := f.read(CHUNK_BYTES):
            chunks.append(chunk)
    if f.digest is None:
        raise StoreError(f"{path} changed while it was read; retry once it is fully written")
    return b"".join(chunks), f.digest
