"""The TCP seeding listener: other hosts' daemons ask a daemon for its arena here.

It answers ``seed`` and nothing else, one request per connection, after a
shared-secret challenge-response (see :mod:`wcache.store.protocol`): the listener
sends a challenge (a random nonce), the peer answers with a ``seed`` request and
its HMAC-SHA256 under the secret (:func:`wcache.store.protocol.seed_mac`),
checked with ``hmac.compare_digest``; any other command, a bad or missing MAC, a
malformed frame or the owner's ``seed_tcp_timeout_s`` of silence is refused
(logged with the peer's address) before anything else happens. The reply is
signed the same way.

:class:`SeedListener` owns the listening socket and its accept thread; what it
shares with the daemon that composes it (:class:`wcache.store.server.DaemonServer`)
is the :class:`SeedOwner` protocol: the ``seed`` handler, the stop flag, the
connection slots (one limit over Unix and TCP connections) and the refusal
counters. The wire protocol is the daemon's (docs/design.md section 5.1).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

import wcache
from wcache.errors import SeedListenFailed
from wcache.store.errors import PeerRefused, ProtocolError, StoreError
from wcache.store.protocol import (
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    SEED_NONCE_BYTES,
    SEED_REPLY_LABEL,
    SEED_REQUEST_LABEL,
    ConnectionClosed,
    check_request,
    error_frame,
    recv_frame,
    seed_mac,
    send_frame,
)

__all__ = ["SeedListener", "SeedOwner", "bind_seed_socket"]

log = logging.getLogger("wcache.store")


class SeedOwner(Protocol):
    """What a :class:`SeedListener` needs of the daemon it serves for."""

    #: Handler of the ``seed`` command (:class:`wcache.store.seed.SeedSource`).
    seed_source: Any

    @property
    def stopping(self) -> threading.Event:
        """Set once the daemon stops: the accept loop ends."""

    @property
    def seed_tcp_timeout_s(self) -> float:
        """Seconds a TCP peer has for its whole exchange (read per connection)."""

    def admit_(self, conn: socket.socket, thread: threading.Thread) -> bool:
        """Take a connection slot for ``conn`` (handled by ``thread``); False when full."""

    def forget_(self, conn: socket.socket) -> None:
        """Give ``conn``'s slot back."""

    def refuse_(self, conn: socket.socket, err: StoreError) -> None:
        """Count ``err.code``, send ``err`` as an error frame, close ``conn``."""

    def refuse_full_(self, conn: socket.socket, peer: str) -> None:
        """Refuse ``conn`` because every connection slot is taken (``daemon-busy``)."""


def bind_seed_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening: what a
    :class:`SeedListener` listens and accepts on. ``wcache serve`` binds it before
    the rank loads anything, so an address in use is refused at once, not after the
    load; until the listener starts, a peer's connection is refused at once
    (ECONNREFUSED: nothing listens), as before the bind, where a listening socket
    would hold it for the seeding timeout (break17 #2).

    Args:
        host: the address to bind (an interface's address; ``0.0.0.0`` binds every
            interface; an IPv6 address when it holds ``:``).
        port: TCP port; 0 picks a free one (``getsockname()`` has it).

    Raises:
        SeedListenFailed: the address cannot be bound (in use, not this host's, a
            privileged port).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise _listen_failed(host, port, e) from e
    return listener


def _listen_failed(host: str, port: int, exc: OSError) -> SeedListenFailed:
    """The refusal of ``host:port`` for seeding, at its bind or its ``listen()``
    (where a second daemon's early bind of the same port fails: SO_REUSEADDR)."""
    return SeedListenFailed(
        f"cannot listen for seeding on {host}:{port}: {exc}; pick another "
        f"--seed-listen address or port"
    )


class SeedListener:
    """Accepts ``seed`` requests on ``host:port`` (TCP) for ``owner``.

    Args:
        owner: the daemon (:class:`SeedOwner`; ``owner.seed_source`` answers).
        host: the address to bind (an interface's address; ``0.0.0.0`` binds
            every interface).
        port: TCP port; 0 picks a free one.
        secret: the shared secret (:func:`wcache.store.seed.read_secret`).
        backlog: ``listen()`` backlog.
        poll_s: how often the accept loop wakes to notice ``owner.stopping`` (seconds).
        bound: a socket :func:`bind_seed_socket` already bound to ``host:port``
            (the listener owns it from here and listens on it); None binds one now.

    Raises:
        StoreError: an empty secret.
        SeedListenFailed: the address cannot be bound.
    """

    def __init__(
        self,
        owner: SeedOwner,
        host: str,
        port: int,
        secret: bytes,
        *,
        backlog: int,
        poll_s: float,
        bound: socket.socket | None = None,
    ):
        if not secret:
            if bound is not None:
                bound.close()
            raise StoreError("a TCP seeding listener needs a non-empty secret")
        listener = bound if bound is not None else bind_seed_socket(host, port)
        try:
            listener.listen(backlog)
        except OSError as e:
            listener.close()
            raise _listen_failed(host, port, e) from e
        listener.settimeout(poll_s)
        self._owner = owner
        self._secret = bytes(secret)
        self._socket = listener
        self._poll_s = poll_s
        #: ``(host, port)`` the listener is bound to.
        self.address: tuple[str, int] = (host, listener.getsockname()[1])
        self._thread = threading.Thread(
            target=self._accept_loop, name="wcache-seed-tcp", daemon=True
        )

    def start(self) -> SeedListener:
        """Start the accept thread."""
        self._thread.start()
        log.info("daemon pid %d accepts seed requests on tcp %s:%d", os.getpid(), *self.address)
        return self

    def close(self, join_timeout_s: float) -> None:
        """Wait for the accept thread (``owner.stopping`` must be set), then close the
        socket. Connections being handled are the owner's to end."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout_s)
        self._socket.close()

    def _accept_loop(self) -> None:
        while not self._owner.stopping.is_set():
            try:
                conn, addr = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._owner.stopping.is_set():
                    return
                log.exception("seeding accept failed; still serving")
                time.sleep(self._poll_s)
                continue
            conn.settimeout(self._owner.seed_tcp_timeout_s)
            thread = threading.Thread(
                target=self._handle, args=(conn, addr), name="wcache-seed-conn", daemon=True
            )
            if not self._owner.admit_(conn, thread):
                self._owner.refuse_full_(conn, addr[0])
                continue
            thread.start()

    def _handle(self, conn: socket.socket, addr: tuple) -> None:
        """One authenticated ``seed`` exchange; everything else is refused and logged."""
        peer = f"{addr[0]}:{addr[1]}"
        refuse = self._owner.refuse_
        try:
            nonce = secrets.token_hex(SEED_NONCE_BYTES)
            send_frame(
                conn,
                {
                    "op": "challenge",
                    "nonce": nonce,
                    "protocol": PROTOCOL_VERSION,
                    "wcache": wcache.__version__,
                },
            )
            try:
                request, _ = recv_frame(
                    conn,
                    frame_timeout_s=self._owner.seed_tcp_timeout_s,
                    max_bytes=MAX_REQUEST_BYTES,
                )
            except ConnectionClosed:
                return
            except ProtocolError as e:
                log.warning(
                    "seeding peer %s sent a bad frame (%s); closing its connection", peer, e
                )
                refuse(conn, e)
                return
            op = request.get("op")
            if op != "seed":
                log.warning("refused %r from %s: the TCP listener answers only seed", op, peer)
                refuse(
                    conn,
                    PeerRefused(
                        f"{op!r} is not accepted over TCP; this listener "
                        f"answers only seed (other commands: the local "
                        f"Unix socket)"
                    ),
                )
                return
            mac = request.get("mac")
            try:
                expected = seed_mac(self._secret, SEED_REQUEST_LABEL, nonce, request)
                ok = isinstance(mac, str) and hmac.compare_digest(mac.encode(), expected.encode())
            except ProtocolError:
                ok = False
            if not ok:
                log.warning(
                    "refused a seed request from %s: %s authentication",
                    peer,
                    "missing" if mac is None else "bad",
                )
                refuse(
                    conn,
                    PeerRefused(
                        "authentication failed: the request is not signed "
                        "with this daemon's seeding secret; give the "
                        "receiver the source's --seed-secret-file"
                    ),
                )
                return
            if not isinstance(request.get("nonce"), str):
                refuse(conn, ProtocolError("seed over TCP needs the client's nonce"))
                return
            try:
                check_request(request)
            except ProtocolError as e:
                refuse(conn, e)
                return
            try:
                reply = self._owner.seed_source.handle(request, {"pid": peer, "tcp": True})
            except StoreError as e:
                reply = error_frame(e)
            except Exception as e:  # a bug in a handler must not take the daemon down
                log.exception("seed handler error for %s", peer)
                reply = error_frame(e)
            try:
                reply["mac"] = seed_mac(self._secret, SEED_REPLY_LABEL, request["nonce"], reply)
            except ProtocolError as e:  # the client's nonce is not hex: its own fault
                reply = error_frame(e)
            if reply.get("ok"):
                log.info("seeding %s over TCP", peer)
            send_frame(conn, reply)
        except OSError as e:  # timeouts included: the peer went silent or away
            log.warning("seeding connection from %s dropped: %s", peer, e)
        finally:
            self._owner.forget_(conn)
            conn.close()
