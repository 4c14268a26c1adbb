"""wcache/stages/gptq.py: GPTQ's zero-point stages (with compressed-tensors' own)."""

from __future__ import annotations

import pytest
import torch

from wcache.stages import (
    compressed_tensors,
    gptq,
)

vllm = pytest.importorskip("vllm")


from tests.helpers.cpu_stage_inputs import layer_cfg, run_stage  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_world")


def test_gptq_and_ct_zero_point_stages():
    """gptq.drop_zero_points drops qzeros (TRANSFORM) and gptq.clear_zero_points leaves the
    None slot (METADATA); CT clears the attribute of a symmetric layer only."""
    out = run_stage(
        gptq.drop_zero_points, {"qzeros": torch.zeros(1, 1, dtype=torch.int32)}, layer_cfg()
    )
    assert (("qzeros",), {}) == (out.drop, dict(out.attrs))
    out = run_stage(gptq.clear_zero_points, {}, layer_cfg())
    assert ((), {"qzeros": None}) == (out.drop, dict(out.attrs))
    out = run_stage(compressed_tensors.clear_zero_point, {}, layer_cfg("ct_w4a16"))
    assert {"weight_zero_point": None} == dict(out.attrs) and out.drop == ()
    out = run_stage(compressed_tensors.clear_zero_point, {}, layer_cfg("ct_w4a16", zero_point=True))
    assert {} == dict(out.attrs) and out.drop == ()
