"""Seeding a daemon from a daemon on another host: the TCP seeding listener
(`--seed-listen`), its shared-secret challenge-response, and `--seed-from
tcp://HOST:PORT`, at the store level (no vLLM).

The listener binds a non-loopback address of this machine when it has one, so
the TCPStore, gloo and the control connection take the path another host's
would; on a machine with only the loopback interface the tests use 127.0.0.1
(the code path is the same, only the interface differs)."""

import ipaddress
import logging
import os
import socket
import struct
import subprocess
import threading

import msgpack
import pytest
import torch

from wcache.store import CacheKey, DaemonMissing, DaemonServer, KeyMismatch, attach, daemon_status
from wcache.store import seed as seed_mod
from wcache.store import server as server_mod
from wcache.store.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    SEED_REPLY_LABEL,
    SEED_REQUEST_LABEL,
    recv_frame,
    seed_mac,
    send_frame,
)
from wcache.store.seed import SeedFailed, SeedSecretUnsafe, SeedSource, read_secret, seed_arena
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon, synthetic_export
from wcache.testing.store import assert_serves_export as _assert_serves_export

SECRET = b"q2Zl5m1dW0bO3x7Yk8c9v4n6J2h1g0f5e4d3c2b1a0Y="  # 44 bytes, as base64 of 32 random bytes


def _non_loopback_ipv4() -> str:
    """An IPv4 address of this machine other than loopback, else 127.0.0.1."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
        candidates += [
            line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line
        ]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    for addr in candidates:
        if ipaddress.ip_address(addr).is_loopback:
            continue
        try:
            with socket.socket() as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return "127.0.0.1"  # loopback only: same code path, another interface


@pytest.fixture(scope="module")
def host():
    return _non_loopback_ipv4()


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "seed.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def tcp_source(sock_dir, key, host):
    """An in-process daemon answering seed over TCP on `host`: (server, "tcp://host:port")."""
    server = DaemonServer(synthetic_export(), key, socket_dir=sock_dir, device_id="cpu-src").start()
    server.seed_source = SeedSource(server, host=host)
    h, port = server.listen_seed_tcp(host, 0, SECRET)
    yield server, f"tcp://{h}:{port}"
    for t in server.seed_source.threads:
        t.join(30)
    server.stop()


def _exchange(source, build_request):
    """A raw TCP exchange: read the challenge, send build_request(challenge) (raw
    bytes or a frame), return the reply frame, or None when the daemon closed."""
    host, port = seed_mod.parse_host_port(source)
    with socket.create_connection((host, port), timeout=10) as s:
        challenge, _ = recv_frame(s)
        assert "challenge" == challenge["op"] and PROTOCOL_VERSION == challenge["protocol"]
        out = build_request(challenge)
        if isinstance(out, bytes):
            s.sendall(out)
        else:
            send_frame(s, out)
        try:
            reply, _ = recv_frame(s)
        except (ConnectionError, server_mod.ConnectionClosed):
            return None
        return reply


def _signed(challenge, frame, secret=SECRET):
    frame = {**frame, "nonce": "ab" * 32}
    frame["mac"] = seed_mac(secret, SEED_REQUEST_LABEL, challenge["nonce"], frame)
    return frame


def test_tcp_seeding_between_two_daemons(sock_dir, key, host, secret_file, tmp_path, monkeypatch):
    """A daemon seeded over TCP from a daemon subprocess listening on a non-loopback address serves identical bytes; store, gloo and the control connection all use that address; the source keeps serving."""
    src = start_daemon(
        sock_dir,
        "cpu-src",
        extra_args=(
            "--seed-source",
            "--seed-listen",
            f"{host}:0",
            "--seed-secret-file",
            secret_file,
        ),
    )
    try:
        listen = src.ready_line.split("seed_listen=")[1]
        assert listen.startswith(f"{host}:") and int(listen.rsplit(":", 1)[1]) > 0
        groups = []
        real_group = seed_mod._group

        def recording_group(backend, h, port, rank, device, token, **kw):
            groups.append((h, kw.get("gloo_host")))
            return real_group(backend, h, port, rank, device, token, **kw)

        monkeypatch.setattr(seed_mod, "_group", recording_group)
        with attach(key, socket_dir=sock_dir, device_id="cpu-src"):  # an engine holds the source
            arena = seed_arena(f"tcp://{listen}", key, secret=read_secret(secret_file))
            receiver = DaemonServer(arena, key, socket_dir=sock_dir, device_id="cpu-dst").start()
            try:
                _assert_serves_export(key, sock_dir, "cpu-dst")
            finally:
                receiver.stop()
            st = daemon_status(os.path.join(sock_dir, "wcache-cpu-src.sock"))
            assert (1, 1, listen) == (
                st["attachments_active"],
                st["seeds_served"],
                st["seed_listen"],
            )
        # the receiver reached the source's store at `host` and bound gloo to the address it left from
        assert [(host, host)] == groups
        _assert_serves_export(key, sock_dir, "cpu-src")  # still serving after it seeded
        with pytest.raises(KeyMismatch, match="receiver=.*source=") as ei:
            seed_arena(f"tcp://{listen}", CacheKey({**BASE_KEY, "dtype": "float16"}), secret=SECRET)
        assert ["dtype"] == ei.value.fields
    finally:
        stop_daemon(src)


def test_wrong_or_missing_secret_is_refused_and_nothing_is_sent(tcp_source, caplog):
    """A request signed with another secret, or unsigned, gets peer-refused with no manifest or token; no sending thread starts; each refusal is logged."""
    server, source = tcp_source
    caplog.set_level(logging.WARNING, logger="wcache.store")
    with pytest.raises(SeedFailed, match=r"refused to seed \[peer-refused\].*seeding secret"):
        seed_arena(source, CacheKey(BASE_KEY), secret=b"another secret, 16+ bytes long")
    request = {"op": "seed", "key": CacheKey(BASE_KEY).fields, "backend": None, "nonce": "ab" * 32}
    unsigned = _exchange(source, lambda ch: request)
    forged = _exchange(source, lambda ch: {**request, "mac": "00" * 32})
    for reply in (unsigned, forged):
        assert (False, "peer-refused") == (reply["ok"], reply["code"])
        assert not {"manifest", "token", "port", "digest", "mac"} & set(reply)
    assert [] == server.seed_source.threads and 0 == server.seed_source.seeds_done
    refusals = [
        r.getMessage() for r in caplog.records if "refused a seed request" in r.getMessage()
    ]
    assert 3 == len(refusals) and {"bad", "missing"} == {
        m.split(": ")[-1].split()[0] for m in refusals
    }
    with pytest.raises(SeedFailed, match="needs the source's shared secret"):
        seed_arena(source, CacheKey(BASE_KEY))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_secret_file_readable_by_others_is_refused(tmp_path, mode):
    """A secret file with any group/other bit set is refused naming `chmod 600`."""
    path = tmp_path / "s"
    path.write_bytes(SECRET)
    path.chmod(mode)
    with pytest.raises(SeedSecretUnsafe, match=f"mode {mode:o}.*chmod 600 {path}"):
        read_secret(str(path))


def test_secret_file_bad_kinds_are_refused(tmp_path):
    """A missing file, a directory and a too-short secret are refused with a fix; a symlink to a 0600 file is read (Kubernetes mounts)."""
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    short.chmod(0o600)
    cases = {
        str(tmp_path / "nope"): "No such file",
        str(tmp_path): "not a regular file",
        str(short): "holds 3 bytes",
    }
    for path, reason in cases.items():
        with pytest.raises(SeedSecretUnsafe, match=f"{reason}.*(urandom|16)"):
            read_secret(path)
    good = tmp_path / "good"
    good.write_bytes(SECRET + b"\n")
    good.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(good)
    assert SECRET == read_secret(str(link))


def test_serve_refuses_unsafe_or_missing_seeding_arguments(tmp_path, capsys):
    """`wcache serve` refuses a world-readable secret file (exit 1, chmod 600), and --seed-listen without a secret or on 0.0.0.0 without --seed-advertise (exit 2), before any load."""
    from wcache import cli

    loose = tmp_path / "loose"
    loose.write_bytes(SECRET)
    loose.chmod(0o644)
    base = ["serve", "--model", str(tmp_path)]
    assert 1 == cli.main(
        [*base, "--seed-listen", "127.0.0.1:29600", "--seed-secret-file", str(loose)]
    )
    assert "[seed-secret-unsafe]" in capsys.readouterr().err
    loose.chmod(0o600)
    for extra, says in (
        (["--seed-listen", "127.0.0.1:29600"], "need --seed-secret-file"),
        (["--seed-from", "tcp://10.0.0.5:29600"], "need --seed-secret-file"),
        (["--seed-listen", "0.0.0.0:29600", "--seed-secret-file", str(loose)], "--seed-advertise"),
        (["--seed-listen", "nohost", "--seed-secret-file", str(loose)], "HOST:PORT"),
    ):
        assert 2 == cli.main([*base, *extra])
        assert says in capsys.readouterr().err


def test_serve_refuses_a_seed_listen_address_in_use_before_loading(tmp_path, capsys, monkeypatch):
    """A --seed-listen port that is taken is refused with seed-listen-failed before the
    engine config is even read (break16 #3: it came after the whole load and export)."""
    from wcache import cli
    from wcache.vllm import build

    def loaded(*_a, **_k):
        raise AssertionError("the checkpoint was read before the address was bound")

    monkeypatch.setattr(build, "checked_engine_config", loaded)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert 1 == cli.main(
            [
                "serve",
                "--model",
                str(tmp_path),
                "--seed-listen",
                f"127.0.0.1:{port}",
                "--seed-secret-file",
                str(secret),
            ]
        )
    err = capsys.readouterr().err
    assert "[seed-listen-failed]" in err and f"127.0.0.1:{port}" in err, err


@pytest.mark.parametrize("op", ["shutdown", "get", "status", "invalidate", "release", "hello"])
def test_non_seed_ops_over_tcp_are_refused(tcp_source, key, sock_dir, op):
    """Every command but seed, even correctly signed, is refused over TCP; the daemon keeps serving and is not invalidated."""
    server, source = tcp_source
    reply = _exchange(
        source,
        lambda ch: _signed(
            ch, {"op": op, "key": key.fields, "code": "x", "protocol": PROTOCOL_VERSION}
        ),
    )
    assert (False, "peer-refused") == (reply["ok"], reply["code"]) and "only seed" in reply[
        "message"
    ]
    assert server.invalidated is None and not server._shutdown_requested.is_set()
    _assert_serves_export(key, sock_dir, "cpu-src")


def test_malformed_frames_over_tcp_leave_the_source_serving(tcp_source, key, monkeypatch):
    """An oversized length, bytes that are not msgpack, a list frame, a half frame and a silent peer are each dropped (the silent one within the timeout); then a real TCP seeding succeeds."""
    server, source = tcp_source
    bad = {
        "oversized": struct.pack(">I", MAX_FRAME_BYTES + 1),
        "not msgpack": struct.pack(">I", 3) + b"\xc1\xc1\xc1",
        "a list": struct.pack(">I", 2) + msgpack.packb([1]),
        "signed bad nonce": None,
    }
    for name, data in bad.items():
        if data is None:
            reply = _exchange(
                source, lambda ch: {**_signed(ch, {"op": "seed", "key": key.fields}), "nonce": "zz"}
            )
            assert (False, "peer-refused") == (reply["ok"], reply["code"]), (
                name
            )  # mac covers the nonce
            continue
        reply = _exchange(source, lambda ch, data=data: data)
        assert reply is not None and (False, "protocol-error") == (reply["ok"], reply["code"]), name
    monkeypatch.setattr(server_mod, "SEED_TCP_TIMEOUT_S", 0.5)
    host, port = seed_mod.parse_host_port(source)
    reply = _exchange(
        source, lambda ch: struct.pack(">I", 100) + b"\x81"
    )  # a half frame, then silence
    assert "protocol-error" == reply["code"] and "not completed within 0.5 s" in reply["message"]
    with socket.create_connection((host, port), timeout=10) as s:  # silence after the challenge
        recv_frame(s)
        s.settimeout(5)
        assert b"" == s.recv(1 << 16)  # closed by the daemon, not by our timeout
    assert [] == server.seed_source.threads
    receiver = DaemonServer(
        seed_arena(source, key, secret=SECRET),
        key,
        socket_dir=server.socket_dir,
        device_id="cpu-dst",
    ).start()
    try:
        _assert_serves_export(key, server.socket_dir, "cpu-dst")
    finally:
        receiver.stop()


def test_nothing_listening_is_daemon_missing(host):
    """--seed-from tcp:// an address nobody listens on is daemon-missing naming --seed-listen."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    with pytest.raises(DaemonMissing, match="--seed-listen"):
        seed_arena(f"tcp://{host}:{port}", CacheKey(BASE_KEY), secret=SECRET)


def test_an_unsigned_answer_is_not_received(host, key):
    """A listener that does not know the secret (its answer is not signed with it) is refused before anything is received."""
    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen(1)

    def impostor():
        conn, _ = listener.accept()
        with conn:
            send_frame(conn, {"op": "challenge", "nonce": "11" * 32, "protocol": PROTOCOL_VERSION})
            req, _ = recv_frame(conn)
            reply = {
                "ok": True,
                "manifest": {},
                "backend": "gloo",
                "host": host,
                "port": 1,
                "token": "t",
                "digest": ["blake3", "00"],
            }
            reply["mac"] = seed_mac(
                b"not the shared secret!", SEED_REPLY_LABEL, req["nonce"], reply
            )
            send_frame(conn, reply)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(SeedFailed, match="not signed with our secret"):
            seed_arena(f"tcp://{host}:{listener.getsockname()[1]}", key, secret=SECRET)
    finally:
        t.join(10)
        listener.close()


def test_rank_ports_follow_the_local_rank():
    """Rank i of a node listens on, and asks, PORT + i; port 0 stays 0; a port past 65535 is refused."""
    from wcache.daemon.serve import rank_seed_address

    assert ("10.0.0.5", 29602) == rank_seed_address("tcp://10.0.0.5:29600", 2)
    assert ("fd00::5", 29601) == rank_seed_address("[fd00::5]:29600", 1)
    assert ("10.0.0.5", 0) == rank_seed_address("10.0.0.5:0", 3)
    with pytest.raises(ValueError, match="65535"):
        rank_seed_address("10.0.0.5:65535", 1)


def test_bytes_that_differ_from_the_signed_digest_are_not_served(tcp_source, key, monkeypatch):
    """When what arrives over gloo (data and unsigned digest agreeing) differs from the digest in the source's signed answer, as after tampering on the way, nothing is served."""
    server, source = tcp_source
    real_handle = SeedSource.handle

    def handle(self, req, state):
        reply = real_handle(self, req, state)
        return {**reply, "digest": ["blake3", "00" * 32]}  # signed by the listener after this

    monkeypatch.setattr(SeedSource, "handle", handle)
    arena = seed_arena(source, key, secret=SECRET)
    with pytest.raises(SeedFailed, match="signed answer .*changed on the way"):
        DaemonServer(arena, key, socket_dir=server.socket_dir, device_id="cpu-dst")
    DaemonServer(synthetic_export(), key, socket_dir=server.socket_dir, device_id="cpu-dst").stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_seeding_over_tcp(sock_dir, host, secret_file):
    """A CUDA daemon seeded over TCP from a daemon process on cuda:0 holds the same bytes, checked against the signed device digest: over NCCL onto cuda:1 with two GPUs, over gloo onto cuda:0 with one."""
    from wcache.store.arena import tensor_views
    from wcache.store.prebuilt import served_arena

    two = torch.cuda.device_count() >= 2
    device, backend = ("cuda:1", None) if two else ("cuda:0", "gloo")
    key = CacheKey(BASE_KEY)
    src = start_daemon(
        sock_dir,
        "gpu0",
        extra_args=(
            "--device",
            "cuda:0",
            "--seed-source",
            "--seed-listen",
            f"{host}:0",
            "--seed-secret-file",
            secret_file,
        ),
    )
    try:
        listen = src.ready_line.split("seed_listen=")[1]
        dst = DaemonServer(
            seed_arena(f"tcp://{listen}", key, secret=SECRET, backend=backend),
            key,
            socket_dir=sock_dir,
            device=device,
            device_id="gpu-dst",
        )
        try:
            view = served_arena(dst)
            try:
                assert torch.device(device) == view.tensor.device
                views = tensor_views(view.tensor, dst.manifest)
                for name, t in synthetic_export().tensors.items():
                    assert torch.equal(t, views[name].cpu()), name
            finally:
                view.close()
        finally:
            dst.stop()
    finally:
        stop_daemon(src)


def test_unauthenticated_tcp_peers_cannot_take_local_slots(tcp_source, key, sock_dir, monkeypatch):
    """TCP seeding connections have their own MAX_SEED_CONNECTIONS, apart from the
    local ones: with every TCP slot held by silent peers (no request, no MAC), the
    next TCP peer is refused daemon-busy and local engines still attach up to the
    local limit (break10 #1: 64 silent TCP peers locked every engine out)."""
    server, source = tcp_source
    monkeypatch.setattr(server_mod, "MAX_CONNECTIONS", 2)  # local slots, read per accept
    host, port = seed_mod.parse_host_port(source)
    held = []
    try:
        for _ in range(server_mod.MAX_SEED_CONNECTIONS):
            s = socket.create_connection((host, port), timeout=10)
            held.append(s)
            assert "challenge" == recv_frame(s)[0]["op"]  # admitted: its handler runs
        with socket.create_connection((host, port), timeout=10) as s:
            reply, _ = recv_frame(s)
        assert (False, "daemon-busy") == (reply["ok"], reply["code"])
        assert f"{server_mod.MAX_SEED_CONNECTIONS} seeding connections" in reply["message"]
        with (
            attach(key, socket_dir=sock_dir, device_id="cpu-src") as a1,
            attach(key, socket_dir=sock_dir, device_id="cpu-src") as a2,
        ):
            want = synthetic_export().tensors["w0"]
            assert torch.equal(want, a1.tensors["w0"]) and torch.equal(want, a2.tensors["w0"])
    finally:
        for s in held:
            s.close()
