"""The lean serving process (wcache.store.lean, issue 28): after the hand-off the
daemon's pid serves without torch, answers as before, cleans up on SIGTERM; a
hand-off that cannot happen leaves the full process serving."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from wcache.store import (
    CacheKey,
    DaemonServer,
    attach,
    cli_status,
    daemon_status,
    lean,
    paths,
    socket_path,
)
from wcache.store.client import Connection
from wcache.store.errors import KeyMismatch, SeedUnavailable
from wcache.store.manifest import DTYPE_ITEMSIZES
from wcache.store.seed import SeedFailed, seed_arena
from wcache.testing.store import (
    BASE_KEY,
    assert_serves_export,
    rss_bytes,
    start_daemon,
    stop_daemon,
    synthetic_export,
)

#: The synthetic lean daemon holds a 0.1 MiB arena; Python with msgpack, attrs,
#: blake3 and prometheus_client is ~30 MiB. A torch import alone is ~220 MiB.
LEAN_RSS_BOUND_BYTES = 80 << 20
#: The hand-off takes an interpreter start and the store imports (~0.3 s).
LEAN_WAIT_S = 30.0
#: A stand-in for wcache.store.seed_helper (run as ``EXE -m wcache.store.seed_helper``,
#: arguments ignored): reads the request, reports a store, then waits as a helper
#: whose receiver never joins does; FAKE_HELPER_IGNORE_TERM=1 makes it ignore SIGTERM.
FAKE_HELPER = """#!{python}
import json, os, signal, sys, time
if os.environ.get("FAKE_HELPER_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdin.readline()
print(json.dumps({{"port": 1, "token": "00"}}), flush=True)
time.sleep(600)
"""

#: A seeding helper killed just after its reply (break10 #2: an OOM kill there left
#: the receiver waiting 76 s): the real helper, whose send_arena kills it.
DYING_HELPER = """#!{python}
import os, signal, sys
import wcache.store.seed as seed
import wcache.store.seed_helper as helper
seed.send_arena = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
sys.exit(helper.main())
"""


def _wait_serving(sock_dir: str, mode: str) -> dict:
    deadline = time.monotonic() + LEAN_WAIT_S
    while True:
        try:
            st = daemon_status(socket_path(sock_dir, "cpu"))
            if st.get("serving") == mode:
                return st
        except Exception:  # between exec and accept: the backlog may refuse
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
    theirs = {
        name: obj.itemsize
        for name in dir(torch)
        if isinstance(obj := getattr(torch, name), torch.dtype)
        and not obj.is_complex
        and str(obj) == f"torch.{name}"
    }
    assert theirs == dict(DTYPE_ITEMSIZES)


def test_serving_modules_import_without_torch():
    """The store modules the lean server imports load no torch (nor vLLM)."""
    code = (
        "import sys, wcache.store.server, wcache.store.http, wcache.store.client, "
        "wcache.store.lean, wcache.store.transport_shm, wcache.store.manifest\n"
        "print(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules))"
    )
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


@pytest.mark.parametrize(
    "operator,expected",
    [
        (None, {"A": "b"}),
        ("4", {"A": "b", "MALLOC_ARENA_MAX": "4"}),
        ("1", {"A": "b", "MALLOC_ARENA_MAX": "1"}),
    ],
)
def test_helper_environ_restores_the_operators_malloc_arena_max(operator, expected):
    """A seeding helper gets the operator's MALLOC_ARENA_MAX (none when unset), not the lean server's 1."""
    assert expected == lean.helper_environ(
        lean.lean_environ({"A": "b", **({"MALLOC_ARENA_MAX": operator} if operator else {})}),
        operator,
    )


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if e)


def _pids_running(word: bytes, parent: int | None = None) -> list[int]:
    """The pids whose command line holds ``word`` (children of ``parent`` only, when given)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if word in cmdline and parent in (None, ppid):
            found.append(int(name))
    return found


def _seed_helpers_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children running wcache.store.seed_helper."""
    return _pids_running(b"wcache.store.seed_helper", pid)


@pytest.mark.parametrize("how", ["sigterm", "shutdown"])
def test_stopping_the_lean_daemon_ends_a_seeding_helper_in_flight(sock_dir, monkeypatch, how):
    """A receiver took the seed reply and never joins: the helper holds an attachment, lacks MALLOC_ARENA_MAX (the operator set none), and is gone once the lean daemon stopped by SIGTERM or `shutdown`."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    proc = start_daemon(sock_dir, extra_args=("--lean",))
    sock = socket_path(sock_dir, "cpu")
    helpers: list[int] = []
    try:
        _wait_serving(sock_dir, "lean")
        conn = Connection(sock)
        try:
            reply = conn.request({"op": "seed", "key": BASE_KEY})  # and never join the group
        finally:
            conn.close()
        assert (True, "127.0.0.1") == (reply["ok"], reply["host"])
        helpers = _seed_helpers_of(proc.pid)
        assert 1 == len(helpers)
        helper = helpers[0]
        assert "MALLOC_ARENA_MAX" not in _environ(helper)
        assert "1" == _environ(proc.pid)["MALLOC_ARENA_MAX"]
        assert 1 == daemon_status(sock)["attachments_active"]  # the helper's
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            conn = Connection(sock)
            try:
                conn.request({"op": "shutdown"})
            finally:
                conn.close()
        assert 0 == proc.wait(30)
        assert not os.path.exists(f"/proc/{helper}"), "the seeding helper outlived its daemon"
    finally:
        stop_daemon(proc)
        for pid in helpers:  # one left behind by a failure here must not outlive the test
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fake_helper(tmp_path, monkeypatch):
    """LEAN_EXEC_ENV pointed at :data:`FAKE_HELPER`: seeds whose receivers never join, without torch."""
    path = tmp_path / "fake-seed-helper"
    path.write_text(FAKE_HELPER.format(python=sys.executable))
    path.chmod(0o700)
    monkeypatch.setenv(lean.LEAN_EXEC_ENV, str(path))
    yield path
    for pid in _pids_running(str(path).encode()):  # left behind by a failure: not past the test
        os.kill(pid, signal.SIGKILL)


def test_a_seed_beyond_the_cap_is_refused_seed_unavailable(server, sock_dir, key, fake_helper):
    """With MAX_CONCURRENT_SEEDS helpers in flight a further seed is refused seed-unavailable, which the receiver raises as SeedFailed naming the code; a reaped helper frees its slot."""
    server.seed_source = lean.LeanSeedSource(server, 0)
    for _ in range(lean.MAX_CONCURRENT_SEEDS):
        seed_arena(server.socket_path, key)  # replies taken, nobody joins
    helpers = server.seed_source.helpers
    assert lean.MAX_CONCURRENT_SEEDS == len(helpers)
    with pytest.raises(
        SeedFailed,
        match=r"refused to seed \[seed-unavailable\].*at most "
        rf"{lean.MAX_CONCURRENT_SEEDS} at once",
    ) as ei:
        seed_arena(server.socket_path, key)
    assert "seed-unavailable" == ei.value.__cause__.code
    assert 1 == daemon_status(server.socket_path)["refusals"]["seed-unavailable"]
    assert lean.MAX_CONCURRENT_SEEDS == len(server.seed_source.helpers)  # the refusal started none
    helpers[0].kill()
    deadline = time.monotonic() + LEAN_WAIT_S
    while helpers[0] in server.seed_source.helpers and time.monotonic() < deadline:
        time.sleep(0.02)
    seed_arena(server.socket_path, key)  # the slot is free again
    assert lean.MAX_CONCURRENT_SEEDS == len(server.seed_source.helpers)


@pytest.mark.parametrize("ignore_term,signal_seen", [("0", signal.SIGTERM), ("1", signal.SIGKILL)])
def test_server_stop_ends_every_helper(
    server, key, fake_helper, monkeypatch, ignore_term, signal_seen
):
    """DaemonServer.stop ends the lean seed source's helpers: SIGTERM, or SIGKILL after the grace for one that ignores it; later seeds are refused."""
    monkeypatch.setattr(lean, "HELPER_STOP_GRACE_S", 0.5)
    monkeypatch.setenv("FAKE_HELPER_IGNORE_TERM", ignore_term)
    source = server.seed_source = lean.LeanSeedSource(server, 0)
    seed_arena(server.socket_path, key)
    [helper] = source.helpers
    t0 = time.monotonic()
    server.stop()
    assert (-signal_seen, ()) == (helper.returncode, source.helpers)
    assert time.monotonic() - t0 < lean.HELPER_STOP_GRACE_S + 5.0
    with pytest.raises(SeedUnavailable, match="stopping"):
        source.handle({"key": BASE_KEY}, {"pid": os.getpid()})


@pytest.mark.parametrize("operator", [None, "4"])
def test_the_helper_runs_under_the_operators_malloc_arena_max(
    server, key, fake_helper, monkeypatch, operator
):
    """In the lean server's environment (MALLOC_ARENA_MAX=1), a helper gets the operator's value, or none when the operator set none."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")  # as lean_environ left it in the lean server
    source = server.seed_source = lean.LeanSeedSource(server, 0, operator)
    seed_arena(server.socket_path, key)
    [helper] = source.helpers
    assert operator == _environ(helper.pid).get("MALLOC_ARENA_MAX")


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
        while (st := daemon_status(socket_path(sock_dir, "cpu")))[
            "seeds_served"
        ] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ("lean", False, pid, 1, 0, {"release": 1}) == (
            st["serving"],
            st["torch_loaded"],
            st["pid"],
            st["seeds_served"],
            st["attachments_active"],
            st["releases"],
        )
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


@pytest.mark.parametrize(
    "enabled, transport, reason",
    [
        (False, "shm", "--no-lean"),
        (True, "cuda_vmm", "cuda_vmm transport: its handles live in this process"),
    ],
)
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
    assert {"sigterm": "stopping", "invalidated": "arena invalidated [guard-failed]"}[
        event
    ] == reason
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
    monkeypatch.setattr(
        lean,
        "lean_refusal",
        lambda server, enabled: seen.setdefault("enabled", enabled) and "stop here",
    )
    lean.handoff(server)
    assert enabled == seen["enabled"]


def test_lean_server_closes_descriptors_it_was_not_handed(tmp_path):
    """Only stdio and the descriptors the state names survive into the lean server."""
    stray = os.open(tmp_path / "stray", os.O_CREAT | os.O_RDWR)  # inheritable: no O_CLOEXEC here
    kept = os.open(tmp_path / "kept", os.O_CREAT | os.O_RDWR)
    os.set_inheritable(stray, True)
    code = (
        f"import os; from wcache.store import lean; "
        f"lean._close_inherited_fds({{'memfd': {kept}, 'listener': {kept}, 'lock_fd': {kept}, "
        f"'http': []}}); print(sorted(int(n) for n in os.listdir('/proc/self/fd')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        pass_fds=(stray, kept),
        check=True,
    ).stdout
    left = eval(out)  # noqa: S307  (our own child's list of ints)
    assert kept in left and stray not in left
    os.close(stray)
    os.close(kept)


def test_a_helper_that_does_not_start_is_logged_on_the_source(
    server, sock_dir, key, tmp_path, monkeypatch, caplog
):
    """A seeding helper that answers no store (here: a line that is not JSON) fails
    the seed for the receiver and leaves a line in the source's log, as a helper
    that fails later does (break10 #6: the source logged nothing)."""
    path = tmp_path / "bad-seed-helper"
    path.write_text("#!/bin/sh\necho not-json\n")
    path.chmod(0o700)
    monkeypatch.setenv(lean.LEAN_EXEC_ENV, str(path))
    server.seed_source = lean.LeanSeedSource(server, 0)
    with caplog.at_level(logging.WARNING, logger="wcache.store"):
        with pytest.raises(SeedFailed, match="seeding helper did not start"):
            seed_arena(server.socket_path, key)
    assert any(
        "from this lean daemon failed: its helper pid" in r.getMessage()
        and "did not start" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert () == server.seed_source.helpers


def test_a_helper_killed_after_its_reply_fails_the_receiver_at_once(
    server, sock_dir, key, tmp_path, monkeypatch
):
    """The helper answers (its store listening) and is killed before it joins: the
    receiver's fill fails naming the closed store, instead of c10d retrying the
    refused connection past SEED_CONNECT_TIMEOUT_S (break10 #2: 76 s)."""
    path = tmp_path / "dying-seed-helper"
    path.write_text(DYING_HELPER.format(python=sys.executable))
    path.chmod(0o700)
    monkeypatch.setenv(lean.LEAN_EXEC_ENV, str(path))
    server.seed_source = lean.LeanSeedSource(server, 0)
    arena = seed_arena(server.socket_path, key)
    dst = torch.empty(arena.manifest.arena_nbytes, dtype=torch.uint8)
    with pytest.raises(SeedFailed, match="nothing listens on the source's seeding store"):
        arena.fill(dst)
