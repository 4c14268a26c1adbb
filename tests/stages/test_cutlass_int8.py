"""wcache/stages/cutlass_int8.py: the CUTLASS W8A8 INT8 stages, run in the plan's order
(with the shared channelwise-scale stage), equal vLLM's own
``CutlassInt8ScaledMMLinearKernel.process_weights_after_loading`` run on the same
tensors (values, dtypes, shapes, strides); the weight is a transposed view; the
activation stages do nothing where vLLM does nothing; missing inputs are refused."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings

from tests.helpers.cuda_cases import H200, cuda_config, cutlass_int8_cases, make_module
from wcache.core import LayerConfig, QuantSpec
from wcache.plans import cutlass_int8 as cutlass_int8_plans
from wcache.shell import load_
from wcache.stages import cutlass_int8 as CI8
from wcache.stages.common import StageInputError

#: vLLM's CutlassInt8ScaledMMLinearKernel.layer_param_names for compressed-tensors.
PARAM_NAMES = ("weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj")


def _vllm_processed(tensors: dict[str, torch.Tensor], cfg: LayerConfig) -> torch.nn.Module:
    """vLLM's CUTLASS INT8 post-load on a plain module holding clones of ``tensors``."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassInt8ScaledMMLinearKernel,
    )

    layer = make_module({k: v.clone() for k, v in tensors.items()})
    layer.logical_widths = list(cfg.get("logical_widths"))
    kernel = types.SimpleNamespace(
        layer_param_names=PARAM_NAMES,
        config=types.SimpleNamespace(
            is_channelwise=cfg.quant.strategy == "channel",
            is_static_input_scheme=cfg.quant.static_input,
            input_symmetric=cfg.quant.input_symmetric,
        ),
    )
    CutlassInt8ScaledMMLinearKernel.process_weights_after_loading(kernel, layer)
    return layer


@settings(max_examples=25, deadline=None)
@given(cutlass_int8_cases())
def test_stages_equal_vllms_post_load(case):
    """Every tensor the stages leave (weight, weight_scale, input_scale,
    input_zero_point, azp_adj) equals vLLM's: values, dtype, shape and strides, across
    tensor/channel scales, fused widths, static/dynamic, symmetric/asymmetric input."""
    pytest.importorskip("vllm")
    cfg, tensors = case
    ours = make_module({k: v.clone() for k, v in tensors.items()})
    load_(ours, cutlass_int8_plans.W8A8_INT8.bind(cfg, H200))
    theirs = _vllm_processed(tensors, cfg)
    for name in PARAM_NAMES:
        want = getattr(theirs, name, None)
        got = getattr(ours, name, None)
        if want is None:
            assert got is None, name
            continue
        assert (want.dtype, want.shape, want.stride()) == (got.dtype, got.shape, got.stride())
        assert torch.equal(want, got), name


def test_transpose_is_a_view_with_column_major_strides():
    """The [N, K] int8 weight becomes its [K, N] transpose over the same storage."""
    w = torch.arange(12, dtype=torch.int8).reshape(3, 4)
    cfg = cuda_config("ct_w8a8_int8", 4, 3, bits=8, strategy="channel", kernel="cutlass_int8")
    out = CI8.transpose_weight.fn({"weight": w}, cfg, H200, {})
    t = out.tensors["weight"]
    assert ((4, 3), (1, 4)) == (tuple(t.shape), t.stride())
    assert t.data_ptr() == w.data_ptr() and torch.equal(w.t(), t)


def _int8_cfg(static: bool, symmetric: bool) -> LayerConfig:
    spec = QuantSpec(
        "ct_w8a8_int8",
        num_bits=8,
        act_bits=8,
        strategy="channel",
        static_input=static,
        input_symmetric=symmetric,
        kernel="cutlass_int8",
    )
    return LayerConfig(spec, 4, 2, name="model.layers.0.q")


def test_dynamic_and_symmetric_activations_change_nothing_they_need_not():
    """Dynamic activations: no input-scale fold. Symmetric: no azp_adj. Static
    symmetric: the scale is its max, 0-d."""
    w_kn = torch.tensor([[1, -2], [3, 4], [-5, 6], [7, 8]], dtype=torch.int8)
    assert {} == dict(CI8.fold_input_scale.fn({}, _int8_cfg(False, True), H200, {}).tensors)
    out = CI8.compute_azp_adj.fn({"weight": w_kn}, _int8_cfg(False, True), H200, {})
    assert {} == dict(out.tensors)
    folded = CI8.fold_input_scale.fn(
        {"input_scale": torch.tensor([0.25, 0.5])}, _int8_cfg(True, True), H200, {}
    )
    assert torch.equal(torch.tensor(0.5), folded.tensors["input_scale"])


def test_azp_adj_is_the_weights_column_sums_times_the_static_zero_point():
    """Asymmetric: azp_adj is int32 [1, N] = sum over K of the [K, N] weight; static, times
    the folded zero point."""
    w_kn = torch.tensor([[1, -2], [3, 4], [-5, 6], [7, 8]], dtype=torch.int8)
    dynamic = CI8.compute_azp_adj.fn({"weight": w_kn}, _int8_cfg(False, False), H200, {})
    assert torch.equal(torch.tensor([[6, 16]], dtype=torch.int32), dynamic.tensors["azp_adj"])
    static = CI8.compute_azp_adj.fn(
        {"weight": w_kn, "input_zero_point": torch.tensor(-3, dtype=torch.int32)},
        _int8_cfg(True, False),
        H200,
        {},
    )
    assert torch.equal(torch.tensor([[-18, -48]], dtype=torch.int32), static.tensors["azp_adj"])


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: CI8.fold_input_scale.fn({}, _int8_cfg(True, True), H200, {}),
            "static W8A8 INT8 without input_scale",
        ),
        (
            lambda: CI8.fold_input_scale.fn(
                {"input_scale": torch.tensor([0.5])}, _int8_cfg(True, False), H200, {}
            ),
            "asymmetric static W8A8 INT8 without input_zero_point",
        ),
        (
            lambda: CI8.compute_azp_adj.fn(
                {"weight": torch.zeros(4, 2, dtype=torch.int8)}, _int8_cfg(True, False), H200, {}
            ),
            "asymmetric static W8A8 INT8 without input_zero_point",
        ),
    ],
)
def test_missing_inputs_raise_stage_input_error(call, message):
    """A static scheme without its input scale or zero point raises StageInputError
    naming the layer and the missing tensor."""
    with pytest.raises(StageInputError, match=f"model.layers.0.q.*{message}"):
        call()
