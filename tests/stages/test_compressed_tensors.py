"""wcache/stages/compressed_tensors.py: the W4A16 transposes equal vLLM's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from wcache.stages import (
    compressed_tensors,
    cpu_wna16,
)

vllm = pytest.importorskip("vllm")


from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    BF16,
    HOST_W4A16,
    int32,
    layer_cfg,
    module_of,
    run_stage,
    seeded_gen,
    shapes,
    vllm_cpu_kernel,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


@given(shapes)
def test_ct_transposes_match_vllm(shape):
    """compressed-tensors transposes and the CPU repack equal vLLM's kernel on CT layout."""
    k, n, g, seed = shape
    groups = 1 if g == -1 else k // g
    w = int32(seed, (n, k // 8))
    s = torch.rand(n, groups, generator=seeded_gen(seed)).to(BF16)
    zp = int32(seed + 1, (n // 8, groups))
    ref = module_of(qweight=w, scales=s, qzeros=zp)
    ref.qweight.input_dim = ref.qweight.packed_dim = 1
    ref.scales.output_dim = 0
    ref.qzeros.output_dim = 0
    ref.bias = None
    with pytest.MonkeyPatch.context() as mp:  # the w4a16 layout on any host
        mp.setenv(cpu_wna16.W4A8_ENV, "0")
        vllm_cpu_kernel(k, n, g, True).process_weights_after_loading(ref)
    cfg = layer_cfg("ct_w4a16", k=k, n=n, g=g, zero_point=True)
    tw = run_stage(compressed_tensors.transpose_weight, {"weight_packed": w}, cfg)
    ts = run_stage(compressed_tensors.transpose_scales, {"weight_scale": s}, cfg)
    tz = run_stage(cpu_wna16.transpose_zero_points("qzeros"), {"qzeros": zp}, cfg)
    rp = run_stage(cpu_wna16.repack("w"), {"w": tw.tensors["weight_packed"]}, cfg, HOST_W4A16)
    assert torch.equal(ref.qweight.data, rp.tensors["w"])
    assert torch.equal(ref.scales.data, ts.tensors["weight_scale"])
    assert torch.equal(ref.qzeros.data, tz.tensors["qzeros"])
