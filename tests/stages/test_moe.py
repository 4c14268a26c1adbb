"""wcache/stages/moe.py: the FP8 requantization equals vLLM's in-place function;
the recorded backend must match the engine's; the shape check names what differs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import moe_cases as mc
from wcache.core import RecordedMismatch
from wcache.plans.fused_moe import UNQUANTIZED_CPU_VEC
from wcache.stages import moe

pytest.importorskip("vllm")


@settings(max_examples=10, deadline=None)
@given(e=st.sampled_from([1, 3]), inter=st.sampled_from([64, 96]), seed=st.integers(0, 2**16))
def test_fp8_requantization_equals_vllms_in_place_function(e, inter, seed):
    """fp8_moe.process_weight_tensor_strategy gives the bytes and max scales of vLLM's
    process_fp8_weight_tensor_strategy_moe (run on a copy, with vLLM's pure-torch
    static quantizer standing in for the CUDA op), and leaves its input untouched."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    h = 128
    t = mc.fp8_tensor_experts(e, h, inter, seed)
    before = t["w13_weight"].clone()
    cfg = mc.moe_config(
        "fp8_moe_tensor",
        "triton",
        experts=e,
        hidden=h,
        inter=inter,
        backend="TRITON",
        experts_cls="TritonExperts",
        strategy="tensor",
    )
    out = moe.process_weight_tensor_strategy(t, cfg, mc.H200, {}).tensors

    from tests.helpers import vllm_layers as VL

    with VL.vllm_context("cpu"):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    orig = fp8_utils.ops.scaled_fp8_quant
    fp8_utils.ops.scaled_fp8_quant = lambda x, scale: quant.forward_native(x, scale)
    try:
        w_ref, s_ref = fp8_utils.process_fp8_weight_tensor_strategy_moe(
            t["w13_weight"].clone(), t["w13_weight_scale"], inter, e
        )
    finally:
        fp8_utils.ops.scaled_fp8_quant = orig
    assert torch.equal(out["w13_weight"].view(torch.uint8), w_ref.view(torch.uint8))
    assert torch.equal(out["w13_weight_scale"], s_ref)
    assert torch.equal(t["w13_weight"].view(torch.uint8), before.view(torch.uint8))


def test_recorded_backend_must_match_the_engines():
    """moe.set_experts_kernel records the daemon's resolved backend; a restore whose
    engine resolved another backend raises RecordedMismatch naming both."""
    from wcache.core import LayerState

    config, tensors, target = mc.unquantized_cpu().example()
    bound = UNQUANTIZED_CPU_VEC.bind(config, target)
    recorded = {"moe.set_experts_kernel": {"backend": "CPU", "experts": "X86CPUUnquantizedExperts"}}
    with pytest.raises(RecordedMismatch, match="X86CPUUnquantizedExperts"):
        bound.restore_run(LayerState(tensors=tensors), recorded)


@pytest.mark.parametrize(
    "tensors, match",
    [
        (
            {"w13_weight": torch.zeros(2, 64, 32), "w2_weight": torch.zeros(2, 32, 32)},
            "experts of hidden size",
        ),
        (
            {"w13_weight": torch.zeros(2, 60, 64), "w2_weight": torch.zeros(2, 64, 32)},
            "rows for 2 shard",
        ),
        (
            {"w13_weight": torch.zeros(3, 64, 64), "w2_weight": torch.zeros(3, 64, 32)},
            "holds 3 experts",
        ),
    ],
)
def test_shape_check_refuses_experts_of_another_layer(tensors, match):
    """moe.validate_expert_shapes names what does not fit the layer's MoeShape."""
    cfg = mc.moe_config(
        "unquantized_moe",
        "triton",
        experts=2,
        hidden=64,
        inter=32,
        backend="TRITON",
        experts_cls="TritonExperts",
    )
    with pytest.raises(moe.MoeLayoutError, match=match):
        moe.validate_expert_shapes(tensors, cfg, mc.H200, {})
