"""The client: attach to a daemon's arena (zero-copy or copy) and the CLI helpers.

``attach(key, ...)`` checks the socket dir and socket (owner, symlink), checks
the daemon's uid (SO_PEERCRED), says ``hello``, asks ``get`` with the key and
maps the handle: tensors are views into one read-only mapping (CPU) or one
IPC-opened allocation (CUDA). Any failure after mapping drops every mapping
before the error is raised, so a caller can fall back to disk safely.

One convention for naming a daemon: a function that talks to one daemon takes its
socket path, ``sock_path`` (:func:`daemon_status`, :func:`fetch_artifacts`,
:func:`invalidate_daemon`, :func:`shutdown_daemon`); the socket path is built in one
place, :func:`wcache.store.paths.socket_path` from ``(socket_dir, device_id)``, or
listed by :func:`wcache.store.paths.list_sockets`. The entry points that find a daemon
by what it serves take ``(socket_dir, device_id)`` and build the path with it:
:func:`attach` (a key on a device) and the CLI helpers (:func:`cli_status`,
:func:`cli_stop`; the dir through :func:`wcache.store.paths.resolve_socket_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import socket
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import wcache
from wcache.store import paths
from wcache.store.artifacts import open_bundle_fd
from wcache.store.errors import (
    ArenaInvalidated,
    ArtifactsCorrupt,
    ArtifactsMissing,
    DaemonBusy,
    DaemonMissing,
    IdleTimeout,
    KeyMismatch,
    PeerRefused,
    ProtocolError,
    Released,
    SeedUnavailable,
    StoreError,
    TransportFailed,
    UnsafePath,
)
from wcache.store.manifest import KIND_BUFFER, CacheKey, Manifest
from wcache.store.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    raise_for_error,
    recv_frame,
    send_frame,
)
from wcache.store.server import peer_credentials
from wcache.store.transport_shm import open_shm

if TYPE_CHECKING:  # torch only where an arena is attached: status, stop and probes need none
    import torch

__all__ = [
    "attach",
    "Attachment",
    "Connection",
    "daemon_status",
    "fetch_artifacts",
    "shutdown_daemon",
    "invalidate_daemon",
    "cli_status",
    "cli_stop",
    "MODES",
]

log = logging.getLogger("wcache.store")

try:
    # The cuda_vmm transport's driver bindings (the optional wcache[cuda] extra): an
    # engine imports wcache.store when vLLM loads the plugin, so this ~15 ms import
    # happens at start-up rather than inside the timed weight load. Loads no driver.
    import cuda.bindings.driver  # noqa: F401 (probe: is the cuda extra installed)
except Exception:  # noqa: BLE001  (absent on CPU hosts; cuda_vmm then reports why)
    pass

MODES = ("zero_copy", "copy")
# Replies to get carry the manifest (MiBs for big models); allow a slow daemon this long.
REPLY_TIMEOUT_S = 60.0
# cli_stop waits this long for a daemon to remove its socket after shutdown.
STOP_WAIT_S = 10.0
STOP_POLL_S = 0.05
# The guard's message travels to the daemon's log and status; a few lines suffice.
INVALIDATE_MESSAGE_CHARS = 2000
_ERRORS: dict[str, type[StoreError]] = {
    c.code: c
    for c in (
        DaemonMissing,
        KeyMismatch,
        TransportFailed,
        ProtocolError,
        DaemonBusy,
        Released,
        UnsafePath,
        PeerRefused,
        ArenaInvalidated,
        IdleTimeout,
        SeedUnavailable,
        ArtifactsMissing,
        ArtifactsCorrupt,
    )
}


class Connection:
    """One checked connection to a daemon, after ``hello``.

    Args:
        sock_path: the daemon's socket.
        connect_timeout_s: seconds for connect and ``hello`` together.
        reply_timeout_s: seconds each later request may wait for its reply
            (default :data:`REPLY_TIMEOUT_S`); an engine passes its own
            ``connect_timeout_s`` so that no wait outlasts its setting.

    Raises (from the constructor):
        DaemonMissing: no socket dir / socket, or nothing listening.
        UnsafePath: unsafe socket dir or socket.
        PeerRefused: the daemon runs as another user, or refused our uid.
        ProtocolError: another protocol version.
    """

    def __init__(
        self,
        sock_path: str,
        connect_timeout_s: float = 5.0,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ):
        self.path = sock_path
        self.sock: socket.socket | None = None
        try:
            paths.ensure_socket_dir(os.path.dirname(sock_path), create=False)
            paths.check_socket_file(sock_path)
        except FileNotFoundError:
            raise DaemonMissing(
                f"no daemon socket at {sock_path}; start one with `wcache serve`"
            ) from None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(connect_timeout_s)
        try:
            s.connect(sock_path)
        except OSError as e:
            s.close()
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PeerRefused(
                    f"permission denied connecting to {sock_path}: the daemon there "
                    f"runs as another user; run as that user or start a daemon of "
                    f"your own (`wcache serve`)"
                ) from None
            if isinstance(e, socket.timeout) or e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                raise DaemonMissing(
                    f"no daemon answers on {sock_path} ({e}); the socket is stale or "
                    "the daemon is not running: start one with `wcache serve`"
                ) from None
            raise DaemonMissing(f"cannot connect to {sock_path}: {e}") from e
        self.sock = s
        try:
            pid, uid, _ = peer_credentials(s)
            if uid != os.getuid():
                raise PeerRefused(
                    f"the process on {sock_path} (pid {pid}) runs as uid {uid}, not as you "
                    f"(uid {os.getuid()}); refusing it"
                )
            self.hello = self.request(
                {"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": wcache.__version__}
            )
            if self.hello.get("protocol") != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"daemon speaks protocol {self.hello.get('protocol')!r}, we speak "
                    f"{PROTOCOL_VERSION}"
                )
        except TimeoutError:
            self.close()
            raise DaemonMissing(
                f"daemon on {sock_path} did not answer hello within {connect_timeout_s} s"
            ) from None
        except BaseException:
            self.close()
            raise
        s.settimeout(reply_timeout_s)

    def request(self, frame: dict[str, Any], max_fds: int = 0) -> dict[str, Any]:
        """Send one command and return its ``ok`` reply (fds in ``reply["_fds"]``).

        Raises:
            DaemonMissing: the daemon closed the connection or gave no reply within
                the connection's timeout.
            Released: this connection was closed.
        """
        sock = self.sock
        if sock is None:
            raise Released(f"the connection to {self.path} was closed; connect again")
        try:
            send_frame(sock, frame)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may have refused us and closed: its error frame is still readable
        except TimeoutError:
            raise DaemonMissing(
                f"daemon on {self.path} took no {frame.get('op')!r} request "
                f"within {sock.gettimeout()} s"
            ) from None
        try:
            reply, fds = recv_frame(sock, max_fds)
        except (BrokenPipeError, ConnectionResetError, ConnectionClosed) as e:
            raise DaemonMissing(f"daemon on {self.path} closed the connection: {e}") from e
        except TimeoutError:
            raise DaemonMissing(
                f"daemon on {self.path} did not answer {frame.get('op')!r} within "
                f"{sock.gettimeout()} s; it is stalled or overloaded"
            ) from None
        if fds:
            reply["_fds"] = fds
        try:
            if reply.get("ok") is False and reply.get("code") == KeyMismatch.code:
                raise KeyMismatch(
                    f"daemon on {self.path}: {reply.get('message')}",
                    fields=[str(f) for f in reply.get("fields") or ()],
                    theirs=reply.get("theirs") if isinstance(reply.get("theirs"), dict) else {},
                )
            return raise_for_error(reply, _ERRORS)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Attachment:
    """Tensors served by a daemon.

    Attributes:
        tensors: name -> tensor (aliases are the SAME object as their target).
            In ``zero_copy`` mode they are views of one read-only mapping (CPU)
            or one CUDA IPC allocation; in ``copy`` mode of one private copy.
        kinds: name -> ``"param"`` | ``"buffer"``.
        persistent: name -> bool, for buffers.
        aliases: alias -> canonical name.
        layers, extra: the export's JSON data.
        manifest: the :class:`Manifest`.
        nbytes: bytes of the arena.
        mode: ``"zero_copy"`` or ``"copy"``.
        device: ``"cpu"`` or ``"cuda:<i>"``.
        transport: what served the bytes: ``"shm"``, ``"cuda_vmm"`` or ``"cuda_ipc"``.
        writable: whether a write through these tensors would land (``copy``
            mode: in the private copy; ``cuda_ipc``: in the daemon's memory).
            ``shm`` and ``cuda_vmm`` mappings are read-only: a write faults. The
            restore guard checksums content where this is True.
        copy_on_write: True once :meth:`allow_private_writes_` made a CPU
            ``zero_copy`` mapping copy-on-write (a write then lands in this
            process's own copy of the page; the daemon's bytes never change).
        keeps_addresses_on_write: whether private writes keep every tensor's
            address (:meth:`allow_private_writes_` for ``shm`` and ``copy``,
            :meth:`privatize_in_place_` for ``cuda_vmm``): what CUDA graphs
            and torch.compile need, as they hold addresses. False only for a
            ``cuda_ipc`` ``zero_copy`` attachment, whose tensors can become
            private only as new allocations (new addresses).

    Lifetime: every tensor view holds the mapping (its storage owns the mmap
    object or the CUDA mapping), so :meth:`close` only drops this object's
    references and the connection; the memory is unmapped when the last view
    dies, never under a live one.
    """

    def __init__(
        self,
        manifest: Manifest,
        base: torch.Tensor,
        mm: mmap.mmap | None,
        conn: Connection | None,
        mode: str,
        transport: str = "shm",
        sock_path: str | None = None,
        key: CacheKey | None = None,
        vmm: Any = None,
    ):
        self.manifest = manifest
        self.mode = mode
        self.transport = transport
        self.writable = mode == "copy" or transport == "cuda_ipc"
        self.sock_path = sock_path
        self.key = key
        self.nbytes = manifest.arena_nbytes
        self.device = str(base.device)
        self._base: torch.Tensor | None = base
        self._mm = mm
        self._conn = conn
        from wcache.store.arena import tensor_views  # noqa: PLC0415 (torch import ~2 s: only when called)

        self._tensors = tensor_views(base, manifest)
        self.kinds = {e.name: e.kind for e in manifest.tensors} | {
            a.name: a.kind for a in manifest.aliases
        }
        self.persistent = {
            e.name: e.persistent for e in manifest.tensors if e.kind == KIND_BUFFER
        } | {a.name: a.persistent for a in manifest.aliases if a.kind == KIND_BUFFER}
        self.aliases = {a.name: a.target for a in manifest.aliases}
        self.layers = dict(manifest.layers)
        self.extra = dict(manifest.extra)
        self._entries = {e.name: e for e in manifest.tensors}
        self.copy_on_write = False
        #: the cuda_vmm mapping (:class:`wcache.store.transport_vmm.VmmMapping`) of a
        #: zero_copy attachment, for :meth:`privatize_in_place_`; None otherwise
        self._vmm = vmm if mode == "zero_copy" else None
        self.keeps_addresses_on_write = not (mode == "zero_copy" and transport == "cuda_ipc")

    @property
    def closed(self) -> bool:
        return self._base is None

    @property
    def arena(self) -> torch.Tensor:
        """The whole arena, ``[nbytes]`` uint8 (read-only unless :attr:`writable`)."""
        if self._base is None:
            raise Released("this attachment was closed; attach again")
        return self._base

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._base is None:
            raise Released("this attachment was closed; attach again")
        return self._tensors

    @property
    def arena_range(self) -> tuple[int, int]:
        """[start, end) addresses of the arena in this process."""
        if self._base is None:
            raise Released("this attachment was closed; attach again")
        start = self._base.data_ptr()
        return start, start + self.nbytes

    def release_ranges_(self, names: Iterable[str]) -> int:
        """Drop this process's pages of the given tensors (``MADV_DONTNEED``).

        Only for a CPU ``zero_copy`` attachment (a no-op returning 0 elsewhere).
        The range of each tensor is widened to whole pages; on a shared memfd
        mapping that is safe even for neighbours: a later read faults the same
        bytes back in from the daemon's memfd. It lowers this process's RSS
        (RssShmem), e.g. after a DERIVE stage copied a weight into a private
        prepacked handle.

        Returns:
            bytes advised.

        Raises:
            Released: the attachment is closed.
            KeyError: an unknown name.
            StoreError: code ``cow-armed``: the mapping was made copy-on-write
                (:meth:`allow_private_writes_`); dropping pages now would throw away
                this process's own writes (weight updates).
        """
        if self._base is None:
            raise Released("this attachment was closed")
        if self._mm is None:
            return 0
        if self.copy_on_write:
            raise StoreError(
                "release_ranges_ after allow_private_writes_ would discard this "
                "process's written pages; release ranges before arming copy-on-write",
                code="cow-armed",
            )
        page = mmap.PAGESIZE
        total = 0
        for name in names:
            e = self._entries[self.aliases.get(name, name)]
            if e.nbytes == 0:
                continue
            lo = e.offset // page * page
            hi = min(-(-(e.offset + e.nbytes) // page) * page, self.nbytes)
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            total += hi - lo
        return total

    def allow_private_writes_(self) -> bool:
        """Make later writes through these tensors land in this process's own
        pages (copy on write), so that vLLM's weight updates (``load_weights``,
        ``reload_weights``) work on a restored model without touching the daemon's
        bytes.

        A CPU ``zero_copy`` mapping (``MAP_PRIVATE``, read-only until now) is made
        writable: each written page is copied on its first write, untouched pages
        stay shared. A ``copy`` attachment is private already.

        Returns:
            True when writes are now private (CPU ``zero_copy``, or ``copy`` mode);
            False for a CUDA ``zero_copy`` attachment, whose mapping cannot be made
            copy-on-write: the caller privatizes before writing, with
            :meth:`privatize_in_place_` (``cuda_vmm``: the addresses stay) or by
            giving each tensor a new private copy (``cuda_ipc``: new addresses;
            see :attr:`keeps_addresses_on_write`).

        Raises:
            Released: the attachment is closed.
            TransportFailed: ``mprotect`` refused.
        """
        if self._base is None:
            raise Released("this attachment was closed")
        if self.mode == "copy":
            return True
        if self._mm is None:
            return False
        if not self.copy_on_write:
            from wcache.store.arena import allow_private_writes_  # noqa: PLC0415 (torch import ~2 s: only when called)

            allow_private_writes_(self._base, self.nbytes)
            self.copy_on_write = True
        return True

    def privatize_in_place_(self) -> int:
        """Make the whole arena this process's own, writable, at the same addresses
        (a ``cuda_vmm`` ``zero_copy`` attachment:
        :meth:`wcache.store.transport_vmm.VmmMapping.privatize_`): tensors, CUDA
        graphs and compiled code keep their addresses and see later writes; the
        daemon's memory is never written. The whole mapping is copied at once
        (``cuMemMap`` maps whole allocations only), on the first call; later
        calls copy nothing.

        Returns:
            bytes copied (the mapping's size on the first call, then 0).

        Raises:
            Released: the attachment is closed.
            TransportFailed: not a ``cuda_vmm`` ``zero_copy`` attachment (``shm``
                and ``copy`` use :meth:`allow_private_writes_`; ``cuda_ipc`` cannot
                keep addresses), or a driver call failed (the read-only mapping is
                left in place).
        """
        if self._base is None:
            raise Released("this attachment was closed")
        if self._vmm is None:
            raise TransportFailed(
                f"privatize_in_place_ needs a cuda_vmm zero_copy attachment, "
                f"this one is {self.transport} {self.mode}"
            )
        copied = self._vmm.privatize_()
        if copied:
            self.writable = True
        return copied

    def close(self) -> None:
        """Drop this attachment's references to the mapping and tell the daemon.
        Idempotent.

        The mapping is unmapped at once when no tensor view is left, else when the
        last view dies: each view's storage holds the mapping (``torch.frombuffer``
        keeps the mmap object, the CUDA storages their IPC or VMM mapping), so a
        view kept past ``close()`` stays readable instead of faulting.
        """
        if self._base is None:
            return
        self._tensors = {}
        self._base = None
        self._vmm = None  # the views' storages keep the mapping alive
        self._mm = None  # never mmap.close(): that would unmap under live views
        if self._conn is not None:
            with contextlib.suppress(StoreError, OSError):
                self._conn.request({"op": "release"})
            self._conn.close()
            self._conn = None

    def invalidate(self, code: str, message: str) -> bool:
        """Tell the daemon that a guard fired on its bytes (see
        :func:`invalidate_daemon`); the daemon stops serving this arena and exits.

        Returns:
            True when the daemon acknowledged.
        """
        if self.sock_path is None or self.key is None:
            return False
        return invalidate_daemon(self.sock_path, self.key, code, message)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = (
            "closed"
            if self.closed
            else f"{len(self.manifest.tensors)} tensors, {self.nbytes} bytes"
        )
        return f"Attachment({self.mode}, {self.device}, {state})"


def _local_cuda_index(device_uuid: str | None, wanted: int | None) -> int:
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    for i in range(torch.cuda.device_count()):
        if paths.cuda_device_uuid(i) == device_uuid:
            if wanted is not None and wanted != i:
                raise TransportFailed(
                    f"the daemon serves {device_uuid} (local cuda:{i}), the client asked "
                    f"for cuda:{wanted}"
                )
            return i
    raise TransportFailed(f"the daemon's GPU {device_uuid} is not visible to this process")


def attach(
    key: CacheKey,
    socket_dir: str | None = None,
    device: str = "cpu",
    device_id: str | None = None,
    mode: str = "zero_copy",
    connect_timeout_s: float = 5.0,
) -> Attachment:
    """Attach to the daemon serving ``key`` on one device.

    Args:
        key: the cache key this engine needs.
        socket_dir: per-user socket dir (default :func:`paths.default_socket_dir`).
        device: ``"cpu"`` or ``"cuda"``/``"cuda:<i>"``.
        device_id: names the daemon's socket (default ``"cpu"`` or the GPU UUID).
        mode: ``"zero_copy"`` (views of the daemon's memory; the connection
            stays open until :meth:`Attachment.close`) or ``"copy"`` (one
            private copy; the mapping and connection are dropped at once, the
            daemon keeps serving others).
        connect_timeout_s: seconds for connect and hello, and again at most for
            each later reply (``get``, ``release``): no wait of an attach
            outlasts it.

    Returns:
        An :class:`Attachment`.

    Raises:
        DaemonMissing, KeyMismatch (``.fields``), TransportFailed, ProtocolError,
        PeerRefused, UnsafePath, ShmTooSmall (cuda_ipc with a full /dev/shm): see
        :mod:`wcache.store.errors`.
    """
    if mode not in MODES:
        raise StoreError(f"mode {mode!r} is not one of {MODES}")
    if not isinstance(key, CacheKey):
        raise StoreError("key must be a CacheKey")
    t0 = time.perf_counter()
    kind, index = paths.parse_device(device)
    if device_id is None:
        device_id = paths.default_device_id(kind, index)
    sock_path = paths.socket_path(socket_dir, device_id)
    conn = Connection(sock_path, connect_timeout_s, reply_timeout_s=connect_timeout_s)
    mm = base = vmm = None
    try:
        daemon_device = conn.hello.get("device")
        if daemon_device != kind:
            raise TransportFailed(
                f"daemon on {sock_path} serves {daemon_device!r}, asked for {kind!r}"
            )
        if conn.hello.get("transport") == "cuda_ipc":  # torch's IPC ref counters live there
            paths.check_dev_shm(paths.DEV_SHM_REFCOUNT_BYTES, "attaching over cuda_ipc")
        reply = conn.request(
            {
                "op": "get",
                "key": key.fields,
                "mode": mode,
                "transport": conn.hello.get("transport"),
            },
            max_fds=1,
        )
        fds = reply.pop("_fds", [])
        try:
            manifest = Manifest.from_dict(reply.get("manifest"))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if CacheKey(manifest.key) != key:
            for fd in fds:
                os.close(fd)
            raise KeyMismatch(
                "daemon answered with a manifest of another key",
                fields=key.diff(CacheKey(manifest.key)),
            )
        handle = reply.get("handle")
        if not isinstance(handle, dict):
            handle = {}
        transport = handle.get("kind")
        if kind == "cpu":
            mm, base = open_shm(handle, fds, manifest.arena_nbytes)
        elif transport == "cuda_vmm":
            from wcache.store.transport_vmm import open_vmm  # noqa: PLC0415 (torch import ~2 s: only when called)

            local = _local_cuda_index(conn.hello.get("device_uuid"), index)
            base, vmm = open_vmm(handle, fds, manifest.arena_nbytes, local)
        else:
            from wcache.store.transport_cuda import open_cuda  # noqa: PLC0415 (torch import ~2 s: only when called)

            for fd in fds:
                os.close(fd)
            local = _local_cuda_index(conn.hello.get("device_uuid"), index)
            base = open_cuda(handle, manifest.arena_nbytes, local)
        held: Connection | None = conn  # the attachment's connection; copy mode keeps none
        if mode == "copy":
            import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

            private = torch.empty_like(base)
            private.copy_(base)
            del base
            base = private
            mm = vmm = None  # the last reference: unmapped here
            with contextlib.suppress(StoreError, OSError):
                conn.request({"op": "release"})
            conn.close()
            held = None
        att = Attachment(
            manifest,
            base,
            mm,
            held,
            mode,
            transport=str(transport),
            sock_path=sock_path,
            key=key,
            vmm=vmm,
        )
    except BaseException:
        base = mm = vmm = None  # unmapped once no view is left (none escaped this function)
        conn.close()  # idempotent: copy mode may have closed it
        raise
    log.info(
        "attached %s (%s, %s, %d tensors, %.1f MiB) in %.1f ms",
        sock_path,
        mode,
        transport,
        len(manifest.tensors),
        manifest.arena_nbytes / 2**20,
        (time.perf_counter() - t0) * 1e3,
    )
    return att


# --------------------------------------------------------------------------- CLI helpers


def daemon_status(sock_path: str, connect_timeout_s: float = 5.0) -> dict[str, Any]:
    """The ``status`` reply of the daemon on one socket; connect, hello and the
    reply each wait at most ``connect_timeout_s``."""
    conn = Connection(sock_path, connect_timeout_s, reply_timeout_s=connect_timeout_s)
    try:
        return conn.request({"op": "status"})
    finally:
        conn.close()


def fetch_artifacts(sock_path: str, connect_timeout_s: float = 5.0) -> Any:
    """The start-up artifact bundle the daemon on ``sock_path`` holds
    (:class:`wcache.store.artifacts.Bundle`, its sealed memfd now owned by the caller).

    Raises:
        ArtifactsMissing: the daemon holds none.
        ArtifactsCorrupt: the reply's memfd or manifest is malformed.
        DaemonMissing, PeerRefused, ProtocolError: as :class:`Connection`.
    """

    conn = Connection(sock_path, connect_timeout_s, reply_timeout_s=REPLY_TIMEOUT_S)
    try:
        reply = conn.request({"op": "artifacts"}, max_fds=1)
    finally:
        conn.close()
    return open_bundle_fd(reply.get("manifest"), list(reply.pop("_fds", [])))


def invalidate_daemon(
    sock_path: str, key: CacheKey, code: str, message: str, connect_timeout_s: float = 5.0
) -> bool:
    """Tell the daemon on ``sock_path`` that a restore guard fired on the arena of
    ``key``: it stops serving that arena (new ``get`` answered ``arena-invalidated``,
    ``wcache status`` shows the reason) and exits so a supervisor restarts it.

    Returns:
        True when the daemon acknowledged; False when it could not be reached
        (it is gone already) or serves another key.
    """
    try:
        conn = Connection(sock_path, connect_timeout_s, reply_timeout_s=connect_timeout_s)
    except StoreError as e:
        log.warning("cannot tell the daemon on %s to invalidate its arena: %s", sock_path, e)
        return False
    try:
        conn.request(
            {
                "op": "invalidate",
                "key": key.fields,
                "code": str(code),
                "message": str(message)[:INVALIDATE_MESSAGE_CHARS],
            }
        )
        return True
    except StoreError as e:
        log.warning("the daemon on %s refused to invalidate: %s", sock_path, e)
        return False
    finally:
        conn.close()


def shutdown_daemon(sock_path: str, wait_s: float = STOP_WAIT_S) -> bool:
    """Send ``shutdown`` and wait until the socket is gone; True when it is."""
    conn = Connection(sock_path)
    try:
        conn.request({"op": "shutdown"})
    finally:
        conn.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not os.path.lexists(sock_path):
            return True
        time.sleep(STOP_POLL_S)
    return False


#: Probe of a daemon found in the registry (seconds): a live local daemon answers
#: in milliseconds; this only bounds `wcache status` when one hangs.
STATUS_PROBE_S = 1.0


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cli_status(socket_dir: str | None) -> int:
    """Print every daemon in a socket dir, then every other live daemon of this
    user (other socket dirs, or a socket file gone). Returns 0 when at least one
    answers in the dir, 3 when none does (1 when the dir is unsafe)."""
    d = paths.resolve_socket_dir(socket_dir)
    try:
        paths.ensure_socket_dir(d, create=False)
    except FileNotFoundError:
        print(f"no daemons: {d} does not exist")
        _print_other_daemons(set())
        return 3
    except UnsafePath as e:
        print(f"wcache status: error [{e.code}]: {e}", file=sys.stderr)
        return 1
    found = 0
    try:
        socks = paths.list_sockets(d)
    except UnsafePath as e:
        print(f"wcache status: error [{e.code}]: {e}", file=sys.stderr)
        return 1
    for sock in socks:
        try:
            st = daemon_status(sock)
        except (PeerRefused, UnsafePath) as e:
            print(f"{sock}: refused [{e.code}]: {e}")
            continue
        except StoreError as e:
            alive = paths.owner_alive(paths.read_pid_file(paths.pid_path(sock)))
            print(f"{sock}: {'not answering' if alive else 'stale (owner dead)'} [{e.code}]")
            continue
        found += 1
        _print_status(sock, st)
    if not found:
        print(f"no daemons answer in {d}")
    _print_other_daemons(set(socks))
    return 0 if found else 3


def _print_status(sock: str, st: dict[str, Any]) -> None:
    print(
        f"{sock}\n  pid {st['pid']}  device {st['device_id']} ({st['transport']})  up {st['uptime_s']:.0f} s\n"
        f"  holds {_fmt_bytes(st['bytes_held'])} in {st['tensors']} tensors (+{st['aliases']} aliases)\n"
        f"  clients {st['clients_connected']}  attachments {st['attachments_active']} active, "
        f"{st['attachments_total']} served\n  key {st['key_digest'][:16]}  fields "
        f"{', '.join(sorted(st['key_fields']))}"
        + (f"\n  job {st['job']!r}" if st.get("job") else "")
    )
    if st.get("origin"):
        snap = st.get("snapshot")
        print(
            f"  from {st['origin']}"
            + (f"  snapshot {snap['dir']}: {snap['state']}" if snap else "")
            + (f" {snap['error']}" if snap and snap.get("error") else "")
            + f"  seeded {st.get('seeds_served') or 0} peer(s)"
        )
    if st.get("serving"):  # a daemon older than the lean hand-off (issue 28) has none
        print(
            f"  serving {st['serving']}"
            + (
                " (torch-free)"
                if st["serving"] == "lean"
                else f" (torch {'loaded' if st.get('torch_loaded') else 'not loaded'})"
            )
        )
    art = st.get("artifacts")
    if art is not None:  # a daemon older than start-up bundles has none
        if art.get("present"):
            print(
                f"  artifacts present  {_fmt_bytes(art['bytes'])} in {art['files']} files  "
                f"vLLM {art.get('vllm')} compile dirs "
                f"{', '.join(d[:16] for d in art.get('compile_dirs') or []) or '-'}  "
                f"from {art.get('state')}"
            )
        else:
            print(
                "  artifacts absent"
                + (f" ({art['state']})" if art.get("state") else "")
                + (f": {art['error']}" if art.get("error") else "")
            )
    inv = st.get("invalidated")
    if inv:
        print(
            f"  INVALIDATED [{inv.get('code')}] by pid {inv.get('pid')}: {inv.get('message')}\n"
            f"  refuses new attaches ({ArenaInvalidated.code}) and exits; a supervisor restarts it"
        )


def _print_other_daemons(listed: set[str]) -> None:
    """Every other live daemon of this user (from :func:`paths.registered_daemons`):
    those of other socket dirs, and any whose socket file is gone (unreachable
    by engines; stop it with ``kill <pid>``)."""
    others = [r for r in paths.registered_daemons() if r["socket"] not in listed]
    if not others:
        return
    print(f"other live daemons of uid {os.getuid()}:")
    for rec in others:
        try:
            st = daemon_status(rec["socket"], connect_timeout_s=STATUS_PROBE_S)
        except StoreError as e:
            print(
                f"{rec['socket']}\n  pid {rec['pid']}  device {rec['device_id']}  UNREACHABLE "
                f"[{e.code}]: its socket is gone or not answering; stop it with "
                f"`kill {rec['pid']}`"
            )
            continue
        _print_status(rec["socket"], st)


def cli_stop(socket_dir: str | None, device: str | None) -> int:
    """Stop the daemon of one device id (or every daemon when ``device`` is None).
    Returns 0 when all targeted daemons stopped, 1 when one did not, 3 when none ran."""
    d = paths.resolve_socket_dir(socket_dir)
    try:
        paths.ensure_socket_dir(d, create=False)
        socks = [paths.socket_path(d, device)] if device else paths.list_sockets(d)
    except FileNotFoundError:
        print(f"no daemons: {d} does not exist")
        return 3
    except StoreError as e:
        print(f"wcache stop: error [{e.code}]: {e}", file=sys.stderr)
        return 1
    stopped = failed = 0
    for sock in socks:
        try:
            ok = shutdown_daemon(sock)
        except DaemonMissing:
            continue
        except StoreError as e:
            print(f"{sock}: cannot stop [{e.code}]: {e}")
            failed += 1
            continue
        print(f"{sock}: {'stopped' if ok else 'shutdown sent, socket still present'}")
        stopped += ok
        failed += not ok
    if not stopped and not failed:
        print(f"no running daemon{' for ' + device if device else ''} in {d}")
        if device:
            others = [os.path.basename(p) for p in paths.list_sockets(d)]
            if others:
                print(f"sockets there: {', '.join(others)} (see `wcache status`)")
        return 3
    return 1 if failed else 0
