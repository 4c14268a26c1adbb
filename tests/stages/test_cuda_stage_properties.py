"""Properties across the CUDA stage families (marlin, fp8, nvfp4): shapes on meta
tensors, and the table of bad inputs with the exact error each raises."""

from __future__ import annotations

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec
from wcache.stages import fp8 as F8
from wcache.stages import marlin as M
from wcache.stages import mxfp8 as MX
from wcache.stages import nvfp4 as F4

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


from tests.helpers.cuda_stage_inputs import H200, cfg  # noqa: E402
from wcache.stages import marlin_fp4 as MF4  # noqa: E402 (grouped with the section it serves)


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
