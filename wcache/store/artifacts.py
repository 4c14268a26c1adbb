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
check every file's blake3, rename) and never overwrites an existing one.

This module imports neither torch nor vLLM: the daemon's lean server serves
bundles, snapshots store them. What the factors mean and whether a bundle fits
an engine is :mod:`wcache.vllm.startup`.

Source: vllm/compilation/decorators.py (``torch_aot_compile/{hash}``),
vllm/compilation/caching.py (``aot_compile_hash_factors``); tarfile, blake3.
"""

from __future__ import annotations

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
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import blake3

from wcache.errors import ArtifactsCorrupt, ArtifactsMissing, StoreError

__all__ = [
    "BUNDLE_FORMAT", "BUNDLE_ROOTS", "MAX_BUNDLE_BYTES", "TAR_FILE", "MANIFEST_FILE", "Bundle",
    "ArtifactsMissing", "ArtifactsCorrupt", "pack_bundle", "bundle_from_bytes", "write_bundle",
    "read_bundle", "open_bundle_fd", "install_bundle", "InstallResult", "bundle_summary",
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
            raise ArtifactsCorrupt(f"{what} is {nbytes} bytes, over the {MAX_BUNDLE_BYTES}-byte limit")
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


def pack_bundle(roots: Mapping[str, str | os.PathLike], entries: list[tuple[str, str]],
                factors: Mapping[str, Any]) -> Bundle:
    """Pack ``entries`` (``(root name, path relative to that root)``, each a
    directory or a file) of the cache directories ``roots`` into a sealed bundle.

    Args:
        roots: cache root name (one of :data:`BUNDLE_ROOTS`) -> directory.
        entries: what to carry; symlinks and special files inside are skipped.
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

    def write(f: Any) -> None:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in checked:
                base = Path(roots[entry["root"]]) / entry["path"]
                arc = f"{entry['root']}/{entry['path']}"
                for path, name in _walk(base, arc):
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
    manifest = {"format": BUNDLE_FORMAT, "factors": dict(factors), "entries": checked,
                "files": files, "nbytes": sum(f["nbytes"] for f in files),
                "tar_nbytes": tar_nbytes, "tar_blake3": tar_digest}
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
        ArtifactsCorrupt: the bytes differ from the manifest, or the manifest is malformed.
    """
    _check_manifest(manifest)

    def write(f: Any) -> None:
        if isinstance(data, (bytes, bytearray, memoryview)):
            f.write(data)
        else:
            shutil.copyfileobj(data, f, _CHUNK)

    fd, nbytes, digest = _sealed_from(write, "the start-up artifact bundle")
    if nbytes != manifest["tar_nbytes"] or digest != manifest["tar_blake3"]:
        os.close(fd)
        raise ArtifactsCorrupt(f"bundle tar is {nbytes} bytes with blake3 {digest[:16]}, its "
                               f"manifest says {manifest['tar_nbytes']} bytes, "
                               f"{str(manifest['tar_blake3'])[:16]}")
    return Bundle(fd, dict(manifest))


def _check_manifest(manifest: Any) -> None:
    """Raises ArtifactsCorrupt unless ``manifest`` has the fields a bundle needs."""
    if not isinstance(manifest, Mapping):
        raise ArtifactsCorrupt(f"bundle manifest is a {type(manifest).__name__}, not a map")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ArtifactsCorrupt(f"bundle format {manifest.get('format')!r}, this wcache reads "
                               f"{BUNDLE_FORMAT}")
    for name, kind in (("factors", Mapping), ("entries", list), ("files", list), ("nbytes", int),
                       ("tar_nbytes", int), ("tar_blake3", str)):
        if not isinstance(manifest.get(name), kind):
            raise ArtifactsCorrupt(f"bundle manifest field {name!r} is missing or not a {kind.__name__}")
    if not 0 <= manifest["tar_nbytes"] <= MAX_BUNDLE_BYTES:
        raise ArtifactsCorrupt(f"bundle of {manifest['tar_nbytes']} bytes is over the "
                               f"{MAX_BUNDLE_BYTES}-byte limit")
    for entry in manifest["entries"]:
        if not isinstance(entry, Mapping):
            raise ArtifactsCorrupt("a bundle entry is not a map")
        _check_entry(str(entry.get("root")), str(entry.get("path")))


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
            raise ArtifactsCorrupt(f"the bundle memfd holds {size} bytes, its manifest says "
                                   f"{manifest['tar_nbytes']}")
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
    directory.mkdir(parents=True, exist_ok=True)
    for name, write in ((TAR_FILE, lambda f: _copy_fd(bundle, f)),
                        (MANIFEST_FILE, lambda f: f.write(json.dumps(dict(bundle.manifest),
                                                                     sort_keys=True).encode()))):
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
        ArtifactsCorrupt: the manifest is unreadable or the tar differs from it.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ArtifactsCorrupt(f"{directory / MANIFEST_FILE} is unreadable: {e}") from None
    try:
        with open(directory / TAR_FILE, "rb") as f:
            return bundle_from_bytes(f, manifest)
    except FileNotFoundError:
        raise ArtifactsCorrupt(f"{directory / MANIFEST_FILE} names a bundle but "
                               f"{directory / TAR_FILE} is missing") from None


@attrs.frozen
class InstallResult:
    """What :func:`install_bundle` did: entries (``root/path``) installed, and those
    skipped because the engine's cache already had them."""

    installed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    nbytes: int = 0


def install_bundle(bundle: Bundle, dests: Mapping[str, str | os.PathLike]) -> InstallResult:
    """Install each entry of ``bundle`` whose destination does not exist yet.

    Per entry: its tar members are written into a fresh temp dir beside the
    destination (same file system), every file checked against its blake3, then
    the entry is renamed into place (``os.rename``: atomic; a directory that
    appeared meanwhile makes the rename fail and the entry is skipped). An
    existing destination is never touched. Roots missing from ``dests`` are skipped.

    Args:
        bundle: the bundle.
        dests: cache root name -> the engine's directory for it (created if missing).

    Returns:
        The entries installed and skipped, and the bytes written.

    Raises:
        ArtifactsCorrupt: a member outside its entry, not a file or directory, or with a
            wrong digest (nothing of that entry is left behind; entries installed before
            stay: each was complete and checked).
    """
    digests = {f["path"]: (f["blake3"], f["nbytes"]) for f in bundle.manifest["files"]}
    installed, skipped, written = [], [], 0
    with os.fdopen(os.dup(bundle.fd), "rb") as raw:
        raw.seek(0)
        with tarfile.open(fileobj=raw, mode="r:") as tar:
            members = tar.getmembers()
            for entry in bundle.manifest["entries"]:
                root, rel = entry["root"], entry["path"]
                name = f"{root}/{rel}"
                if root not in dests:
                    skipped.append(name)
                    continue
                final = Path(dests[root]) / rel
                if os.path.lexists(final):
                    skipped.append(name)
                    continue
                mine = [m for m in members if m.name == name or m.name.startswith(name + "/")]
                final.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=final.parent))
                try:
                    written += _extract_entry(tar, mine, name, tmp / "e", digests)
                    try:
                        os.rename(tmp / "e", final)
                    except OSError:  # appeared meanwhile (another engine installed it): keep theirs
                        skipped.append(name)
                        continue
                    installed.append(name)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    return InstallResult(tuple(installed), tuple(skipped), written)


def _extract_entry(tar: tarfile.TarFile, members: list[tarfile.TarInfo], name: str, out: Path,
                   digests: Mapping[str, tuple[str, int]]) -> int:
    """Write ``members`` (entry ``name``) under ``out``, checking each file; bytes written."""
    written = 0
    if not members:
        raise ArtifactsCorrupt(f"bundle entry {name} has no member in the tar")
    for m in members:
        rel = PurePosixPath(m.name).relative_to(name) if m.name != name else PurePosixPath(".")
        if m.name != name and (".." in rel.parts or rel.is_absolute()):
            raise ArtifactsCorrupt(f"tar member {m.name!r} escapes its entry {name}")
        target = out if m.name == name else out / rel
        if m.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        if not m.isfile():
            raise ArtifactsCorrupt(f"tar member {m.name!r} is not a plain file or directory")
        want = digests.get(m.name)
        if want is None:
            raise ArtifactsCorrupt(f"tar member {m.name!r} is not in the bundle's manifest")
        target.parent.mkdir(parents=True, exist_ok=True)
        h = blake3.blake3()
        src = tar.extractfile(m)
        with open(target, "wb") as f:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
        os.chmod(target, (m.mode & 0o777) | 0o600)
        if h.hexdigest() != want[0]:
            raise ArtifactsCorrupt(f"{m.name}: blake3 {h.hexdigest()[:16]} differs from the "
                                   f"bundle manifest's {want[0][:16]}")
        written += m.size
    return written


def bundle_summary(bundle: Bundle | None, state: str | None = None,
                   error: str | None = None) -> dict[str, Any]:
    """What ``status`` shows of a daemon's bundle: present, bytes, files, the
    vLLM hashes it was made under, and the priming state (``priming``,
    ``primed``, ``failed``, ``snapshot``, ``peer``) with its error."""
    if bundle is None:
        return {"present": False, "state": state, "error": error}
    factors = bundle.manifest.get("factors") or {}
    return {"present": True, "state": state, "error": error, "bytes": bundle.nbytes,
            "tar_bytes": bundle.tar_nbytes, "files": len(bundle.manifest["files"]),
            "entries": len(bundle.manifest["entries"]),
            "compile_dirs": [e["path"].rsplit("/", 1)[-1] for e in bundle.manifest["entries"]
                             if e["root"] == "vllm"
                             and e["path"].startswith("torch_compile_cache/")],
            "config_hash": factors.get("config_hash"),
            "vllm": factors.get("vllm")}
