"""tests/helpers/result_rows.py: one row per test, its outcome and why."""

from __future__ import annotations

import types

from tests.helpers.result_rows import row_for_test as row_of


def _report(when: str, outcome: str, longrepr=None):
    return types.SimpleNamespace(
        when=when,
        outcome=outcome,
        passed=outcome == "passed",
        skipped=outcome == "skipped",
        failed=outcome == "failed",
        longrepr=longrepr,
    )


def test_one_row_a_test_from_its_call():
    assert row_of("lora", "t[bf16]", "m::t[bf16]", _report("setup", "passed")) is None
    assert row_of("lora", "t[bf16]", "m::t[bf16]", _report("teardown", "passed")) is None
    assert row_of("lora", "t[bf16]", "m::t[bf16]", _report("call", "passed")) == {
        "case": "lora/t[bf16]",
        "outcome": "pass",
        "reason": "",
        "test": "m::t[bf16]",
    }


def test_a_skip_or_failure_keeps_its_reason():
    skip = _report("call", "skipped", ("m.py", 3, "Skipped: bf16 only"))
    assert row_of("lora", "t", "m::t", skip)["reason"] == "Skipped: bf16 only"
    failed = row_of("lora", "t", "m::t", _report("call", "failed", "x" * 3000 + "assert 1 == 2"))
    assert failed["outcome"] == "fail" and failed["reason"].endswith("assert 1 == 2")
    assert len(failed["reason"]) == 2000


def test_a_setup_that_fails_gives_the_row():
    """The module fixture (the engines) failing fails every test at setup: each gets a row."""
    row = row_of("lora", "t", "m::t", _report("setup", "failed", "engine died"))
    assert (row["outcome"], row["reason"]) == ("fail", "engine died")
