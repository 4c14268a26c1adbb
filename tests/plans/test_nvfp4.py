"""wcache/plans/nvfp4.py: a W4A16 NVFP4 checkpoint is refused with the reason. The
contracts are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest

from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers.cuda_contracts import H200, nvfp4_layer


def test_nvfp4_w4a16_linear_on_sm90_is_refused(simulated_cuda):
    """A W4A16 NVFP4 checkpoint (``modelopt_fp4_w4a16``) has no plan anywhere: the
    adapter's config is refused by plan_for naming why (before any weight is read)."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = nvfp4_layer((64, 64), 128, w4a16=True)
    config = layer_config(layer.quant_method, layer, H200, name="layer")
    with pytest.raises(NoPlan, match="no plan for method 'modelopt_fp4_w4a16'"):
        plan_for(config, target=H200)
