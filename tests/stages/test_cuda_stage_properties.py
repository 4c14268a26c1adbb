"""Properties across the CUDA stage families (marlin, fp8, nvfp4): shapes on meta
tensors. Each family's bad inputs and the exact errors they raise are in its own
tests/stages/test_<family>.py."""

from __future__ import annotations

import pytest
import torch

from wcache.stages import fp8 as F8
from wcache.stages import marlin as M
from wcache.stages import nvfp4 as F4

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


from tests.helpers.cuda_stage_inputs import H200, cfg  # noqa: E402


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
