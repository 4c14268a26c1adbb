"""The ``gpu_engine`` tier: a real vLLM CUDA engine restores each format from a real
``wcache serve`` daemon (the four-load acceptance), on the H200.

Every test here is marked ``gpu_engine`` and skipped unless torch sees a CUDA device
*and* vLLM's CUDA build imports (its ``_C_stable_libtorch`` kernels). Run it with
``bash tools/gpu/run-tier.sh`` on the H200 machine (docs/gpu.md); outcomes are
appended as JSON lines to ``$WCACHE_GPU_ENGINE_RESULTS``
(:func:`wcache.testing.engine_acceptance.record_result`) and rendered into
docs/plans.md's real-engine column (``make docs``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def _vllm_cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "gpu_engine tier: torch sees no CUDA device"
    if importlib.util.find_spec("vllm") is None:
        return "gpu_engine tier: vLLM is not installed (tools/gpu/device-setup.sh)"
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations or ()), ""))
    if not list(root.glob("_C_stable_libtorch*.so")):
        return f"gpu_engine tier: {root} is not vLLM's CUDA build (no _C_stable_libtorch)"
    return None


SKIP_REASON = _vllm_cuda_reason()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=SKIP_REASON or "")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu_engine)
            item.add_marker(pytest.mark.slow)
            if SKIP_REASON:
                item.add_marker(skip)


#: A module that defines this (e.g. ``RESULT_PREFIX = "lora"``) gets one results row per
#: test (:func:`tests.helpers.result_rows.row_for_test`) on the tier's results file, beside
#: the rows its tests record themselves.
RESULT_PREFIX_ATTR = "RESULT_PREFIX"


#: Beside the results file: each failed test's id and traceback, appended as it fails
#: (``<results>.failures``). A tier cut by its timeout (run-tier.sh's ``timeout``) never
#: prints pytest's summary, so the failures would be dots without names.
FAILURES_SUFFIX = ".failures"


def _record_failure(report: pytest.TestReport) -> None:
    from wcache.testing.engine_acceptance import RESULTS_ENV

    results = os.environ.get(RESULTS_ENV)
    if not results:
        return
    with open(results + FAILURES_SUFFIX, "a") as f:
        f.write(f"===== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        _record_failure(outcome.get_result())
    prefix = getattr(getattr(item, "module", None), RESULT_PREFIX_ATTR, None)
    if prefix is None or SKIP_REASON:
        return
    from tests.helpers.result_rows import row_for_test
    from wcache.testing.engine_acceptance import record_result

    row = row_for_test(prefix, item.name, item.nodeid, outcome.get_result())
    if row is not None:
        record_result(row)
