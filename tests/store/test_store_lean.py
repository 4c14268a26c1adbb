"""The lean serving process (wcache.store.lean, issue 28): after the hand-off the
daemon's pid serves without torch, answers as before, cleans up on SIGTERM; a
hand-off that cannot happen leaves the full process serving."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from wcache.store import CacheKey, DaemonServer, attach, cli_status, daemon_status, lean, paths, socket_path
from wcache.store.client import Connection
from wcache.store.errors import KeyMismatch
from wcache.store.seed import seed_arena
from wcache.store.manifest import DTYPE_ITEMSIZES
from wcache.testing.store import (
    BASE_KEY, assert_serves_export, rss_bytes, start_daemon, stop_daemon, synthetic_export,
)

#: The synthetic lean daemon holds a 0.1 MiB arena; Python with msgpack, attrs,
#: blake3 and prometheus_client is ~30 MiB. A torch import alone is ~220 MiB.
LEAN_RSS_BOUND_BYTES = 80 << 20
#: The hand-off takes an interpreter start and the store imports (~0.3 s).
LEAN_WAIT_S = 30.0


def _wait_serving(sock_dir: str, mode: str) -> dict:
    deadline = time.monotonic() + LEAN_WAIT_S
    while True:
        try:
            st = daemon_status(socket_path(sock_dir, "cpu"))
            if st.get("serving") == mode:
                return st
        except Exception:  # noqa: BLE001  (between exec and accept: the backlog may refuse)
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon did not report serving={mode!r}")
        time.sleep(0.05)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_dtype_itemsizes_match_torch():
    """The manifest's torch-free itemsize table equals torch's for every non-complex dtype."""
    theirs = {name: obj.itemsize for name in dir(torch)
              if isinstance(obj := getattr(torch, name), torch.dtype)
              and not obj.is_complex and str(obj) == f"torch.{name}"}
    assert theirs == dict(DTYPE_ITEMSIZES)


def test_serving_modules_import_without_torch():
    """The store modules the lean server imports load no torch (nor vLLM)."""
    code = ("import sys, wcache.store.server, wcache.store.http, wcache.store.client, "
            "wcache.store.lean, wcache.store.transport_shm, wcache.store.manifest\n"
            "print(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "[]" == out.stdout.strip(), out.stderr


def test_lean_daemon_serves_the_same_bytes_without_torch(sock_dir, capsys):
    """After the hand-off: same pid, no libtorch mapped, status says lean, attach reads the export bit for bit, a key mismatch in seed is refused naming the field."""
    proc = start_daemon(sock_dir, extra_args=("--lean",))
    try:
        pid = int(proc.ready_line.split("pid=")[1].split()[0])
        st = _wait_serving(sock_dir, "lean")
        assert (pid, False) == (st["pid"], st["torch_loaded"])
        assert proc.stdout.readline().startswith(f"{lean.LEAN_LINE} pid={pid} ")
        assert "libtorch" not in _maps(pid)
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"MALLOC_ARENA_MAX=1" in f.read().split(b"\0")
        key = CacheKey(BASE_KEY)
        assert_serves_export(key, sock_dir, "cpu")
        assert rss_bytes(pid) < LEAN_RSS_BOUND_BYTES
        conn = Connection(socket_path(sock_dir, "cpu"))
        try:
            with pytest.raises(KeyMismatch) as err:
                conn.request({"op": "seed", "key": {**BASE_KEY, "dtype": "float16"}})
            assert ["dtype"] == err.value.fields
        finally:
            conn.close()
        st = daemon_status(socket_path(sock_dir, "cpu"))
        assert (1, 0) == (st["attachments_total"], st["attachments_active"])
        assert 0 == cli_status(sock_dir)
        assert "  serving lean (torch-free)\n" in capsys.readouterr().out
    finally:
        stop_daemon(proc)


def test_lean_environ_holds_malloc_to_one_arena_unless_set():
    """The lean server's environment adds MALLOC_ARENA_MAX=1 and keeps an operator's own value and the rest."""
    assert {"MALLOC_ARENA_MAX": "1", "A": "b"} == lean.lean_environ({"A": "b"})
    assert {"MALLOC_ARENA_MAX": "4"} == lean.lean_environ({"MALLOC_ARENA_MAX": "4"})


def test_a_peer_seeds_from_the_lean_daemon(sock_dir):
    """seed against a lean daemon: its helper attaches and sends the arena, the peer serves the export bit for bit, the lean process stays torch-free and counts the seed; the helper's attachment is released."""
    proc = start_daemon(sock_dir, extra_args=("--lean",))
    try:
        pid = int(proc.ready_line.split("pid=")[1].split()[0])
        _wait_serving(sock_dir, "lean")
        key = CacheKey(BASE_KEY)
        arena = seed_arena(socket_path(sock_dir, "cpu"), key, connect_timeout_s=LEAN_WAIT_S)
        receiver = DaemonServer(arena, key, socket_dir=sock_dir, device_id="cpu-peer").start()
        try:
            assert_serves_export(key, sock_dir, "cpu-peer")
        finally:
            receiver.stop()
        deadline = time.monotonic() + LEAN_WAIT_S
        while (st := daemon_status(socket_path(sock_dir, "cpu")))["seeds_served"] != 1 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ("lean", False, pid, 1, 0, {"release": 1}) == (
            st["serving"], st["torch_loaded"], st["pid"], st["seeds_served"], st["attachments_active"],
            st["releases"])
        assert "libtorch" not in _maps(pid)
    finally:
        stop_daemon(proc)


def test_lean_daemon_sigterm_removes_socket_pid_file_and_registry_entry(sock_dir):
    """SIGTERM to the lean process: exit 0, and its socket, pid file and registry entry are gone."""
    proc = start_daemon(sock_dir, extra_args=("--lean",))
    sock = socket_path(sock_dir, "cpu")
    _wait_serving(sock_dir, "lean")
    assert [proc.pid] == [r["pid"] for r in paths.registered_daemons() if r.get("socket") == sock]
    proc.send_signal(signal.SIGTERM)
    assert 0 == proc.wait(30)
    stop_daemon(proc)
    assert (False, False) == (os.path.exists(sock), os.path.exists(paths.pid_path(sock)))
    assert [] == [r for r in paths.registered_daemons() if r.get("socket") == sock]


def test_exec_failure_keeps_the_full_process_serving(sock_dir, monkeypatch):
    """An interpreter that cannot be exec'd: the daemon says why, stays full and serves the same bytes."""
    monkeypatch.setenv(lean.LEAN_EXEC_ENV, "/nonexistent/python3")
    proc = start_daemon(sock_dir, extra_args=("--lean",))
    try:
        line = proc.stdout.readline()
        assert line.startswith("wcache: serving: full (exec /nonexistent/python3 failed: "), line
        st = _wait_serving(sock_dir, "full")
        assert (proc.pid, True) == (st["pid"], st["torch_loaded"])
        assert_serves_export(CacheKey(BASE_KEY), sock_dir, "cpu")
    finally:
        stop_daemon(proc)


@pytest.fixture
def server(sock_dir):
    server = DaemonServer(synthetic_export(), CacheKey(BASE_KEY), socket_dir=sock_dir).start()
    yield server
    server.stop()


def test_handoff_with_an_attached_client_stays_full(server, sock_dir, monkeypatch):
    """A connection that holds an attachment past the drain time keeps the full process, which serves on."""
    monkeypatch.setattr(lean, "HANDOFF_DRAIN_S", 0.3)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("exec'd with a client attached"))
    with attach(CacheKey(BASE_KEY), socket_dir=sock_dir):
        reason = lean.handoff(server)
    assert "1 connection(s) still open after 0.3 s" == reason
    assert_serves_export(CacheKey(BASE_KEY), sock_dir, "cpu")


def test_execv_error_restores_descriptors_and_serving(server, sock_dir, monkeypatch):
    """execve raising: the fds are close-on-exec again, no state file is left, and the socket answers."""
    def fail(*_):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "execve", fail)
    monkeypatch.setattr(lean, "_preflight", lambda exe: None)
    reason = lean.handoff(server)
    assert reason.startswith(f"exec {sys.executable} failed: [Errno 13] Permission denied")
    fds = (server._serving.fd, server._listener.fileno(), server._lock_fd)
    assert (False, False, False) == tuple(os.get_inheritable(fd) for fd in fds)
    assert [] == [n for n in os.listdir(sock_dir) if n.startswith(lean.STATE_PREFIX)]
    assert_serves_export(CacheKey(BASE_KEY), sock_dir, "cpu")


@pytest.mark.parametrize("enabled, transport, reason", [
    (False, "shm", "--no-lean"),
    (True, "cuda_vmm", "cuda_vmm transport: its handles live in this process"),
])
def test_lean_refusal_reasons(server, monkeypatch, enabled, transport, reason):
    """--no-lean and a CUDA transport keep the full process, each with its reason."""
    monkeypatch.setattr(server, "transport", transport)
    assert reason == lean.lean_refusal(server, enabled=enabled)


def test_unpicklable_http_probe_keeps_the_full_process(server):
    """An --http probe that cannot cross execve (a lambda) keeps the full process, naming why."""
    from wcache.store.http import OpsServer

    with OpsServer("127.0.0.1", 0, lambda: None):
        reason = lean.lean_refusal(server)
    assert reason.startswith("the --http probe cannot be carried over (")
    assert lean.lean_refusal(server) is None


@pytest.mark.parametrize("event", ["sigterm", "invalidated"])
def test_a_stop_or_invalidation_during_the_handoff_calls_it_off(server, monkeypatch, event):
    """A SIGTERM (its handler: request_shutdown) or an invalidation that arrives while
    the hand-off drains or writes its state: no exec, the full process keeps what it
    must act on (the stop, exit status 75), no state file is left."""
    monkeypatch.setattr(lean, "_preflight", lambda exe: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("exec'd although stopping"))
    real_mkstemp = lean.tempfile.mkstemp

    def mkstemp_then_event(*args, **kwargs):  # the event lands while the state is written
        if event == "sigterm":
            server.request_shutdown()
        else:
            server.invalidated = {"code": "guard-failed", "pid": 1, "message": "", "at": 0.0}
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(lean.tempfile, "mkstemp", mkstemp_then_event)
    reason = lean.handoff(server)
    assert {"sigterm": "stopping", "invalidated": "arena invalidated [guard-failed]"}[event] == reason
    assert [] == [n for n in os.listdir(server.socket_dir) if n.startswith(lean.STATE_PREFIX)]
    if event == "sigterm":
        server.serve_forever()  # returns: the stop asked is honoured
        assert server.stopping.is_set()
    else:
        assert 75 == server.exit_code


@pytest.mark.parametrize("value, enabled", [("1", False), ("0", True), ("", True)])
def test_no_lean_env_is_read_as_a_flag(server, monkeypatch, value, enabled):
    """WCACHE_NO_LEAN=1 (what --no-lean sets) keeps the full process; 0 or empty does not."""
    monkeypatch.setenv(lean.NO_LEAN_ENV, value)
    seen = {}
    monkeypatch.setattr(lean, "lean_refusal",
                        lambda server, enabled: seen.setdefault("enabled", enabled) and "stop here")
    lean.handoff(server)
    assert enabled == seen["enabled"]


def test_lean_server_closes_descriptors_it_was_not_handed(tmp_path):
    """Only stdio and the descriptors the state names survive into the lean server."""
    stray = os.open(tmp_path / "stray", os.O_CREAT | os.O_RDWR)  # inheritable: no O_CLOEXEC here
    kept = os.open(tmp_path / "kept", os.O_CREAT | os.O_RDWR)
    os.set_inheritable(stray, True)
    code = (f"import os; from wcache.store import lean; "
            f"lean._close_inherited_fds({{'memfd': {kept}, 'listener': {kept}, 'lock_fd': {kept}, "
            f"'http': []}}); print(sorted(int(n) for n in os.listdir('/proc/self/fd')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         pass_fds=(stray, kept), check=True).stdout
    left = eval(out)  # noqa: S307  (our own child's list of ints)
    assert kept in left and stray not in left
    os.close(stray)
    os.close(kept)
