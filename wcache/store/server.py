"""The daemon: holds one rank's arena and serves it over a Unix socket.

``DaemonServer(export, key, ...)`` takes the per-device lock (a second daemon
fails fast with ``daemon-busy``), claims the socket path (replacing a socket
only when its owner is dead), and builds the arena. ``start()`` binds the
socket (0600, in a 0700 dir), writes the pid file and serves in background
threads; ``serve_forever()`` blocks until ``shutdown`` or ``stop()``;
:func:`serve` is the foreground entry point with a ready line and SIGTERM
handling.

Every connection gets a handler thread. The peer's uid (SO_PEERCRED) must equal
the allowed uid (by default our own). A handler exception is answered with an
error frame and the daemon keeps serving; a frame that breaks the framing
(truncated, oversized, not msgpack) is answered when possible and the
connection is closed.

:meth:`DaemonServer.listen_seed_tcp` adds a TCP listener for other hosts'
daemons (:class:`wcache.store.seed_listener.SeedListener`, which the daemon
owns): it answers ``seed`` and nothing else, one request per connection, after a
shared-secret challenge-response (see :mod:`wcache.store.protocol`); the Unix
socket is unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import wcache
from wcache.errors import name_some
from wcache.store import paths
from wcache.store.artifacts import bundle_summary
from wcache.store.errors import (
    ArenaInvalidated,
    ArtifactsMissing,
    DaemonBusy,
    IdleTimeout,
    KeyMismatch,
    PeerRefused,
    ProtocolError,
    StoreError,
    TransportFailed,
)
from wcache.store.manifest import CacheKey, Export, Manifest
from wcache.store.protocol import (
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    ConnectionClosed,
    check_request,
    error_frame,
    pin_map_keys,
    recv_frame,
    send_frame,
)
from wcache.store.seed_listener import SeedListener
from wcache.store.transport_shm import TRANSPORT as SHM_TRANSPORT
from wcache.store.transport_shm import ShmServing

if TYPE_CHECKING:  # circle: prebuilt imports this module (build_cuda_serving)
    from wcache.store.prebuilt import PrebuiltArena

__all__ = [
    "DaemonServer",
    "serve",
    "peer_credentials",
    "client_key",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_CLIENT",
    "MAX_SEED_CONNECTIONS",
    "HELLO_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "INVALIDATED_EXIT",
    "INVALIDATED_LINGER_S",
    "CUDA_TRANSPORTS",
    "build_cuda_serving",
]

log = logging.getLogger("wcache.store")

# Engines per device are few; more local (Unix socket) connections than this is a
# runaway client.
MAX_CONNECTIONS = 64
#: TCP seeding connections open at once, counted apart from the local ones: they
#: arrive before any authentication, so a flood of them must never take an engine's
#: slot. Each receiver holds one for its exchange only (milliseconds, or the source's
#: first arena digest, ~20 s for a 16 GiB rank), so 32 lets a fleet's nodes start at
#: once while a flood holds at most 32 x MAX_REQUEST_BYTES.
MAX_SEED_CONNECTIONS = 32
#: A key mismatch's log line names this many differing fields, then counts the rest.
MAX_LOGGED_FIELDS = 20
#: Connections one client process (by SO_PEERCRED pid) may hold at once: an engine
#: holds one attachment and makes short status probes; more is a leak or a flood,
#: and refusing it keeps slots free for other clients (engines get through).
MAX_CONNECTIONS_PER_CLIENT = 8
#: A new connection must say hello within this (seconds): a local client sends it
#: right after connecting; a silent one is dropped so it holds no slot.
HELLO_TIMEOUT_S = 10.0
#: A connection that holds no attachment and sends nothing for this long is closed
#: (seconds): status, stop and wait-ready probes are one exchange each. A
#: connection holding an attachment may stay idle for the attachment's lifetime.
IDLE_TIMEOUT_S = 60.0
# listen() backlog: a burst of engines starting at once.
LISTEN_BACKLOG = 64
# The accept loop wakes this often to notice stop().
ACCEPT_POLL_S = 0.2
# Once a frame has started, its remaining bytes must arrive within this time
# (a manifest-sized request is tiny; only a stalled or hostile client is slower).
FRAME_TIMEOUT_S = 30.0
# How often the daemon checks that its socket file is still the one it bound
# (tmp cleaners may delete it); a vanished socket is re-bound within this time.
SOCKET_WATCH_S = 1.0
# stop() waits at most this long for each handler thread to finish.
JOIN_TIMEOUT_S = 5.0
#: After ``invalidate`` the daemon keeps answering this long (new ``get`` refused
#: with ``arena-invalidated``, ``status`` showing the reason) so that engines
#: starting meanwhile log the reason rather than a missing daemon; then it exits.
INVALIDATED_LINGER_S = 2.0
#: Exit status after ``invalidate`` (EX_TEMPFAIL: a supervisor should restart it).
INVALIDATED_EXIT = 75
#: CUDA transports in order of preference: ``cuda_vmm`` maps read-only in the
#: clients (a write faults) and outlives the daemon; ``cuda_ipc`` is the fallback.
CUDA_TRANSPORTS = ("cuda_vmm", "cuda_ipc")
#: A TCP seeding connection must complete its challenge-response within this
#: (seconds): the request is a few KiB; a silent or slow peer is dropped so it
#: cannot hold a handler thread.
SEED_TCP_TIMEOUT_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


class Serving(Protocol):
    """The daemon side of a transport, as :class:`DaemonServer` uses it
    (:class:`~wcache.store.transport_shm.ShmServing`,
    :class:`~wcache.store.transport_cuda.CudaServing`,
    :class:`~wcache.store.transport_vmm.VmmServing`)."""

    def export(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """``(handle, fds)`` for one client: the handle goes in the reply, the fds
        travel as SCM_RIGHTS data."""

    def close(self) -> None:
        """Drop the daemon's hold on the arena; clients that mapped it keep it."""


def build_cuda_serving(
    transport: str | None,
    build_vmm: Callable[[], tuple[Serving, Manifest]],
    build_ipc: Callable[[], tuple[Serving, Manifest]],
) -> tuple[Serving, Manifest, str, str | None]:
    """The CUDA transport policy, for an export and for a prebuilt arena alike:
    ``cuda_vmm`` when asked for or by default, else (or when the default's
    driver support is missing) ``cuda_ipc``.

    Args:
        transport: ``None`` (prefer cuda_vmm, fall back), ``"cuda_vmm"`` (no
            fallback) or ``"cuda_ipc"``.
        build_vmm, build_ipc: allocate and fill the arena with that transport;
            each returns ``(serving, manifest)``.

    Returns:
        ``(serving, manifest, transport name, fallback reason or None)``.

    Raises:
        StoreError: ``transport`` is not a CUDA transport.
        TransportFailed: ``transport="cuda_vmm"`` and it is unavailable.
    """
    from wcache.store import transport_cuda, transport_vmm  # noqa: PLC0415 (torch import ~2 s: only when called)

    if transport not in (None, *CUDA_TRANSPORTS):
        raise StoreError(f"transport {transport!r} is not one of {CUDA_TRANSPORTS}")
    reason = None
    if transport in (None, "cuda_vmm"):
        try:
            return (*build_vmm(), transport_vmm.TRANSPORT, None)
        except TransportFailed as e:
            if transport == "cuda_vmm":
                raise
            reason = str(e)
            log.warning("cuda_vmm unavailable (%s); serving with cuda_ipc", e)
    return (*build_ipc(), transport_cuda.TRANSPORT, reason)


def client_key(fields: Any) -> CacheKey:
    """A client's key map as a :class:`CacheKey`.

    Raises:
        ProtocolError: not a map, or values a key cannot hold.
    """
    if not isinstance(fields, dict):
        raise ProtocolError(f"key must be a map, not {type(fields).__name__}")
    try:
        key = CacheKey(fields)
        key.digest  # noqa: B018  (computes the canonical form: refuses what JSON cannot carry)
    except (StoreError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise ProtocolError(f"key map is malformed: {type(e).__name__}: {str(e)[:200]}") from None
    return key


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a Unix socket."""
    return _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


class DaemonServer:
    """Serves one export for one device.

    Args:
        export: the tensors and metadata to serve, or an already laid-out
            arena to fill (:class:`wcache.store.prebuilt.PrebuiltArena`: a
            snapshot, a peer).
        key: the cache key clients must present.
        socket_dir: per-user socket dir (default :func:`paths.default_socket_dir`).
        device: ``"cpu"`` (shm transport) or ``"cuda"``/``"cuda:<i>"`` (cuda_ipc).
        device_id: names the socket (default ``"cpu"`` or the GPU UUID).
        allowed_uid: the only uid allowed to connect (default: ours); tests
            inject another to simulate a foreign peer.
        transport: CUDA only: ``"cuda_vmm"``, ``"cuda_ipc"`` or None (the
            first of :data:`CUDA_TRANSPORTS` this host supports; the reason a
            VMM arena could not be built is logged and shown in ``status``).

    Raises:
        DaemonBusy: another live daemon holds this device's lock or socket.
        UnsafePath: unsafe socket dir, socket or lock file.
        StoreError: the arena cannot be built.
    """

    #: the arena's layout, and the transport's daemon side that serves it
    manifest: Manifest
    _serving: Serving
    #: set by ``wcache serve`` (:func:`wcache.daemon.serve.serve_rank`) for ``status``:
    #: where the arena came from (``checkpoint``, ``snapshot``, ``peer``) and the
    #: snapshot's ``{"dir", "state", "error"}``; None for other servers
    origin: str | None
    snapshot_state: dict[str, Any] | None
    #: set by ``wcache serve``: its ``--job`` ("" without one); None for other servers.
    #: Only a digest of it is in the socket's name, so ``status`` is where it is read.
    job: str | None

    def __init__(
        self,
        export: Export | PrebuiltArena,
        key: CacheKey,
        socket_dir: str | None = None,
        device: str = "cpu",
        device_id: str | None = None,
        *,
        allowed_uid: int | None = None,
        transport: str | None = None,
    ):
        if not isinstance(key, CacheKey):
            raise StoreError("key must be a CacheKey")
        self.key = key
        self.device_type, index = paths.parse_device(device)
        self.device_uuid: str | None = None
        if self.device_type == "cuda":
            index = paths.cuda_index(index)
            self.device_uuid = paths.cuda_device_uuid(index)
        self.device_index = index
        self.device_id = device_id or paths.default_device_id(self.device_type, index)
        self.socket_dir = paths.ensure_socket_dir(socket_dir)
        self.socket_path = paths.socket_path(self.socket_dir, self.device_id)
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self._lock_fd = paths.acquire_device_lock(self.socket_path)
        try:
            paths.claim_socket_path(self.socket_path)  # fail fast, before the costly arena build
            #: why cuda_vmm was not used (None: it was, or the device is a CPU)
            self.transport_fallback_reason: str | None = None
            if not isinstance(
                export, Export
            ):  # a filled arena (snapshot, peer): wcache.store.prebuilt
                self._serving, self.manifest, TRANSPORT, self.transport_fallback_reason = (
                    export.build(self.device_type, index, transport)
                )
            elif self.device_type == "cpu":
                from wcache.store.arena import build_shm_arena  # noqa: PLC0415 (torch import ~2 s: only when called)

                fd, self.manifest = build_shm_arena(export, key)
                self._serving = ShmServing(fd, self.manifest.arena_nbytes)
                TRANSPORT = SHM_TRANSPORT
            else:
                from wcache.store import transport_vmm  # noqa: PLC0415 (torch import ~2 s: only when called)
                from wcache.store.transport_cuda import CudaServing  # noqa: PLC0415 (torch import ~2 s: only when called)

                cuda_index = paths.cuda_index(index)  # resolved above: no torch call

                def build_ipc() -> tuple[Serving, Manifest]:
                    from wcache.store.arena import build_cuda_arena  # noqa: PLC0415 (torch import ~2 s: only when called)

                    arena, manifest = build_cuda_arena(export, key, cuda_index)
                    return CudaServing(arena), manifest

                self._serving, self.manifest, TRANSPORT, self.transport_fallback_reason = (
                    build_cuda_serving(
                        transport,
                        lambda: transport_vmm.build_vmm_arena(export, key, cuda_index),
                        build_ipc,
                    )
                )
            self.transport = TRANSPORT
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._init_runtime()

    @classmethod
    def adopt(
        cls,
        *,
        key: CacheKey,
        manifest: Manifest,
        serving: Any,
        transport: str,
        device_id: str,
        socket_dir: str,
        lock_fd: int,
        listener: socket.socket,
        socket_ino: int,
        registry_path: str | None,
        allowed_uid: int,
    ) -> DaemonServer:
        """A server over what another process image of this pid built and bound
        (the lean hand-off, :mod:`wcache.store.lean`): the filled arena's
        ``serving``, the device lock fd and the bound, listening socket. Nothing is
        built, locked or bound again; the pid file and registry entry (this pid)
        stay valid. CPU only. :meth:`start` starts the accept thread."""
        self = cls.__new__(cls)
        self.key = key
        self.device_type, self.device_index, self.device_uuid = "cpu", None, None
        self.device_id = device_id
        self.socket_dir = paths.ensure_socket_dir(socket_dir)
        self.socket_path = paths.socket_path(self.socket_dir, device_id)
        self.allowed_uid = allowed_uid
        self._lock_fd = lock_fd
        self.transport_fallback_reason = None
        self._serving, self.manifest, self.transport = serving, manifest, transport
        self._init_runtime()
        listener.settimeout(ACCEPT_POLL_S)
        self._listener, self._socket_ino, self._registry_path = listener, socket_ino, registry_path
        return self

    def _init_runtime(self) -> None:
        """The serving state both a built and an adopted server start with."""
        self.frame_timeout_s = FRAME_TIMEOUT_S
        self.hello_timeout_s = HELLO_TIMEOUT_S
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self.max_connections_per_client = MAX_CONNECTIONS_PER_CLIENT
        self._manifest_dict = self.manifest.to_dict()
        #: the key's field names, interned and held: requests carrying them then add
        #: nothing to the interned-string table (wcache.store.protocol.pin_map_keys)
        self._key_names = pin_map_keys(self.key.fields)
        #: ``"full"`` (the process that built the arena) or ``"lean"`` (wcache.store.lean)
        self.serving_mode = "full"
        self.origin = None
        self.snapshot_state = None
        self.job = None
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._registry_path: str | None = None
        self._next_watch = 0.0
        self._accept_thread: threading.Thread | None = None
        self._accept_paused = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}
        #: Unix connections: the handler's state (peer pid, hello, attached, opened at)
        self._conn_states: dict[socket.socket, dict[str, Any]] = {}
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._shutdown_requested = threading.Event()
        self._started_at = time.monotonic()
        self.attachments_active = 0
        self.attachments_total = 0
        #: attachments ended, by how: ``release`` (the client asked) or ``disconnect``
        #: (its connection closed while attached: a closed engine, a killed client)
        self.releases: collections.Counter[str] = collections.Counter()
        #: error replies sent to clients (Unix socket and TCP seeding), by reason code (key-mismatch,
        #: arena-invalidated, daemon-busy, peer-refused, idle-timeout, protocol-error, ...):
        #: what the daemon sees of the engines' fallbacks and refusals
        self.refusals: collections.Counter[str] = collections.Counter()
        self.invalidated: dict[str, Any] | None = None
        #: Handler of the ``seed`` command (:class:`wcache.store.seed.SeedSource`), or None.
        self.seed_source: Any = None
        self._seed_listener: SeedListener | None = None
        #: ``(host, port)`` the TCP seeding listener is bound to, or None.
        self.seed_tcp_address: tuple[str, int] | None = None
        #: The start-up artifact bundle served by ``artifacts``
        #: (:class:`wcache.store.artifacts.Bundle`), or None; with its state
        #: (``priming``, ``primed``, ``failed``, ``snapshot``, ``peer`` or None) and error.
        self.artifacts: Any = None
        self.artifacts_state: str | None = None
        self.artifacts_error: str | None = None

    @property
    def exit_code(self) -> int:
        """0, or :data:`INVALIDATED_EXIT` once a client invalidated the arena."""
        return INVALIDATED_EXIT if self.invalidated else 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def nbytes(self) -> int:
        return self.manifest.arena_nbytes

    def start(self) -> DaemonServer:
        """Bind the socket and serve in a background thread; returns once bound."""
        if self._accept_thread is not None:
            return self
        if self._stopping.is_set():
            raise StoreError("this DaemonServer was stopped; build a new one")
        if self._listener is None:  # else adopted (bound, pid file and registry entry written)
            self._listener = self._bind()
            try:
                self._registry_path = paths.register_daemon(self.socket_path, self.device_id)
            except (
                OSError
            ) as e:  # the daemon still serves; only `wcache status` elsewhere misses it
                log.warning("could not record this daemon in %s: %s", paths.registry_dir(), e)
            self._started_at = time.monotonic()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="wcache-accept", daemon=True
        )
        self._accept_thread.start()
        log.info(
            "daemon pid %d serving %s (%s, %.1f MiB, key %s)",
            os.getpid(),
            self.socket_path,
            self.transport,
            self.nbytes / 2**20,
            self.key.digest[:16],
        )
        return self

    def _bind(self) -> socket.socket:
        """Bind and listen on :attr:`socket_path`, write the pid file; the listener.

        Raises:
            StoreError: the socket cannot be bound.
        """
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            listener.bind(self.socket_path)
            bound = True
            os.chmod(self.socket_path, paths.FILE_MODE)
            listener.listen(LISTEN_BACKLOG)
            listener.settimeout(ACCEPT_POLL_S)
            self._socket_ino = os.lstat(self.socket_path).st_ino
            paths.write_pid_file(paths.pid_path(self.socket_path))
        except OSError as e:
            listener.close()
            if bound:  # ours (the device lock is held): no socket file nobody listens on
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
            raise StoreError(f"cannot bind {self.socket_path}: {e}") from e
        return listener

    def _socket_is_ours(self) -> bool:
        try:
            return os.lstat(self.socket_path).st_ino == self._socket_ino
        except FileNotFoundError:
            return False

    def _watch_socket(self) -> None:
        """Re-bind when our socket file vanished (a tmp cleaner, a removed dir), so
        no daemon keeps an arena that no engine and no ``wcache status`` can reach.
        When another live daemon took this device meanwhile, this one stops."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + SOCKET_WATCH_S
        if self._socket_is_ours():
            return
        log.warning("socket %s vanished or was replaced; re-binding", self.socket_path)
        try:
            paths.ensure_socket_dir(self.socket_dir)
            lock = paths.lock_path(self.socket_path)
            if not os.path.exists(lock) or os.stat(lock).st_ino != os.fstat(self._lock_fd).st_ino:
                new_lock = paths.acquire_device_lock(self.socket_path)
                os.close(self._lock_fd)
                self._lock_fd = new_lock
            paths.claim_socket_path(self.socket_path)
            listener = self._bind()
        except (StoreError, OSError) as e:
            log.error(
                "cannot re-bind %s (%s); stopping this daemon so that it is not left unreachable",
                self.socket_path,
                e,
            )
            self._shutdown_requested.set()
            self.stop()  # from the accept thread: stop() does not join it
            return
        old, self._listener = self._listener, listener
        if old is not None:  # always bound here: the accept thread runs after start()
            old.close()
        log.warning("re-bound %s", self.socket_path)

    def pause_accepting_(self) -> None:
        """Stop accepting (the listener stays bound: new clients wait in its
        backlog) and return once the accept thread has ended."""
        self._accept_paused.set()
        if self._accept_thread is not None:
            self._accept_thread.join()
            self._accept_thread = None

    def resume_accepting_(self) -> None:
        """Accept again after :meth:`pause_accepting_`."""
        self._accept_paused.clear()
        self.start()

    @property
    def connections_open(self) -> int:
        """Open connections (Unix and TCP seeding)."""
        with self._conns_lock:
            return len(self._conns)

    def serve_forever(self) -> None:
        """Serve until a client sends ``shutdown`` or :meth:`stop` is called (returns at
        once, after the stop completes, when it already was)."""
        if self._stopping.is_set():
            self.stop()
            return
        self.start()
        try:
            while not self._shutdown_requested.wait(ACCEPT_POLL_S):
                if self._stopping.is_set():
                    break
        finally:
            self.stop()

    def request_shutdown(self) -> None:
        """Ask :meth:`serve_forever` to return (signal-handler safe)."""
        self._shutdown_requested.set()

    def stop(self) -> None:
        """Stop serving: end the seeding helpers (``seed_source.close_``, where the
        seed source has one: :class:`wcache.store.lean.LeanSeedSource`), close the
        socket (removing it and the pid file), end the handler threads, drop the
        arena (clients that mapped it keep it) and release the device lock. Idempotent."""
        if self._stopping.is_set():
            self._stopped.wait(JOIN_TIMEOUT_S)
            return
        self._stopping.set()
        try:
            close_seeds = getattr(self.seed_source, "close_", None)
            if close_seeds is not None:  # the lean server's seeding helpers end with it
                close_seeds()
            if (
                self._accept_thread is not None
                and self._accept_thread is not threading.current_thread()
            ):
                self._accept_thread.join(JOIN_TIMEOUT_S)
            if self._seed_listener is not None:
                self._seed_listener.close(JOIN_TIMEOUT_S)
            if self._listener is not None:
                self._listener.close()
                self._remove_own_files()
            if self._registry_path is not None:
                paths.unregister_daemon(self._registry_path)
            with self._conns_lock:
                conns = dict(self._conns)
            for conn in conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            for thread in conns.values():
                if thread is not threading.current_thread():
                    thread.join(JOIN_TIMEOUT_S)
            self._serving.close()
            if self.artifacts is not None:
                self.artifacts.close()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            self._stopped.set()
            log.info("daemon pid %d stopped (%s)", os.getpid(), self.socket_path)

    def _remove_own_files(self) -> None:
        try:
            if os.lstat(self.socket_path).st_ino == self._socket_ino:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        rec = paths.read_pid_file(paths.pid_path(self.socket_path))
        if rec is not None and rec["pid"] == os.getpid():
            try:
                os.unlink(paths.pid_path(self.socket_path))
            except FileNotFoundError:
                pass

    def __enter__(self) -> DaemonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ TCP seeding

    def listen_seed_tcp(
        self, host: str, port: int, secret: bytes, *, bound: socket.socket | None = None
    ) -> tuple[str, int]:
        """Accept ``seed`` requests of other hosts' daemons on ``host:port`` (TCP),
        through a :class:`wcache.store.seed_listener.SeedListener` this daemon owns.

        Each connection carries one exchange: the daemon sends a challenge
        (a random nonce), the peer answers with a ``seed`` request and its
        HMAC-SHA256 under ``secret`` (:func:`wcache.store.protocol.seed_mac`),
        checked with ``hmac.compare_digest``; any other command, a bad or
        missing MAC, a malformed frame or :data:`SEED_TCP_TIMEOUT_S` of
        silence is refused (logged with the peer's address) before anything
        else happens. The reply is signed the same way. Needs
        :attr:`seed_source`. Closed by :meth:`stop`.

        Args:
            host: the address to bind (an interface's address; ``0.0.0.0``
                binds every interface).
            port: TCP port; 0 picks a free one.
            secret: the shared secret (:func:`wcache.store.seed.read_secret`).
            bound: a socket :func:`wcache.store.seed_listener.bind_seed_socket`
                bound earlier to ``host:port`` (``wcache serve`` binds before it
                loads); None binds now. Owned by the daemon from here, even when
                this raises.

        Returns:
            The bound ``(host, port)``.

        Raises:
            StoreError: no seed source, an empty secret, or already listening.
            SeedListenFailed: the address cannot be bound.
        """
        try:
            if self.seed_source is None:
                raise StoreError(
                    "set seed_source (wcache.store.seed.SeedSource) before listening for seeding"
                )
            if not secret:
                raise StoreError("a TCP seeding listener needs a non-empty secret")
            if self._seed_listener is not None:
                raise StoreError(f"already listening for seeding on {self.seed_tcp_address}")
        except StoreError:
            if bound is not None:
                bound.close()
            raise
        self._seed_listener = SeedListener(
            self, host, port, secret, backlog=LISTEN_BACKLOG, poll_s=ACCEPT_POLL_S, bound=bound
        ).start()
        self.seed_tcp_address = self._seed_listener.address
        return self.seed_tcp_address

    # What the seeding listener shares with the daemon (wcache.store.seed_listener.SeedOwner).

    @property
    def stopping(self) -> threading.Event:
        """Set once :meth:`stop` has begun."""
        return self._stopping

    @property
    def seed_tcp_timeout_s(self) -> float:
        """:data:`SEED_TCP_TIMEOUT_S`, read when each TCP seeding connection starts."""
        return SEED_TCP_TIMEOUT_S

    def admit_(self, conn: socket.socket, thread: threading.Thread) -> bool:
        """Take one of the :data:`MAX_SEED_CONNECTIONS` slots for a TCP seeding
        connection handled by ``thread``; False when every one is taken. The local
        connections' :data:`MAX_CONNECTIONS` are apart: a peer that is not yet
        authenticated cannot take an engine's slot."""
        with self._conns_lock:
            if len(self._conns) - len(self._conn_states) >= MAX_SEED_CONNECTIONS:
                return False
            self._conns[conn] = thread
            return True

    def forget_(self, conn: socket.socket) -> None:
        """Give a connection's slot back."""
        with self._conns_lock:
            self._conns.pop(conn, None)

    def refuse_(self, conn: socket.socket, err: StoreError) -> None:
        """Count ``err.code`` in :attr:`refusals`, send it as an error frame, close ``conn``."""
        self._refuse(conn, err)

    def refuse_full_(self, conn: socket.socket, peer: str) -> None:
        """Refuse a TCP seeding connection from ``peer`` when every slot is taken."""
        log.warning(
            "refused a seeding connection from %s: %d seeding connections open",
            peer,
            MAX_SEED_CONNECTIONS,
        )
        self._refuse(
            conn,
            DaemonBusy(
                f"daemon has {MAX_SEED_CONNECTIONS} seeding connections open; try again later"
            ),
        )

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        while not self._stopping.is_set() and not self._accept_paused.is_set():
            self._watch_socket()
            listener = self._listener  # re-read: _watch_socket may have re-bound it
            if self._stopping.is_set() or listener is None:  # None: never, start() binds first
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("accept failed; still serving")
                time.sleep(ACCEPT_POLL_S)
                continue
            try:
                pid = peer_credentials(conn)[0]
            except OSError:
                conn.close()
                continue
            state = {"hello": False, "attached": False, "pid": pid, "opened": time.monotonic()}
            with self._conns_lock:
                mine = sum(1 for st in self._conn_states.values() if st["pid"] == pid)
                busy = None
                if mine >= self.max_connections_per_client:
                    busy = (
                        f"pid {pid} already holds {mine} connections to this daemon (at most "
                        f"{self.max_connections_per_client} per client); close some first"
                    )
                elif len(self._conn_states) >= MAX_CONNECTIONS and not self._evict_idle_locked():
                    busy = (
                        f"daemon has {MAX_CONNECTIONS} connections, each holding an "
                        f"attachment; try again later"
                    )
                else:
                    thread = threading.Thread(
                        target=self._handle, args=(conn, state), name="wcache-conn", daemon=True
                    )
                    self._conns[conn] = thread
                    self._conn_states[conn] = state
            if busy:
                log.warning("refused a connection from pid %d: %s", pid, busy)
                self._refuse(conn, DaemonBusy(busy))
                continue
            thread.start()

    def _refuse(self, conn: socket.socket, err: StoreError) -> None:
        self._count_refusal(err.code)
        try:
            conn.settimeout(ACCEPT_POLL_S * 5)
            send_frame(conn, error_frame(err))
        except OSError:
            pass
        finally:
            conn.close()

    def _count_refusal(self, code: str) -> None:
        with self._conns_lock:
            self.refusals[code] += 1

    def _evict_idle_locked(self) -> bool:
        """At the connection limit: close the oldest connection that holds no
        attachment (a silent or idle client), so that a new client (an engine) gets
        its slot. Called with ``_conns_lock`` held. False when every connection
        holds an attachment."""
        idle = [
            (st["opened"], conn)
            for conn, st in self._conn_states.items()
            if not st["attached"] and not st.get("evicted")
        ]
        if not idle:
            return False
        _, victim = min(idle, key=lambda item: item[0])
        self._conn_states[victim]["evicted"] = True
        log.warning(
            "at %d connections: closing pid %d's oldest connection, which holds no "
            "attachment, for a new client",
            MAX_CONNECTIONS,
            self._conn_states[victim]["pid"],
        )
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its handler sees the close and ends
        except OSError:
            pass
        return True

    def _handle(self, conn: socket.socket, state: dict[str, Any]) -> None:
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != self.allowed_uid:
                log.warning(
                    "refused a connection from pid %d uid %d (allowed uid %d)",
                    pid,
                    uid,
                    self.allowed_uid,
                )
                self._refuse(
                    conn,
                    PeerRefused(
                        f"uid {uid} may not use this daemon (owner uid {self.allowed_uid})"
                    ),
                )
                return
            while not self._stopping.is_set():
                # Until hello, then while holding no attachment, silence is bounded.
                wait = (
                    None
                    if state["attached"]
                    else self.idle_timeout_s
                    if state["hello"]
                    else self.hello_timeout_s
                )
                conn.settimeout(wait)
                try:
                    request, _ = recv_frame(
                        conn, frame_timeout_s=self.frame_timeout_s, max_bytes=MAX_REQUEST_BYTES
                    )
                except ConnectionClosed:
                    return
                except TimeoutError:  # socket.timeout: nothing arrived within `wait`
                    what = "idle, holding no attachment" if state["hello"] else "no hello"
                    log.info("closing pid %d's connection: %s for %.1f s", pid, what, wait)
                    self._refuse(
                        conn,
                        IdleTimeout(
                            f"connection closed after {wait:.1f} s without a request ({what})"
                        ),
                    )
                    return
                except ProtocolError as e:
                    log.warning("pid %d sent a bad frame (%s); closing its connection", pid, e)
                    self._count_refusal(e.code)
                    try:
                        send_frame(conn, error_frame(e))
                    except OSError:
                        pass
                    return
                except OSError:
                    return
                fds: tuple[int, ...] = ()
                try:
                    reply, fds = self._dispatch(request, state)
                except StoreError as e:
                    reply = error_frame(e)
                except Exception as e:  # a bug in a handler must not take the daemon down
                    log.exception("handler error for pid %d", pid)
                    reply = error_frame(e)
                if not reply.get("ok"):
                    self._count_refusal(str(reply.get("code", StoreError.code)))
                try:
                    send_frame(conn, reply, fds)
                except OSError:
                    return
                if request.get("op") == "shutdown" and reply.get("ok"):
                    self._shutdown_requested.set()
                    threading.Thread(target=self.stop, name="wcache-stop", daemon=True).start()
                    return
        finally:
            if state["attached"]:
                self._release(state, "disconnect")
            with self._conns_lock:
                self._conns.pop(conn, None)
                self._conn_states.pop(conn, None)
            conn.close()

    def _release(self, state: dict, how: str) -> None:
        with self._conns_lock:
            self.attachments_active -= 1
            self.releases[how] += 1
        state["attached"] = False
        collect = getattr(self._serving, "collect", None)
        if collect is not None:
            collect()
        log.info("pid %s released its attachment", state["pid"])

    def _dispatch(self, req: dict[str, Any], state: dict) -> tuple[dict[str, Any], tuple[int, ...]]:
        op = check_request(req)
        if op == "hello":
            if req.get("protocol") != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"client speaks protocol {req.get('protocol')!r}, this daemon "
                    f"{PROTOCOL_VERSION} (wcache {wcache.__version__}, client "
                    f"{req.get('wcache')!r}); run the same wcache version on both sides"
                )
            state["hello"] = True
            return {
                "ok": True,
                "protocol": PROTOCOL_VERSION,
                "wcache": wcache.__version__,
                "pid": os.getpid(),
                "device": self.device_type,
                "device_id": self.device_id,
                "device_uuid": self.device_uuid,
                "transport": self.transport,
            }, ()
        if not state["hello"]:
            raise ProtocolError(f"{op!r} before hello; send hello first")
        if op == "get":
            return self._get(req, state)
        if op == "release":
            if state["attached"]:
                self._release(state, "release")
            return {"ok": True}, ()
        if op == "status":
            st = self.status()
            st["clients_connected"] -= 1  # not counting the connection that asks
            return {"ok": True, **st}, ()
        if op == "invalidate":
            return self._invalidate(req, state)
        if op == "artifacts":
            bundle = self.artifacts
            if bundle is None:
                raise ArtifactsMissing(
                    f"this daemon holds no start-up artifact bundle (state "
                    f"{self.artifacts_state or 'not primed'}"
                    + (f": {self.artifacts_error}" if self.artifacts_error else "")
                    + "); start it with --prime-compile, or from a snapshot or peer that has one"
                )
            return {"ok": True, "manifest": dict(bundle.manifest)}, (bundle.fd,)
        if op == "seed":
            if self.seed_source is None:
                raise ProtocolError(
                    "this daemon does not offer seeding; start it with `wcache serve` "
                    "(wcache.store.seed.SeedSource)"
                )
            return self.seed_source.handle(req, state), ()
        log.info("shutdown requested by pid %s", state["pid"])
        return {"ok": True}, ()

    def _get(self, req: dict[str, Any], state: dict) -> tuple[dict[str, Any], tuple[int, ...]]:
        t0 = time.perf_counter()
        fields = req.get("key")
        if not isinstance(fields, dict):
            raise ProtocolError("get needs a key map")
        if req.get("transport") not in (None, self.transport):
            raise ProtocolError(
                f"client wants transport {req.get('transport')!r}, daemon serves {self.transport}"
            )
        if state["attached"]:
            raise ProtocolError("this connection already holds an attachment; release it first")
        if self.invalidated:
            inv = self.invalidated
            raise ArenaInvalidated(
                f"this daemon's arena was invalidated by pid {inv['pid']} "
                f"[{inv['code']}]: {inv['message']}; it exits and a fresh "
                f"daemon rebuilds it (load from disk meanwhile)"
            )
        theirs = client_key(fields)
        if theirs != self.key:
            diff = self.key.diff(theirs)
            mine = self.key.fields
            log.warning(
                "pid %s asked for key %s; differing fields %s",
                state["pid"],
                theirs.digest[:16],
                name_some(diff, MAX_LOGGED_FIELDS),
            )
            return {
                "ok": False,
                "code": KeyMismatch.code,
                "fields": diff,
                "theirs": {k: mine.get(k) for k in diff},
                "message": f"{theirs.versions_note(self.key)}daemon key differs in "
                f"{', '.join(diff)}: {theirs.describe_diff(self.key)}",
            }, ()
        handle, fds = self._serving.export()
        with self._conns_lock:
            self.attachments_active += 1
            self.attachments_total += 1
            state["attached"] = True  # under the lock: eviction never picks an attached client
        log.info(
            "pid %s attached (%s, %s) in %.1f ms",
            state["pid"],
            req.get("mode"),
            self.transport,
            (time.perf_counter() - t0) * 1e3,
        )
        return {"ok": True, "manifest": self._manifest_dict, "handle": handle}, fds

    def _invalidate(
        self, req: dict[str, Any], state: dict
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """A client's guard fired on this arena: stop serving it, exit after
        :data:`INVALIDATED_LINGER_S` with :data:`INVALIDATED_EXIT`."""
        fields = req.get("key")
        if not isinstance(fields, dict) or client_key(fields) != self.key:
            raise ProtocolError("invalidate names another key than this daemon serves; ignored")
        with self._conns_lock:
            invalidated = self.invalidated
            first = invalidated is None
            if invalidated is None:
                invalidated = self.invalidated = {
                    "pid": state["pid"],
                    "code": str(req.get("code", "guard-failed")),
                    "message": str(req.get("message", ""))[:2000],
                    "at": time.time(),
                }
        if first:
            log.error(
                "arena INVALIDATED by pid %s [%s]: %s; refusing new attaches, exiting in %.1f s "
                "with status %d so a supervisor restarts this daemon",
                state["pid"],
                invalidated["code"],
                invalidated["message"],
                INVALIDATED_LINGER_S,
                INVALIDATED_EXIT,
            )
            timer = threading.Timer(INVALIDATED_LINGER_S, self.request_shutdown)
            timer.daemon = True
            timer.start()
        return {"ok": True, "exit_in_s": INVALIDATED_LINGER_S}, ()

    def status(self) -> dict[str, Any]:
        """Memory held, clients, uptime, key, pid. ``clients_connected`` counts
        open connections (the ``status`` command leaves out the asking one);
        ``releases`` counts ended attachments by how (``release``, ``disconnect``)
        and ``refusals`` the error replies by reason code.
        ``origin`` (``checkpoint|snapshot|peer``), ``snapshot`` (``{"dir",
        "state": read|writing|written|failed, "error"}``) and ``seeds_served``
        are those of a ``wcache serve`` daemon, else None."""
        with self._conns_lock:
            clients = len(self._conns)
            active = self.attachments_active
            releases = dict(self.releases)
            refusals = dict(self.refusals)
        return {
            "pid": os.getpid(),
            "wcache": wcache.__version__,
            "protocol": PROTOCOL_VERSION,
            "device": self.device_type,
            "device_id": self.device_id,
            "device_uuid": self.device_uuid,
            "transport": self.transport,
            "socket": self.socket_path,
            "bytes_held": self.nbytes,
            "tensors": len(self.manifest.tensors),
            "aliases": len(self.manifest.aliases),
            "clients_connected": clients,
            "attachments_active": active,
            "attachments_total": self.attachments_total,
            "releases": releases,
            "refusals": refusals,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
            "key_digest": self.key.digest,
            "key_fields": self.key.fields,
            "invalidated": self.invalidated,
            "transport_fallback_reason": self.transport_fallback_reason,
            # "lean": the torch-free process that serves after the hand-off (wcache.store.lean)
            "serving": self.serving_mode,
            "torch_loaded": "torch" in sys.modules,
            # set by `wcache serve` (wcache.daemon.serve.serve_rank); None for other servers
            "origin": self.origin,
            "job": self.job,
            "snapshot": self.snapshot_state,
            "seeds_served": getattr(getattr(self, "seed_source", None), "seeds_done", None),
            "seed_listen": (
                f"{self.seed_tcp_address[0]}:{self.seed_tcp_address[1]}"
                if self.seed_tcp_address
                else None
            ),
            "artifacts": bundle_summary(self.artifacts, self.artifacts_state, self.artifacts_error),
        }


def serve(export: Export, key: CacheKey, **kw) -> int:
    """Foreground daemon: build, bind, print a ready line, serve until a
    ``shutdown`` command, SIGTERM, SIGINT or ``invalidate``; returns the exit
    status (:attr:`DaemonServer.exit_code`).

    The ready line (stdout, flushed) reads
    ``wcache-store ready key=<digest> bytes=<n> socket=<path> pid=<pid> transport=<name>``.
    """
    server = DaemonServer(export, key, **kw)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.request_shutdown())
    server.start()
    print(
        f"wcache-store ready key={key.digest} bytes={server.nbytes} socket={server.socket_path} "
        f"pid={os.getpid()} transport={server.transport}",
        flush=True,
    )
    server.serve_forever()
    return server.exit_code
