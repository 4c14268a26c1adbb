"""first_traceback: the root cause of an engine's failure, also from a stack deeper
than the lines it keeps (the H200's GPT-OSS MXFP4 failure ended at a caret line)."""

from __future__ import annotations

from wcache.daemon.tracebacks import MAX_TRACEBACK_LINES, first_traceback


def _frames(n: int) -> list[str]:
    out = []
    for i in range(n):
        out += [f'  File "/x/m{i}.py", line {i}, in f{i}', "    g()", "    ^^^"]
    return out


def test_a_short_traceback_ends_at_its_exception_line():
    """The kept text runs from 'Traceback' to the exception line, nothing after."""
    text = "\n".join(
        ["log line", "Traceback (most recent call last):", *_frames(3), "ValueError: bad", "tail"]
    )
    got = first_traceback(text)
    assert got is not None
    assert got.splitlines()[0] == "Traceback (most recent call last):"
    assert got.splitlines()[-1] == "ValueError: bad"


def test_a_deep_traceback_keeps_its_exception_line_after_a_count():
    """A stack longer than MAX_TRACEBACK_LINES keeps the first lines, then how many
    were cut, then the exception line (not a caret line)."""
    frames = _frames(MAX_TRACEBACK_LINES)
    text = "\n".join(["Traceback (most recent call last):", *frames, "RuntimeError: root cause"])
    got = first_traceback(text).splitlines()
    assert got[-1] == "RuntimeError: root cause"
    cut = len(frames) - (MAX_TRACEBACK_LINES - 1)
    assert got[-2] == f"  ... ({cut} more lines)"
    assert len(got) == MAX_TRACEBACK_LINES + 2


def test_a_workers_logged_traceback_is_the_root_cause():
    """A worker's start failure logged through vLLM's logger (process and log prefixes on
    every line) comes before the engine core's generic one: its exception is returned."""
    worker = "(Worker pid=27897) ERROR 12-04 23:23:12 [multiproc_executor.py:953] "
    core = "(EngineCore pid=27812) ERROR 12-04 23:23:14 [core.py:1510] "
    text = "\n".join(
        [
            worker + "WorkerProc failed to start.",
            worker + "Traceback (most recent call last):",
            *(worker + f for f in _frames(2)),
            worker + "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s)",
            core + "Traceback (most recent call last):",
            *(core + f for f in _frames(2)),
            core + "Exception: WorkerProc initialization failed due to an exception",
        ]
    )
    got = first_traceback(text).splitlines()
    assert got[0] == "Traceback (most recent call last):"
    assert got[1] == '  File "/x/m0.py", line 0, in f0'
    assert got[-1] == "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s)"
