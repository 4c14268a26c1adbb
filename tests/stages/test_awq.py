"""wcache/stages/awq.py: AWQ's conversion to the standard (GPTQ) packing equals vLLM's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from wcache.stages import (
    awq,
)

vllm = pytest.importorskip("vllm")


from vllm.model_executor.layers.quantization.utils import quant_utils as qu  # noqa: E402 (after pytest.importorskip)
from vllm.scalar_type import scalar_types  # noqa: E402 (after pytest.importorskip)

from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    int32,
    layer_cfg,
    module_of,
    run_stage,
    seeded_gen,
    shapes,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


@given(shapes)
def test_awq_stage_matches_vllm_conversion(shape):
    """awq.convert_to_standard equals vLLM's _convert_awq_to_standard_format on a layer."""
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format

    k, n, g, seed = shape
    groups = 1 if g == -1 else k // g
    qweight, qzeros = int32(seed, (k, n // 8)), int32(seed + 1, (groups, n // 8))
    ref = module_of(qweight=qweight, qzeros=qzeros)
    _convert_awq_to_standard_format(ref, "qweight", "qzeros", 4)
    cfg = layer_cfg(k=k, n=n, g=g)
    out = run_stage(awq.convert_to_standard, {"qweight": qweight, "qzeros": qzeros}, cfg).tensors
    assert torch.equal(ref.qweight.data, out["qweight"])
    assert torch.equal(ref.qzeros.data, out["qzeros"])


@given(shapes)
def test_awq_convert_to_standard_gives_gptq_pack(shape):
    """AWQ-packed quantized weights become exactly gptq_pack of the same values."""
    k, n, g, seed = shape
    w = torch.randn(k, n, generator=seeded_gen(seed))
    _, q_w, _, _ = qu.quantize_weights(w, scalar_types.uint4, g, zero_points=True)
    awq_packed = qu.awq_pack(q_w, 4, k, n)
    qzeros = torch.zeros(1 if g == -1 else k // g, n // 8, dtype=torch.int32)
    out = run_stage(
        awq.convert_to_standard, {"qweight": awq_packed, "qzeros": qzeros}, layer_cfg(k=k, n=n, g=g)
    )
    assert torch.equal(qu.gptq_pack(q_w, 4, k, n), out.tensors["qweight"])
