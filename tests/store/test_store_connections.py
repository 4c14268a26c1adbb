"""A daemon cannot be denied to engines, and errors reach people as one line:
idle and silent connections time out, connections are limited per client and
idle ones make room, malformed frames of any type get ``protocol-error``, a
stalled daemon holds a client no longer than its ``connect_timeout_s``, and a
socket of another user is refused with ``unsafe-path`` / ``peer-refused``."""

import errno
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.helpers.stalled_daemon import stalled_daemon as fake_stalled_daemon
from wcache import cli
from wcache.store import (
    CacheKey,
    DaemonMissing,
    PeerRefused,
    UnsafePath,
    attach,
    cli_status,
    daemon_status,
    paths,
)
from wcache.store.protocol import PROTOCOL_VERSION, recv_frame, send_frame
from wcache.testing.store import BASE_KEY, synthetic_export

#: Timeouts the tests give the daemon (seconds): short, so the suite stays fast.
SHORT_TIMEOUT_S = 0.5
#: Slack on top of an expected wait (seconds) on a loaded 2-core machine.
SLACK_S = 3.0
#: Idle connections a flood opens: the daemon's whole connection limit.
FLOOD = 64


def _raw(server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(SHORT_TIMEOUT_S + SLACK_S)
    s.connect(server.socket_path)
    return s


def _hello(s: socket.socket) -> None:
    send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": "t"})
    assert recv_frame(s)[0]["ok"] is True


# --------------------------------------------------------------------------- malformed frames

#: (request after hello, fragment of the protocol-error message)
MALFORMED = [
    ({"op": ["get"]}, "'op' must be a string"),
    ({"op": {"a": 1}}, "'op' must be a string"),
    ({"op": 7}, "'op' must be a string"),
    ({"op": None}, "'op' must be a string"),
    ({}, "'op' must be a string"),
    ({"op": "nope"}, "unknown command"),
    ({"op": "hello", "protocol": True}, "'protocol' must be int, not bool"),
    ({"op": "hello", "protocol": "1"}, "'protocol' must be int, not str"),
    ({"op": "hello", "protocol": 1.0}, "'protocol' must be int, not float"),
    ({"op": "hello"}, "needs the field(s) ['protocol']"),
    ({"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": 3}, "'wcache' must be str or nil"),
    ({"op": "get"}, "needs the field(s) ['key']"),
    ({"op": "get", "key": [1]}, "'key' must be dict"),
    ({"op": "get", "key": {}, "mode": 5}, "'mode' must be str or nil"),
    ({"op": "get", "key": {}, "transport": ["shm"]}, "'transport' must be str or nil"),
    ({"op": "get", "key": {"model": b"\x00\xff"}}, "key map is malformed"),
    ({"op": "status", "verbose": True}, "status takes no field 'verbose'"),
    ({"op": "release", "x": None}, "release takes no field 'x'"),
    ({"op": "invalidate", "key": "k"}, "'key' must be dict"),
    ({"op": "invalidate", "key": {}, "code": 5}, "'code' must be str or nil"),
    ({"op": "seed", "key": {}, "backend": 1}, "'backend' must be str or nil"),
    ({"op": "shutdown", "now": True}, "shutdown takes no field 'now'"),
]


def test_malformed_frame_matrix_gets_protocol_error_and_no_traceback(daemon, caplog):
    """Every malformed request of the table is answered protocol-error naming the problem, the
    connection stays usable, no traceback is logged, and the daemon neither stops nor is invalidated."""
    caplog.set_level(logging.DEBUG, logger="wcache.store")
    with _raw(daemon) as s:
        _hello(s)
        for frame, fragment in MALFORMED:
            send_frame(s, frame)
            reply = recv_frame(s)[0]
            assert (False, "protocol-error") == (reply["ok"], reply["code"]), frame
            assert fragment in reply["message"], (frame, reply["message"])
        send_frame(s, {"op": "status"})
        assert daemon.nbytes == recv_frame(s)[0]["bytes_held"]
    assert [] == [r.getMessage() for r in caplog.records if r.exc_info]
    assert daemon.invalidated is None and not daemon._shutdown_requested.is_set()


@pytest.mark.parametrize("payload", [[1, 2], 5, "op", None, b"x"], ids=repr)
def test_frames_that_are_not_maps_get_protocol_error(daemon, payload):
    """A frame holding a list, number, string, nil or bytes is answered protocol-error."""
    import msgpack

    from wcache.store.protocol import HEADER

    body = msgpack.packb(payload, use_bin_type=True)
    with _raw(daemon) as s:
        s.sendall(HEADER.pack(len(body)) + body)
        reply = recv_frame(s)[0]
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert "not a map" in reply["message"]


# --------------------------------------------------------------------------- idle and silent clients


def test_silent_connection_is_closed_after_the_hello_timeout(daemon):
    """A client that never says hello gets idle-timeout after hello_timeout_s and loses its slot."""
    daemon.hello_timeout_s = SHORT_TIMEOUT_S
    with _raw(daemon) as s:
        t0 = time.monotonic()
        reply = recv_frame(s)[0]
        waited = time.monotonic() - t0
    assert ("idle-timeout", True) == (reply["code"], "no hello" in reply["message"])
    assert SHORT_TIMEOUT_S * 0.9 <= waited < SHORT_TIMEOUT_S + SLACK_S
    deadline = time.monotonic() + SLACK_S  # the handler frees the slot right after answering
    while daemon._conns and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 0 == daemon_status(daemon.socket_path)["clients_connected"]


def test_idle_connection_without_attachment_is_closed(daemon):
    """After hello, a connection holding no attachment is closed after idle_timeout_s."""
    daemon.idle_timeout_s = SHORT_TIMEOUT_S
    with _raw(daemon) as s:
        _hello(s)
        reply = recv_frame(s)[0]
    assert ("idle-timeout", True) == (reply["code"], "holding no attachment" in reply["message"])


def test_attached_connection_may_stay_idle(daemon, key, sock_dir):
    """An attachment's connection outlives the idle timeout: still counted active, released on close."""
    daemon.idle_timeout_s = daemon.hello_timeout_s = SHORT_TIMEOUT_S
    with attach(key, socket_dir=sock_dir) as att:
        time.sleep(SHORT_TIMEOUT_S * 3)
        assert 1 == daemon_status(daemon.socket_path)["attachments_active"]
        assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])
    deadline = time.monotonic() + SLACK_S
    while daemon.attachments_active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 0 == daemon.attachments_active


def test_flood_of_idle_connections_does_not_deny_an_attach(daemon, key, sock_dir):
    """64 idle connections (the whole limit, as from many clients) and an attach still succeeds bit-exact."""
    daemon.max_connections_per_client = FLOOD * 2  # the flood counts as many clients here
    flood = [_raw(daemon) for _ in range(FLOOD)]
    try:
        deadline = time.monotonic() + SLACK_S
        while len(daemon._conns) < FLOOD and time.monotonic() < deadline:
            time.sleep(0.05)
        assert FLOOD == len(daemon._conns)
        with attach(key, socket_dir=sock_dir) as att:
            assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])
    finally:
        for s in flood:
            s.close()


def test_one_client_cannot_take_every_connection(daemon, sock_dir):
    """Past max_connections_per_client one pid is refused daemon-busy; another process attaches fine."""
    from wcache.store.server import MAX_CONNECTIONS_PER_CLIENT

    mine = [_raw(daemon) for _ in range(MAX_CONNECTIONS_PER_CLIENT)]
    try:
        with _raw(daemon) as extra:
            reply = recv_frame(extra)[0]
        assert ("daemon-busy", True) == (reply["code"], "per client" in reply["message"])
        script = textwrap.dedent(f"""
            import sys, torch
            from wcache.testing.store import BASE_KEY, synthetic_export
            from wcache.store import CacheKey, attach
            with attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r}) as att:
                print(torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"]))
        """)
        child = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert "True" == child.stdout.strip(), child.stderr[-2000:]
    finally:
        for s in mine:
            s.close()


# --------------------------------------------------------------------------- a stalled daemon


@pytest.fixture
def stalled_daemon(sock_dir):
    """A fake daemon on the cpu socket that answers hello, then never answers again."""
    with fake_stalled_daemon(paths.socket_path(sock_dir, "cpu")) as path:
        yield path


@pytest.mark.parametrize("call", ["attach", "status"])
def test_stalled_daemon_holds_a_client_no_longer_than_connect_timeout(
    stalled_daemon, sock_dir, call
):
    """A daemon that answers hello and then stalls: the client gives up with daemon-missing
    within connect_timeout_s (not the 60 s reply timeout)."""
    t0 = time.monotonic()
    with pytest.raises(DaemonMissing) as info:
        if call == "attach":
            attach(CacheKey(BASE_KEY), socket_dir=sock_dir, connect_timeout_s=SHORT_TIMEOUT_S)
        else:
            daemon_status(stalled_daemon, connect_timeout_s=SHORT_TIMEOUT_S)
    waited = time.monotonic() - t0
    assert SHORT_TIMEOUT_S * 0.9 <= waited < SHORT_TIMEOUT_S + SLACK_S
    assert f"within {SHORT_TIMEOUT_S} s" in str(info.value)


# --------------------------------------------------------------------------- another user's socket


@pytest.fixture
def lstat_denied(monkeypatch, daemon):
    """lstat of the daemon's socket fails with EACCES, as for a socket in another user's 0700 dir."""
    real = os.lstat

    def lstat(path, *a, **kw):
        if os.fspath(path) == daemon.socket_path:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "lstat", lstat)
    yield
    monkeypatch.undo()  # before the daemon's teardown, which lstats its socket


def test_attach_to_an_uninspectable_socket_is_unsafe_path(lstat_denied, key, sock_dir):
    """attach raises UnsafePath (code unsafe-path), not a bare PermissionError."""
    with pytest.raises(UnsafePath) as info:
        attach(key, socket_dir=sock_dir)
    assert "unsafe-path" == info.value.code and "another user" in str(info.value)


def test_status_of_an_uninspectable_socket_is_one_line(lstat_denied, sock_dir, capsys):
    """`wcache status` prints one line with [unsafe-path] for the socket and no traceback."""
    assert 3 == cli.main(["status", "--socket-dir", sock_dir])
    out = capsys.readouterr()
    lines = [ln for ln in out.out.splitlines() if "[unsafe-path]" in ln]
    assert 1 == len(lines) and "Traceback" not in out.out + out.err


@pytest.fixture
def connect_denied(monkeypatch):
    """connect() fails with EACCES, as on a socket file of another user."""

    def connect(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", connect)


def test_attach_denied_by_permissions_is_peer_refused(daemon, key, sock_dir, connect_denied):
    """attach raises PeerRefused (code peer-refused) naming another user, not daemon-missing."""
    with pytest.raises(PeerRefused) as info:
        attach(key, socket_dir=sock_dir)
    assert "peer-refused" == info.value.code and "another user" in str(info.value)


def test_status_denied_by_permissions_is_one_line(daemon, sock_dir, connect_denied, capsys):
    """cli_status prints `refused [peer-refused]` for the socket, no traceback."""
    assert 3 == cli_status(sock_dir)
    out = capsys.readouterr().out
    assert f"{daemon.socket_path}: refused [peer-refused]" in out and "Traceback" not in out
