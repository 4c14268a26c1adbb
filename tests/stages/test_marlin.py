"""wcache/stages/marlin.py: the Marlin repack, permutations, zero points, padding
and the FP8/MXFP8 Marlin scales equal vLLM's functions bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.stages import marlin as M
from wcache.stages import packing as P

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")

from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as mfp8  # noqa: E402 (after pytest.importorskip)
from vllm.model_executor.layers.quantization.utils import (  # noqa: E402 (after pytest.importorskip)
    mxfp8_utils,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import pack_cols  # noqa: E402 (after pytest.importorskip)

from tests.helpers.cuda_stage_inputs import H200, cfg, fp8_from_bits, seeded_gen, u8  # noqa: E402


@given(st.sampled_from([4, 8]), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**16))
def test_repack_equals_marlin_weights(bits, k_tiles, n_blocks, seed):
    """marlin_repack(gptq_pack(q)) == marlin_weights(q, K, N, bits, get_weight_perm(bits))."""
    k, n = 16 * k_tiles, 64 * n_blocks
    q = torch.randint(0, 2**bits, (k, n), generator=seeded_gen(seed), dtype=torch.int32)
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
    s = torch.randn(rows, n, generator=seeded_gen(seed)).to(torch.bfloat16)
    assert torch.equal(mu.marlin_permute_scales(s, k, n, g), M.marlin_permute_scales(s, k, n, g))


@given(
    st.sampled_from([4, 8]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([64, 128, 256]),
    st.integers(0, 2**16),
)
def test_zero_points_and_pack_equal_vllm(bits, groups, n, seed):
    """marlin_zero_points and pack_int32 match vLLM's marlin_zero_points / pack_cols."""
    zp = torch.randint(0, 2**bits, (groups, n), generator=seeded_gen(seed), dtype=torch.int32)
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
    gen = seeded_gen(seed)
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
    b = torch.randn(n, generator=seeded_gen(seed)).to(torch.bfloat16)
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
    gen = seeded_gen(11)
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


@given(
    st.sampled_from([64, 100, 128]),
    st.sampled_from([64, 128, 96]),
    st.integers(0, 2**16),
    st.sampled_from(["bfloat16", "float16"]),
)
def test_fp8_marlin_stages_equal_vllm(n, k, seed, dtype):
    """FP8 weight-only Marlin: pack_fp8_to_int32 + repack, and the scale cast/expand/pad/
    permute/exponent-bias, equal vLLM's prepare_fp8_layer_for_marlin pieces."""
    gen = seeded_gen(seed)
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
    q, s = mxfp8_utils._mxfp8_e4m3_quantize_torch(torch.randn(n, k, generator=seeded_gen(seed)))
    c = cfg("mxfp8", k, n, 8, -1)
    pn, pk = mu.marlin_padded_nk(n, k, 32)
    exp = s.view(torch.float8_e8m0fnu).to(torch.bfloat16).T.contiguous()
    exp = mu.marlin_permute_scales(mu.marlin_pad_scales(exp, n, k, pn, pk, 32), pk, pn, 32)
    exp = mfp8.mxfp8_marlin_process_scales(exp)
    got = M.permute_mxfp8_scales({"weight_scale": s}, c, H200, {}).tensors["weight_scale"]
    assert torch.equal(u8(exp), u8(got))


#: Bad inputs of the marlin stages and the exact error each raises.
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
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_inputs_raise_exact_errors(call, error, message):
    """Each bad input raises its wcache error class (a ValueError) with an actionable message."""
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and info.value.code
