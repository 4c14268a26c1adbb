"""wcache/stages/mxfp8.py: MXFP8 quantization equals vLLM's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.stages import mxfp8 as MX

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")

from vllm.model_executor.layers.quantization.utils import (  # noqa: E402 (after pytest.importorskip)
    mxfp8_utils,
)

from tests.helpers.cuda_stage_inputs import seeded_gen, u8  # noqa: E402


@given(st.sampled_from([(4, 32), (100, 64), (3, 256)]), st.integers(0, 2**16), st.booleans())
def test_mxfp8_quantize_equals_vllm(shape, seed, with_zero_block):
    """mxfp8_e4m3_quantize == vLLM's _mxfp8_e4m3_quantize_torch (values and E8M0 codes)."""
    w = (torch.randn(*shape, generator=seeded_gen(seed)) * 3).to(torch.bfloat16)
    if with_zero_block:
        w[0, :32] = 0
    eq, es = mxfp8_utils._mxfp8_e4m3_quantize_torch(w)
    q, s = MX.mxfp8_e4m3_quantize(w)
    assert torch.equal(u8(eq), u8(q)) and torch.equal(es, s)


#: Bad inputs of the mxfp8 stages and the exact error each raises.
BAD_INPUTS = [
    (lambda: MX.mxfp8_e4m3_quantize(torch.zeros(4, 48)), MX.Mxfp8LayoutError, "divisible by 32"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_inputs_raise_exact_errors(call, error, message):
    """Each bad input raises its wcache error class (a ValueError) with an actionable message."""
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and info.value.code
