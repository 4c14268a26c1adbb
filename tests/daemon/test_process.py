"""run_engine's launcher rule: an explicit launcher goes before the engine's command,
``()`` starts it directly, and ``None`` takes the template that the engine's
environment names in ``$WCACHE_ENGINE_TEMPLATE`` (the CPU suite's engine template),
falling back to a direct start where it names none (the engine's command is
recorded, not run); and an interrupted run_engine stops the engine's whole process
group (a stand-in engine whose child ignores SIGTERM)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wcache.daemon import process
from wcache.daemon.process import ENGINE_TEMPLATE_ENV, run_engine, template_launcher

ENGINE = [sys.executable, "-m", "wcache.vllm.run_engine"]


@pytest.fixture
def commands(monkeypatch):
    """The commands run_engine runs, each answered with an empty JSON result."""
    seen: list[tuple[list[str], dict]] = []

    def fake_run(cmd, environ, timeout_s):
        seen.append((list(cmd), dict(environ)))
        return subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr="")

    monkeypatch.setattr(process, "_run_in_own_group", fake_run)
    monkeypatch.delenv(ENGINE_TEMPLATE_ENV, raising=False)
    return seen


def test_template_launcher_is_wcache_run_on_the_socket_dir():
    """The prefix is `python -m wcache run [--no-fallback] --socket-dir D --`."""
    assert template_launcher("/s") == [
        sys.executable, "-m", "wcache", "run", "--socket-dir", "/s", "--",
    ]  # fmt: skip
    assert template_launcher("/s", fallback=False)[4:] == [
        "--no-fallback",
        "--socket-dir",
        "/s",
        "--",
    ]


@pytest.mark.parametrize(
    ("os_env", "engine_env", "launcher", "prefix"),
    [
        (None, None, None, []),  # nothing names a template: direct
        ("/t", None, None, template_launcher("/t")),  # this process's environment names it
        (None, {ENGINE_TEMPLATE_ENV: "/e"}, None, template_launcher("/e")),  # the engine's env
        ("/t", {ENGINE_TEMPLATE_ENV: ""}, None, []),  # emptied for one engine: direct
        ("/t", None, (), []),  # an explicit () is a direct start
        ("/t", None, ("L", "--"), ["L", "--"]),  # an explicit launcher wins
    ],
)
def test_launcher_rule(commands, monkeypatch, os_env, engine_env, launcher, prefix):
    """The launcher before run_engine's command, by where the template is named."""
    if os_env is not None:
        monkeypatch.setenv(ENGINE_TEMPLATE_ENV, os_env)
    run_engine("/m", env=engine_env, launcher=launcher)
    ((cmd, env),) = commands
    assert cmd[: len(prefix)] == prefix
    assert cmd[len(prefix) : len(prefix) + len(ENGINE)] == ENGINE
    assert env.get(ENGINE_TEMPLATE_ENV, None) == (
        (engine_env or {}).get(ENGINE_TEMPLATE_ENV, os_env)
    )


#: A caller of run_engine stopped by SIGTERM, whose "engine" (the launcher: a stand-in
#: that ignores the engine command after it) starts a child that ignores SIGTERM, as
#: vLLM's engine core may while it starts, and writes its pid (argv[1]: the pid file).
_INTERRUPTED_CALLER = """
import sys
from wcache.daemon import process
process.ENGINE_STOP_GRACE_S = 1.0
engine = (
    "import signal, subprocess, sys, time\\n"
    "core = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\\n"
    "open(sys.argv[1], 'w').write(str(core.pid))\\n"
    "time.sleep(120)\\n"
)
process.exit_on_sigterm()
process.run_engine("/m", launcher=(sys.executable, "-c", engine, sys.argv[1]))
"""


def test_an_interrupted_caller_stops_the_engines_whole_process_group(tmp_path):
    """SIGTERM to run_engine's caller (exit_on_sigterm) ends it with 143 and stops
    every process of the engine's group, a child that ignores SIGTERM included
    (SIGKILL after ENGINE_STOP_GRACE_S): subprocess.run killed only the direct child,
    which left vLLM's engine core under pid 1 (break pass 9)."""
    import os
    import signal
    import time

    pid_file = tmp_path / "core.pid"
    caller = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_CALLER, str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert caller.poll() is None, "the caller ended before its engine started"
            time.sleep(0.05)
        core = int(pid_file.read_text())
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        caller.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(core, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(core, signal.SIGKILL)
        pytest.fail("the engine's child that ignores SIGTERM outlived its caller")


def test_an_engine_past_its_timeout_is_stopped_and_timeout_expired_raised():
    """The timeout stops the engine's group and raises subprocess.TimeoutExpired, which
    callers (the acceptance, the benchmarks) catch as before."""
    import os
    import time

    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        process._run_in_own_group(
            [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), 0.5
        )
    assert time.monotonic() - t0 < 30  # stopped by SIGTERM, not waited out
