"""vLLM's OpenAI-compatible server restarts from the daemon, driven by an HTTP client.

One daemon (``wcache serve``) and three server starts with the README's serving
command (``python -m vllm.entrypoints.openai.api_server ... --load-format wcache
--model-loader-extra-config '{"fallback": true}'``): two restarts restore from the
daemon, the third runs after the daemon was stopped and loads from disk with the
reason ``daemon-missing``. Each asks ``POST /v1/completions`` for two prompts x 16
greedy tokens. The daemon and the servers find each other through the default
socket dir (``$XDG_RUNTIME_DIR/wcache``, a private temporary dir here), so the
commands are the README's, not variants with a socket_dir option.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import pytest

from wcache.daemon.process import ENGINE_ARGS, DaemonProcess, ServerProcess, server_command
from wcache.store import daemon_status
from wcache.store.paths import list_sockets

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("The capital of France is", "Water boils at a temperature of")
MAX_TOKENS = 16
#: The README's engine option: fall back to disk (logging the reason) when the daemon
#: is missing; the restarts prove restore through the log, not through a refusal.
EXTRA = {"fallback": True}
RESTORE_LINE = "wcache: weight-load phase (restore)"
FALLBACK_LINE = "wcache: weight-load phase (fallback)"
#: A --wait-ready probe resolves the engine arguments with vLLM (~5-15 s here).
WAIT_READY_TIMEOUT_S = 300


@attrs.define
class Run:
    texts: dict = attrs.field(factory=dict)
    logs: dict = attrs.field(factory=dict)
    ready: dict = attrs.field(factory=dict)
    #: the daemon's status just before each daemon-backed server start
    status: dict = attrs.field(factory=dict)
    #: after SIGTERM: the daemon's exit status and what is left in its socket dir
    stopped: dict = attrs.field(factory=dict)


def _wait_ready(env: dict[str, str]) -> subprocess.CompletedProcess:
    """``wcache status --wait-ready --timeout 0`` for the daemon's engine arguments."""
    cmd = [
        sys.executable,
        "-m",
        "wcache.cli",
        "status",
        "--wait-ready",
        "--timeout",
        "0",
        "--model",
        env["WCACHE_E2E_MODEL"],
        *ENGINE_ARGS,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=WAIT_READY_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def run():
    from wcache.testing.fixtures import build

    model = build("bf16")
    out = Run()
    with tempfile.TemporaryDirectory(prefix="wc-srv-") as runtime:
        env = {"XDG_RUNTIME_DIR": runtime}
        daemon = DaemonProcess(model, Path(runtime) / "wcache", env=env).start()
        try:
            probe_env = {**daemon.env, "WCACHE_E2E_MODEL": str(model)}
            out.ready["up"] = _wait_ready(probe_env)
            for name in ("first", "second"):
                out.status[name] = daemon_status(list_sockets(daemon.socket_dir)[0])
                with ServerProcess(model, "wcache", EXTRA, env=env) as server:
                    out.texts[name] = server.complete(PROMPTS, MAX_TOKENS)
                out.logs[name] = server.log
        finally:
            daemon.stop()
        registry = Path(runtime) / "wcache-daemons"  # the daemon's registry_dir() under this env
        out.stopped = {
            "exit": daemon.proc.returncode,
            "left": sorted(os.listdir(daemon.socket_dir)),
            "registered": sorted(os.listdir(registry)) if registry.is_dir() else [],
            "registry_was_used": registry.is_dir(),
        }
        out.ready["down"] = _wait_ready(probe_env)
        with ServerProcess(model, "wcache", EXTRA, env=env) as server:
            out.texts["daemon_stopped"] = server.complete(PROMPTS, MAX_TOKENS)
        out.logs["daemon_stopped"] = server.log
    yield out


@pytest.mark.e2e
@pytest.mark.slow
def test_restarted_server_answers_identically(run):
    """Both daemon-backed starts and the disk fallback return the same two 16-token texts."""
    first = run.texts["first"]
    assert len(first) == len(PROMPTS) and all(t.strip() for t in first)
    assert first[0].startswith(" Paris")
    assert run.texts["second"] == first
    assert run.texts["daemon_stopped"] == first


@pytest.mark.e2e
@pytest.mark.slow
def test_restarts_restore_from_the_daemon(run):
    """Each daemon-backed start logs the restore phase and no fallback."""
    for name in ("first", "second"):
        assert RESTORE_LINE in run.logs[name], name
        assert "falling back to disk" not in run.logs[name], name


@pytest.mark.e2e
@pytest.mark.slow
def test_servers_restore_from_the_lean_serving_process(run):
    """Both daemon-backed starts attach to the torch-free lean process (issue 28), same pid."""
    for name in ("first", "second"):
        st = run.status[name]
        assert ("lean", False) == (st["serving"], st["torch_loaded"]), name


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_to_the_lean_daemon_cleans_up(run):
    """SIGTERM to the lean daemon: exit 0, no socket or pid file left (only the lock file), no registry entry."""
    assert run.stopped["registry_was_used"]
    assert (0, [], []) == (
        run.stopped["exit"],
        [n for n in run.stopped["left"] if not n.endswith(".lock")],
        run.stopped["registered"],
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_stopped_daemon_falls_back_naming_daemon_missing(run):
    """With the daemon stopped the server loads from disk and logs the reason daemon-missing."""
    log = run.logs["daemon_stopped"]
    assert FALLBACK_LINE in log
    assert re.search(r"falling back to disk on tp_rank=0 pp_rank=0 \[daemon-missing\]", log)
    assert RESTORE_LINE not in log


@pytest.mark.e2e
@pytest.mark.slow
def test_wait_ready_follows_the_daemon(run):
    """`wcache status --wait-ready` exits 0 while the daemon serves, 3 naming daemon-missing after."""
    up, down = run.ready["up"], run.ready["down"]
    assert (up.returncode, down.returncode) == (0, 3), up.stdout + up.stderr + down.stderr
    assert up.stdout.startswith("wcache: ready: all 1 rank(s)")
    assert "wcache: not ready [daemon-missing]" in down.stdout


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it with vLLM", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_readme_serving_lines_are_the_tested_commands():
    """README's daemon and server lines are the commands this test runs (plus its small-machine
    engine arguments): same programs, same arguments and values."""
    daemon_line, server_line = _readme_commands()
    model = "/path/to/checkpoint"
    tested_daemon = ["wcache", "serve", "--model", model, *ENGINE_ARGS]
    tested_server = server_command(model, "wcache", EXTRA)
    tested_server[:3] = ["python", "-m", tested_server[2]]

    def pairs(argv: list[str]) -> set[tuple[str, str]]:
        return {(a, b) for a, b in itertools.pairwise(argv) if a.startswith("--")}

    assert daemon_line[:2] == tested_daemon[:2]
    assert pairs(daemon_line) <= pairs(tested_daemon)
    assert server_line[:3] == tested_server[:3]
    assert pairs(server_line) <= pairs(tested_server)
    assert ("--load-format", "wcache") in pairs(server_line)
