"""run_engine's launcher rule: an explicit launcher goes before the engine's command,
``()`` starts it directly, and ``None`` takes the template that the engine's
environment names in ``$WCACHE_ENGINE_TEMPLATE`` (the CPU suite's engine template),
falling back to a direct start where it names none. The engine's command is
recorded, not run."""

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

    def fake_run(cmd, **kw):
        seen.append((list(cmd), kw["env"]))
        return subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr="")

    monkeypatch.setattr(process.subprocess, "run", fake_run)
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
