"""wcache/stages/nvfp4.py: the NVFP4 block-scale swizzle, dequantization, padding
and the activation-scale fuse equal vLLM's."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import reference_kernels as R
from wcache.core import Target
from wcache.stages import nvfp4 as F4

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu  # noqa: E402 (after pytest.importorskip)
from vllm.model_executor.layers.quantization.utils import (  # noqa: E402 (after pytest.importorskip)
    nvfp4_utils,
)

from tests.helpers.cuda_stage_inputs import H200, cfg, seeded_gen, u8  # noqa: E402


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
    s = _e4m3_scales(seeded_gen(seed), shape)
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        expected = nvfp4_utils.swizzle_blockscale(s)
    got = F4.swizzle_blockscale(s)
    assert got.shape == expected.shape and torch.equal(u8(expected), u8(got))
    assert torch.equal(u8(F4.unswizzle_blockscale(got, m, kg)), u8(s))


@given(st.sampled_from([1, 100, 128]), st.sampled_from([4, 8, 12]), st.integers(0, 2**16))
def test_unswizzle_equals_vllm_convert_when_k_groups_multiple_of_4(m, kg, seed):
    """Where vLLM's convert_swizzled_to_linear is right (K/16 % 4 == 0), ours equals it."""
    s = _e4m3_scales(seeded_gen(seed), (m, kg))
    sw = F4.swizzle_blockscale(s)
    expected = emu.convert_swizzled_to_linear(sw, m, kg * 16, 16)
    assert torch.equal(u8(expected), u8(F4.unswizzle_blockscale(sw, m, kg)))


@pytest.mark.parametrize("kg", [3, 6])
def test_vllm_convert_swizzled_to_linear_bug_when_k_groups_not_multiple_of_4(kg):
    """vLLM's convert_swizzled_to_linear returns the padded columns when K/16 % 4 != 0
    (it slices by K, not K/16); ours returns exactly [m, K/16]."""
    m = 100
    s = _e4m3_scales(seeded_gen(kg), (m, kg))
    sw = F4.swizzle_blockscale(s)
    wrong = emu.convert_swizzled_to_linear(sw, m, kg * 16, 16)
    assert wrong.shape[1] != kg
    assert F4.unswizzle_blockscale(sw, m, kg).shape == (m, kg)


@given(st.sampled_from([32, 100, 128]), st.sampled_from([64, 128]), st.integers(0, 2**16))
def test_nvfp4_dequant_equals_vllm_dequantize_to_dtype(n, k, seed):
    """The NVFP4 reference dequantization (swizzled scales) == vLLM's dequantize_to_dtype
    and break_fp4_bytes (K/16 % 4 == 0, where vLLM's helper is correct)."""
    gen = seeded_gen(seed)
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
    w = torch.randint(0, 256, (n, kb), generator=seeded_gen(seed), dtype=torch.int32).to(
        torch.uint8
    )
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


#: Bad inputs of the nvfp4 stages and the exact error each raises.
BAD_INPUTS = [
    (lambda: F4.swizzle_blockscale(torch.zeros(4, 4)), F4.Nvfp4LayoutError, "float8_e4m3fn"),
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
