"""wcache/stages/cpu_gemm.py: the SGL int8 and torch-linear stages and the host
probe equal what vLLM-CPU does on this host."""

from __future__ import annotations

import pytest
import torch

from wcache.stages import (
    common,
    cpu_gemm,
)

vllm = pytest.importorskip("vllm")

import vllm._custom_ops  # noqa: E402, F811 (registers torch.ops._C; after the importorskip)

from tests.helpers import vllm_layers  # noqa: E402  (one gloo world per session)
from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    BF16,
    HOST,
    LIBRARY,
    layer_cfg,
    module_of,
    run_stage,
    seeded_gen,
)

pytestmark = pytest.mark.usefixtures("vllm_world")
NO_CONVERT_WEIGHT_PACKED = f"vLLM's {LIBRARY} has no torch.ops._C.convert_weight_packed"


@pytest.mark.parametrize(
    "n,k,dtype",
    [
        (96, 64, BF16),
        (8, 40, BF16),
        (96, 40, BF16),
        (4096, 4096, BF16),
        (96, 64, torch.float16),
        (4096, 4096, torch.int8),
        (96, 40, torch.int8),
    ],
)
def test_sgl_shape_rule_equals_vllms_check_on_amx(n, k, dtype, monkeypatch):
    """cpu_gemm.sgl_shape is vLLM's check_cpu_sgl_kernel when the host has AMX."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    assert check_cpu_sgl_kernel(n, k, dtype) == cpu_gemm.sgl_shape(n, k, dtype)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_bind_torch_linear_equals_vllms_fallback(dtype):
    """cpu_gemm.bind_torch_linear: vLLM's F.linear branch, weight kept, same output."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    w = torch.randn(96, 48, generator=seeded_gen(0)).to(dtype)  # K = 48: never SGL-shaped
    ref = module_of(weight=w)
    ref.bias = None
    with pytest.MonkeyPatch.context() as mp:  # force vLLM's fallback branch on any host
        mp.setattr(vllm._custom_ops, "_supports_onednn", False)
        dispatch_cpu_unquantized_gemm(ref, remove_weight=True)
    assert tuple(ref.weight.shape) == (96, 48)  # vLLM keeps the weight
    out = run_stage(cpu_gemm.bind_torch_linear, {"weight": w}, layer_cfg("unquantized"))
    x = torch.randn(5, 48, generator=seeded_gen(1)).to(dtype)
    bias = torch.randn(96, generator=seeded_gen(2)).to(dtype)
    assert (out.release, out.tensors, out.drop) == ((), {}, ())
    assert torch.equal(ref.cpu_linear(x, ref.weight, bias), out.attrs["cpu_linear"](x, w, bias))
    meta = run_stage(cpu_gemm.bind_torch_linear, {"weight": w.to("meta")}, layer_cfg("unquantized"))
    assert meta.attrs["cpu_linear"] is torch.nn.functional.linear


def test_probe_decisions_are_what_vllm_does_here():
    """Each probed unquantized GEMM decision is the branch vLLM's dispatch takes on
    this host for a real layer of that dtype, and the op flags are torch.ops._C's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from wcache.stages.cpu_gemm import gemm_decision
    from wcache.vllm import probe

    for dtype in (BF16, torch.float16, torch.float32):
        for n, k in ((64, 96), (64, 48)):  # SGL-shaped (taken on AMX hosts), and not
            layer = module_of(weight=torch.randn(n, k, generator=seeded_gen(3)).to(dtype))
            layer.bias = None
            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
            prepacked = layer.weight.numel() == 0  # oneDNN and SGL release the weight
            decided = HOST.kernel(gemm_decision(dtype, cpu_gemm.sgl_shape(n, k, dtype)))
            assert decided in ("onednn", "sgl", "torch_linear"), (dtype, decided)
            assert (decided != "torch_linear") == prepacked, (dtype, n, k, decided)
            assert decided == probe._branch_of(layer.cpu_linear), (dtype, n, k)
            assert decided == probe.unquantized_gemm_kernel(n, k, dtype)
    for op in probe.PROBED_OPS:
        expected = "present" if hasattr(torch.ops._C, op) else "absent"
        assert expected == HOST.kernel(f"op.{op}")


@pytest.mark.skipif(
    HOST.kernel("op.convert_weight_packed") != "present",
    reason=NO_CONVERT_WEIGHT_PACKED,
)
@pytest.mark.parametrize(
    "strategy,widths,bias",
    [("tensor", (32, 64), True), ("channel", (64,), False), ("tensor", (96,), False)],
)
def test_sgl_int8_stages_match_vllm(strategy, widths, bias, monkeypatch):
    """The SGL W8A8 INT8 stages (packed weight, per-channel scales, bias_fp32) equal
    CPUInt8ScaledMMLinearKernel.process_weights_for_sgl bit for bit (AMX reported
    present in-process; vLLM's SGL ops run on this ISA without it)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vllm_layers.ct_w8a8_int8_linear(64, widths, strategy, True, True, BF16, bias)
    ref = case.new_layer()
    case.vllm_process(ref)
    assert ref.scheme.kernel.linear_method.__name__ == "_apply_weights_sgl"
    raw = case.new_layer()
    cfg = case.config
    w = run_stage(cpu_gemm.pack_sgl_int8_weight, {"weight": raw.weight.data}, cfg).tensors["weight"]
    assert torch.equal(ref.weight.data, w) and ref.weight.dtype == w.dtype
    s_out = run_stage(
        cpu_gemm.convert_int8_scale_to_channelwise, {"weight_scale": raw.weight_scale.data}, cfg
    ).tensors
    assert torch.equal(ref.weight_scale.data, s_out.get("weight_scale", raw.weight_scale.data))
    b = run_stage(
        cpu_gemm.copy_bias_to_float32, {"bias": raw.bias.data} if bias else {}, cfg
    ).tensors
    assert (
        torch.equal(ref.bias_fp32.data, b["bias_fp32"])
        if bias
        else not hasattr(ref, "bias_fp32") and {} == dict(b)
    )


def test_sgl_int8_n_not_multiple_of_32_fails_in_vllm_too(monkeypatch):
    """An int8 weight with N % 32 != 0 (vLLM's check_cpu_sgl_kernel accepts N % 16):
    vLLM's own SGL post-load fails, and so does the wcache stage, naming the rule."""
    if HOST.kernel("op.convert_weight_packed") != "present":
        pytest.skip(NO_CONVERT_WEIGHT_PACKED)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vllm_layers.ct_w8a8_int8_linear(64, (48,), "tensor", True, True, BF16)
    with pytest.raises(RuntimeError, match="BLOCK_N"):
        case.vllm_process(case.new_layer())
    with pytest.raises(common.StageInputError, match="multiple of 32"):
        run_stage(
            cpu_gemm.pack_sgl_int8_weight, {"weight": case.new_layer().weight.data}, case.config
        )
