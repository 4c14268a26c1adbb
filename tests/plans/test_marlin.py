"""wcache/plans/marlin.py: the Marlin plans for AWQ, GPTQ and compressed-tensors W4A16,
checked on CPU: restore(export(prepare)) == load, the Marlin-layout forward equals the
checkpoint's dequantized forward bit for bit (padded tails zero), and the refusals
(fused MoE, int8/fp8 activations, a CPU target) name their reasons. The contracts
against vLLM's own layers are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings

from tests.helpers import reference_kernels as R
from tests.helpers.cuda_cases import (
    CPU,
    H200,
    assert_restore_invariant,
    cuda_config,
    marlin_int_cases,
)
from wcache.core import (
    NoPlan,
    QuantSpec,
    Target,
)
from wcache.plans.registry import plan_for


@settings(max_examples=20)
@given(marlin_int_cases())
def test_marlin_int_restore_invariant_and_checkpoint_forward(case):
    """AWQ/GPTQ/CT-W4A16 Marlin: restore == load, and the Marlin-layout forward equals
    the checkpoint's dequantized forward bit for bit (padding sliced away)."""
    cfg, tensors = case
    plan, loaded, _, x, out = assert_restore_invariant(cfg, tensors)
    assert plan.kernel == "marlin"
    assert torch.equal(R.int_checkpoint_forward(tensors, cfg, x), out)
    w_name = "weight_packed" if cfg.quant.method == "ct_w4a16" else "qweight"
    vals = R.marlin_unrepack(getattr(loaded, w_name), cfg.quant.num_bits)
    tail = torch.cat([vals[cfg.size_k :].reshape(-1), vals[:, cfg.size_n :].reshape(-1)])
    assert torch.equal(tail, torch.zeros_like(tail))  # padded tails are zero


@pytest.mark.parametrize(
    "cfg,target,reason",
    [
        (
            cuda_config("awq", 128, 128, bits=4, g=64, zp=True, kind="moe", kernel="marlin"),
            H200,
            "fused-MoE",
        ),
        (
            cuda_config("gptq", 128, 128, bits=4, g=64, kind="moe", kernel="marlin"),
            H200,
            "fused-MoE",
        ),
        (
            evolve(
                cuda_config("gptq", 128, 128, bits=4, g=64),
                quant=QuantSpec(
                    "gptq",
                    num_bits=4,
                    group_size=64,
                    kernel="marlin",
                    options=(("marlin_input_dtype", "int8"),),
                ),
            ),
            H200,
            "int8 activations",
        ),
        (
            evolve(
                cuda_config("ct_w4a16", 128, 128, bits=4, g=64),
                quant=QuantSpec(
                    "ct_w4a16",
                    num_bits=4,
                    group_size=64,
                    kernel="marlin",
                    options=(("marlin_input_dtype", "fp8"),),
                ),
            ),
            H200,
            "fp8 activations",
        ),
        (
            cuda_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"),
            Target("cuda", (9, 0), env=(("VLLM_MARLIN_INPUT_DTYPE", "fp8"),)),
            "fp8 activations",
        ),
        (cuda_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"), CPU, "CUDA kernel"),
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Unsupported Marlin combinations (MoE layers, int8/fp8 activations, a CPU target)
    raise NoPlan whose message names the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan
