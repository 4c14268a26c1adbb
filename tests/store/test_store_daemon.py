"""Daemon and client in one process: zero-copy attach, read-only mapping, keys,
copy mode, locking, stale sockets, peer uid, protocol errors, CLI helpers."""

import os
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from wcache.store import (
    CacheKey,
    DaemonBusy,
    DaemonMissing,
    DaemonServer,
    KeyMismatch,
    PeerRefused,
    Released,
    StoreError,
    UnsafePath,
    attach,
    cli_status,
    cli_stop,
    daemon_status,
    paths,
    socket_path,
)
from wcache.store.client import Connection
from wcache.store.protocol import PROTOCOL_VERSION, recv_frame, send_frame
from wcache.testing.store import BASE_KEY, mapping_of, synthetic_export

# A second daemon must be refused well before a client's connect timeout.
FAIL_FAST_S = 2.0


def test_attach_is_zero_copy_read_only_and_bit_exact(daemon, key, sock_dir):
    """Every tensor equals the export bit for bit and lies inside one read-only memfd mapping
    (private, so that it can later turn copy-on-write for weight updates)."""
    export = synthetic_export()
    with attach(key, socket_dir=sock_dir) as att:
        lo, hi = att.arena_range
        perms, path = mapping_of(lo)
        assert "r--p" == perms and path.startswith("/memfd:wcache-arena")
        for name, t in export.tensors.items():
            v = att.tensors[name]
            assert torch.equal(t, v) and t.stride() == v.stride() and t.dtype == v.dtype, name
            if v.numel():
                assert lo <= v.data_ptr() < hi, name
            assert lo == v.untyped_storage().data_ptr(), name
        assert att.tensors["lm_head.weight"] is att.tensors["w0"]
        assert {"q_slice": False, "scale": True, "rope.cache": True} == att.persistent
        assert "buffer" == att.kinds["rope.cache"] and "param" == att.kinds["lm_head.weight"]
        assert {"seed": 0} == att.extra and 1 == att.layers["layer0"]["plan_version"]
        assert att.nbytes == daemon.nbytes


def test_two_clients_see_the_same_bytes(daemon, key, sock_dir):
    """Two attachments map the same memfd pages: equal bytes, same device inode."""
    with attach(key, socket_dir=sock_dir) as a, attach(key, socket_dir=sock_dir) as b:
        assert a.tensors["w0"].data_ptr() != b.tensors["w0"].data_ptr()  # two mappings ...
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), name
        ino_a = os.stat(f"/proc/self/map_files/{a.arena_range[0]:x}-{a.arena_range[1]:x}").st_ino
        ino_b = os.stat(f"/proc/self/map_files/{b.arena_range[0]:x}-{b.arena_range[1]:x}").st_ino
        assert ino_a == ino_b  # ... of one memfd
        assert 2 == daemon_status(daemon.socket_path)["attachments_active"]


def test_key_mismatch_names_the_differing_fields(daemon, sock_dir):
    """A key with other checkpoint and tp values fails with KeyMismatch naming exactly those fields."""
    other = CacheKey({**BASE_KEY, "checkpoint": "deadbeef", "tp": [2, 0]})
    with pytest.raises(KeyMismatch) as ei:
        attach(other, socket_dir=sock_dir)
    assert ["checkpoint", "tp"] == ei.value.fields
    assert {"checkpoint": "c0ffee", "tp": [1, 0]} == ei.value.theirs
    assert "key-mismatch" == ei.value.code


def test_copy_mode_is_private_and_leaves_others_valid(daemon, key, sock_dir):
    """copy mode gives private writable tensors, drops its mapping, and another client's mapping stays valid."""
    export = synthetic_export()
    with attach(key, socket_dir=sock_dir) as shared:
        before = {n: t.clone() for n, t in shared.tensors.items()}
        with attach(key, socket_dir=sock_dir, mode="copy") as private:
            perms, _ = mapping_of(private.tensors["w0"].data_ptr())
            assert "s" != perms[3]  # private memory, not the shared mapping
            private.tensors["w0"].add_(1)  # writable, and only ours
            assert 0 == private.release_ranges_(["w0"])
        assert 1 == daemon_status(daemon.socket_path)["attachments_active"]
        for n, t in shared.tensors.items():
            assert torch.equal(before[n], t), n
        assert torch.equal(export.tensors["w0"], shared.tensors["w0"])


def test_close_is_idempotent_and_released_after(daemon, key, sock_dir):
    """After close, tensors raise Released; closing twice is fine; the daemon counts the release."""
    att = attach(key, socket_dir=sock_dir)
    att.close()
    att.close()
    with pytest.raises(Released):
        att.tensors
    deadline = time.monotonic() + 5
    while daemon_status(daemon.socket_path)["attachments_active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 == daemon_status(daemon.socket_path)["attachments_active"]


def test_release_ranges_drops_resident_pages(daemon, key, sock_dir):
    """release_ranges_ lowers the mapping's resident size, and the bytes read back unchanged."""
    export = synthetic_export()

    def rss_of_mapping(lo):
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if "-" in line.split()[0] and ":" not in line.split()[0]:
                    inside = int(line.split("-")[0], 16) == lo
                elif inside and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
        raise LookupError

    with attach(key, socket_dir=sock_dir) as att:
        lo, _ = att.arena_range
        names = [n for n in att.tensors if n.startswith("layer")]
        total = sum(
            float(att.tensors[n].float().sum()) for n in att.tensors if att.tensors[n].numel()
        )
        resident = rss_of_mapping(lo)
        released = att.release_ranges_(names)
        assert released > 0 and rss_of_mapping(lo) <= resident - released
        for n in names:
            assert torch.equal(export.tensors[n], att.tensors[n])
        assert total == sum(
            float(att.tensors[n].float().sum()) for n in att.tensors if att.tensors[n].numel()
        )


def test_second_daemon_fails_fast_and_first_stays_reachable(daemon, key, sock_dir):
    """Another daemon for the same device raises DaemonBusy at once; the first keeps serving."""
    t0 = time.monotonic()
    with pytest.raises(DaemonBusy):
        DaemonServer(synthetic_export(seed=1), key, socket_dir=sock_dir)
    assert time.monotonic() - t0 < FAIL_FAST_S
    with attach(key, socket_dir=sock_dir) as att:
        assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])


def test_other_device_id_gets_its_own_daemon(daemon, key, sock_dir):
    """A daemon for another device id coexists, on its own socket."""
    with DaemonServer(
        synthetic_export(seed=1), key, socket_dir=sock_dir, device_id="cpu-rank1-x"
    ) as other:
        assert socket_path(sock_dir, "cpu-rank1-x") == other.socket_path
        with attach(key, socket_dir=sock_dir, device_id="cpu-rank1-x") as att:
            assert torch.equal(synthetic_export(seed=1).tensors["w0"], att.tensors["w0"])


def _fake_stale_socket(sock_dir, owner_pid, start_time=None):
    """A bound-then-abandoned socket file with a pid file naming owner_pid."""
    path = socket_path(sock_dir, "cpu")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # nothing listens any more: the file remains
    paths.write_pid_file(paths.pid_path(path), owner_pid)
    if start_time is not None:
        with open(paths.pid_path(path), "w") as f:
            f.write(f'{{"pid": {owner_pid}, "start_time": {start_time}}}')
    return path


def test_stale_socket_replaced_only_when_owner_dead(sock_dir, key):
    """A socket whose pid-file owner lives is kept (DaemonBusy); once the owner dies it is replaced."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = _fake_stale_socket(sock_dir, owner.pid)
        with pytest.raises(DaemonBusy, match=str(owner.pid)):
            DaemonServer(synthetic_export(), key, socket_dir=sock_dir)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        owner.kill()
        owner.wait()
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir):
        with attach(key, socket_dir=sock_dir) as att:
            assert torch.equal(synthetic_export().tensors["q"], att.tensors["q"])


def test_stale_socket_with_reused_pid_is_replaced(sock_dir, key):
    """A live pid with another start time (pid reuse) does not own the socket: it is replaced."""
    _fake_stale_socket(sock_dir, os.getpid(), start_time=1)
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir) as server:
        assert os.getpid() == paths.read_pid_file(paths.pid_path(server.socket_path))["pid"]


def test_socket_without_pid_file_that_accepts_is_not_stolen(sock_dir, key):
    """A listening socket with no pid file is treated as alive (DaemonBusy), never judged by existence."""
    path = socket_path(sock_dir, "cpu")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with pytest.raises(DaemonBusy, match="accepts"):
            DaemonServer(synthetic_export(), key, socket_dir=sock_dir)
    finally:
        listener.close()
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir):  # now dead: replaced
        pass


def test_foreign_uid_is_refused(sock_dir, key):
    """A connection from a uid other than the allowed one gets PeerRefused; a daemon allowing our uid serves us."""
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir, allowed_uid=os.getuid() + 4242):
        with pytest.raises(PeerRefused, match="may not use"):
            attach(key, socket_dir=sock_dir)
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir) as server:
        assert server.allowed_uid == os.getuid()
        with attach(key, socket_dir=sock_dir) as att:
            assert att.nbytes == server.nbytes


def test_missing_daemon_and_stale_socket_raise_daemon_missing(sock_dir, key):
    """No socket, or a socket nobody listens on, raises DaemonMissing (code daemon-missing)."""
    with pytest.raises(DaemonMissing) as ei:
        attach(key, socket_dir=sock_dir)
    assert "daemon-missing" == ei.value.code
    _fake_stale_socket(sock_dir, 999999999)
    with pytest.raises(DaemonMissing, match="stale"):
        attach(key, socket_dir=sock_dir, connect_timeout_s=1.0)
    with pytest.raises(DaemonMissing):
        attach(key, socket_dir=os.path.join(sock_dir, "nope"))


def test_unsafe_socket_dirs_are_refused(sock_dir, key, tmp_path):
    """Symlinked, foreign-owned and group/world-accessible socket dirs are refused on both ends."""
    link = os.path.join(sock_dir, "link")
    real = os.path.join(sock_dir, "real")
    os.mkdir(real, 0o700)
    os.symlink(real, link)
    for kind, d in (("symlink", link),):
        with pytest.raises(UnsafePath, match=kind):
            DaemonServer(synthetic_export(), key, socket_dir=d)
        with pytest.raises(UnsafePath, match=kind):
            attach(key, socket_dir=d)
    loose = os.path.join(sock_dir, "loose")
    os.mkdir(loose)
    os.chmod(loose, 0o755)
    with pytest.raises(UnsafePath, match="0700"):
        DaemonServer(synthetic_export(), key, socket_dir=loose)
    if os.getuid() == 0:  # only root can hand a dir to another uid
        foreign = os.path.join(sock_dir, "foreign")
        os.mkdir(foreign, 0o700)
        os.chown(foreign, 4242, -1)
        with pytest.raises(UnsafePath, match="owned by uid 4242"):
            attach(key, socket_dir=foreign)


def test_symlinked_socket_is_refused(daemon, key, sock_dir):
    """A client refuses a socket path that is a symlink (even to a real daemon socket)."""
    link = socket_path(sock_dir, "cpu-link")
    os.symlink(daemon.socket_path, link)
    with pytest.raises(UnsafePath, match="symlink"):
        attach(key, socket_dir=sock_dir, device_id="cpu-link")


def test_socket_and_dir_permissions(daemon, sock_dir):
    """The socket is 0600 in a 0700 dir, with a pid file naming this process and its start time."""
    assert 0o600 == stat.S_IMODE(os.lstat(daemon.socket_path).st_mode)
    assert 0o700 == stat.S_IMODE(os.lstat(sock_dir).st_mode)
    rec = paths.read_pid_file(paths.pid_path(daemon.socket_path))
    assert {"pid": os.getpid(), "start_time": paths.process_start_time(os.getpid())} == rec


def _raw(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(daemon.socket_path)
    return s


def test_protocol_version_mismatch_is_a_clear_error(daemon):
    """hello with another protocol version is answered protocol-error naming both versions."""
    with _raw(daemon) as s:
        send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION + 1, "wcache": "9.9"})
        reply, _ = recv_frame(s)
    assert (False, "protocol-error") == (reply["ok"], reply["code"])
    assert f"protocol {PROTOCOL_VERSION + 1}" in reply["message"] and "9.9" in reply["message"]


def test_commands_before_hello_and_unknown_ops_are_errors(daemon):
    """get before hello and an unknown op are answered with errors on the same, still usable connection."""
    with _raw(daemon) as s:
        send_frame(s, {"op": "get", "key": {}})
        assert "protocol-error" == recv_frame(s)[0]["code"]
        send_frame(s, {"op": "hello", "protocol": PROTOCOL_VERSION, "wcache": "x"})
        assert recv_frame(s)[0]["ok"] is True
        send_frame(s, {"op": "rm -rf"})
        assert "unknown command" in recv_frame(s)[0]["message"]
        send_frame(s, {"op": "get", "key": "notamap"})
        assert "protocol-error" == recv_frame(s)[0]["code"]
        send_frame(s, {"op": "status"})
        assert daemon.nbytes == recv_frame(s)[0]["bytes_held"]


def test_handler_exception_answers_error_and_daemon_keeps_serving(
    daemon, key, sock_dir, monkeypatch
):
    """A bug in a handler becomes an internal-error frame; the daemon still serves attach afterwards."""
    monkeypatch.setattr(daemon, "status", lambda: 1 / 0)
    conn = Connection(daemon.socket_path)
    with pytest.raises(StoreError, match="ZeroDivisionError") as ei:
        conn.request({"op": "status"})
    assert "internal-error" == ei.value.code
    conn.close()
    with attach(key, socket_dir=sock_dir) as att:
        assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])


def test_status_reports_memory_clients_uptime_and_key(daemon, key, sock_dir):
    """status gives bytes held, clients, attachments, key digest/fields and pid."""
    with attach(key, socket_dir=sock_dir):
        st = daemon_status(daemon.socket_path)
    assert (daemon.nbytes, os.getpid(), key.digest, key.fields) == (
        st["bytes_held"],
        st["pid"],
        st["key_digest"],
        st["key_fields"],
    )
    assert 1 == st["clients_connected"]  # the attachment (the asking connection is left out)
    assert 1 == st["attachments_active"] and st["uptime_s"] >= 0


def test_cli_status_and_stop(sock_dir, key, capsys):
    """cli_status prints the daemon and returns 0; cli_stop stops it (socket gone) and returns 0; then 3."""
    server = DaemonServer(synthetic_export(), key, socket_dir=sock_dir).start()
    assert 0 == cli_status(sock_dir)
    out = capsys.readouterr().out
    assert server.socket_path in out and key.digest[:16] in out
    assert 0 == cli_stop(sock_dir, "cpu")
    assert not os.path.exists(server.socket_path)
    assert 3 == cli_status(sock_dir)
    assert 3 == cli_stop(sock_dir, None)


def test_bad_mode_and_device_are_refused(daemon, key, sock_dir):
    """An unknown mode or device string is a StoreError before any connection."""
    with pytest.raises(StoreError, match="mode"):
        attach(key, socket_dir=sock_dir, mode="mmap")
    with pytest.raises(StoreError, match="device"):
        attach(key, socket_dir=sock_dir, device="tpu")


@pytest.mark.parametrize("engine_vllm,daemon_vllm", [("0.32.0", "0.33.0"), ("0.33.0", "0.32.0")])
def test_key_of_another_vllm_release_is_refused_naming_both(sock_dir, engine_vllm, daemon_vllm):
    """An engine and a daemon of different vLLM releases (keys equal but for
    versions.vllm) refuse each other, in both directions, naming both versions."""
    versions = {"wcache": "0.1.0", "torch": "2.13.0+cpu"}
    daemon_key = CacheKey({**BASE_KEY, "versions": {**versions, "vllm": daemon_vllm}})
    engine_key = CacheKey({**BASE_KEY, "versions": {**versions, "vllm": engine_vllm}})
    with DaemonServer(synthetic_export(), daemon_key, socket_dir=sock_dir):
        with pytest.raises(KeyMismatch) as ei:
            attach(engine_key, socket_dir=sock_dir)
    assert ["versions"] == ei.value.fields
    message = str(ei.value)
    assert f"vLLM {engine_vllm} (engine) vs {daemon_vllm} (daemon)" in message
    assert f'versions.vllm: engine="{engine_vllm}" daemon="{daemon_vllm}"' in message


def test_a_failed_bind_leaves_no_socket_file(sock_dir, key, monkeypatch):
    """A bind whose pid file cannot be written (a file system that filled up after the
    start's check) fails with store-error and removes the socket it bound: no socket
    file nobody listens on is left (break13 #1)."""

    def full(path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paths, "write_pid_file", full)
    with pytest.raises(StoreError, match="No space left on device"):
        DaemonServer(synthetic_export(), key, socket_dir=sock_dir).start()
    assert [n for n in os.listdir(sock_dir) if n.endswith(".sock")] == []
