"""No invisible daemons: a vanished socket is re-bound, `wcache status` lists every
live daemon of the user, and the default socket dir avoids /tmp when it can."""

import math
import os
import shutil
import time

import pytest

from wcache.store import DaemonServer, attach, cli_status, daemon_status, paths
from wcache.store import server as server_mod
from wcache.testing.store import synthetic_export

# The daemon checks its socket every SOCKET_WATCH_S; allow a few periods.
REBIND_WAIT_S = 5 * getattr(server_mod, "SOCKET_WATCH_S", 1.0)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("what", ["socket", "socket dir"])
def test_deleted_socket_is_rebound_and_listed(sock_dir, key, capsys, what):
    """A tmp cleaner deletes the socket (or the whole dir): the daemon re-binds it, an
    engine attaches again, and `wcache status` lists it."""
    with DaemonServer(synthetic_export(), key, socket_dir=sock_dir) as server:
        sock = server.socket_path
        if what == "socket":
            os.unlink(sock)
        else:
            shutil.rmtree(sock_dir)
        assert _wait_for(
            lambda: os.path.exists(sock) and paths.socket_accepts(sock), REBIND_WAIT_S
        ), "the daemon did not re-bind its vanished socket"
        assert 0o700 == os.stat(sock_dir).st_mode & 0o777
        with attach(key, socket_dir=sock_dir) as att:
            assert att.tensors
        assert os.getpid() == daemon_status(sock)["pid"]
        assert 0 == cli_status(sock_dir)
        assert sock in capsys.readouterr().out


def test_status_lists_daemons_of_other_socket_dirs(tmp_path, key, capsys):
    """`wcache status` on the default dir also lists a live daemon of another socket dir."""
    other = tmp_path / "elsewhere"
    with DaemonServer(synthetic_export(), key, socket_dir=str(other)) as server:
        assert 3 == cli_status(str(tmp_path / "empty"))  # none in this dir...
        out = capsys.readouterr().out
        assert server.socket_path in out  # ...but the other daemon is listed
        assert key.digest[:16] in out
    assert [] == paths.registered_daemons()  # stop() removed its record


def test_unreachable_daemon_is_listed_with_its_pid(tmp_path, key, capsys):
    """A live daemon whose socket cannot be re-bound stops itself; until then status names its pid."""
    server = DaemonServer(synthetic_export(), key, socket_dir=str(tmp_path / "s"))
    server._next_watch = math.inf  # no re-bind in this test
    with server:
        os.unlink(server.socket_path)
        cli_status(str(tmp_path / "empty"))
        out = capsys.readouterr().out
        assert f"pid {os.getpid()}" in out and "UNREACHABLE" in out and "kill" in out


def test_daemon_that_lost_its_device_to_another_stops(sock_dir, key):
    """When the socket vanished and another live daemon took the device meanwhile, the
    first one stops (freeing its arena) instead of serving nothing."""
    first = DaemonServer(synthetic_export(), key, socket_dir=sock_dir)
    first._next_watch = math.inf  # hold the watch until the second daemon serves
    first.start()
    try:
        shutil.rmtree(sock_dir)
        second = DaemonServer(synthetic_export(), key, socket_dir=sock_dir).start()
        try:
            first._next_watch = 0.0
            assert _wait_for(first._stopped.is_set, REBIND_WAIT_S)
            assert paths.socket_accepts(second.socket_path)
            assert second.socket_path == first.socket_path
        finally:
            second.stop()
    finally:
        first.stop()


def test_default_socket_dir_skips_unusable_runtime_dir(monkeypatch, tmp_path):
    """$XDG_RUNTIME_DIR is used only when it is ours and writable."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert str(runtime / "wcache") == paths.default_socket_dir()
    assert str(runtime / "wcache-daemons") == paths.registry_dir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/run")
    assert f"/tmp/wcache-{os.getuid()}" == paths.default_socket_dir()
