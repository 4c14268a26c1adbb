"""``wcache serve --prime-compile``'s priming run (wcache.daemon.prime, serve._prime)
versus a stop request: the priming engine is killed, nothing is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types

import pytest

from wcache.daemon import prime, serve
from wcache.errors import PrimingFailed


def _stub_server():
    return types.SimpleNamespace(
        artifacts=None,
        artifacts_state=None,
        artifacts_error=None,
        socket_dir=None,
        _shutdown_requested=threading.Event(),
        stopping=threading.Event(),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stop_request_kills_the_priming_engine_and_keeps_nothing(tmp_path, monkeypatch):
    """A `wcache stop`/SIGTERM while priming ends the priming engine (its pid gone) within
    a few polls, and the rank keeps no bundle (state failed, reason stopped)."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    monkeypatch.setattr(prime, "priming_command", lambda *a, **k: [sys.executable, "-c", code])
    server = _stub_server()
    stopper = threading.Timer(1.0, server._shutdown_requested.set)  # arrives while priming
    stopper.start()
    t0 = time.monotonic()
    serve._prime(server, ("m", [], "", "serve"), str(tmp_path / "snap"), "tp0of1-pp0of1-dp0of1")
    took = time.monotonic() - t0
    pid = int(pid_file.read_text())
    assert took < 1.0 + 10 * prime.STOP_POLL_S, f"priming ran {took:.1f} s"
    assert not _alive(pid)
    assert (server.artifacts, server.artifacts_state, server.artifacts_error) == (
        None,
        "failed",
        "[priming-failed] stopped",
    )
    assert not (tmp_path / "snap").exists()


def test_a_stop_requested_before_priming_ends_it_at_the_first_poll(monkeypatch):
    """A stop that arrived before priming began ends it within a poll or two, not after the engine."""
    monkeypatch.setattr(
        prime,
        "priming_command",
        lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(60)"],
    )
    server = _stub_server()
    server.stopping.set()
    t0 = time.monotonic()
    serve._prime(server, ("m", [], "", "serve"), None, "tp0of1-pp0of1-dp0of1")
    assert time.monotonic() - t0 < 10 * prime.STOP_POLL_S
    assert server.artifacts_state == "failed"


def test_the_priming_engine_dies_with_its_rank(tmp_path):
    """PR_SET_PDEATHSIG: a priming engine whose rank is SIGKILLed is killed too (no orphan)."""
    pid_file = tmp_path / "pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    rank = (
        f"import sys; from wcache.daemon import prime; "
        f"prime._run_until_stopped([sys.executable, '-c', {child!r}], None, 60, lambda: False, {str(tmp_path)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", rank])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the priming engine never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_wait_primed_returns_the_primed_line_and_refuses_a_failure():
    """DaemonProcess.wait_primed: returns the line prime_compile prints (PRIMED_PREFIX),
    and raises at once on a priming failure instead of waiting out its timeout."""
    import collections

    from wcache.daemon.process import DaemonProcess

    d = DaemonProcess.__new__(DaemonProcess)
    d.proc = types.SimpleNamespace(poll=lambda: None)
    line = f"{prime.PRIMED_PREFIX} 3 entries for llm, 1.8 MiB, compile dirs ['d7303c25'] in 9 s"
    d.lines = collections.deque(["wcache: ready rank=0/1", line])
    assert d.wait_primed(timeout_s=5) == line
    d.lines = collections.deque(["wcache: priming failed [priming-failed]: boom"])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not prime"):
        d.wait_primed(timeout_s=60)
    assert time.monotonic() - t0 < 5


def test_a_failed_priming_engine_names_its_root_cause(monkeypatch):
    """vLLM's engine core prints the root cause (here vLLM's memory check) long before
    the generic "Engine core initialization failed" that ends the log: the PrimingFailed
    message carries that first traceback, not only the output tail."""
    child = (
        "import sys\n"
        "try:\n"
        "    raise ValueError('Free memory on device cuda:0 (20.1/79.2 GiB) on startup is less "
        "than desired GPU memory utilization (0.3, 23.8 GiB)')\n"
        "except ValueError:\n"
        "    import traceback; traceback.print_exc()\n"
        "print('noise ' * 2000)\n"
        "sys.exit('RuntimeError: Engine core initialization failed. See root cause above.')\n"
    )
    monkeypatch.setattr(prime, "priming_command", lambda *a, **k: [sys.executable, "-c", child])
    with pytest.raises(PrimingFailed) as e:
        prime.prime_compile("m", [], socket_dir=None, timeout_s=60)
    msg = str(e.value)
    assert "ValueError: Free memory on device cuda:0" in msg
    assert msg.rstrip().endswith("Engine core initialization failed. See root cause above.")
