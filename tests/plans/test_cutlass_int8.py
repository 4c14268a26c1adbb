"""wcache/plans/cutlass_int8.py: compressed-tensors W8A8 INT8 on CUTLASS checked on CPU
(every stage is plain torch): restore(export(prepare)) == load with nothing replayed,
the loaded weight is the checkpoint's transpose and ``azp_adj`` its column sums, and
the refusals name their reasons. The contract against vLLM's own layer is a row of
tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.helpers.cuda_cases import (
    CPU,
    H200,
    assert_stages_pure,
    attr_paths,
    cuda_config,
    cutlass_int8_cases,
    roundtrip,
)
from wcache.core import NoPlan, Target
from wcache.plans import cutlass_int8 as cutlass_int8_plans
from wcache.plans.registry import plan_for
from wcache.shell import snapshot


@settings(max_examples=15, deadline=None)
@given(cutlass_int8_cases())
def test_restore_invariant_and_layout(case):
    """restore(export(prepare)) == load (every tensor's bytes, shape, strides); every
    stage is pure; no stage is replayed; the weight is the checkpoint's ``[K, N]``
    transpose (strides ``(1, K)``), and asymmetric activations get ``azp_adj`` = the
    int32 column sums ``[1, N]`` (static: times the folded zero point)."""
    cfg, tensors = case
    plan = plan_for(cfg, target=H200).plan
    assert plan is cutlass_int8_plans.W8A8_INT8
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, H200)
    assert snapshot(loaded, attr_paths(plan)) == snapshot(restored, attr_paths(plan))
    assert_stages_pure(plan, tensors, cfg, H200)
    assert [] == [s.name for s in plan.stages if s.replayable]
    assert torch.equal(tensors["weight"].t(), loaded.weight)
    assert (1, cfg.size_k) == loaded.weight.stride()
    colsum = tensors["weight"].to(torch.int32).sum(dim=1).reshape(1, -1)
    if cfg.quant.input_symmetric:
        assert "azp_adj" not in prepared.tensors
    elif cfg.quant.static_input:  # times the folded zero point
        assert torch.equal(loaded.input_zero_point * colsum, loaded.azp_adj)
    else:
        assert torch.equal(colsum, loaded.azp_adj)


@pytest.mark.parametrize(
    "cfg,target,reason",
    [
        (
            cuda_config("ct_w8a8_int8", 64, 64, bits=8, strategy="group", kernel="cutlass_int8"),
            H200,
            "tensor/channel",
        ),
        (
            cuda_config("ct_w8a8_int8", 64, 64, bits=8, strategy="channel", kernel="cutlass_int8"),
            Target("cuda", (7, 0)),
            "compute capability >= 7.5",
        ),
        (
            cuda_config("ct_w8a8_int8", 64, 64, bits=8, strategy="channel", kernel="cutlass_int8"),
            CPU,
            "CUTLASS INT8 is a CUDA kernel; the target is cpu",
        ),
        (
            cuda_config(
                "ct_w8a8_int8",
                64,
                64,
                bits=8,
                strategy="channel",
                kind="moe",
                kernel="cutlass_int8",
            ),
            H200,
            "linear layers, not moe",
        ),
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Group scales, a capability below sm75, a CPU target and a MoE layer raise NoPlan
    whose message names the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan
