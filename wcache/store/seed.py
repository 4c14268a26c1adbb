"""Seeding a new daemon's arena from a running daemon of the same key, over
``torch.distributed`` (gloo between CPU daemons, NCCL between GPU daemons).

The control socket only agrees on the key and the rendezvous: the receiver
sends ``{"op": "seed", "key": ..., "backend": ...}`` to the source daemon; the
source checks the key (a mismatch is answered like ``get``: ``key-mismatch``
naming the fields), opens a ``TCPStore`` on a free port and answers with its
manifest and the store's address. A background thread in the source then joins
a two-rank process group of its own (rank 0; never the default group, so a
daemon whose ranks already initialized vLLM's distributed state is unaffected)
and broadcasts the arena in chunks, then the arena's digest; the source keeps
serving engines meanwhile (other threads; its arena is only read). The
receiver (rank 1) receives straight into its new arena (the memfd mapping on
CPU, the device allocation on CUDA), computes the same digest over what
arrived and refuses the arena when the two differ.

Across hosts (``wcache serve --seed-listen HOST:PORT --seed-secret-file FILE``
on the source, ``--seed-from tcp://HOST:PORT --seed-secret-file FILE`` on the
receiver) the same ``seed`` exchange runs over one TCP connection per request,
authenticated by a shared secret with an HMAC-SHA256 challenge-response in both
directions (:func:`wcache.store.protocol.seed_mac`; the secret never travels).
That connection answers ``seed`` and nothing else. The source's TCPStore and
its gloo device then bind and advertise the source's address, the receiver's
gloo device the address its control connection left from (``GLOO_SOCKET_IFNAME``
overrides both; NCCL picks its interface itself, ``NCCL_SOCKET_IFNAME``), and the
authenticated reply carries the arena's digest, against which what arrived is
checked. The weights themselves travel unencrypted over gloo/NCCL, as vLLM's own
distributed traffic does.

Digests: :func:`wcache.store.arena_digest.arena_digest` (blake3 on CPU, a
device-side checksum on CUDA; see there).

Source: torch.distributed c10d (TCPStore, PrefixStore, ProcessGroupGloo,
ProcessGroupNCCL), the pattern of vLLM's StatelessProcessGroup
(vllm/distributed/utils.py) for groups outside the default one.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import os
import secrets
import socket
import stat
import threading
import time
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from wcache.errors import SeedFailed, SeedSecretUnsafe  # re-exported: their old home
from wcache.store.arena_digest import DIGEST_BYTES, arena_digest
from wcache.store.client import Connection
from wcache.store.errors import DaemonMissing, KeyMismatch, ProtocolError, StoreError
from wcache.store.manifest import CacheKey, Manifest
from wcache.store.prebuilt import PrebuiltArena, served_arena
from wcache.store.protocol import (
    PROTOCOL_VERSION,
    SEED_BACKENDS,
    SEED_CHUNK_BYTES,
    SEED_NONCE_BYTES,
    SEED_REPLY_LABEL,
    SEED_REQUEST_LABEL,
    SEED_TIMEOUT_ENV,
    check_seed_request,
    parse_seconds,
    recv_frame,
    seed_mac,
    send_frame,
)

__all__ = [
    "SeedFailed",
    "SeedSecretUnsafe",
    "SeedSource",
    "seed_arena",
    "send_arena",
    "arena_digest",
    "read_secret",
    "parse_host_port",
    "seed_timeout_s",
    "BACKENDS",
    "SEED_CHUNK_BYTES",
    "SEED_TIMEOUT_ENV",
    "TCP_SCHEME",
]

log = logging.getLogger("wcache.store")

#: torch.distributed backend per device type (defined torch-free, for the lean server).
BACKENDS = SEED_BACKENDS
#: How long either side waits for the other to join or for a chunk (seconds):
#: a 70B-shaped rank over a 10 Gb/s link needs minutes.
SEED_TIMEOUT_S = 600.0
#: What a seeding NCCL group is built with (ProcessGroupNCCL reads it in its
#: constructor, torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): 2, CleanUpOnly.
#: On a timeout or a peer's error the watchdog aborts this group's communicator and
#: fails its work, which the side waiting on it raises as ``seed-failed``. torch's
#: default, 3 (SkipCleanUp), tears the whole process down (SIGABRT): a serving
#: source daemon would die, and the engines mapping its weights with it.
NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
#: How long the receiver tries to reach the source's TCPStore (seconds). The
#: source opened it just before replying, so it answers at once unless the
#: source died in between, which fails within seconds (:func:`_connect_store`);
#: this bounds a host that does not answer at all.
SEED_CONNECT_TIMEOUT_S = 30.0
#: One attempt at connecting to the source's TCPStore (seconds; c10d may run
#: ~2.5x over it), within SEED_CONNECT_TIMEOUT_S.
STORE_ATTEMPT_S = 2.0
#: Prefix of every key the seeding group writes in its TCPStore; a random
#: token follows it per seeding (see :meth:`SeedSource.handle`).
STORE_PREFIX = "wcache-seed/"
#: Bytes of randomness in that token.
TOKEN_BYTES = 16
#: ``--seed-from`` prefix naming a source daemon's TCP seeding listener.
TCP_SCHEME = "tcp://"
#: Connecting to a source's TCP listener (seconds): a reachable host answers in
#: milliseconds; longer means it is down or a firewall drops the packets.
TCP_CONNECT_TIMEOUT_S = 10.0
#: Waiting for the source's reply over TCP (seconds): before answering, the source
#: computes its arena's digest once (blake3 at ~1 GB/s per core: ~20 s for a
#: 16 GiB CPU rank; a device checksum on CUDA).
TCP_REPLY_TIMEOUT_S = 120.0
#: Shortest secret accepted (bytes, after stripping the trailing newline): 16
#: random bytes (128 bits) as `head -c 32 /dev/urandom | base64` writes 44.
SECRET_MIN_BYTES = 16
#: Largest secret file read (bytes): a secret, not a document.
SECRET_MAX_BYTES = 4096
#: Bind addresses that listen on every interface: they cannot be advertised.
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
#: listen() backlog of a seeding TCPStore: one receiver per seeding.
STORE_BACKLOG = 8
SECRET_FIX = (
    "create it with `head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE` and give "
    "the same file to the source and the receiver"
)


def read_secret(path: str) -> bytes:
    """The shared seeding secret in ``path`` (its bytes, the trailing newline stripped).

    Symlinks are followed (Kubernetes mounts secrets as symlinks); the file that
    is opened is checked (``fstat``), not the name.

    Raises:
        SeedSecretUnsafe: missing or unreadable, not a regular file, group/other
            permission bits set (fix: ``chmod 600 FILE``), shorter than
            :data:`SECRET_MIN_BYTES` or longer than :data:`SECRET_MAX_BYTES`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        raise SeedSecretUnsafe(f"seed secret file {path}: {e.strerror}; {SECRET_FIX}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SeedSecretUnsafe(f"seed secret file {path} is not a regular file; {SECRET_FIX}")
        if st.st_mode & 0o077:
            raise SeedSecretUnsafe(
                f"seed secret file {path} has mode {stat.S_IMODE(st.st_mode):o}: "
                f"group or others may read it; run `chmod 600 {path}`"
            )
        data = os.read(fd, SECRET_MAX_BYTES + 1)
    finally:
        os.close(fd)
    secret = data.rstrip(b"\r\n")
    if not SECRET_MIN_BYTES <= len(secret) <= SECRET_MAX_BYTES:
        raise SeedSecretUnsafe(
            f"seed secret file {path} holds {len(secret)} bytes; a secret needs "
            f"{SECRET_MIN_BYTES} to {SECRET_MAX_BYTES}; {SECRET_FIX}"
        )
    return secret


def parse_host_port(spec: str, what: str = "--seed-listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` (``tcp://`` prefix allowed) as ``(host, port)``.

    Raises:
        ValueError: no port, a port outside 0..65535, or an empty host.
    """
    rest = spec.removeprefix(TCP_SCHEME)
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {spec!r} is not HOST:PORT (e.g. 10.0.0.5:29600, [fd00::5]:29600)")
    return host, int(port)


def seed_timeout_s() -> float:
    """The seeding timeout in seconds: :data:`SEED_TIMEOUT_ENV` when set, else
    :data:`SEED_TIMEOUT_S`.

    Raises:
        SeedFailed: the variable is set to something other than a positive number.
    """
    raw = os.environ.get(SEED_TIMEOUT_ENV, "").strip()
    if not raw:
        return SEED_TIMEOUT_S
    try:
        return parse_seconds(raw)
    except ValueError as e:
        raise SeedFailed(
            f"{SEED_TIMEOUT_ENV}: {e}; unset it (default {SEED_TIMEOUT_S:g} s) or "
            f"pass `wcache serve --seed-timeout SECONDS`"
        ) from None


_env_lock = threading.Lock()


def _nccl_group(prefixed: Any, rank: int, opts: Any) -> Any:
    """``ProcessGroupNCCL`` built under :data:`NCCL_GROUP_ENV` (the process's own
    values are put back at once: vLLM's groups elsewhere in it keep theirs)."""

    with _env_lock:
        saved = {k: os.environ.get(k) for k in NCCL_GROUP_ENV}
        os.environ.update(NCCL_GROUP_ENV)
        try:
            return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _listening_store(host: str, timeout: datetime.timedelta) -> Any:
    """A master ``TCPStore`` listening on ``host`` only, on a free port (c10d's own
    master binds every interface; it adopts this socket through ``master_listen_fd``
    and closes it when the store goes)."""

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(STORE_BACKLOG)
        port = listener.getsockname()[1]
    except OSError as e:
        listener.close()
        raise StoreError(f"cannot open the seeding store on {host}: {e}") from e
    fd = listener.detach()
    return dist.TCPStore(
        host, port, 2, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    )


def _group(
    backend: str,
    host: str,
    port: int,
    rank: int,
    device: torch.device,
    token: str,
    *,
    is_master: bool,
    timeout_s: float,
    store: Any = None,
    gloo_host: str | None = None,
) -> Any:
    """The two-rank group; ``gloo_host``: the local address gloo binds and
    advertises (across hosts), None for c10d's default (``GLOO_SOCKET_IFNAME``
    or this host's name)."""

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = _connect_store(host, port, is_master)
        store.set_timeout(timeout)  # connected: the rendezvous and transfer may take long
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}{token}/", store)
    if backend == "gloo":
        if gloo_host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(prefixed, rank, 2, timeout), store
        # torch's stubs lack _Options (their Options is Backend.Options at run time), the
        # options type gloo's devices are set on
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts), store
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return _nccl_group(prefixed, rank, opts), store
    raise StoreError(f"seeding backend {backend!r} is not one of {sorted(set(BACKENDS.values()))}")


def _connect_store(host: str, port: int, is_master: bool) -> Any:
    """A client of the source's seeding ``TCPStore`` on ``host:port``, tried for
    :data:`SEED_CONNECT_TIMEOUT_S` in attempts of :data:`STORE_ATTEMPT_S`, each
    after :func:`_probe_store`.

    c10d's client alone retries a refused connection for its whole timeout (and
    past it: 76 s at 30 s here). The source opened its store before it
    answered, so a refusal means the process holding it has ended since (a lean
    daemon's helper killed just after its reply, say by the OOM killer); the
    probe before each attempt turns that into an error within seconds. The
    first probe can still be accepted by a process the kernel is tearing down.

    Raises:
        RuntimeError: the store refuses connections, or c10d's last attempt
            failed (a timeout: the host does not answer).
    """
    deadline = time.monotonic() + SEED_CONNECT_TIMEOUT_S
    while True:
        if not is_master:
            _probe_store(host, port)
        try:
            return dist.TCPStore(
                host,
                port,
                2,
                is_master,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=STORE_ATTEMPT_S),
            )
        except RuntimeError:  # c10d's DistNetworkError/DistStoreError: a timeout
            if is_master or time.monotonic() >= deadline:
                raise


def _probe_store(host: str, port: int) -> None:
    """Fail at once when nothing listens on the source's seeding store (see
    :func:`_connect_store`). Any other outcome (accepted, a timeout, an
    unreachable network) is left to c10d, as before.

    Raises:
        RuntimeError: the connection was refused (the receiver raises it as
            ``seed-failed``).
    """
    try:
        with socket.create_connection((host, port), timeout=SEED_CONNECT_TIMEOUT_S):
            pass
    except ConnectionRefusedError as e:
        raise RuntimeError(
            f"nothing listens on the source's seeding store {host}:{port} ({e}): the "
            f"source opened it before it answered, so the process sending the arena "
            f"has ended since (killed, out of memory?): the source daemon's log says why"
        ) from None
    except OSError:  # a timeout or an unreachable host: c10d's own connect reports it
        pass


def _broadcast(pg: Any, t: torch.Tensor, timeout_s: float) -> None:
    """One broadcast from rank 0, waited for on this thread for at most ``timeout_s``.

    An explicit timeout makes ``Work.wait`` block until the work is done on NCCL
    too (without one it only orders the current stream after it), and on expiry
    abort the group's communicator and raise, so a peer that died or stalls ends
    in an error here rather than a hang or the watchdog's abort.

    Raises:
        RuntimeError: c10d's errors (``DistBackendError`` included): the peer went
            away, the timeout ran out.
    """

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    if not pg.broadcast([t], opts).wait(datetime.timedelta(seconds=timeout_s)):
        raise RuntimeError(f"a seeding broadcast did not finish within {timeout_s:g} s")


def _close_group(pg: Any) -> None:
    """Shut a group down explicitly (ProcessGroupNCCL warns, and may hang at
    exit, when it is only garbage-collected); best effort, after the transfer."""
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # the bytes are already checked by digest
            log.debug("seeding group shutdown failed", exc_info=True)


def _ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, n - off)) for off in range(0, n, chunk)]


class SeedSource:
    """Answers the ``seed`` command of a running :class:`DaemonServer`
    (``server.seed_source = SeedSource(server)``).

    Args:
        server: the daemon whose arena is sent.
        host: address the seeding TCPStore listens on (only there), and that the
            receiver connects to. The loopback address by default (requests over
            the local control socket); a daemon seeding other hosts gives its
            ``--seed-listen`` address (requests over TCP).
        advertise: the address receivers are told to connect to, and that gloo
            binds, when it differs from ``host`` (``host`` a wildcard such as
            ``0.0.0.0``); an address of this host.

    Raises:
        StoreError: ``host`` is a wildcard and no ``advertise`` is given.
    """

    def __init__(self, server: Any, host: str = "127.0.0.1", advertise: str | None = None):
        if host in WILDCARD_HOSTS and not advertise:
            raise StoreError(
                f"seeding listens on every interface ({host!r}); give the address "
                f"receivers reach it at (--seed-advertise), or listen on that address"
            )
        self.server = server
        self.host = host
        self.advertise = advertise or host
        self._digest: tuple[str, str] | None = None
        self._digest_lock = threading.Lock()
        self.seeds_done = 0
        self.threads: list[threading.Thread] = []

    def digest(self, arena: torch.Tensor) -> tuple[str, str]:
        """The arena's digest, computed once (the arena never changes)."""
        with self._digest_lock:
            if self._digest is None:
                self._digest = arena_digest(arena)
            return self._digest

    def handle(self, req: dict[str, Any], state: dict) -> dict[str, Any]:
        """Check the key and backend, start the sending thread, return the reply.

        ``state["tcp"]`` (a request over the TCP listener, already authenticated):
        the reply also carries the arena's digest (computed once), and gloo binds
        :attr:`advertise` instead of c10d's default device.
        """
        server = self.server
        mismatch, backend = check_seed_request(req, server)
        if mismatch is not None:
            return mismatch
        tcp = bool(state.get("tcp"))
        digest = None
        if tcp:  # the authenticated reply carries it: what arrives is checked against it
            view = served_arena(server)
            try:
                digest = list(self.digest(view.tensor))
            finally:
                view.close()
        store = _listening_store(self.host, datetime.timedelta(seconds=seed_timeout_s()))
        # The TCPStore listens on `host` only; the group's keys live under a random
        # token that travels only over the uid-checked Unix socket or the
        # authenticated TCP exchange, so nobody else can join the group and
        # receive the weights.
        token = secrets.token_hex(TOKEN_BYTES)
        gloo_host = self.advertise if tcp else None
        thread = threading.Thread(
            target=self._send,
            args=(store, backend, token, state.get("pid"), gloo_host),
            name="wcache-seed",
            daemon=True,
        )
        thread.start()
        self.threads.append(thread)
        reply = {
            "ok": True,
            "manifest": server._manifest_dict,
            "backend": backend,
            "host": self.advertise,
            "port": store.port,
            "token": token,
            "chunk_bytes": SEED_CHUNK_BYTES,
        }
        if digest is not None:
            reply["digest"] = digest
        return reply

    def _send(
        self, store: Any, backend: str, token: str, pid: Any, gloo_host: str | None = None
    ) -> None:
        server = self.server
        view = None
        try:
            device = (
                torch.device("cpu")
                if server.device_type == "cpu"
                else torch.device("cuda", server.device_index)
            )
            view = served_arena(server)
            send_arena(
                store,
                backend,
                self.host,
                token,
                view.tensor,
                device,
                lambda: self.digest(view.tensor),
                pid,
                gloo_host,
            )
            self.seeds_done += 1
        except Exception:  # the receiver sees its own error; the source keeps serving
            log.exception("seeding pid %s failed; still serving", pid)
        finally:
            if view is not None:
                view.close()


def send_arena(
    store: Any,
    backend: str,
    host: str,
    token: str,
    arena: torch.Tensor,
    device: torch.device,
    digest: Any,
    pid: Any = None,
    gloo_host: str | None = None,
) -> None:
    """The source's side of one seeding: join the two-rank group (rank 0) over
    ``store``, broadcast ``arena`` in :data:`SEED_CHUNK_BYTES` chunks, then its digest.

    Args:
        store: the master ``TCPStore`` the reply named (:func:`_listening_store`).
        arena: ``[arena_nbytes]`` uint8, only read.
        digest: a callable returning ``(algorithm, hex digest)`` of ``arena``
            (:func:`wcache.store.arena_digest.arena_digest`, computed once by the caller).
        pid: the receiver's pid, for the log.

    Raises:
        RuntimeError: c10d's errors (the receiver went away, a timeout).
    """
    t0 = time.perf_counter()
    timeout_s = seed_timeout_s()
    pg = None
    try:
        pg, _ = _group(
            backend,
            host,
            store.port,
            0,
            device,
            token,
            is_master=True,
            timeout_s=timeout_s,
            store=store,
            gloo_host=gloo_host,
        )
        for off, length in _ranges(arena.numel(), SEED_CHUNK_BYTES):
            _broadcast(pg, arena[off : off + length], timeout_s)
        algo, hexd = digest()
        d = torch.frombuffer(bytearray(bytes.fromhex(hexd)), dtype=torch.uint8).to(device)
        _broadcast(pg, d, timeout_s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log.info(
            "seeded pid %s: %.1f MiB over %s in %.3f s (%s %s)",
            pid,
            arena.numel() / 2**20,
            backend,
            time.perf_counter() - t0,
            algo,
            hexd[:16],
        )
    finally:
        if pg is not None:
            _close_group(pg)


def _tcp_seed_request(
    source: str, secret: bytes, request: dict[str, Any], connect_timeout_s: float
) -> tuple[dict[str, Any], str]:
    """One authenticated ``seed`` exchange with the TCP listener ``source``
    (``tcp://HOST:PORT``); returns the verified reply and the local address the
    connection left from (gloo binds it: the interface that routes to the source).

    Raises:
        DaemonMissing: nothing answers there.
        KeyMismatch: the source serves another key (an authenticated answer).
        SeedFailed: the source refused us (another secret), or did not prove it
            knows the secret, or the exchange broke off or timed out.
    """
    host, port = parse_host_port(source, "--seed-from")
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
        raise DaemonMissing(
            f"nothing answers seeding requests on {source} ({e}); start the source "
            f"with `wcache serve ... --seed-listen {host}:{port} --seed-secret-file "
            f"FILE`, and check the address and the firewall between the hosts"
        ) from None
    try:
        sock.settimeout(TCP_REPLY_TIMEOUT_S)
        challenge, _ = recv_frame(sock, frame_timeout_s=TCP_REPLY_TIMEOUT_S)
        if challenge.get("op") != "challenge" or not isinstance(challenge.get("nonce"), str):
            raise SeedFailed(
                f"{source} did not send a seeding challenge "
                f"({str(challenge.get('message') or sorted(challenge))[:300]})"
            )
        if challenge.get("protocol") != PROTOCOL_VERSION:
            raise SeedFailed(
                f"{source} speaks protocol {challenge.get('protocol')!r} (wcache "
                f"{challenge.get('wcache')!r}), we speak {PROTOCOL_VERSION}; run the "
                f"same wcache version on both hosts"
            )
        req = {**request, "nonce": secrets.token_hex(SEED_NONCE_BYTES)}
        # MAC what the source will decode: msgpack turns tuples into lists
        req = msgpack.unpackb(msgpack.packb(req, use_bin_type=True), raw=False)
        req["mac"] = seed_mac(secret, SEED_REQUEST_LABEL, challenge["nonce"], req)
        send_frame(sock, req)
        reply, _ = recv_frame(sock, frame_timeout_s=TCP_REPLY_TIMEOUT_S)
        local_host = sock.getsockname()[0]
    except (OSError, ProtocolError) as e:  # socket.timeout is an OSError
        raise SeedFailed(
            f"the seeding exchange with {source} broke off: {e}; check that the "
            f"source daemon still runs and that --seed-from names its --seed-listen "
            f"address"
        ) from e
    finally:
        sock.close()
    mac = reply.get("mac")
    if reply.get("ok") is False and reply.get("code") != KeyMismatch.code:
        raise SeedFailed(f"{source} refused to seed [{reply.get('code')}]: {reply.get('message')}")
    if not isinstance(mac, str) or not _compare(
        mac, seed_mac(secret, SEED_REPLY_LABEL, req["nonce"], reply)
    ):
        raise SeedFailed(
            f"the answer from {source} is not signed with our secret: it is not a "
            f"wcache daemon holding the same --seed-secret-file; nothing is received"
        )
    if reply.get("ok") is False:
        raise KeyMismatch(
            f"daemon on {source}: {reply.get('message')}",
            fields=[str(f) for f in reply.get("fields") or ()],
            theirs=reply.get("theirs") if isinstance(reply.get("theirs"), dict) else {},
        )
    return reply, local_host


def _compare(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def seed_arena(
    source: str,
    key: CacheKey,
    *,
    connect_timeout_s: float = 5.0,
    backend: str | None = None,
    secret: bytes | None = None,
) -> PrebuiltArena:
    """Ask the daemon at ``source`` to seed us; return the arena to build.

    ``source``: a daemon's Unix socket path (this host, uid-checked), or
    ``tcp://HOST:PORT``, a daemon's ``--seed-listen`` address on another host
    (needs ``secret``, the bytes of the shared ``--seed-secret-file``:
    :func:`read_secret`). ``backend``: None for the device's (:data:`BACKENDS`);
    ``"gloo"`` between CUDA daemons too (gloo stages CUDA tensors through host
    memory: slower than NCCL, but it works where NCCL cannot, e.g. two daemons
    on one GPU).

    The returned :class:`PrebuiltArena`'s ``fill`` joins the source's process
    group (rank 1), receives the arena into the new allocation, and checks the
    digest of what arrived against the source's (over TCP also against the
    digest in the source's authenticated reply).

    Raises:
        KeyMismatch: the source serves another key (fields named).
        DaemonMissing: nothing answers on ``source``.
        SeedFailed: the source refused (another secret, too), a ``tcp://``
            source without ``secret``, the manifest's key is not ``key``, or
            (from ``fill``) the transfer failed or the digests differ.
    """

    request = {"op": "seed", "key": key.fields, "backend": backend}
    gloo_host = None
    if source.startswith(TCP_SCHEME):
        if not secret:
            raise SeedFailed(
                f"--seed-from {source} needs the source's shared secret: give "
                f"--seed-secret-file FILE (the same file as the source's)"
            )
        timeout = max(connect_timeout_s, TCP_CONNECT_TIMEOUT_S)
        reply, gloo_host = _tcp_seed_request(source, secret, request, timeout)
    else:
        conn = Connection(source, connect_timeout_s)
        try:
            try:
                reply = conn.request(request)
            except KeyMismatch:
                raise
            except StoreError as e:
                raise SeedFailed(f"the daemon on {source} refused to seed [{e.code}]: {e}") from e
        finally:
            conn.close()
    try:
        manifest = Manifest.from_dict(reply.get("manifest"))
        backend, host, port = reply["backend"], str(reply["host"]), int(reply["port"])
        token = str(reply["token"])
        chunk = int(reply.get("chunk_bytes") or SEED_CHUNK_BYTES)
    except (KeyError, TypeError, ValueError) as e:
        raise SeedFailed(
            f"the daemon at {source} sent an incomplete seeding answer ({e}); run the "
            f"same wcache version on both sides"
        ) from e
    if CacheKey(manifest.key) != key:
        raise SeedFailed(
            f"the daemon at {source} sent a manifest of key "
            f"{CacheKey(manifest.key).digest[:16]}, we asked for {key.digest[:16]}"
        )
    signed = reply.get("digest")  # over TCP: the source's digest, authenticated with the reply
    if gloo_host is not None and not (isinstance(signed, list) and len(signed) == 2):
        raise SeedFailed(
            f"the daemon at {source} sent no arena digest; run the same wcache "
            f"version on both sides"
        )

    def fill(dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        pg = None
        try:
            timeout_s = seed_timeout_s()
            pg, _store = _group(
                backend,
                host,
                port,
                1,
                dst.device,
                token,
                is_master=False,
                timeout_s=timeout_s,
                gloo_host=gloo_host,
            )
            for off, length in _ranges(manifest.arena_nbytes, chunk):
                _broadcast(pg, dst[off : off + length], timeout_s)
            theirs = torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=dst.device)
            _broadcast(pg, theirs, timeout_s)
            if dst.device.type == "cuda":
                torch.cuda.synchronize(dst.device)  # NCCL work is async: done before shutdown
        except RuntimeError as e:  # c10d reports timeouts and broken connections so
            raise SeedFailed(
                f"seeding from {source} broke off: {e}; check that the source "
                f"daemon still runs (`wcache status`), or start this one from the "
                f"checkpoint or a snapshot"
            ) from e
        finally:
            if pg is not None:
                _close_group(pg)
        algo, mine = arena_digest(dst[: manifest.arena_nbytes])
        theirs_hex = bytes(theirs.cpu().tolist()).hex()
        if mine != theirs_hex:
            raise SeedFailed(
                f"what arrived from {source} does not match the source's digest "
                f"({algo}: got {mine[:16]}, source {theirs_hex[:16]}); nothing is served"
            )
        if signed is not None and [algo, mine] != list(signed):
            raise SeedFailed(
                f"what arrived from {source} does not match the digest in the source's "
                f"signed answer ({algo}: got {mine[:16]}, signed {str(signed[1])[:16]}): "
                f"the bytes were changed on the way; nothing is served"
            )
        log.info(
            "seeded from %s over %s: %.1f MiB in %.3f s, %s verified",
            source,
            backend,
            manifest.arena_nbytes / 2**20,
            time.perf_counter() - t0,
            algo,
        )

    return PrebuiltArena(manifest, fill, f"peer {source}")
