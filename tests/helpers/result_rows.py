"""One results row per test for the gpu_engine tier's feature modules
(tests/gpu_engine/conftest.py: modules that define ``RESULT_PREFIX``)."""

from __future__ import annotations

from typing import Any

#: pytest's report outcome -> the results file's (as the tier's own rows spell it).
VERDICTS = {"passed": "pass", "failed": "fail", "skipped": "skip"}
#: Characters of a failure's report a row keeps (its end: the assertion).
MAX_REASON_CHARS = 2000


def row_for_test(prefix: str, name: str, nodeid: str, report: Any) -> dict[str, Any] | None:
    """The row of one test's ``report`` (a ``pytest.TestReport``): for its call, or for
    a setup that failed or skipped it (its module fixture's engines); ``None`` for the
    other phases, so each test gives one row."""
    if not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return None
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    elif report.failed:
        reason = str(report.longrepr)[-MAX_REASON_CHARS:]
    return {
        "case": f"{prefix}/{name}",
        "outcome": VERDICTS[report.outcome],
        "reason": reason,
        "test": nodeid,
    }
