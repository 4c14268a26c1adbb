"""The GPU tier writes each failure's id and traceback beside its results as the test
fails (tests/gpu_engine/conftest.py): a tier cut by run-tier.sh's timeout prints no
pytest summary (2026-12-06: three F's of the dense stage left no name)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

from wcache.testing.engine_acceptance import RESULTS_ENV

CONFTEST = Path(__file__).resolve().parents[1] / "gpu_engine" / "conftest.py"


def _conftest():
    spec = importlib.util.spec_from_file_location("gpu_engine_conftest", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failure_is_appended_beside_the_results_file(tmp_path, monkeypatch):
    conftest = _conftest()
    results = tmp_path / "results.jsonl"
    report = types.SimpleNamespace(
        nodeid="tests/gpu_engine/test_x.py::test_y[bf16]", when="call", longreprtext="E boom"
    )
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    conftest._record_failure(report)  # no results file named: nothing written, no error
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(RESULTS_ENV, str(results))
    conftest._record_failure(report)
    conftest._record_failure(types.SimpleNamespace(**{**vars(report), "when": "setup"}))
    text = (tmp_path / "results.jsonl.failures").read_text()
    assert text.count("===== tests/gpu_engine/test_x.py::test_y[bf16]") == 2
    assert "(call) FAILED\nE boom" in text and "(setup) FAILED" in text
