"""Daemon and clients in separate processes: read-only faults, daemon death,
and 100 attach/detach cycles with flat memory and descriptors."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from wcache.store import CacheKey, DaemonServer, attach, daemon_status, socket_path
from wcache.testing.store import (
    BASE_KEY,
    count_arena_mappings,
    fd_count,
    rss_bytes,
    start_daemon,
    stop_daemon,
    synthetic_export,
)

# Arena tensors large enough that a leaked mapping (or a leaked copy) per cycle
# would show: 8 layers x 64 Ki fp16 elements = 1 MiB per attachment.
CYCLE_NUMEL = 64 * 1024
CYCLES = 100
WARMUP_CYCLES = 10
# RSS growth tolerated over 100 cycles: allocator and interpreter noise, far
# below the 100 MiB a leaked 1 MiB mapping per cycle would add.
RSS_TOLERANCE_BYTES = 8 << 20
# Descriptors may differ by a transient one (e.g. a log file reopened).
FD_TOLERANCE = 1
# A killed client's connection closes with its process; the daemon's handler
# sees it at once (seconds allowed: a busy 2-core host).
RELEASE_WAIT_S = 10.0


def _client_script(sock_dir: str, body: str) -> list[str]:
    prelude = f"""
        import sys, torch
        from wcache.testing.store import BASE_KEY, synthetic_export
        from wcache.store import CacheKey, attach
        att = attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r})
    """
    return [sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(body)]


def test_write_to_mapping_faults_and_daemon_bytes_stay(sock_dir):
    """A client writing into an attached tensor dies with SIGSEGV/SIGBUS; the daemon's bytes are unchanged."""
    proc = start_daemon(sock_dir)
    try:
        child = subprocess.run(
            _client_script(
                sock_dir,
                """
            print("attached", flush=True)
            att.tensors["w0"].fill_(7)
            print("wrote", flush=True)
        """,
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "attached" in child.stdout and "wrote" not in child.stdout, child.stderr
        assert child.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (
            child.returncode,
            child.stderr[-2000:],
        )
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir) as att:
            assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])
    finally:
        stop_daemon(proc)


def test_client_survives_daemon_sigkill_and_new_daemon_starts_clean(sock_dir):
    """After the daemon is SIGKILLed the client's tensors still read right; a new daemon then binds the same socket."""
    proc = start_daemon(sock_dir)
    try:
        att = attach(CacheKey(BASE_KEY), socket_dir=sock_dir)
        proc.kill()
        proc.wait()
        export = synthetic_export()
        for name, t in export.tensors.items():
            assert torch.equal(t, att.tensors[name]), name
        att.close()  # the release to a dead daemon is skipped quietly
        sock = socket_path(sock_dir, "cpu")
        assert os.path.exists(sock)  # the dead daemon's socket is left behind ...
        with DaemonServer(
            synthetic_export(seed=5), CacheKey(BASE_KEY), socket_dir=sock_dir
        ) as server:
            assert sock == server.socket_path  # ... and replaced, its owner being dead
            with attach(CacheKey(BASE_KEY), socket_dir=sock_dir) as again:
                assert torch.equal(synthetic_export(seed=5).tensors["w0"], again.tensors["w0"])
    finally:
        stop_daemon(proc)


def test_second_daemon_process_fails_fast_then_sigterm_stops_cleanly(sock_dir):
    """The ready line names key digest, bytes and socket; a second daemon process exits with daemon-busy
    while the first answers; SIGTERM then stops the first with exit code 0, removing socket and pid file."""
    proc = start_daemon(sock_dir)
    sock = socket_path(sock_dir, "cpu")
    try:
        st = daemon_status(sock)
        assert (
            f"wcache-store ready key={CacheKey(BASE_KEY).digest} bytes={st['bytes_held']} socket={sock} "
            f"pid={proc.pid} transport=shm"
        ) == proc.ready_line
        with pytest.raises(RuntimeError, match="DaemonBusy"):
            start_daemon(sock_dir, seed=1)
        assert proc.pid == daemon_status(sock)["pid"]
        proc.send_signal(signal.SIGTERM)
        assert 0 == proc.wait(30)
        assert (False, False) == (os.path.exists(sock), os.path.exists(sock + ".pid"))
    finally:
        stop_daemon(proc)


def _cycle(key, sock_dir, mode):
    with attach(key, socket_dir=sock_dir, mode=mode) as att:
        total = sum(float(t.float().sum()) for n, t in att.tensors.items() if n.startswith("layer"))
    return total


def test_attach_detach_cycles_leave_memory_and_fds_flat(sock_dir):
    """100 attach/detach cycles (zero-copy and copy) leave daemon and client RSS and descriptors flat."""
    proc = start_daemon(sock_dir, n=8, numel=CYCLE_NUMEL)
    key = CacheKey(BASE_KEY)
    # arenas other tests of this process still map (vLLM's process-global rope cache can
    # keep a restored model's buffers alive): this test checks only its own cycles
    mapped_before_test = count_arena_mappings()
    try:
        expected = _cycle(key, sock_dir, "zero_copy")
        for i in range(WARMUP_CYCLES):
            _cycle(key, sock_dir, "copy" if i % 2 else "zero_copy")
        gc.collect()
        before = (
            rss_bytes(),
            fd_count(),
            rss_bytes(proc.pid),
            fd_count(proc.pid),
            count_arena_mappings(),
        )
        for i in range(CYCLES):
            assert expected == _cycle(key, sock_dir, "copy" if i % 2 else "zero_copy")
        gc.collect()
        after = (
            rss_bytes(),
            fd_count(),
            rss_bytes(proc.pid),
            fd_count(proc.pid),
            count_arena_mappings(),
        )
        assert after[0] - before[0] < RSS_TOLERANCE_BYTES, ("client rss", before, after)
        assert abs(after[1] - before[1]) <= FD_TOLERANCE, ("client fds", before, after)
        assert after[2] - before[2] < RSS_TOLERANCE_BYTES, ("daemon rss", before, after)
        assert abs(after[3] - before[3]) <= FD_TOLERANCE, ("daemon fds", before, after)
        assert mapped_before_test == after[4] == before[4]
        st = daemon_status(socket_path(sock_dir, "cpu"))
        assert (0, 1 + WARMUP_CYCLES + CYCLES) == (
            st["attachments_active"],
            st["attachments_total"],
        )
    finally:
        stop_daemon(proc)


def test_sigkilled_client_frees_its_attachment(sock_dir):
    """A client SIGKILLed while it holds an attachment: the daemon counts a disconnect release, has none active, and serves the next client."""
    proc = start_daemon(sock_dir)
    try:
        child = subprocess.Popen(
            _client_script(
                sock_dir,
                """
            print("attached", flush=True)
            sys.stdin.read()
        """,
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert "attached" == child.stdout.readline().strip()
        st = daemon_status(socket_path(sock_dir, "cpu"))
        assert (1, 1) == (st["attachments_active"], st["clients_connected"])
        child.send_signal(signal.SIGKILL)
        assert -signal.SIGKILL == child.wait(30)
        deadline = time.monotonic() + RELEASE_WAIT_S
        while (st := daemon_status(socket_path(sock_dir, "cpu")))[
            "attachments_active"
        ] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (0, 0, {"disconnect": 1}) == (
            st["attachments_active"],
            st["clients_connected"],
            st["releases"],
        )
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir) as att:
            assert torch.equal(synthetic_export().tensors["w0"], att.tensors["w0"])
    finally:
        stop_daemon(proc)
