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

Digests: :func:`wcache.store.arena_digest.arena_digest` (blake3 on CPU, a
device-side checksum on CUDA; see there).

Source: torch.distributed c10d (TCPStore, PrefixStore, ProcessGroupGloo,
ProcessGroupNCCL), the pattern of vLLM's StatelessProcessGroup
(vllm/distributed/utils.py) for groups outside the default one.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from typing import Any

import torch

from wcache.store.arena_digest import DIGEST_BYTES, arena_digest
from wcache.store.errors import KeyMismatch, ProtocolError, StoreError
from wcache.store.manifest import CacheKey, Manifest
from wcache.store.prebuilt import PrebuiltArena, served_arena

__all__ = ["SeedFailed", "SeedSource", "seed_arena", "arena_digest", "BACKENDS", "SEED_CHUNK_BYTES"]

log = logging.getLogger("wcache.store")

#: torch.distributed backend per device type.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
#: Bytes per broadcast: gloo's TCP transport handles messages below 2 GiB best,
#: and chunks let both sides report progress; 256 MiB costs one round trip per
#: chunk, negligible against the transfer.
SEED_CHUNK_BYTES = 256 << 20
#: How long either side waits for the other to join or for a chunk (seconds):
#: a 70B-shaped rank over a 10 Gb/s link needs minutes.
SEED_TIMEOUT_S = 600.0
#: How long the receiver tries to reach the source's TCPStore (seconds). The
#: source opened it just before replying, so it answers at once unless the
#: source died in between; c10d retries a refused connection until this runs
#: out, with retries (here a 10 s limit gave up after 18 s and 29 s, this
#: 30 s one after 42 s), so a dead source costs under ~1.5 min rather than
#: SEED_TIMEOUT_S that way (20-30 min).
SEED_CONNECT_TIMEOUT_S = 30.0
#: Prefix of every key the seeding group writes in its TCPStore; a random
#: token follows it per seeding (see :meth:`SeedSource.handle`).
STORE_PREFIX = "wcache-seed/"
#: Bytes of randomness in that token.
TOKEN_BYTES = 16


class SeedFailed(StoreError):
    """Seeding from a peer daemon failed: it refused (another key, seeding not
    offered), the transfer broke off, or what arrived does not match the
    source's digest. Start from the checkpoint or a snapshot instead, or check
    that both daemons were started with the same engine arguments."""

    code = "seed-failed"


def _group(backend: str, host: str, port: int, rank: int, device: torch.device, token: str, *,
           is_master: bool, store: Any = None) -> Any:
    import torch.distributed as dist  # noqa: PLC0415

    timeout = datetime.timedelta(seconds=SEED_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(host, port, 2, is_master, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=SEED_CONNECT_TIMEOUT_S))
        store.set_timeout(timeout)  # connected: the rendezvous and transfer may take long
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}{token}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout), store
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts), store
    raise StoreError(f"seeding backend {backend!r} is not one of {sorted(set(BACKENDS.values()))}")


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([t], opts).wait()


def _close_group(pg: Any) -> None:
    """Shut a group down explicitly (ProcessGroupNCCL warns, and may hang at
    exit, when it is only garbage-collected); best effort, after the transfer."""
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001  (the bytes are already checked by digest)
            log.debug("seeding group shutdown failed", exc_info=True)


def _ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, n - off)) for off in range(0, n, chunk)]


class SeedSource:
    """Answers the ``seed`` command of a running :class:`DaemonServer`
    (``server.seed_source = SeedSource(server)``).

    Args:
        server: the daemon whose arena is sent.
        host: address the TCPStore listens on and that the receiver connects
            to (the seeding rendezvous travels over the local control socket,
            so the default is the loopback address).
    """

    def __init__(self, server: Any, host: str = "127.0.0.1"):
        self.server = server
        self.host = host
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
        """Check the key and backend, start the sending thread, return the reply."""
        import torch.distributed as dist  # noqa: PLC0415

        server = self.server
        fields = req.get("key")
        if not isinstance(fields, dict):
            raise ProtocolError("seed needs a key map")
        theirs = CacheKey(fields)
        if theirs != server.key:
            diff = server.key.diff(theirs)
            return {"ok": False, "code": KeyMismatch.code, "fields": diff,
                    "theirs": {k: server.key.fields.get(k) for k in diff},
                    "message": f"seeding source's key differs in {', '.join(diff)}: "
                               f"{theirs.describe_diff(server.key, 'receiver', 'source')}; start "
                               f"the receiver with the source's engine arguments, or from the "
                               f"checkpoint"}
        backend = req.get("backend") or BACKENDS[server.device_type]
        allowed = {BACKENDS[server.device_type]} | ({"gloo"} if server.device_type == "cuda" else set())
        if backend not in allowed:
            raise ProtocolError(f"receiver asks for backend {backend!r}; a {server.device_type} "
                                f"daemon seeds over {' or '.join(sorted(allowed))}")
        if server.invalidated:
            raise StoreError("this daemon's arena was invalidated; it seeds no one")
        store = dist.TCPStore(self.host, 0, 2, True, timeout=datetime.timedelta(seconds=SEED_TIMEOUT_S),
                              wait_for_workers=False)
        # The TCPStore listens on a port any local user can reach; the group's keys
        # live under a random token that travels only over the uid-checked Unix
        # socket, so nobody else can join the group and receive the weights.
        token = secrets.token_hex(TOKEN_BYTES)
        thread = threading.Thread(target=self._send, args=(store, backend, token, state.get("pid")),
                                  name="wcache-seed", daemon=True)
        thread.start()
        self.threads.append(thread)
        return {"ok": True, "manifest": server._manifest_dict, "backend": backend, "host": self.host,
                "port": store.port, "token": token, "chunk_bytes": SEED_CHUNK_BYTES}

    def _send(self, store: Any, backend: str, token: str, pid: Any) -> None:
        server = self.server
        t0 = time.perf_counter()
        view = pg = None
        try:
            device = torch.device("cpu") if server.device_type == "cpu" else \
                torch.device("cuda", server.device_index)
            pg, _ = _group(backend, self.host, store.port, 0, device, token, is_master=True, store=store)
            view = served_arena(server)
            arena = view.tensor
            for off, length in _ranges(server.manifest.arena_nbytes, SEED_CHUNK_BYTES):
                _broadcast(pg, arena[off:off + length])
            algo, hexd = self.digest(arena)
            d = torch.frombuffer(bytearray(bytes.fromhex(hexd)), dtype=torch.uint8).to(device)
            _broadcast(pg, d)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seeds_done += 1
            dt = time.perf_counter() - t0
            log.info("seeded pid %s: %.1f MiB over %s in %.3f s (%s %s)", pid,
                     server.manifest.arena_nbytes / 2**20, backend, dt, algo, hexd[:16])
        except Exception:  # the receiver sees its own error; the source keeps serving
            log.exception("seeding pid %s failed; still serving", pid)
        finally:
            if pg is not None:
                _close_group(pg)
            if view is not None:
                view.close()


def seed_arena(sock_path: str, key: CacheKey, *, connect_timeout_s: float = 5.0,
               backend: str | None = None) -> PrebuiltArena:
    """Ask the daemon on ``sock_path`` to seed us; return the arena to build.

    ``backend``: None for the device's (:data:`BACKENDS`); ``"gloo"`` between
    CUDA daemons too (gloo stages CUDA tensors through host memory: slower than
    NCCL, but it works where NCCL cannot, e.g. two daemons on one GPU).

    The returned :class:`PrebuiltArena`'s ``fill`` joins the source's process
    group (rank 1), receives the arena into the new allocation, and checks the
    digest of what arrived against the source's.

    Raises:
        KeyMismatch: the source serves another key (fields named).
        DaemonMissing: nothing answers on ``sock_path``.
        SeedFailed: the source refused, the manifest's key is not ``key``,
            or (from ``fill``) the transfer failed or the digests differ.
    """
    from wcache.store.client import Connection  # noqa: PLC0415

    conn = Connection(sock_path, connect_timeout_s)
    try:
        try:
            reply = conn.request({"op": "seed", "key": key.fields, "backend": backend})
        except KeyMismatch:
            raise
        except StoreError as e:
            raise SeedFailed(f"the daemon on {sock_path} refused to seed: {e}") from e
    finally:
        conn.close()
    manifest = Manifest.from_dict(reply.get("manifest"))
    if CacheKey(manifest.key) != key:
        raise SeedFailed(f"the daemon on {sock_path} sent a manifest of key "
                         f"{CacheKey(manifest.key).digest[:16]}, we asked for {key.digest[:16]}")
    backend, host, port = reply["backend"], str(reply["host"]), int(reply["port"])
    token = str(reply["token"])
    chunk = int(reply.get("chunk_bytes") or SEED_CHUNK_BYTES)

    def fill(dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        pg = None
        try:
            pg, _store = _group(backend, host, port, 1, dst.device, token, is_master=False)
            for off, length in _ranges(manifest.arena_nbytes, chunk):
                _broadcast(pg, dst[off:off + length])
            theirs = torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=dst.device)
            _broadcast(pg, theirs)
            if dst.device.type == "cuda":
                torch.cuda.synchronize(dst.device)  # NCCL work is async: done before shutdown
        except RuntimeError as e:  # c10d reports timeouts and broken connections so
            raise SeedFailed(f"seeding from {sock_path} broke off: {e}; check that the source "
                             f"daemon still runs (`wcache status`), or start this one from the "
                             f"checkpoint or a snapshot") from e
        finally:
            if pg is not None:
                _close_group(pg)
        algo, mine = arena_digest(dst[:manifest.arena_nbytes])
        theirs_hex = bytes(theirs.cpu().tolist()).hex()
        if mine != theirs_hex:
            raise SeedFailed(f"what arrived from {sock_path} does not match the source's digest "
                             f"({algo}: got {mine[:16]}, source {theirs_hex[:16]}); nothing is served")
        log.info("seeded from %s over %s: %.1f MiB in %.3f s, %s verified", sock_path, backend,
                 manifest.arena_nbytes / 2**20, time.perf_counter() - t0, algo)

    return PrebuiltArena(manifest, fill, f"peer {sock_path}")
