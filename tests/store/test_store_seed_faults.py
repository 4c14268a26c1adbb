"""A seeding peer that dies or stalls mid-broadcast, over gloo between CPU daemons
(issue 27 item 2; the NCCL case needs two GPUs): the source keeps serving and can
seed again, the receiver fails with ``seed-failed`` in bounded time, and neither
side aborts or hangs. The peer that fails is a real process
(``python -m wcache.testing.store``), stopped after its first chunk by
:func:`wcache.testing.store.fault_seeding`.
"""

import datetime
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from wcache.store import DaemonServer, attach, daemon_status, socket_path
from wcache.store.seed import SEED_TIMEOUT_ENV, SeedFailed, seed_arena, seed_timeout_s
from wcache.testing.store import (
    BASE_KEY,
    SEED_STALLED_LINE,
    assert_serves_export,
    start_daemon,
    stop_daemon,
)

#: The synthetic arena (6 float32 tensors of 4096) is 96 KiB: 24 chunks of this size.
CHUNK = 4096
#: How long a peer may take to reach its first chunk (a subprocess imports torch).
STALL_WAIT_S = 90.0


def _wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> None:
    """Read ``proc``'s stdout until a line starts with ``text`` (fails on exit or timeout)."""
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(text):
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout_s), (
        f"no {text!r} from pid {proc.pid} in {timeout_s} s (rc {proc.poll()})"
    )


def _log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


def _receive_in_thread(
    arena, key, sock_dir: str, device_id: str
) -> tuple[threading.Thread, list, list]:
    """Build a receiving DaemonServer from ``arena`` on a thread; its error, its end time."""
    errors, ended = [], []

    def receive() -> None:
        try:
            DaemonServer(arena, key, socket_dir=sock_dir, device_id=device_id).stop()
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)
        ended.append(time.monotonic())

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    return t, errors, ended


def _stalled_seeding(
    sock_dir: str, key
) -> tuple[subprocess.Popen, tuple[threading.Thread, list, list]]:
    """A source daemon that stalls after its first chunk, and a receiver (on a thread,
    :func:`_receive_in_thread`) seeding from it; returns once the source has stalled."""
    src = start_daemon(
        sock_dir,
        "cpu-src",
        extra_args=("--seed-source", "--seed-chunk-bytes", str(CHUNK), "--seed-stall-after", "1"),
    )
    try:
        arena = seed_arena(socket_path(sock_dir, "cpu-src"), key)
        receiving = _receive_in_thread(arena, key, sock_dir, "cpu-dst")
        _wait_for_line(src, SEED_STALLED_LINE, STALL_WAIT_S)
    except BaseException:
        stop_daemon(src)
        raise
    return src, receiving


def test_a_receiver_killed_after_its_first_chunk_leaves_the_source_serving(
    sock_dir, key, monkeypatch
):
    """SIGKILL a receiving daemon after its first chunk: the source logs the failed seeding, answers status with its engine still attached, serves a new engine, and seeds another daemon."""
    monkeypatch.setenv(SEED_TIMEOUT_ENV, "30")
    src = start_daemon(
        sock_dir, "cpu-src", extra_args=("--seed-source", "--seed-chunk-bytes", str(CHUNK))
    )
    src_sock = socket_path(sock_dir, "cpu-src")
    receiver = None
    try:
        with attach(key, socket_dir=sock_dir, device_id="cpu-src"):  # an engine holds the source
            receiver = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "wcache.testing.store",
                    "seed-receive",
                    "--socket-dir",
                    sock_dir,
                    "--device-id",
                    "cpu-dst",
                    "--seed-from",
                    src_sock,
                    "--key",
                    json.dumps(BASE_KEY),
                    "--seed-stall-after",
                    "1",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            _wait_for_line(receiver, SEED_STALLED_LINE, STALL_WAIT_S)
            killed = time.monotonic()
            receiver.kill()
            receiver.wait(10)
            deadline = killed + seed_timeout_s() + 15
            while "failed; still serving" not in _log(src) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "failed; still serving" in _log(src), _log(src)[-3000:]
            noticed_s = time.monotonic() - killed
            st = daemon_status(src_sock)
            assert 1 == st["attachments_active"] and st["invalidated"] is None, st
        assert src.poll() is None, _log(src)[-3000:]
        assert_serves_export(key, sock_dir, "cpu-src")  # engines still attach
        again = DaemonServer(
            seed_arena(src_sock, key), key, socket_dir=sock_dir, device_id="cpu-dst2"
        ).start()
        try:
            assert_serves_export(key, sock_dir, "cpu-dst2")  # it seeds again, whole
        finally:
            again.stop()
        print(
            f"source noticed the dead receiver in {noticed_s:.2f} s (timeout {seed_timeout_s():g} s)"
        )
    finally:
        if receiver is not None and receiver.poll() is None:
            receiver.kill()
        stop_daemon(src)


def test_a_source_killed_mid_broadcast_fails_the_receiver_with_seed_failed(
    sock_dir, key, monkeypatch
):
    """SIGKILL the source after its first chunk: the receiver raises SeedFailed (no abort, no hang) well before the seeding timeout, and serves nothing."""
    monkeypatch.setenv(SEED_TIMEOUT_ENV, "60")
    src, (t, errors, ended) = _stalled_seeding(sock_dir, key)
    try:
        killed = time.monotonic()
        src.kill()
        t.join(seed_timeout_s() + 30)
    finally:
        stop_daemon(src)
    assert not t.is_alive(), "the receiver still waits for a dead source"
    assert 1 == len(errors) and isinstance(errors[0], SeedFailed), errors
    assert "broke off" in str(errors[0]) and "seed-failed" == errors[0].code
    waited_s = ended[0] - killed
    assert waited_s < seed_timeout_s() / 2, (
        f"{waited_s:.1f} s: the dead source was waited out, not seen"
    )
    assert not os.path.exists(socket_path(sock_dir, "cpu-dst"))  # nothing is served


def test_a_stalled_source_fails_the_receiver_after_the_seeding_timeout(sock_dir, key, monkeypatch):
    """A source that stops sending after one chunk (alive, silent) fails the receiver with SeedFailed once the lowered seeding timeout runs out; the source itself keeps serving."""
    timeout_s = 3.0
    monkeypatch.setenv(SEED_TIMEOUT_ENV, str(timeout_s))
    src, (t, errors, ended) = _stalled_seeding(sock_dir, key)
    try:
        stalled = time.monotonic()
        t.join(timeout_s + 60)
        assert not t.is_alive(), "the receiver ignores the seeding timeout"
        assert 1 == len(errors) and isinstance(errors[0], SeedFailed), errors
        assert ended[0] - stalled < timeout_s + 30
        assert_serves_export(key, sock_dir, "cpu-src")
    finally:
        stop_daemon(src)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_bad_seeding_timeout_is_refused_with_the_fix(value, monkeypatch, capsys):
    """WCACHE_SEED_TIMEOUT_S and `wcache serve --seed-timeout` take only a positive number of seconds."""
    from wcache import cli

    monkeypatch.setenv(SEED_TIMEOUT_ENV, value)
    with pytest.raises(SeedFailed, match="is not a positive number of seconds; unset it"):
        seed_timeout_s()
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--model", "/nonexistent", "--seed-timeout", value])
    assert 2 == ei.value.code
    assert "--seed-timeout: " in capsys.readouterr().err


def test_serve_seed_timeout_reaches_the_seeding_code(tmp_path, monkeypatch):
    """`wcache serve --seed-timeout 7.5` sets WCACHE_SEED_TIMEOUT_S, for its rank processes and seeding helpers, before it looks at the model."""
    from wcache import cli

    monkeypatch.setenv(SEED_TIMEOUT_ENV, "600")  # restored after the test
    assert 2 == cli.main(["serve", "--model", str(tmp_path / "missing"), "--seed-timeout", "7.5"])
    assert 7.5 == seed_timeout_s()


@pytest.mark.parametrize("before", [None, "3"])
def test_a_seeding_nccl_group_is_built_to_abort_its_communicator_not_the_process(
    monkeypatch, before
):
    """The seeding NCCL group is constructed with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly: the watchdog aborts the communicator, never the serving daemon), and the process's own value is back right after. A fake ProcessGroupNCCL records what its constructor saw; the real one needs two GPUs."""
    import torch
    import torch.distributed as dist

    from wcache.store import seed

    seen = []

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, opts):
            seen.append(
                (os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), rank, size, opts._timeout)
            )

    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    store = dist.HashStore()
    pg, _ = seed._group(
        "nccl",
        "127.0.0.1",
        0,
        1,
        torch.device("cuda", 0),
        "tok",
        is_master=False,
        timeout_s=42.0,
        store=store,
    )
    assert isinstance(pg, FakeNCCL)
    assert [("2", 1, 2, datetime.timedelta(seconds=42))] == seen
    assert before == os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
