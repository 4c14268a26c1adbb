"""Start-up artifact bundles: the on-disk caches an engine writes while it starts
(vLLM's torch.compile artifacts, Triton kernels, vLLM's model-info cache), packed
for one key so that they travel with the daemon (issue 24, item 3).

A bundle is a tar (stdlib ``tarfile``, no compression: the artifacts are mostly
compiled code and already dense) held in a sealed memfd, plus a JSON-able
manifest::

    {"format": 1,
     "factors": {...},                 # what it was made under (wcache.vllm.startup)
     "entries": [{"root": "vllm", "path": "torch_compile_cache/torch_aot_compile/<hash>"}, ...],
     "files": [{"path": "vllm/torch_compile_cache/.../model", "nbytes": 123, "blake3": "..."}],
     "nbytes": <sum of file bytes>, "tar_nbytes": <bytes of the tar>, "tar_blake3": "..."}

An *entry* is the unit of installation: one directory (or file) under one cache
root (``vllm`` -> ``VLLM_CACHE_ROOT``, ``triton`` -> ``TRITON_CACHE_DIR``,
``inductor`` -> ``TORCHINDUCTOR_CACHE_DIR``). :func:`install_bundle` installs each
entry the engine's cache does not have yet (extract to a temp dir beside it,
check every file's size and blake3, ``renameat2(RENAME_NOREPLACE)``) and never
overwrites an existing one, even one that appears while it installs.

This module imports neither torch nor vLLM: the daemon's lean server serves
bundles, snapshots store them. What the factors mean and whether a bundle fits
an engine is :mod:`wcache.vllm.startup`.

Source: vllm/compilation/decorators.py (``torch_aot_compile/{hash}``),
vllm/compilation/caching.py (``aot_compile_hash_factors``); tarfile, blake3.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import json
import logging
import mmap
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import blake3

from wcache.errors import ArtifactsCorrupt, ArtifactsMissing, StoreError

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_ROOTS",
    "MAX_BUNDLE_BYTES",
    "TAR_FILE",
    "MANIFEST_FILE",
    "Bundle",
    "ArtifactsMissing",
    "ArtifactsCorrupt",
    "pack_bundle",
    "bundle_from_bytes",
    "write_bundle",
    "read_bundle",
    "open_bundle_fd",
    "install_bundle",
    "InstallResult",
    "bundle_summary",
    "INSTALL_FAILED",
]

log = logging.getLogger("wcache.store")

BUNDLE_FORMAT = 1
#: The cache roots a bundle may carry, by the name its entries use (the same
#: names as wcache.testing.caches.CACHE_ENV_DIRS' sub-directories). The driver's
#: PTX JIT cache (CUDA_CACHE_PATH) is not carried: it is one index file plus
#: blobs, which cannot be installed entry by entry without rewriting the index.
BUNDLE_ROOTS = ("vllm", "triton", "inductor")
#: Largest bundle accepted (bytes of the tar): an 8B model's AOT artifacts plus
#: Inductor and Triton kernels are tens to a few hundred MiB; 8 GiB refuses a
#: runaway cache (a wrong root) before it fills memory.
MAX_BUNDLE_BYTES = 8 << 30
#: Files of a bundle in a snapshot directory.
TAR_FILE = "startup.tar"
MANIFEST_FILE = "startup.json"
#: Seals of a filled bundle memfd (no writes, no resize, no more seals).
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
#: Read size while hashing or copying (bytes).
_CHUNK = 1 << 20
#: Prefix of the temp dirs an install extracts into (beside the final entry).
_TMP_PREFIX = ".wcache-startup-"
#: Reason code of an entry that could not be moved into the engine's cache for a
#: reason other than "already there" (EACCES, EXDEV, ENOSPC, ...): a StoreError,
#: which the loader logs before the engine compiles as usual.
INSTALL_FAILED = "artifacts-install-failed"
#: renameat2(2)'s "relative to the working directory" fd and its no-replace flag
#: (linux/fcntl.h, linux/fs.h): the rename fails with EEXIST when the target exists.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
#: errnos of a kernel or file system that does not do RENAME_NOREPLACE (before
#: Linux 3.15; some network and FUSE file systems): the fallbacks of :func:`_place` apply.
_NOREPLACE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
#: errnos saying the destination exists (a file, a directory, or a non-empty one).
_EXISTS = (errno.EEXIST, errno.ENOTEMPTY)
#: Reasons :class:`InstallResult` gives for a skipped entry.
SKIP_PRESENT = "present"  # the engine's cache had it (or it appeared meanwhile)
SKIP_NO_ROOT = "no-root"  # the caller gave no directory for its root
SKIP_NOT_IN_TAR = "not-in-tar"  # listed, but the tar has no member of it (see install_bundle)


@attrs.frozen
class Bundle:
    """A bundle held in memory.

    Attributes:
        fd: a sealed memfd holding the tar (owned by this value's holder; close with :meth:`close`).
        manifest: the manifest (see the module docstring).
    """

    fd: int
    manifest: Mapping[str, Any] = attrs.field(eq=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the artifact files (not counting tar headers)."""
        return int(self.manifest["nbytes"])

    @property
    def tar_nbytes(self) -> int:
        return int(self.manifest["tar_nbytes"])

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _digest_file(path: Path) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sealed_from(write: Any, what: str) -> tuple[int, int, str]:
    """A sealed memfd filled by ``write(fileobj)``; returns (fd, nbytes, blake3)."""
    fd = os.memfd_create("wcache-startup", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with os.fdopen(os.dup(fd), "w+b") as f:
            write(f)
            f.flush()
            nbytes = f.tell()
        if nbytes > MAX_BUNDLE_BYTES:
            raise ArtifactsCorrupt(
                f"{what} is {nbytes} bytes, over the {MAX_BUNDLE_BYTES}-byte limit"
            )
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, nbytes, _digest_fd(fd, nbytes)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise StoreError(f"cannot hold {what} in memory: {e}") from e
        raise


def _digest_fd(fd: int, nbytes: int) -> str:
    h = blake3.blake3()
    if nbytes:
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            h.update(mm)
    return h.hexdigest()


def pack_bundle(
    roots: Mapping[str, str | os.PathLike],
    entries: list[tuple[str, str]],
    factors: Mapping[str, Any],
) -> Bundle:
    """Pack ``entries`` (``(root name, path relative to that root)``, each a
    directory or a file) of the cache directories ``roots`` into a sealed bundle.

    Args:
        roots: cache root name (one of :data:`BUNDLE_ROOTS`) -> directory.
        entries: what to carry; symlinks and special files inside are skipped, and an
            entry that is itself one (or is gone) is left out of the manifest, so each
            listed entry has members in the tar.
        factors: what the artifacts were made under (JSON-able; :mod:`wcache.vllm.startup`).

    Returns:
        The bundle (its fd owned by the caller).

    Raises:
        ArtifactsCorrupt: an unknown root, an entry path that is absolute or has ``..``,
            or a bundle over :data:`MAX_BUNDLE_BYTES`.
        StoreError: the memfd cannot be made.
    """
    files: list[dict[str, Any]] = []
    checked = []
    for root, rel in entries:
        _check_entry(root, rel)
        if root not in roots:
            raise ArtifactsCorrupt(f"entry {root}/{rel}: no directory given for root {root!r}")
        checked.append({"root": root, "path": rel})

    carried = []

    def write(f: Any) -> None:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in checked:
                base = Path(roots[entry["root"]]) / entry["path"]
                arc = f"{entry['root']}/{entry['path']}"
                walked = _walk(base, arc)
                if walked:  # a symlink, special file or vanished entry carries nothing
                    carried.append(entry)
                for path, name in walked:
                    st = os.lstat(path)
                    info = tarfile.TarInfo(name)
                    info.mtime = int(st.st_mtime)
                    info.mode = stat.S_IMODE(st.st_mode)
                    if stat.S_ISDIR(st.st_mode):
                        info.type = tarfile.DIRTYPE
                        tar.addfile(info)
                        continue
                    info.size = st.st_size
                    with open(path, "rb") as src:
                        tar.addfile(info, src)
                    files.append({"path": name, "nbytes": st.st_size, "blake3": _digest_file(path)})

    fd, tar_nbytes, tar_digest = _sealed_from(write, "the start-up artifact bundle")
    manifest = {
        "format": BUNDLE_FORMAT,
        "factors": dict(factors),
        "entries": carried,
        "files": files,
        "nbytes": sum(f["nbytes"] for f in files),
        "tar_nbytes": tar_nbytes,
        "tar_blake3": tar_digest,
    }
    return Bundle(fd, manifest)


def _walk(base: Path, arc: str) -> list[tuple[Path, str]]:
    """(path, archive name) of ``base`` and, for a directory, everything under it
    that is a directory or a regular file (sorted, so the tar is reproducible)."""
    if base.is_symlink() or not (base.is_dir() or base.is_file()):
        return []
    out = [(base, arc)]
    if base.is_dir():
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            rel = Path(dirpath).relative_to(base)
            for name in sorted(dirnames) + sorted(filenames):
                p = Path(dirpath) / name
                if p.is_symlink() or not (p.is_dir() or p.is_file()):
                    continue
                out.append((p, str(PurePosixPath(arc) / rel.as_posix() / name).replace("/./", "/")))
    return out


def _check_entry(root: str, rel: str) -> None:
    p = PurePosixPath(rel)
    if root not in BUNDLE_ROOTS:
        raise ArtifactsCorrupt(f"unknown cache root {root!r}; a bundle carries {BUNDLE_ROOTS}")
    if not rel or p.is_absolute() or ".." in p.parts or "." in p.parts or rel != str(p):
        raise ArtifactsCorrupt(f"entry path {rel!r} under {root} is not a plain relative path")


def bundle_from_bytes(data: bytes | io.BufferedIOBase | Any, manifest: Mapping[str, Any]) -> Bundle:
    """A bundle from the tar's bytes (or a readable binary file) and its manifest,
    checked against the manifest's ``tar_blake3``.

    Raises:
        ArtifactsCorrupt: the bytes differ from the manifest, the manifest is malformed,
            or reading ``data`` fails (an OSError: EIO, ...).
        StoreError: the memfd cannot be made or filled.
    """
    _check_manifest(manifest)

    def write(f: Any) -> None:
        if isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
            return
        while True:
            try:
                chunk = data.read(_CHUNK)
            except OSError as e:  # a read error is the source's, not the memfd's
                raise ArtifactsCorrupt(f"cannot read the bundle tar: {_oserror(e)}") from e
            if not chunk:
                return
            f.write(chunk)

    fd, nbytes, digest = _sealed_from(write, "the start-up artifact bundle")
    if nbytes != manifest["tar_nbytes"] or digest != manifest["tar_blake3"]:
        os.close(fd)
        raise ArtifactsCorrupt(
            f"bundle tar is {nbytes} bytes with blake3 {digest[:16]}, its "
            f"manifest says {manifest['tar_nbytes']} bytes, "
            f"{str(manifest['tar_blake3'])[:16]}"
        )
    return Bundle(fd, dict(manifest))


def _check_manifest(manifest: Any) -> None:
    """Check that ``manifest`` has the fields a bundle needs, each of its type: every
    entry a map with a string ``root`` (one of :data:`BUNDLE_ROOTS`) and a plain
    relative string ``path``, every files item a map with a string ``path`` and
    ``blake3`` and an int ``nbytes >= 0``.

    Raises:
        ArtifactsCorrupt: naming the first field that is missing or malformed.
    """
    if not isinstance(manifest, Mapping):
        raise ArtifactsCorrupt(f"bundle manifest is a {type(manifest).__name__}, not a map")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ArtifactsCorrupt(
            f"bundle format {manifest.get('format')!r}, this wcache reads {BUNDLE_FORMAT}"
        )
    for name, kind in (
        ("factors", Mapping),
        ("entries", list),
        ("files", list),
        ("nbytes", int),
        ("tar_nbytes", int),
        ("tar_blake3", str),
    ):
        if not isinstance(manifest.get(name), kind):
            raise ArtifactsCorrupt(
                f"bundle manifest field {name!r} is missing or not a {kind.__name__}"
            )
    if not 0 <= manifest["tar_nbytes"] <= MAX_BUNDLE_BYTES:
        raise ArtifactsCorrupt(
            f"bundle of {manifest['tar_nbytes']} bytes is over the {MAX_BUNDLE_BYTES}-byte limit"
        )
    for entry in manifest["entries"]:
        if not isinstance(entry, Mapping):
            raise ArtifactsCorrupt(f"bundle entry {entry!r:.80} is not a map")
        root, rel = entry.get("root"), entry.get("path")
        if not isinstance(root, str) or not isinstance(rel, str):
            raise ArtifactsCorrupt(
                f"bundle entry {dict(entry)!r:.120} lacks a string root and path"
            )
        _check_entry(root, rel)
    for item in manifest["files"]:
        if not isinstance(item, Mapping):
            raise ArtifactsCorrupt(f"bundle files item {item!r:.80} is not a map")
        path, digest, nbytes = item.get("path"), item.get("blake3"), item.get("nbytes")
        if not (
            isinstance(path, str)
            and isinstance(digest, str)
            and isinstance(nbytes, int)
            and not isinstance(nbytes, bool)
            and nbytes >= 0
        ):
            raise ArtifactsCorrupt(
                f"bundle files item {dict(item)!r:.120} needs a string path and "
                f"blake3 and an int nbytes >= 0"
            )


def open_bundle_fd(manifest: Any, fds: list[int]) -> Bundle:
    """Client side: the bundle a daemon passed (one sealed memfd with ``manifest``).

    Raises:
        ArtifactsCorrupt: not exactly one fd, not sealed against writes, the wrong size
            or a malformed manifest (the fds are closed).
    """
    try:
        _check_manifest(manifest)
        if len(fds) != 1:
            raise ArtifactsCorrupt(f"expected one memfd with the bundle, got {len(fds)}")
        fd = fds[0]
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_WRITE:
            raise ArtifactsCorrupt("the bundle memfd is not sealed against writes")
        size = os.fstat(fd).st_size
        if size != manifest["tar_nbytes"]:
            raise ArtifactsCorrupt(
                f"the bundle memfd holds {size} bytes, its manifest says {manifest['tar_nbytes']}"
            )
    except BaseException:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    return Bundle(fd, dict(manifest))


def write_bundle(directory: str | os.PathLike, bundle: Bundle) -> None:
    """Write ``bundle`` as :data:`TAR_FILE` + :data:`MANIFEST_FILE` into
    ``directory`` (a snapshot's rank dir), each through a temp file and a rename,
    the manifest last (a manifest names a complete tar).

    Raises:
        OSError: the directory is not writable or the disk is full (temp files removed).
    """
    directory = Path(directory)
    # 0700: a snapshot's folder that group or others can write is refused when read
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, write in (
        (TAR_FILE, lambda f: _copy_fd(bundle, f)),
        (
            MANIFEST_FILE,
            lambda f: f.write(json.dumps(dict(bundle.manifest), sort_keys=True).encode()),
        ),
    ):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _copy_fd(bundle: Bundle, f: Any) -> None:
    with os.fdopen(os.dup(bundle.fd), "rb") as src:
        src.seek(0)
        shutil.copyfileobj(src, f, _CHUNK)


def read_bundle(directory: str | os.PathLike) -> Bundle | None:
    """The bundle :func:`write_bundle` left in ``directory``, or None when there is none.

    Raises:
        ArtifactsCorrupt: the manifest is unreadable, malformed or missing beside a
            tar, the tar is missing,
            unreadable (any OSError: a directory, EACCES, EIO; the message names the
            path and errno) or differs from the manifest.
        StoreError: the memfd cannot be made.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        if (directory / TAR_FILE).exists():  # write_bundle writes the manifest last
            raise ArtifactsCorrupt(
                f"{directory / TAR_FILE} has no {MANIFEST_FILE} beside it (an unfinished "
                f"write, or a removed file); write the snapshot again"
            ) from None
        return None
    except OSError as e:
        raise ArtifactsCorrupt(f"{directory / MANIFEST_FILE} is unreadable: {_oserror(e)}") from e
    except ValueError as e:
        raise ArtifactsCorrupt(f"{directory / MANIFEST_FILE} is not JSON: {e}") from e
    try:
        with open(directory / TAR_FILE, "rb") as f:
            return bundle_from_bytes(f, manifest)
    except FileNotFoundError:
        raise ArtifactsCorrupt(
            f"{directory / MANIFEST_FILE} names a bundle but {directory / TAR_FILE} is missing"
        ) from None
    except OSError as e:
        raise ArtifactsCorrupt(f"{directory / TAR_FILE} is unreadable: {_oserror(e)}") from e


def _oserror(e: OSError) -> str:
    """``[ERRNO] message`` of ``e`` (e.g. ``[EISDIR] Is a directory``)."""
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "no errno"
    return f"[{name}] {e.strerror or e}"


@attrs.frozen
class InstallResult:
    """What :func:`install_bundle` did.

    Attributes:
        installed: entries (``root/path``) moved into the engine's caches.
        skipped: entries not installed (the engine's cache already had them, their
            root has no destination, or the tar carries nothing of them).
        nbytes: bytes of the files installed, as the bundle carries them (an install
            fixup that rewrites a file, such as a startup plan's rebase, is not counted).
        reasons: ``(entry, reason)`` for each skipped entry, the reason one of
            :data:`SKIP_PRESENT`, :data:`SKIP_NO_ROOT`, :data:`SKIP_NOT_IN_TAR`.
    """

    installed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    nbytes: int = 0
    reasons: tuple[tuple[str, str], ...] = ()


def _libc_renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or None where libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _rename_noreplace(src: Path, dst: Path) -> None:
    """``renameat2(src, dst, RENAME_NOREPLACE)``: atomic, and fails with EEXIST when
    ``dst`` exists (a file, or a directory, empty or not).

    Raises:
        OSError: with the call's errno (ENOSYS where libc has no renameat2).
    """
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "libc has no renameat2", str(dst))
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


def _place(src: Path, dst: Path) -> bool:
    """Move the extracted entry ``src`` to ``dst`` unless ``dst`` exists; True when
    moved, False when ``dst`` exists (kept as it is).

    ``renameat2(RENAME_NOREPLACE)`` where the kernel and file system do it. Where
    they refuse the flag (EINVAL, ENOSYS, EOPNOTSUPP): a file is hard-linked to
    ``dst`` (link(2) never replaces: EEXIST) and its temp name removed; a
    directory has no such call, so it is renamed after an ``lexists`` check, and
    an empty directory that another process creates between the two is replaced
    (rename(2) onto an empty directory succeeds). That window is the fallback's
    only gap; a non-empty directory still makes the rename fail (ENOTEMPTY).

    Raises:
        StoreError: code :data:`INSTALL_FAILED`, the move failed for another reason
            (EACCES, EXDEV, ENOSPC, ...; the message names the path and errno).
    """
    try:
        try:
            _rename_noreplace(src, dst)
            return True
        except OSError as e:
            if e.errno not in _NOREPLACE_UNSUPPORTED:
                raise
        if not src.is_dir():
            os.link(src, dst)
            os.unlink(src)
            return True
        if os.path.lexists(dst):
            return False
        os.rename(src, dst)
        return True
    except OSError as e:
        if e.errno in _EXISTS:
            return False
        raise StoreError(
            f"cannot install the start-up artifact {dst}: {_oserror(e)}", code=INSTALL_FAILED
        ) from e


def _members_by_entry(
    members: list[tarfile.TarInfo], names: set[str]
) -> dict[str, list[tarfile.TarInfo]]:
    """Each entry name of ``names`` -> its tar members (the member named so, and
    those under it), in tar order; one pass over the members, so a bundle of many
    small entries (Inductor's files) is not entries x members."""
    out: dict[str, list[tarfile.TarInfo]] = {n: [] for n in names}
    for m in members:
        parts = m.name.split("/")
        for i in range(len(parts), 0, -1):
            owner = "/".join(parts[:i])
            if owner in out:
                out[owner].append(m)
                break
    return out


def install_bundle(
    bundle: Bundle,
    dests: Mapping[str, str | os.PathLike],
    fixups: Mapping[str, Callable[[Path, Path], None]] | None = None,
    skip: Mapping[str, str] | None = None,
) -> InstallResult:
    """Install each entry of ``bundle`` whose destination does not exist yet.

    Per entry: its tar members are written into a fresh temp dir beside the
    destination (same file system), every file's size and blake3 checked against
    the manifest, then the entry is moved into place by :func:`_place`
    (``renameat2(RENAME_NOREPLACE)``: atomic, and an entry that appeared meanwhile,
    file or directory, is kept and this one skipped). An existing destination is
    never touched. Roots missing from ``dests`` are skipped, and so is an entry the
    tar has no member of (a bundle packed before :func:`pack_bundle` left such
    entries out: a symlinked cache entry it counted and did not carry); each skip
    has its reason in :attr:`InstallResult.reasons`.

    Args:
        bundle: the bundle (its manifest checked, as every :class:`Bundle` read or
            received is).
        dests: cache root name -> the engine's directory for it (created if missing).
        fixups: cache root name -> ``fix(extracted, final)``, called on each entry of
            that root after its files are checked and before it is moved into place
            (``extracted`` is where it is now, ``final`` where it goes): what makes a
            cache entry valid at its new path (Triton's group files name absolute
            paths), so an installed entry's files may differ from the manifest's
            digests in what the fixup rewrote. An exception from it leaves nothing of
            that entry behind and propagates.
        skip: ``"{root}/{path}"`` -> reason code: entries the caller leaves out (each
            in :attr:`InstallResult.reasons` with its code).

    Returns:
        The entries installed and skipped, the bytes written, the skips' reasons.

    Raises:
        ArtifactsCorrupt: a member outside its entry, not a file or directory, sparse,
            of another size than the manifest says, or with a wrong digest (nothing of
            that entry is left behind; entries installed before stay: each was
            complete and checked).
        StoreError: code :data:`INSTALL_FAILED`, an entry could not be moved into place
            for a reason other than "already there" (EACCES, EXDEV, ...).
    """
    digests = {f["path"]: (f["blake3"], f["nbytes"]) for f in bundle.manifest["files"]}
    installed, reasons, written = [], [], 0
    with os.fdopen(os.dup(bundle.fd), "rb") as raw:
        raw.seek(0)
        with tarfile.open(fileobj=raw, mode="r:") as tar:
            names = {f"{e['root']}/{e['path']}": e for e in bundle.manifest["entries"]}
            by_entry = _members_by_entry(tar.getmembers(), set(names))
            for name, entry in names.items():
                root, rel = entry["root"], entry["path"]
                if skip and name in skip:
                    reasons.append((name, skip[name]))
                    continue
                if root not in dests:
                    reasons.append((name, SKIP_NO_ROOT))
                    continue
                final = Path(dests[root]) / rel
                if os.path.lexists(final):
                    reasons.append((name, SKIP_PRESENT))
                    continue
                mine = by_entry[name]
                if not mine:
                    reasons.append((name, SKIP_NOT_IN_TAR))
                    continue
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
                try:
                    nbytes = _extract_entry(tar, mine, name, tmp / "e", digests)
                    fix = (fixups or {}).get(root)
                    if fix is not None:
                        fix(tmp / "e", final)
                    if _place(tmp / "e", final):
                        installed.append(name)
                        written += nbytes
                    else:  # appeared meanwhile (another engine installed it): keep theirs
                        reasons.append((name, SKIP_PRESENT))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return InstallResult(tuple(installed), tuple(n for n, _ in reasons), written, tuple(reasons))


def _extract_entry(
    tar: tarfile.TarFile,
    members: list[tarfile.TarInfo],
    name: str,
    out: Path,
    digests: Mapping[str, tuple[str, int]],
) -> int:
    """Write ``members`` (entry ``name``, at least one) under ``out``, checking each
    file's size before and its blake3 after writing it; bytes written.

    Raises:
        ArtifactsCorrupt: a member escapes the entry, is not a plain file or
            directory, is sparse, is not in the manifest, or has another size or
            digest than the manifest says.
    """
    written = 0
    for m in members:
        rel = PurePosixPath(m.name).relative_to(name) if m.name != name else PurePosixPath(".")
        if m.name != name and (".." in rel.parts or rel.is_absolute()):
            raise ArtifactsCorrupt(f"tar member {m.name!r} escapes its entry {name}")
        target = out if m.name == name else out / rel
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        if m.issparse():  # a GNU sparse member's size is not what it writes
            raise ArtifactsCorrupt(
                f"tar member {m.name!r} is a sparse file; a bundle holds plain files"
            )
        if not m.isfile():
            raise ArtifactsCorrupt(f"tar member {m.name!r} is not a plain file or directory")
        want = digests.get(m.name)
        if want is None:
            raise ArtifactsCorrupt(f"tar member {m.name!r} is not in the bundle's manifest")
        if m.size != want[1]:
            raise ArtifactsCorrupt(
                f"tar member {m.name!r} is {m.size} bytes, the bundle manifest says {want[1]}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        h = blake3.blake3()
        src = tar.extractfile(m)
        if src is None:  # narrowing: a plain file (checked above) always has its data
            raise ArtifactsCorrupt(f"tar member {m.name!r} has no data to extract")
        with open(target, "wb") as f:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
        os.chmod(target, (m.mode & 0o777) | 0o600)
        if h.hexdigest() != want[0]:
            raise ArtifactsCorrupt(
                f"{m.name}: blake3 {h.hexdigest()[:16]} differs from the "
                f"bundle manifest's {want[0][:16]}"
            )
        written += m.size
    return written


def bundle_summary(
    bundle: Bundle | None, state: str | None = None, error: str | None = None
) -> dict[str, Any]:
    """What ``status`` shows of a daemon's bundle: present, bytes, files, the
    vLLM hashes it was made under, and the priming state (``priming``,
    ``primed``, ``failed``, ``snapshot``, ``peer``) with its error. Never raises:
    it reads the manifest with ``.get`` (a ``status`` reply must not fail on a
    bundle, whatever its manifest holds)."""
    if bundle is None:
        return {"present": False, "state": state, "error": error}
    manifest = bundle.manifest
    factors = manifest.get("factors") or {}
    entries = [e for e in manifest.get("entries") or () if isinstance(e, Mapping)]
    return {
        "present": True,
        "state": state,
        "error": error,
        "bytes": manifest.get("nbytes"),
        "tar_bytes": manifest.get("tar_nbytes"),
        "files": len(manifest.get("files") or ()),
        "entries": len(entries),
        "compile_dirs": [
            str(e.get("path")).rsplit("/", 1)[-1]
            for e in entries
            if e.get("root") == "vllm" and str(e.get("path")).startswith("torch_compile_cache/")
        ],
        "config_hash": factors.get("config_hash"),
        "vllm": factors.get("vllm"),
    }
