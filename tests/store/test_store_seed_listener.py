"""The TCP seeding listener on its own, with a fake owner in place of the daemon: what
it asks of its owner (wcache.store.seed_listener.SeedOwner) is all it uses."""

from __future__ import annotations

import socket
import threading

import pytest

from wcache.store.errors import PeerRefused, StoreError
from wcache.store.protocol import PROTOCOL_VERSION, recv_frame, send_frame
from wcache.store.seed_listener import SeedListener

SECRET = b"s" * 32
#: Seconds a test waits for the listener's threads (they answer in milliseconds).
WAIT_S = 10.0


class FakeOwner:
    """Records every call the listener makes; ``full`` refuses every connection."""

    def __init__(self, full: bool = False):
        self.seed_source = None
        self.stopping = threading.Event()
        self.seed_tcp_timeout_s = WAIT_S
        self.full = full
        self.calls: list[tuple] = []
        self.done = threading.Event()

    def admit_(self, conn, thread):
        self.calls.append(("admit",))
        return not self.full

    def forget_(self, conn):
        self.calls.append(("forget",))
        self.done.set()

    def refuse_(self, conn, err):
        self.calls.append(("refuse", type(err), err.code))
        conn.close()

    def refuse_full_(self, conn, peer):
        self.calls.append(("full", peer))
        conn.close()
        self.done.set()


@pytest.fixture
def listening(request):
    owner = FakeOwner(full=request.param)
    listener = SeedListener(owner, "127.0.0.1", 0, SECRET, backlog=4, poll_s=0.05).start()
    yield owner, listener
    owner.stopping.set()
    listener.close(WAIT_S)


@pytest.mark.parametrize("listening", [False], indirect=True)
def test_a_non_seed_command_is_refused_through_the_owner(listening):
    """The listener takes a slot, sends its challenge, refuses `status` as peer-refused
    through the owner, and gives the slot back."""
    owner, listener = listening
    with socket.create_connection(listener.address, timeout=WAIT_S) as s:
        challenge, _ = recv_frame(s)
        send_frame(s, {"op": "status", "protocol": PROTOCOL_VERSION})
        assert owner.done.wait(WAIT_S)
    assert ("challenge", PROTOCOL_VERSION) == (challenge["op"], challenge["protocol"])
    assert [("admit",), ("refuse", PeerRefused, "peer-refused"), ("forget",)] == owner.calls


@pytest.mark.parametrize("listening", [True], indirect=True)
def test_a_full_owner_refuses_before_any_exchange(listening):
    """When the owner has no slot left the connection is handed to refuse_full_ with the
    peer's address and nothing is sent."""
    owner, listener = listening
    with socket.create_connection(listener.address, timeout=WAIT_S) as s:
        assert owner.done.wait(WAIT_S)
        assert b"" == s.recv(1)
    assert [("admit",), ("full", "127.0.0.1")] == owner.calls


def test_an_empty_secret_or_a_taken_address_is_refused():
    """No listener starts without a secret, nor on an address already bound."""
    with pytest.raises(StoreError, match="non-empty secret"):
        SeedListener(FakeOwner(), "127.0.0.1", 0, b"", backlog=4, poll_s=0.05)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(StoreError, match="cannot listen for seeding"):
            SeedListener(
                FakeOwner(), "127.0.0.1", taken.getsockname()[1], SECRET, backlog=4, poll_s=0.05
            )


def test_a_bound_seed_socket_refuses_peers_until_the_listener_starts():
    """wcache serve binds the --seed-listen address before its load; until the rank
    serves, a peer's connection is refused at once (nothing listens), not held in a
    backlog until the peer's seeding timeout (break17 #2); an address another socket
    listens on is refused as seed-listen-failed."""
    from wcache.errors import SeedListenFailed
    from wcache.store.seed_listener import bind_seed_socket

    bound = bind_seed_socket("127.0.0.1", 0)
    port = bound.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            busy = taken.getsockname()[1]
            with pytest.raises(SeedListenFailed, match=f"on 127.0.0.1:{busy}: .*in use"):
                bind_seed_socket("127.0.0.1", busy)
        listener = SeedListener(
            FakeOwner(), "127.0.0.1", port, SECRET, backlog=4, poll_s=0.05, bound=bound
        )
        assert ("127.0.0.1", port) == listener.address
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()  # listens now
    finally:
        bound.close()
