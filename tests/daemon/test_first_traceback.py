"""first_traceback: the root cause of an engine's failure, also from a stack deeper
than the lines it keeps (the H200's GPT-OSS MXFP4 failure ended at a caret line)."""

from __future__ import annotations

from wcache.daemon.process import MAX_TRACEBACK_LINES, first_traceback


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
