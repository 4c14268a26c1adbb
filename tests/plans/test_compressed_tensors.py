"""wcache/plans/compressed_tensors.py: block-FP8 compressed-tensors checkpoints are
refused with the reason. The contracts are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest

from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers.cuda_contracts import H200, SM80, ct_fp8_scheme, ct_layer, ct_w8a16_fp8_scheme


def test_ct_fp8_block_on_fp8_marlin_is_refused(simulated_sm80):
    """A block-FP8 compressed-tensors checkpoint below sm89 (CompressedTensorsW8A16Fp8,
    Marlin block FP8) is refused by plan_for naming Marlin block FP8."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = ct_layer(ct_w8a16_fp8_scheme("block", False, (128, 128)), (128,), 256, bias=False)
    config = layer_config(layer.quant_method, layer, SM80, name="layer")
    assert (config.quant.kernel, config.quant.strategy) == ("fp8_marlin", "block")
    with pytest.raises(NoPlan, match="Marlin block FP8 is not supported"):
        plan_for(config, target=SM80)


def test_ct_w8a8_fp8_block_is_refused(simulated_cuda):
    """CompressedTensorsW8A8Fp8 with block scales reaches plan_for as ct_w8a8_fp8 /
    block and is refused with the reason (its block scale is ``weight_scale``, which
    the ``fp8/cutlass_block`` plan does not take)."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = ct_layer(ct_fp8_scheme("block", False, (128, 128)), (128,), 256, bias=False)
    config = layer_config(layer.quant_method, layer, H200, name="layer")
    assert (config.quant.method, config.quant.strategy) == ("ct_w8a8_fp8", "block")
    with pytest.raises(NoPlan, match="block FP8 uses the cutlass_block plan"):
        plan_for(config, target=H200)
