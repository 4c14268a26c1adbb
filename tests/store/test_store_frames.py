"""Malformed, truncated and oversized frames: answered with an error or a closed
connection, and the daemon keeps serving (hypothesis)."""

import os
import shutil
import socket
import struct
import tempfile

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.store import CacheKey, DaemonServer, ProtocolError, attach, daemon_status
from wcache.store.protocol import HEADER, MAX_FRAME_BYTES, PROTOCOL_VERSION, recv_frame, send_frame
from wcache.testing.store import BASE_KEY, synthetic_export


@pytest.fixture(scope="module")
def module_daemon():
    d = tempfile.mkdtemp(prefix="wcf-")
    os.chmod(d, 0o700)
    server = DaemonServer(synthetic_export(), CacheKey(BASE_KEY), socket_dir=d).start()
    yield server
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


def _send_raw(server, data: bytes, hello_first: bool) -> tuple[str, dict | None]:
    """Send raw bytes, half-close, and report ("reply", frame) or ("closed", None)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(server.socket_path)
    try:
        if hello_first:
            send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": "t"})
            assert recv_frame(s)[0]["ok"] is True
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.shutdown(socket.SHUT_WR)  # a truncated frame is now truncated for good
        try:
            reply, _ = recv_frame(s)
        except ProtocolError:  # ConnectionClosed included: the daemon dropped us
            return "closed", None
        except (TimeoutError, ConnectionResetError):
            return "closed", None
        return "reply", reply
    finally:
        s.close()


def _assert_still_serving(server):
    st_ = daemon_status(server.socket_path)
    assert server.nbytes == st_["bytes_held"]


frame_bytes = st.one_of(
    st.binary(max_size=64),  # garbage, often a truncated header or body
    st.builds(
        lambda n, body: HEADER.pack(n) + body, st.integers(0, 2**32 - 1), st.binary(max_size=32)
    ),
    st.builds(
        lambda obj: (lambda p: HEADER.pack(len(p)) + p)(
            msgpack.packb(obj)
        ),  # valid msgpack, odd content
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**63 - 1)
            | st.text(max_size=8)
            | st.binary(max_size=8),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
            max_leaves=8,
        ),
    ),
    st.builds(
        lambda op, extra: (lambda p: HEADER.pack(len(p)) + p)(msgpack.packb({"op": op, **extra})),
        st.sampled_from(["get", "release", "status", "hello", "nope", ""]),
        st.dictionaries(
            st.sampled_from(["key", "mode", "protocol", "transport"]),
            st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=4) | st.just({"x": 1}),
            max_size=3,
        ),
    ),
)


@given(data=frame_bytes, hello_first=st.booleans())
def test_any_bytes_get_an_answer_or_a_close_and_daemon_serves_on(module_daemon, data, hello_first):
    """Whatever bytes a client sends, it gets a well-formed reply or a closed connection; the daemon serves on."""
    outcome, reply = _send_raw(module_daemon, data, hello_first)
    if outcome == "reply":
        assert isinstance(reply.get("ok"), bool)
        if not reply["ok"]:
            assert isinstance(reply["code"], str) and isinstance(reply["message"], str)
    _assert_still_serving(module_daemon)


def test_oversized_length_is_refused_before_reading_the_body(module_daemon):
    """A header announcing more than MAX_FRAME_BYTES is answered at once (no body sent, nothing allocated)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(module_daemon.socket_path)
    with s:
        s.sendall(HEADER.pack(MAX_FRAME_BYTES + 1))  # connection stays open for writing
        reply, _ = recv_frame(s)
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert "exceeds" in reply["message"]
    _assert_still_serving(module_daemon)


def test_truncated_frame_then_close_leaves_daemon_serving(module_daemon):
    """A client that sends half a frame and disappears costs the daemon nothing: attach still works."""
    payload = msgpack.packb({"op": "status"})
    for cut in (1, HEADER.size, HEADER.size + len(payload) - 1):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(module_daemon.socket_path)
        s.sendall((HEADER.pack(len(payload)) + payload)[:cut])
        s.close()
    with attach(CacheKey(BASE_KEY), socket_dir=os.path.dirname(module_daemon.socket_path)) as att:
        assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])


def test_client_refuses_oversized_frames_too():
    """send_frame refuses to build a frame above the limit (the limit holds on both sides)."""
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ProtocolError, match="exceeds"):
            send_frame(a, {"blob": b"\0" * (MAX_FRAME_BYTES + 1)})
        a.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_frame(b)


def test_no_pickle_on_the_wire():
    """Frames are msgpack maps: an object that only pickle could carry is refused."""
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ProtocolError, match="cannot be encoded"):
            send_frame(a, {"obj": object()})
        send_frame(a, {"op": "status", "n": [1, 2]})
        assert ({"op": "status", "n": [1, 2]}, []) == recv_frame(b)


def test_stalled_half_frame_is_dropped_after_the_frame_timeout(module_daemon, monkeypatch):
    """A client that starts a frame and stalls is answered protocol-error after the frame timeout."""
    monkeypatch.setattr(module_daemon, "frame_timeout_s", 0.2)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(module_daemon.socket_path)
    with s:
        s.sendall(HEADER.pack(100)[:2])  # half a header, then nothing
        reply, _ = recv_frame(s)
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert "within 0.2 s" in reply["message"]
    _assert_still_serving(module_daemon)


def test_a_trickled_half_frame_is_dropped_by_the_frame_deadline(monkeypatch):
    """A peer that keeps a frame open by sending one byte now and then (each read
    well inside the timeout) is cut off when the frame's whole time runs out: the
    timeout is a deadline for the frame, not per read (break10 #1, #3)."""
    import threading
    import time

    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        a.sendall(HEADER.pack(1000))
        while not stop.wait(0.1):
            try:
                a.sendall(b"\x00")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    with a, b:
        t.start()
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="not completed within 0.5 s"):
            recv_frame(b, frame_timeout_s=0.5)
        took = time.monotonic() - t0
        stop.set()
        t.join(5)
    assert took < 3.0, took  # per-read timeouts would never have ended it


def test_a_header_claiming_megabytes_costs_only_what_arrived():
    """The buffer grows with the bytes that arrive: 60 MiB announced and 10 bytes
    sent allocate about a MiB, not 60 (break10 #1, #3: 64 such connections took a
    daemon from 30 MiB to 4 GiB)."""
    import tracemalloc

    a, b = socket.socketpair()
    with a, b:
        a.sendall(HEADER.pack(60 << 20) + b"\x00" * 10)
        a.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError, match="closed mid-frame"):
                recv_frame(b)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 7, (1 << 20) + 1, 5 << 20])
def test_frames_across_the_buffer_growth_round_trip(size):
    """Payloads below, at and past the growth steps arrive whole, with a descriptor."""
    import threading

    a, b = socket.socketpair()
    blob = os.urandom(size)
    r, w = os.pipe()
    try:
        with a, b:
            t = threading.Thread(target=send_frame, args=(a, {"blob": blob}, (w,)))
            t.start()
            frame, fds = recv_frame(b, max_fds=1)
            t.join(10)
            assert frame["blob"] == blob
            assert 1 == len(fds)
            os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_a_daemon_reads_requests_up_to_max_request_bytes_only(module_daemon):
    """A request header above MAX_REQUEST_BYTES is refused before its body; replies
    keep MAX_FRAME_BYTES."""
    from wcache.store.protocol import MAX_REQUEST_BYTES

    assert MAX_REQUEST_BYTES < MAX_FRAME_BYTES
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(module_daemon.socket_path)
    with s:
        s.sendall(HEADER.pack(MAX_REQUEST_BYTES + 1))
        reply, _ = recv_frame(s)
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert f"exceeds the {MAX_REQUEST_BYTES}-byte limit" in reply["message"]
    _assert_still_serving(module_daemon)


def test_a_key_of_too_many_fields_is_refused_at_once(module_daemon):
    """A get whose key has more fields than any key is refused as a protocol error,
    not compared field by field (break10 #4: 100k junk fields kept a core busy 193 s
    and wrote a megabyte log line)."""
    from wcache.store.protocol import MAX_KEY_FIELDS

    junk = {f"k{i}": i for i in range(MAX_KEY_FIELDS + 1)}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(module_daemon.socket_path)
    with s:
        send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": "t"})
        assert recv_frame(s)[0]["ok"] is True
        send_frame(s, {"op": "get", "key": junk})
        reply, _ = recv_frame(s)
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert f"at most {MAX_KEY_FIELDS}" in reply["message"]
    _assert_still_serving(module_daemon)
