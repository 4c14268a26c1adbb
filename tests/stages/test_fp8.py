"""wcache/stages/fp8.py: FP8 quantization (tensor, channel, block), CUTLASS padding
and max-scale requantization equal vLLM's functions."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec
from wcache.stages import fp8 as F8

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


from tests.helpers.cuda_stage_inputs import H200, cfg, fp8_from_bits, seeded_gen, u8  # noqa: E402


@given(
    st.sampled_from([(16, 32), (100, 64), (130, 200)]),
    st.integers(0, 2**16),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_quantize_per_tensor_equals_vllm_torch_fallback(shape, seed, dtype):
    """Per-tensor FP8 == vLLM's _fp8_scale + QuantFP8.forward_native (the static op's fallback)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax

    w = (torch.randn(*shape, generator=seeded_gen(seed)) * 0.1).to(dtype)
    scale = online._fp8_scale(weight_amax(w).reshape(1))
    with set_current_vllm_config(VllmConfig()):
        qf = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
        expected, _ = qf.forward_native(w, scale)
    q, s = F8.quantize_per_tensor(w)
    assert torch.equal(scale, s)
    assert torch.equal(u8(expected), u8(q))


@given(st.sampled_from([(16, 32), (100, 64)]), st.integers(0, 2**16), st.booleans())
def test_quantize_per_channel_equals_vllm(shape, seed, zero_row):
    """Per-channel FP8 == vLLM's _fp8_channel_scale + _fp8_quant_per_channel (incl. zero rows)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    w = (torch.randn(*shape, generator=seeded_gen(seed)) * 0.1).to(torch.bfloat16)
    if zero_row:
        w[0] = 0
    scale = online._fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
    expected = online._fp8_quant_per_channel(w, scale)
    q, s = F8.quantize_per_channel(w)
    assert torch.equal(scale, s) and torch.equal(u8(expected), u8(q))


@given(st.sampled_from([(128, 128), (100, 300), (257, 64)]), st.integers(0, 2**16))
def test_per_block_cast_equals_vllm(shape, seed):
    """per_block_cast_to_fp8 == vLLM's (eager body of the torch.compile'd function) with
    the exact division it gets on CUDA: on CPU, torch turns ``tensor / 448.0`` into a
    reciprocal multiply (1 ulp off, seen on the H200 run), so the reference gets a 0-d
    tensor fp8 max."""
    import vllm.utils.deep_gemm as dg

    ref = getattr(dg.per_block_cast_to_fp8, "_torchdynamo_orig_callable", dg.per_block_cast_to_fp8)
    w = torch.randn(*shape, generator=seeded_gen(seed)).to(torch.bfloat16)
    real = dg.get_fp8_min_max
    dg.get_fp8_min_max = lambda: (real()[0], torch.tensor(real()[1], dtype=torch.float32))
    try:
        eq, es = ref(w, [128, 128], False)
    finally:
        dg.get_fp8_min_max = real
    q, s = F8.per_block_cast_to_fp8(w)
    assert torch.equal(u8(eq), u8(q)) and torch.equal(es, s)


def _vllm_cutlass_kernel():
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFP8ScaledMMLinearKernel

    k = object.__new__(CutlassFP8ScaledMMLinearKernel)  # __init__ needs a CUDA build
    k.layer_param_names = ("weight", "weight_scale", "input_scale", "input_zero_point")
    k.logical_output_size = None
    return k


@given(st.sampled_from([(64, 100), (60, 128), (64, 64), (40, 33)]), st.integers(0, 2**16))
def test_cutlass_pad_per_tensor_equals_vllm(kn, seed):
    """Per-tensor CUTLASS K/N padding == vLLM's kernel post-load (weight, strides, width)."""
    k, n = kn
    w = fp8_from_bits(torch.randint(0, 256, (n, k), generator=seeded_gen(seed))).t()
    s = torch.tensor([0.02])
    mod = torch.nn.Module()
    mod.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    mod.weight_scale = torch.nn.Parameter(s.clone(), requires_grad=False)
    kern = _vllm_cutlass_kernel()
    kern.process_weights_after_loading(mod)
    pw, ps = F8.cutlass_pad(w, s)
    assert pw.shape == mod.weight.shape and pw.stride() == mod.weight.stride()
    assert torch.equal(u8(mod.weight.data), u8(pw)) and torch.equal(mod.weight_scale.data, ps)
    out = F8.set_logical_output_size({}, cfg("fp8", k, n), H200, {})
    assert out.attrs[F8.LOGICAL_OUTPUT_ATTR] == kern.logical_output_size == n


def test_vllm_per_channel_cutlass_pad_crashes_and_ours_pads_scale_with_one():
    """vLLM 0.32 raises on per-channel scales with N % 16 != 0 (N=100), vLLM 0.33 pads; ours
    pads the weight with zeros and the (N, 1) scale with 1.0 to (112, 1), as 0.33 does."""
    from tests.helpers.vllm_layers import cutlass_pad_n_raises

    w = fp8_from_bits(torch.randint(0, 256, (100, 64), generator=seeded_gen(1))).t()
    s = torch.rand(100, 1, generator=seeded_gen(2)) + 0.01
    mod = torch.nn.Module()
    mod.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    mod.weight_scale = torch.nn.Parameter(s.clone(), requires_grad=False)
    pw, ps = F8.cutlass_pad(w, s)
    if cutlass_pad_n_raises():
        with pytest.raises(AssertionError, match="Overwriting existing tensor attribute"):
            _vllm_cutlass_kernel().process_weights_after_loading(mod)
    else:
        _vllm_cutlass_kernel().process_weights_after_loading(mod)
        assert torch.equal(u8(pw), u8(mod.weight)) and pw.stride() == mod.weight.stride()
        assert torch.equal(ps, mod.weight_scale)
    assert tuple(pw.shape) == (64, 112) and pw.stride() == (1, 64)
    assert torch.equal(u8(pw[:, :100]), u8(w)) and torch.equal(
        u8(pw[:, 100:]), torch.zeros(64, 12, dtype=torch.uint8)
    )
    assert tuple(ps.shape) == (112, 1)
    assert torch.equal(ps[:100], s) and torch.equal(ps[100:], torch.ones(12, 1))


def test_requantize_with_max_scale_matches_vllm_with_torch_quant():
    """Unfused per-shard scales -> max scale, shards requantized (vLLM's requantize_with_max_scale
    with its static quant op replaced by the QuantFP8 torch fallback); input not modified."""
    from vllm.model_executor.layers.quantization.utils import w8a8_utils

    gen = seeded_gen(5)
    w = fp8_from_bits(torch.randint(0, 256, (96, 64), generator=gen))
    s = torch.tensor([0.01, 0.03, 0.02])
    widths = (32, 32, 32)

    def static_quant(x, scale):
        q = (x.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-448, 448)
        return q.to(torch.float8_e4m3fn), scale

    ref_w = w.clone()
    with mock.patch.object(w8a8_utils.ops, "scaled_fp8_quant", static_quant):
        exp_s, exp_w = w8a8_utils.requantize_with_max_scale(ref_w, s.clone(), list(widths))
    before = w.clone()
    got_w, got_s = F8.requantize_with_max_scale(w, s, widths)
    assert torch.equal(exp_s, got_s) and torch.equal(u8(exp_w), u8(got_w))
    assert torch.equal(u8(before), u8(w))


#: Bad inputs of the fp8 stages and the exact error each raises.
BAD_INPUTS = [
    (lambda: F8.per_block_cast_to_fp8(torch.zeros(2, 2, 2)), F8.Fp8LayoutError, "2-D"),
    (
        lambda: F8.process_weight_strategy(
            {"weight": torch.zeros(4, 4).to(torch.float8_e4m3fn), "weight_scale": torch.ones(1)},
            LayerConfig(QuantSpec("fp8", strategy="block"), 4, 4),
            H200,
            {},
        ),
        F8.Fp8LayoutError,
        "cutlass_block",
    ),
    (
        lambda: F8.reduce_input_scale(
            {}, LayerConfig(QuantSpec("fp8", static_input=True), 4, 4), H200, {}
        ),
        F8.Fp8LayoutError,
        "no input_scale",
    ),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_inputs_raise_exact_errors(call, error, message):
    """Each bad input raises its wcache error class (a ValueError) with an actionable message."""
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and info.value.code
