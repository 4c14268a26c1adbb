"""CUDA-layout stages (Marlin, FP8, MXFP8, NVFP4) against vLLM 0.32's pure-torch
references, bit for bit, on CPU; plus purity and the bad-input table."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import reference_kernels as R
from wcache.core import LayerConfig, QuantSpec, Target
from wcache.stages import fp8 as F8
from wcache.stages import marlin as M
from wcache.stages import mxfp8 as MX
from wcache.stages import nvfp4 as F4
from wcache.stages import packing as P

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as mfp8  # noqa: E402 (after pytest.importorskip)
from vllm.model_executor.layers.quantization.utils import (  # noqa: E402 (after pytest.importorskip)
    mxfp8_utils,
    nvfp4_utils,
)
from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu  # noqa: E402 (after pytest.importorskip)
from vllm.model_executor.layers.quantization.utils.quant_utils import pack_cols  # noqa: E402 (after pytest.importorskip)

H200 = Target("cuda", (9, 0))
#: float8_e4m3fn NaN bit patterns; drawn FP8 bytes avoid them.
FP8_NAN_BITS = (0x7F, 0xFF)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def fp8_from_bits(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int32)
    for nan in FP8_NAN_BITS:
        b = torch.where(b == nan, torch.zeros_like(b), b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def cfg(method="gptq", k=128, n=128, bits=4, g=-1, zp=False, dtype="bfloat16", extra=()):
    return LayerConfig(
        QuantSpec(method, num_bits=bits, group_size=g, zero_point=zp),
        size_k=k,
        size_n=n,
        params_dtype=dtype,
        extra=extra,
    )


# --------------------------------------------------------------------------- Marlin


@given(st.sampled_from([4, 8]), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**16))
def test_repack_equals_marlin_weights(bits, k_tiles, n_blocks, seed):
    """marlin_repack(gptq_pack(q)) == marlin_weights(q, K, N, bits, get_weight_perm(bits))."""
    k, n = 16 * k_tiles, 64 * n_blocks
    q = torch.randint(0, 2**bits, (k, n), generator=_gen(seed), dtype=torch.int32)
    packed = P.pack_int32(q.t().contiguous(), bits, -1).t().contiguous()
    expected = mut.marlin_weights(q, k, n, bits, mut.get_weight_perm(bits))
    assert torch.equal(expected, M.marlin_repack(packed, k, n, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_perm_equals_vllm(bits):
    """marlin_weight_perm == get_weight_perm (16-bit activations)."""
    assert torch.equal(mut.get_weight_perm(bits), M.marlin_weight_perm(bits))


@given(
    st.sampled_from([-1, 32, 64, 128]),
    st.sampled_from([128, 256]),
    st.sampled_from([64, 128, 192]),
    st.integers(0, 2**16),
)
def test_permute_scales_equals_vllm(g, k, n, seed):
    """marlin_permute_scales matches vLLM for grouped and channelwise scales."""
    rows = k // g if g > 0 else 1
    s = torch.randn(rows, n, generator=_gen(seed)).to(torch.bfloat16)
    assert torch.equal(mu.marlin_permute_scales(s, k, n, g), M.marlin_permute_scales(s, k, n, g))


@given(
    st.sampled_from([4, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([64, 128, 256]),
    st.integers(0, 2**16),
)
def test_zero_points_and_pack_equal_vllm(bits, groups, n, seed):
    """marlin_zero_points and pack_int32 match vLLM's marlin_zero_points / pack_cols."""
    zp = torch.randint(0, 2**bits, (groups, n), generator=_gen(seed), dtype=torch.int32)
    assert torch.equal(
        mu.marlin_zero_points(zp, groups, n, bits), M.marlin_zero_points(zp, groups, n, bits)
    )
    assert torch.equal(pack_cols(zp, bits, groups, n), P.pack_int32(zp, bits, -1))


@given(
    st.sampled_from([32, 64, 128]),
    st.sampled_from([128, 256]),
    st.sampled_from([64, 128, 256]),
    st.integers(0, 2**16),
)
def test_awq_zero_point_pipeline_equals_awq_to_marlin_zero_points(g, k, n, seed):
    """AWQ -> standard -> marlin.permute_zero_points stage == vLLM's awq_to_marlin_zero_points."""
    gen = _gen(seed)
    zp = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32)
    awq = P.pack_awq(zp, 4)
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    _, std = P.awq_to_standard(qweight, awq, 4)
    stage_ = M.permute_zero_points_stage("qzeros")
    out = stage_({"qzeros": std}, cfg("awq", k, n, 4, g, True), H200, {})
    assert torch.equal(mu.awq_to_marlin_zero_points(awq, k // g, n, 4), out.tensors["qzeros"])


@given(st.sampled_from([64, 128, 256]), st.integers(0, 2**16))
def test_permute_bias_equals_vllm(n, seed):
    """marlin_permute_bias matches vLLM."""
    b = torch.randn(n, generator=_gen(seed)).to(torch.bfloat16)
    assert torch.equal(mu.marlin_permute_bias(b), M.marlin_permute_bias(b))


@given(st.integers(1, 700), st.integers(1, 700), st.sampled_from([-1, 32, 64, 128]))
def test_padded_nk_equals_vllm(n, k, g):
    """marlin_padded_nk picks the same tile family as vLLM."""
    assert mu.marlin_padded_nk(n, k, g) == M.marlin_padded_nk(n, k, g)


@pytest.mark.parametrize(
    "method,bits,g,k,n,zp",
    [
        ("gptq", 4, 64, 256, 96, False),
        ("gptq", 8, -1, 192, 96, False),
        ("awq", 4, 128, 256, 96, True),
        ("ct_w4a16", 4, 32, 128, 64, True),
    ],
)
def test_marlin_stages_equal_vllm_kernel_composition(method, bits, g, k, n, zp):
    """repack/permute_scales/zero_points/bias stages == MarlinLinearKernel's composition of
    vLLM helpers (marlin_pad_*, marlin_weights as the repack, marlin_permute_*), with padding."""
    gen = _gen(11)
    groups = k // g if g > 0 else 1
    pn, pk = mu.marlin_padded_nk(n, k, g)
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    packed = P.pack_int32(q.t().contiguous(), bits, -1).t().contiguous()
    s = torch.rand(groups, n, generator=gen).to(torch.bfloat16)
    c = cfg(method, k, n, bits, g, zp)
    got_q = M.repack_stage("qweight")({"qweight": packed}, c, H200, {}).tensors["qweight"]
    qp = torch.nn.functional.pad(q, (0, pn - n, 0, pk - k))
    assert torch.equal(mut.marlin_weights(qp, pk, pn, bits, mut.get_weight_perm(bits)), got_q)
    got_s = M.permute_scales_stage("scales")({"scales": s}, c, H200, {}).tensors["scales"]
    exp_s = mu.marlin_permute_scales(mu.marlin_pad_scales(s, n, k, pn, pk, g), pk, pn, g)
    assert torch.equal(exp_s, got_s)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got_b = M.permute_bias({"bias": bias}, c, H200, {}).tensors["bias"]
    assert torch.equal(mu.marlin_permute_bias(mu.marlin_pad_dim(bias, n, pn)), got_b)
    if zp:
        z = torch.randint(0, 2**bits, (groups, n), generator=gen, dtype=torch.int32)
        std = P.pack_int32(z, bits, -1).t().contiguous()
        got_z = M.permute_zero_points_stage("qzeros")({"qzeros": std}, c, H200, {}).tensors[
            "qzeros"
        ]
        pg = pk // g if g > 0 else 1
        exp_z = mu.marlin_zero_points(mu.marlin_pad_scales(z, n, k, pn, pk, g), pg, pn, bits)
        assert torch.equal(exp_z, got_z)


# --------------------------------------------------------------------------- FP8 / MXFP8 Marlin


@given(
    st.sampled_from([64, 100, 128]),
    st.sampled_from([64, 128, 96]),
    st.integers(0, 2**16),
    st.sampled_from(["bfloat16", "float16"]),
)
def test_fp8_marlin_stages_equal_vllm(n, k, seed, dtype):
    """FP8 weight-only Marlin: pack_fp8_to_int32 + repack, and the scale cast/expand/pad/
    permute/exponent-bias, equal vLLM's prepare_fp8_layer_for_marlin pieces."""
    gen = _gen(seed)
    w = fp8_from_bits(torch.randint(0, 256, (n, k), generator=gen))
    c = cfg(
        "ct_w8a8_fp8", k, n, 8, -1, dtype=dtype, extra=(("logical_widths", (n // 2, n - n // 2)),)
    )
    pn, pk = mu.marlin_padded_nk(n, k, -1)
    packed = mfp8.pack_fp8_to_int32(w, size_k_first=False).T.contiguous()
    assert torch.equal(packed, M.pack_fp8_to_int32(w))
    vals = P.unpack_int32(packed.t().contiguous(), 8, -1).t()
    vals = torch.nn.functional.pad(vals, (0, pn - n, 0, pk - k))
    expected = mut.marlin_weights(vals, pk, pn, 8, mut.get_weight_perm(8))
    got_w = M.repack_fp8_weight({"weight": w}, c, H200, {}).tensors["weight"]
    assert torch.equal(expected, got_w)
    scale = torch.rand(2, generator=gen) * 0.01 + 1e-4
    sd = getattr(torch, dtype)
    exp = scale.to(sd).view(1, -1).repeat_interleave(torch.tensor(c.get("logical_widths")), dim=1)
    exp = mu.marlin_permute_scales(mu.marlin_pad_scales(exp, n, k, pn, pk, -1), pk, pn, -1)
    exp = mfp8.fp8_fused_exponent_bias_into_scales(exp)
    got = M.permute_fp8_scales({"weight_scale": scale}, c, H200, {}).tensors["weight_scale"]
    assert got.dtype == sd and torch.equal(exp, got)


@given(st.sampled_from([64, 100, 128]), st.sampled_from([64, 96, 256]), st.integers(0, 2**16))
def test_mxfp8_marlin_scales_equal_vllm(n, k, seed):
    """MXFP8 Marlin scales == vLLM's cast/transpose/pad/permute + mxfp8_marlin_process_scales."""
    q, s = mxfp8_utils._mxfp8_e4m3_quantize_torch(torch.randn(n, k, generator=_gen(seed)))
    c = cfg("mxfp8", k, n, 8, -1)
    pn, pk = mu.marlin_padded_nk(n, k, 32)
    exp = s.view(torch.float8_e8m0fnu).to(torch.bfloat16).T.contiguous()
    exp = mu.marlin_permute_scales(mu.marlin_pad_scales(exp, n, k, pn, pk, 32), pk, pn, 32)
    exp = mfp8.mxfp8_marlin_process_scales(exp)
    got = M.permute_mxfp8_scales({"weight_scale": s}, c, H200, {}).tensors["weight_scale"]
    assert torch.equal(u8(exp), u8(got))


# --------------------------------------------------------------------------- FP8 quantization


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

    w = (torch.randn(*shape, generator=_gen(seed)) * 0.1).to(dtype)
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

    w = (torch.randn(*shape, generator=_gen(seed)) * 0.1).to(torch.bfloat16)
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
    w = torch.randn(*shape, generator=_gen(seed)).to(torch.bfloat16)
    real = dg.get_fp8_min_max
    dg.get_fp8_min_max = lambda: (real()[0], torch.tensor(real()[1], dtype=torch.float32))
    try:
        eq, es = ref(w, [128, 128], False)
    finally:
        dg.get_fp8_min_max = real
    q, s = F8.per_block_cast_to_fp8(w)
    assert torch.equal(u8(eq), u8(q)) and torch.equal(es, s)


@given(st.sampled_from([(4, 32), (100, 64), (3, 256)]), st.integers(0, 2**16), st.booleans())
def test_mxfp8_quantize_equals_vllm(shape, seed, with_zero_block):
    """mxfp8_e4m3_quantize == vLLM's _mxfp8_e4m3_quantize_torch (values and E8M0 codes)."""
    w = (torch.randn(*shape, generator=_gen(seed)) * 3).to(torch.bfloat16)
    if with_zero_block:
        w[0, :32] = 0
    eq, es = mxfp8_utils._mxfp8_e4m3_quantize_torch(w)
    q, s = MX.mxfp8_e4m3_quantize(w)
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
    w = fp8_from_bits(torch.randint(0, 256, (n, k), generator=_gen(seed))).t()
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

    w = fp8_from_bits(torch.randint(0, 256, (100, 64), generator=_gen(1))).t()
    s = torch.rand(100, 1, generator=_gen(2)) + 0.01
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

    gen = _gen(5)
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


# --------------------------------------------------------------------------- NVFP4


def _e4m3_scales(gen, shape):
    return (
        torch.randint(1, 0x58, shape, generator=gen, dtype=torch.int32)
        .to(torch.uint8)
        .view(torch.float8_e4m3fn)
    )


@given(
    st.sampled_from([1, 100, 128, 300]),
    st.sampled_from([4, 6, 8, 12, 3]),
    st.integers(0, 2**16),
    st.booleans(),
)
def test_swizzle_equals_vllm_and_inverts(m, kg, seed, batched):
    """swizzle_blockscale == vLLM's (its .cuda() patched to a no-op on CPU), for 2-D and 3-D
    scales; unswizzle_blockscale inverts it for every K/16, including K/16 % 4 != 0."""
    shape = (2, m, kg) if batched else (m, kg)
    s = _e4m3_scales(_gen(seed), shape)
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        expected = nvfp4_utils.swizzle_blockscale(s)
    got = F4.swizzle_blockscale(s)
    assert got.shape == expected.shape and torch.equal(u8(expected), u8(got))
    assert torch.equal(u8(F4.unswizzle_blockscale(got, m, kg)), u8(s))


@given(st.sampled_from([1, 100, 128]), st.sampled_from([4, 8, 12]), st.integers(0, 2**16))
def test_unswizzle_equals_vllm_convert_when_k_groups_multiple_of_4(m, kg, seed):
    """Where vLLM's convert_swizzled_to_linear is right (K/16 % 4 == 0), ours equals it."""
    s = _e4m3_scales(_gen(seed), (m, kg))
    sw = F4.swizzle_blockscale(s)
    expected = emu.convert_swizzled_to_linear(sw, m, kg * 16, 16)
    assert torch.equal(u8(expected), u8(F4.unswizzle_blockscale(sw, m, kg)))


@pytest.mark.parametrize("kg", [3, 6])
def test_vllm_convert_swizzled_to_linear_bug_when_k_groups_not_multiple_of_4(kg):
    """vLLM's convert_swizzled_to_linear returns the padded columns when K/16 % 4 != 0
    (it slices by K, not K/16); ours returns exactly [m, K/16]."""
    m = 100
    s = _e4m3_scales(_gen(kg), (m, kg))
    sw = F4.swizzle_blockscale(s)
    wrong = emu.convert_swizzled_to_linear(sw, m, kg * 16, 16)
    assert wrong.shape[1] != kg
    assert F4.unswizzle_blockscale(sw, m, kg).shape == (m, kg)


@given(st.sampled_from([32, 100, 128]), st.sampled_from([64, 128]), st.integers(0, 2**16))
def test_nvfp4_dequant_equals_vllm_dequantize_to_dtype(n, k, seed):
    """The NVFP4 reference dequantization (swizzled scales) == vLLM's dequantize_to_dtype
    and break_fp4_bytes (K/16 % 4 == 0, where vLLM's helper is correct)."""
    gen = _gen(seed)
    w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    s = _e4m3_scales(gen, (n, k // 16))
    gs = torch.tensor(0.0123)
    sw = F4.swizzle_blockscale(s)
    assert torch.equal(emu.break_fp4_bytes(w, torch.float32), R.e2m1_decode(w))
    expected = emu.dequantize_to_dtype(w, sw, gs, torch.float32, 16, swizzle=True)
    assert torch.equal(expected, R.nvfp4_weight(w, sw, gs, n, k))


@given(st.sampled_from([1, 31, 32, 100]), st.sampled_from([8, 16, 24, 48]), st.integers(0, 99))
def test_pad_nvfp4_weight_equals_vllm(n, kb, seed):
    """pad_nvfp4_weight_for_cutlass == vLLM's (rows to 32, FP4 columns to 32)."""
    w = torch.randint(0, 256, (n, kb), generator=_gen(seed), dtype=torch.int32).to(torch.uint8)
    expected, _ = nvfp4_utils.pad_nvfp4_weight_for_cutlass(w)
    assert torch.equal(expected, F4.pad_nvfp4_weight_for_cutlass(w))


def test_fuse_activation_scale_returns_new_tensors():
    """The MoE activation-scale fuse returns products as new tensors, inputs untouched."""
    t = {
        "w13_weight_scale_2": torch.tensor([0.5, 0.25]),
        "w13_input_scale": torch.tensor([2.0, 4.0]),
        "w2_weight_scale_2": torch.tensor([1.0, 3.0]),
        "w2_input_scale": torch.tensor([0.5, 0.5]),
    }
    before = {k: (v.clone(), v._version) for k, v in t.items()}
    out = F4.fuse_moe_activation_scale(t, cfg("modelopt_fp4"), Target("cuda", (10, 0)), {})
    assert torch.equal(out.tensors["w13_weight_scale_2"], torch.tensor([1.0, 1.0]))
    assert torch.equal(out.tensors["w2_weight_scale_2"], torch.tensor([0.5, 1.5]))
    for k, (v, ver) in before.items():
        assert torch.equal(t[k], v) and t[k]._version == ver


# --------------------------------------------------------------------------- NVFP4 on Marlin

from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as mfp4  # noqa: E402 (after pytest.importorskip)

from wcache.stages import marlin_fp4 as MF4  # noqa: E402 (grouped with the section it serves)


def _vllm_repack_reference(b_q_weight, size_k, size_n, num_bits=4, is_a_8bit=False, perm=None):
    """vLLM's pure reference for ``ops.gptq_marlin_repack`` (``marlin_weights`` over
    the unpacked GPTQ rows), what its own kernel test compares the CUDA op with."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    q = unpack_quantized_values_into_int32(b_q_weight, scalar_types.uint4, packed_dim=0)
    return mut.marlin_weights(q.contiguous(), size_k, size_n, num_bits, mut.get_weight_perm(4))


def _nvfp4_scales(gen, shape, small=False):
    """Positive float8_e4m3fn block scales; ``small`` as a checkpoint whose global scale
    is 1 (scales far below 448, so vLLM rescales them by a power of two)."""
    s = torch.rand(shape, generator=gen) * (0.05 if small else 400) + (0.002 if small else 0.5)
    return s.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("n,k", [(128, 256), (100, 80), (64, 128), (256, 64)])
def test_fp4_marlin_repack_equals_vllm(n, k):
    """fp4_marlin_repack == vLLM's weight path of prepare_fp4_layer_for_marlin (view as
    int32, transpose, marlin_pad_qweight, gptq_marlin_repack reference), padded shapes
    included."""
    w = torch.randint(0, 256, (n, k // 2), generator=_gen(n + k), dtype=torch.uint8)
    padded_n, padded_k = mu.marlin_padded_nk(n, k, MF4.NVFP4_GROUP_SIZE)
    q = mu.marlin_pad_qweight(w.view(torch.int32).T.contiguous(), n, k, padded_n, padded_k)
    expected = _vllm_repack_reference(q, padded_k, padded_n)
    assert torch.equal(expected, MF4.fp4_marlin_repack(w, n, k, padded_n, padded_k))


@pytest.mark.parametrize(
    "n,k,dtype,small,zeros",
    [
        (128, 256, torch.bfloat16, False, False),
        (128, 256, torch.bfloat16, True, False),  # rescaled by a power of two > 1
        (100, 80, torch.bfloat16, True, True),  # padded; some zero scales
        (64, 128, torch.float16, True, False),  # fp16: never rescaled
    ],
)
def test_nvfp4_marlin_process_scales_stage_equals_vllm(n, k, dtype, small, zeros):
    """marlin_fp4.process_scales == vLLM's scale path of prepare_fp4_layer_for_marlin
    (transpose, cast, pad, permute, nvfp4_marlin_process_scales, the global scale
    processed and divided by the same factor), bit for bit."""
    gen = _gen(n * k)
    scales = _nvfp4_scales(gen, (n, k // 16), small)
    if zeros:
        scales[::7] = 0
    g = torch.tensor(0.0123 if not small else 1.0)
    padded_n, padded_k = mu.marlin_padded_nk(n, k, 16)
    s = scales.T.contiguous().to(dtype)
    s = mu.marlin_pad_scales(s, n, k, padded_n, padded_k, 16)
    s = mu.marlin_permute_scales(s, padded_k, padded_n, 16)
    exp_s, factor = mfp4.nvfp4_marlin_process_scales(s, a_dtype=dtype)
    exp_g = mfp4.nvfp4_marlin_process_global_scale(g.to(torch.float32), dtype) / factor
    config = cfg("modelopt_fp4", k, n, 4, 16, dtype=str(dtype).removeprefix("torch."))
    t = {"weight_scale": scales, "weight_global_scale": g}
    before = {key: (v.clone(), v._version) for key, v in t.items()}
    out = MF4.process_scales(t, config, H200, {}).tensors
    assert (factor > 1.0) == (small and dtype == torch.bfloat16)
    assert exp_s.dtype == out["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(u8(exp_s), u8(out["weight_scale"]))
    assert torch.equal(exp_g, out["weight_global_scale"])
    for key, (v, ver) in before.items():
        assert torch.equal(
            u8(t[key]) if v.dtype.itemsize == 1 else t[key], u8(v) if v.dtype.itemsize == 1 else v
        )
        assert t[key]._version == ver


def _moe_checkpoint(e, hidden, inter, shards, seed, small=False):
    gen = _gen(seed)
    u8_ = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)  # noqa: E731 (a one-line local function)
    return {
        "w13_weight": u8_(e, shards * inter, hidden // 2),
        "w13_weight_scale": _nvfp4_scales(gen, (e, shards * inter, hidden // 16), small),
        "w13_weight_scale_2": torch.rand(e, generator=gen) * 0.01 + 1e-3,
        "w2_weight": u8_(e, hidden, inter // 2),
        "w2_weight_scale": _nvfp4_scales(gen, (e, hidden, inter // 16), small),
        "w2_weight_scale_2": torch.rand(e, generator=gen) * 0.01 + 1e-3,
    }


def _moe_cfg(e, hidden, inter, act_and_mul=True):
    from wcache.core import MoeShape

    shape = MoeShape(
        num_experts=e,
        global_num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        backend="MARLIN",
        experts="MarlinExperts",
        is_act_and_mul=act_and_mul,
    )
    spec = QuantSpec(
        "modelopt_fp4", num_bits=4, group_size=16, layer_kind="moe", kernel="marlin_moe"
    )
    return LayerConfig(spec, 0, 0, params_dtype="bfloat16", name="experts", moe=shape)


@pytest.mark.parametrize(
    "e,hidden,inter,act_and_mul,small",
    [
        (3, 128, 64, True, False),
        (2, 256, 96, True, True),  # intermediate padded to 128 (hidden % 128 == 0: tile 64)
        (2, 192, 64, True, False),  # hidden % 128 != 0: intermediate padded to 128
        (2, 128, 32, False, True),  # non-gated experts, padded
    ],
)
def test_nvfp4_marlin_moe_stages_equal_vllm(monkeypatch, e, hidden, inter, act_and_mul, small):
    """marlin_fp4.repack_moe_weights + process_moe_scales == vLLM's
    prepare_nvfp4_moe_layer_for_marlin (gptq_marlin_repack swapped for its pure
    reference), intermediate padding and one rescale per projection included."""
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "gptq_marlin_repack", _vllm_repack_reference)
    shards = 2 if act_and_mul else 1
    t = _moe_checkpoint(e, hidden, inter, shards, seed=e * hidden + inter, small=small)
    layer = types.SimpleNamespace(
        num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        params_dtype=torch.bfloat16,
    )
    w13, s13, g13, w2, s2, g2 = mfp4.prepare_nvfp4_moe_layer_for_marlin(
        layer,
        t["w13_weight"],
        t["w13_weight_scale"],
        t["w13_weight_scale_2"],
        t["w2_weight"],
        t["w2_weight_scale"],
        t["w2_weight_scale_2"],
        is_act_and_mul=act_and_mul,
    )
    config = _moe_cfg(e, hidden, inter, act_and_mul)
    out = dict(MF4.repack_moe_weights(t, config, H200, {}).tensors)
    out.update(MF4.process_moe_scales(t, config, H200, {}).tensors)
    expected = {
        "w13_weight": w13,
        "w13_weight_scale": s13,
        "w13_weight_scale_2": g13,
        "w2_weight": w2,
        "w2_weight_scale": s2,
        "w2_weight_scale_2": g2,
    }
    for name, value in expected.items():
        got = out[name]
        assert (value.dtype, tuple(value.shape)) == (got.dtype, tuple(got.shape)), name
        assert torch.equal(
            u8(value) if value.dtype.itemsize == 1 else value,
            u8(got) if got.dtype.itemsize == 1 else got,
        ), name


def test_nvfp4_marlin_stages_accept_meta_tensors():
    """The NVFP4 Marlin stages give vLLM's shapes on meta tensors (no values read)."""
    c = cfg("modelopt_fp4", 80, 100, 4, 16)  # padded to (Kp, Np) = (128, 128)
    meta = {
        "weight": torch.empty(100, 40, dtype=torch.uint8, device="meta"),
        "weight_scale": torch.empty(100, 5, dtype=torch.float8_e4m3fn, device="meta"),
        "weight_global_scale": torch.empty((), device="meta"),
    }
    w = MF4.repack_weight(meta, c, H200, {}).tensors["weight"]
    s = MF4.process_scales(meta, c, H200, {}).tensors
    assert (w.device.type, tuple(w.shape), w.dtype) == ("meta", (8, 256), torch.int32)
    assert tuple(s["weight_scale"].shape) == (8, 128)
    assert s["weight_scale"].dtype == torch.float8_e4m3fn
    moe = {k: v.to("meta") for k, v in _moe_checkpoint(2, 256, 96, 2, seed=1).items()}
    mc = _moe_cfg(2, 256, 96)
    out = dict(MF4.repack_moe_weights(moe, mc, H200, {}).tensors)
    out.update(MF4.process_moe_scales(moe, mc, H200, {}).tensors)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "w13_weight": (2, 16, 512),
        "w2_weight": (2, 8, 512),
        "w13_weight_scale": (2, 16, 256),
        "w2_weight_scale": (2, 8, 256),
        "w13_weight_scale_2": (2,),
        "w2_weight_scale_2": (2,),
    }


# --------------------------------------------------------------------------- meta, errors


def test_stages_accept_meta_tensors():
    """Marlin repack/scales, FP8 quantization and the NVFP4 swizzle produce correct shapes on meta."""
    c = cfg("gptq", 256, 96, 4, 64)
    q = torch.empty(32, 96, dtype=torch.int32, device="meta")
    out = M.repack_stage("qweight")({"qweight": q}, c, H200, {}).tensors["qweight"]
    assert out.device.type == "meta" and tuple(out.shape) == (16, 256)
    w = torch.empty(100, 64, dtype=torch.bfloat16, device="meta")
    q8, s8 = F8.quantize_per_channel(w)
    assert tuple(q8.shape) == (100, 64) and tuple(s8.shape) == (100, 1)
    sw = F4.swizzle_blockscale(torch.empty(100, 6, dtype=torch.float8_e4m3fn, device="meta"))
    assert tuple(sw.shape) == (128, 8)


BAD_INPUTS = [
    (
        lambda: M.marlin_repack(torch.zeros(8, 64, dtype=torch.int32), 128, 64, 4),
        M.MarlinLayoutError,
        "pad with marlin_padded_nk",
    ),
    (lambda: M.marlin_weight_perm(3), M.MarlinLayoutError, "4- or 8-bit"),
    (lambda: M.fp8_exponent_bias(torch.float32), M.MarlinLayoutError, "float16 or bfloat16"),
    (
        lambda: M.repack_stage("qweight")(
            {"qweight": torch.zeros(16, 128, dtype=torch.int32)},
            cfg("gptq", 128, 128, 4, 48),
            H200,
            {},
        ),
        M.MarlinLayoutError,
        "group sizes",
    ),
    (lambda: MX.mxfp8_e4m3_quantize(torch.zeros(4, 48)), MX.Mxfp8LayoutError, "divisible by 32"),
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
    (lambda: F4.swizzle_blockscale(torch.zeros(4, 4)), F4.Nvfp4LayoutError, "float8_e4m3fn"),
    (
        lambda: MF4.fp4_marlin_repack(torch.zeros(64, 64, dtype=torch.uint8), 64, 64, 64, 128),
        MF4.MarlinFp4LayoutError,
        r"\[64, 32\] uint8",
    ),
    (
        lambda: MF4.nvfp4_moe_padded_intermediate(96, 64),
        MF4.MarlinFp4LayoutError,
        "hidden_size = 96 unsupported",
    ),
    (
        lambda: MF4.nvfp4_marlin_process_global_scale(torch.ones(()), torch.float32),
        MF4.MarlinFp4LayoutError,
        "float16 or bfloat16",
    ),
    (
        lambda: F4.validate_loaded(
            {"weight_scale": torch.full((4, 4), float("nan")).to(torch.float8_e4m3fn)},
            cfg("modelopt_fp4"),
            H200,
            {},
        ),
        F4.Nvfp4LayoutError,
        "NaN",
    ),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_inputs_raise_exact_errors(call, error, message):
    """Each bad input raises its wcache error class (a ValueError) with an actionable message."""
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and info.value.code
