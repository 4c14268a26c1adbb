"""Run a test's engine script (``tests/e2e/_lora_engine.py``, ``_update_engine.py``,
``tests/gpu_engine/_sleep_engine.py``) in a child process and read its result: the
last line of its stdout that is a JSON object. A child that fails, or prints no JSON
line, raises an ``AssertionError`` with the first traceback of its output (vLLM's
worker prints the root cause there) and the output's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from wcache.daemon.process import ENGINE_TIMEOUT_S, engine_launcher, first_traceback

#: The repository root: the child imports ``wcache`` and ``tests`` from it.
REPO = Path(__file__).resolve().parents[2]
#: Lines of a failed child's output shown after its first traceback: vLLM's last log
#: lines and the client's own exception, short enough to read in a pytest report.
OUTPUT_TAIL_LINES = 25


@attrs.frozen
class EngineRun:
    """One engine script's run: ``result`` is its last JSON line, ``stderr`` its log."""

    result: dict
    stderr: str


def output_tail(output: str) -> str:
    """The first traceback of ``output`` (if any) and its last :data:`OUTPUT_TAIL_LINES` lines."""
    return f"{first_traceback(output) or ''}\n" + "\n".join(
        output.splitlines()[-OUTPUT_TAIL_LINES:]
    )


def engine_env() -> dict[str, str]:
    """This process's environment for an engine child: offline Hugging Face, no
    tokenizer threads, and the repository root first on ``PYTHONPATH`` (left as it is
    when it is there already: the suite's engine template starts with it there, and a
    ``PYTHONPATH`` that differs from the template's makes ``wcache run`` start the
    script directly)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(path if str(REPO) in path[:1] else [str(REPO), *path]),
    }


def run_engine_script(
    script: Path, args: Sequence[str], label: str, timeout_s: float = ENGINE_TIMEOUT_S
) -> EngineRun:
    """Run ``python script *args`` and return its last JSON line; forked from the
    engine template that ``$WCACHE_ENGINE_TEMPLATE`` names, when it is set
    (:func:`wcache.daemon.process.run_engine`'s rule).

    Args:
        script: the engine script.
        args: its command-line arguments.
        label: names the run in a failure (``"wcache graphs"``: the load format, the mode).
        timeout_s: the child's limit in seconds (an engine start and its generations).

    Raises:
        AssertionError: the child exited non-zero or printed no JSON object line; the
            message has its exit code, first traceback and output tail.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.
    """
    env = engine_env()
    proc = subprocess.run(
        [*engine_launcher(env), sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"{label} engine exited {proc.returncode}\n" + output_tail(proc.stdout + proc.stderr)
        )
    return EngineRun(json.loads(lines[-1]), proc.stderr)
