"""NVFP4 on Marlin (sm90) against vLLM's own CUDA ops, on the H200.

The CPU contract tests (tests/plans/test_cuda_contracts.py) prove wcache's NVFP4 Marlin
stages equal vLLM's post-load with ``ops.gptq_marlin_repack`` swapped for its pure
reference. Here vLLM's real CUDA op runs: ``prepare_fp4_layer_for_marlin`` and
``prepare_nvfp4_moe_layer_for_marlin`` on CUDA tensors give the bytes wcache's stages
give on the same tensors, and vLLM's Marlin FP4 GEMM (``apply_fp4_marlin_linear``) on the
stage outputs gives vLLM's output bit for bit and the dequantized product within FP4's
tolerance. Unlike the rest of this tier it imports vLLM (the tier's harness puts the
CUDA bundle on ``PYTHONPATH``); without vLLM's CUDA build it skips, naming why.
"""

from __future__ import annotations

import types

import pytest
import torch

from wcache.core import LayerConfig, MoeShape, QuantSpec, Target
from wcache.stages import marlin_fp4 as MF4

H200 = Target("cuda", (9, 0))
#: Tokens of the forward check: not a multiple of 16.
TOKENS = 33
#: (N, K): aligned; N and K off Marlin's tiles (padded); a SmolLM2 q/k/v shape.
LINEAR_SHAPES = ((256, 512), (104, 80), (960, 576))
#: (E, hidden, intermediate): aligned; the intermediate padded to Marlin's MoE tile.
MOE_SHAPES = ((4, 256, 128), (3, 256, 96))
#: Relative Frobenius error allowed between Marlin's FP4 GEMM (bf16 activations, fp32
#: accumulate, bf16 output) and the float32 product of the dequantized weight: bf16's
#: 8-bit mantissa on activations and outputs bounds it well below 2%.
FORWARD_REL_TOL = 0.02
#: E2M1 code -> value (sign bit 3), the NVFP4 element format.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _vllm_cuda():
    """vLLM's Marlin FP4 helpers, or a skip naming what is missing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (vLLM's Marlin ops)")
    mfp4 = pytest.importorskip(
        "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4",
        reason="vLLM's CUDA build is not importable",
    )
    from vllm import _custom_ops as ops

    return mfp4, ops


def _checkpoint(n: int, k: int, seed: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=g) * 400 + 0.5).to(torch.float8_e4m3fn)
    return {
        "weight": weight.to(device),
        "weight_scale": scale.to(device),
        "weight_global_scale": torch.tensor(1e-3 / 6, device=device),
    }


def _dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The checkpoint's ``[N, K]`` float32 weight: E2M1 * block scale * global scale."""
    w = t["weight"]
    codes = torch.stack([w & 0xF, w >> 4], dim=-1).reshape(w.shape[0], -1).long()
    lut = torch.tensor(E2M1_VALUES, device=w.device)
    vals = lut[codes & 0x7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = t["weight_scale"].float().repeat_interleave(16, dim=1)
    return vals * scale * t["weight_global_scale"].float()


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("n,k", LINEAR_SHAPES, ids=str)
def test_linear_stages_equal_vllm_cuda_prepare_and_gemm(n, k):
    """wcache's linear stages on CUDA == vLLM's prepare_fp4_layer_for_marlin with its
    real gptq_marlin_repack (bytes of weight, weight_scale, weight_global_scale), and
    apply_fp4_marlin_linear on them equals vLLM's output bit for bit and the
    dequantized product within FP4 Marlin's tolerance."""
    mfp4, _ = _vllm_cuda()
    dev = torch.device("cuda")
    t = _checkpoint(n, k, seed=n + k, device=dev)
    layer = torch.nn.Module()
    for name, value in t.items():
        layer.register_parameter(name, torch.nn.Parameter(value.clone(), requires_grad=False))
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    layer.params_dtype = torch.bfloat16
    layer.bias = None
    mfp4.prepare_fp4_layer_for_marlin(layer)

    config = LayerConfig(
        QuantSpec("modelopt_fp4", num_bits=4, group_size=16, kernel="marlin"), k, n
    )
    ours = dict(MF4.repack_weight(t, config, H200, {}).tensors)
    ours.update(MF4.process_scales(t, config, H200, {}).tensors)
    for name in ("weight", "weight_scale", "weight_global_scale"):
        theirs = getattr(layer, name)
        assert (theirs.dtype, tuple(theirs.shape)) == (ours[name].dtype, tuple(ours[name].shape))
        assert torch.equal(_bytes(theirs), _bytes(ours[name])), name

    x = torch.randn(TOKENS, k, generator=torch.Generator(dev).manual_seed(1), device=dev)
    x = x.to(torch.bfloat16)

    def gemm(w, s, gs):
        return mfp4.apply_fp4_marlin_linear(x, w, s, gs, None, size_n=n, size_k=k)

    y_vllm = gemm(layer.weight, layer.weight_scale, layer.weight_global_scale)
    y_ours = gemm(ours["weight"], ours["weight_scale"], ours["weight_global_scale"])
    assert torch.equal(y_vllm, y_ours)
    ref = x.float() @ _dequant(t).t()
    rel = ((y_ours.float() - ref).norm() / ref.norm()).item()
    assert rel < FORWARD_REL_TOL, f"Marlin FP4 forward is off the dequantized product by {rel}"


@pytest.mark.parametrize("e,hidden,inter", MOE_SHAPES, ids=str)
def test_moe_stages_equal_vllm_cuda_prepare(e, hidden, inter):
    """wcache's MoE stages on CUDA == vLLM's prepare_nvfp4_moe_layer_for_marlin with
    its real gptq_marlin_repack, every expert tensor's bytes (padding included)."""
    mfp4, _ = _vllm_cuda()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(e * hidden + inter)

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(dev)

    def fp8(*shape):
        return (torch.rand(shape, generator=g) * 400 + 0.5).to(torch.float8_e4m3fn).to(dev)

    t = {
        "w13_weight": u8(e, 2 * inter, hidden // 2),
        "w13_weight_scale": fp8(e, 2 * inter, hidden // 16),
        "w13_weight_scale_2": (torch.rand(e, generator=g) * 1e-3 + 1e-4).to(dev),
        "w2_weight": u8(e, hidden, inter // 2),
        "w2_weight_scale": fp8(e, hidden, inter // 16),
        "w2_weight_scale_2": (torch.rand(e, generator=g) * 1e-3 + 1e-4).to(dev),
    }
    layer = types.SimpleNamespace(
        num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        params_dtype=torch.bfloat16,
    )
    w13, s13, g13, w2, s2, g2 = mfp4.prepare_nvfp4_moe_layer_for_marlin(
        layer,
        t["w13_weight"],
        t["w13_weight_scale"],
        t["w13_weight_scale_2"],
        t["w2_weight"],
        t["w2_weight_scale"],
        t["w2_weight_scale_2"],
        is_act_and_mul=True,
    )
    shape = MoeShape(
        num_experts=e,
        global_num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        backend="MARLIN",
        experts="MarlinExperts",
    )
    config = LayerConfig(
        QuantSpec("modelopt_fp4", num_bits=4, group_size=16, layer_kind="moe", kernel="marlin_moe"),
        0,
        0,
        params_dtype="bfloat16",
        moe=shape,
    )
    ours = dict(MF4.repack_moe_weights(t, config, H200, {}).tensors)
    ours.update(MF4.process_moe_scales(t, config, H200, {}).tensors)
    theirs = {
        "w13_weight": w13,
        "w13_weight_scale": s13,
        "w13_weight_scale_2": g13,
        "w2_weight": w2,
        "w2_weight_scale": s2,
        "w2_weight_scale_2": g2,
    }
    for name, value in theirs.items():
        assert (value.dtype, tuple(value.shape)) == (ours[name].dtype, tuple(ours[name].shape))
        assert torch.equal(_bytes(value), _bytes(ours[name])), name
