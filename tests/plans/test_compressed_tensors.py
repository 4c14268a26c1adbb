"""wcache/plans/compressed_tensors.py: which CPU plan (CPUWNA16 W4A16 / w4a8, oneDNN or
AMX SGL W8A8 INT8) each target selects and the CPU refusals with their reasons;
block-FP8 compressed-tensors checkpoints are refused with the reason. The properties
every CPU plan shares are in tests/plans/test_cpu_plan_properties.py; the CUDA
contracts are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest

from wcache.core import QuantSpec
from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import AMX, AVX2, AVX512
from tests.helpers.cpu_plans import assert_refused, assert_resolves
from tests.helpers.cuda_contracts import H200, SM80, ct_fp8_scheme, ct_layer, ct_w8a16_fp8_scheme


@pytest.mark.parametrize(
    "spec,config_kw,target,plan_id",
    [
        (QuantSpec("ct_w4a16", num_bits=4, group_size=64), {}, AVX512, "ct_w4a16/cpu_wna16@1"),
        (
            QuantSpec("ct_w4a16", num_bits=4, group_size=64, zero_point=True),
            {"params_dtype": "float16"},
            AMX,
            "ct_w4a16/cpu_wna16@1",
        ),  # fp16 activations: w4a16
        # AMX with bf16 activations and VLLM_CPU_INT4_W4A8 on: the w4a8 layout
        (
            QuantSpec("ct_w4a16", num_bits=4, group_size=32),
            {},
            vl.synthetic_target(("amx",), env={"VLLM_CPU_INT4_W4A8": "1"}),
            "ct_w4a16/cpu_wna16_w4a8@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="channel"),
            {},
            AVX512,
            "ct_w8a8_int8/onednn@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="channel"),
            {},
            AVX2,
            "ct_w8a8_int8/onednn@1",
        ),
        # AMX, symmetric input, tile-aligned int8: vLLM's SGL int8 kernel
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor"),
            {"size_k": 64, "size_n": 96},
            AMX,
            "ct_w8a8_int8/sgl@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", kernel="sgl"),
            {"size_k": 64, "size_n": 96},
            AVX512,
            "ct_w8a8_int8/sgl@1",
        ),  # the adapter's answer
        (
            QuantSpec(
                "ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", input_symmetric=False
            ),
            {"size_k": 64, "size_n": 96},
            AMX,
            "ct_w8a8_int8/onednn@1",
        ),  # asymmetric input: oneDNN on AMX too
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for picks the compressed-tensors CPU plan for the kernel decisions the
    Target records."""
    assert_resolves(spec, config_kw, target, plan_id)


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
        # vLLM's check_cpu_sgl_kernel takes int8 N % 16, its convert_weight_packed N % 32
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor"),
            (64, 48),
            AMX,
            "convert_weight_packed needs N % 32 == 0",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", kernel="sgl"),
            (64, 96),
            AVX2,
            r"no torch.ops._C.convert_weight_packed, "
            r"torch.ops._C.int8_scaled_mm_with_quant",
        ),
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """W8A8 INT8 shapes and hosts vLLM's SGL kernel cannot take raise NoPlan with the reason."""
    assert_refused(spec, size, target, message)


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
