"""tests.helpers.engine_script: the one way the e2e and gpu_engine tiers run an engine
script and read its result."""

from __future__ import annotations

import pytest

from tests.helpers.engine_script import run_engine_script

#: A child that prints log lines, two JSON lines (the last is the result) and exits 0.
OK_SCRIPT = 'import json\nprint("log")\nprint(json.dumps({"n": 1}))\nprint(json.dumps({"n": 2}))\n'
#: A child that prints a JSON line, then fails with a traceback.
FAILING_SCRIPT = 'print("{}")\nraise ValueError("the root cause")\n'


def test_result_is_the_last_json_line_and_args_reach_the_child(tmp_path):
    """The result is the last stdout line that is a JSON object; the arguments reach the child."""
    script = tmp_path / "ok.py"
    script.write_text("import sys\n" + OK_SCRIPT + "sys.stderr.write(sys.argv[1])\n")
    run = run_engine_script(script, ["an-arg"], "auto")
    assert {"n": 2} == run.result
    assert "an-arg" == run.stderr


def test_a_failed_child_raises_with_its_exit_code_and_first_traceback(tmp_path):
    """A non-zero exit raises AssertionError naming the label, the exit code and the root cause."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    with pytest.raises(AssertionError) as info:
        run_engine_script(script, [], "wcache graphs")
    message = str(info.value)
    assert message.startswith("wcache graphs engine exited 1\nTraceback (most recent call last):")
    assert "ValueError: the root cause" in message


def test_a_child_without_a_json_line_raises(tmp_path):
    """Exit 0 without a JSON object line is a failure too, not an empty result."""
    script = tmp_path / "silent.py"
    script.write_text('print("no result")\n')
    with pytest.raises(AssertionError, match="auto engine exited 0"):
        run_engine_script(script, [], "auto")
