"""Marlin fused-MoE layouts for FP8 (per tensor, per channel, 128x128 block) and
canonical MXFP4 experts (the serialized MXFP8 linear plan reuses the dense
:mod:`wcache.stages.marlin` stages).

Every Marlin MoE layout is the dense Marlin layout (:mod:`wcache.stages.marlin`)
applied per expert: ``gptq_marlin_repack`` on each expert's packed weight and
``marlin_permute_scales`` on each expert's scales, stacked back to ``[E, ...]``.
The repacks are TRANSFORMs the daemon runs once; vLLM writes them with
``replace_parameter`` and a restore never runs them again.

Shapes (``config.moe``): ``E`` experts, ``H`` hidden size, ``I`` the intermediate
size per partition as allocated. Before the repack vLLM 0.33 pads a Marlin-misaligned
``I`` to ``Ip = marlin_moe_padded_intermediate(I, G)`` (zero weights and zero scales;
only FP8 pads, canonical MXFP4 rounds ``I`` up to 128 at creation already).

FP8 on Marlin (``Fp8MoEMethod`` with ``moe_backend="marlin"``, or below sm89): each
expert's FP8 weight is packed four bytes per int32 along K and repacked as 8-bit
Marlin; the per-tensor / per-channel scales become channelwise ``[1, N]`` rows
(block scales ``[K / 128, N]`` groups), are permuted, and get the FP8 exponent bias
fused (``x 2**120`` for bf16, ``x 2**8`` for fp16) because Marlin dequantizes FP8
by a bit shift.

MXFP4 on Marlin (``Mxfp4MoEMethod``, the canonical ``quant_method: mxfp4``; vLLM's
MXFP4 oracle resolves MARLIN on sm90 without FlashInfer and Humming): E2M1 nibbles
two per byte, so each expert's ``[N, K / 2]`` uint8 is viewed as ``[N, K / 8]`` int32,
transposed and repacked as 4-bit Marlin; the E8M0 scales (one per 32 values) go
through the params dtype, are permuted and reordered ``[0, 2, 1, 3]`` in fours, and
stored as float8_e8m0fnu.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages import marlin
from wcache.stages.marlin_moe import marlin_moe_padded_intermediate
from wcache.stages.moe import MoeLayoutError, moe_shape

__all__ = [
    "MX_GROUP_SIZE",
    "marlin_moe_padded_intermediate",
    "repack_experts",
    "fp8_block_group_size",
    "fp8_expert_channel_scales",
    "repack_fp8_experts",
    "permute_fp8_expert_scales",
    "repack_mxfp4_experts",
    "permute_mxfp4_expert_scales",
    "permute_expert_bias",
]

#: OCP MX block size: one E8M0 scale per 32 values along K (MXFP4 and MXFP8).
MX_GROUP_SIZE = 32
#: MXFP4 values per byte (two E2M1 nibbles).
_FP4_PER_BYTE = 2
_MARLIN_FP8 = "vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py"
_MARLIN_FP4 = "vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py"


def _pad_shard_rows(x: torch.Tensor, n: int, padded_n: int) -> torch.Tensor:
    """``[E, 2 * n, ...]`` -> ``[E, 2 * padded_n, ...]``, each of the gate/up shards
    zero-padded. Source: ``marlin_utils_fp8._moe_pad_shard_rows``."""
    if padded_n == n:
        return x
    e, rest = x.shape[0], tuple(x.shape[2:])
    x = x.reshape(e, 2, n, *rest)
    x = torch.nn.functional.pad(x, (0, 0) * len(rest) + (0, padded_n - n))
    return x.reshape(e, 2 * padded_n, *rest)


def _pad_last(x: torch.Tensor, n: int, padded_n: int) -> torch.Tensor:
    """Zero-pad the last dim from ``n`` to ``padded_n``. Source: ``_moe_pad_last``."""
    return x if padded_n == n else torch.nn.functional.pad(x, (0, padded_n - n))


def repack_experts(q_packed: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """Per expert :func:`wcache.stages.marlin.marlin_repack`, stacked.

    Args:
        q_packed: ``[E, size_k // (32 // num_bits), size_n]`` int32, GPTQ order (packed
            along K, low bits first).

    Returns:
        ``[E, size_k // 16, size_n * num_bits // 2]`` int32.

    Source: the per-expert ``ops.gptq_marlin_repack`` loops of
    ``prepare_fp8_moe_layer_for_marlin`` and ``_repack_marlin_experts``.
    """
    if q_packed.device.type == "meta":
        rows, cols = size_k // marlin.MARLIN_TILE, size_n * num_bits // 2
        return q_packed.new_empty((q_packed.shape[0], rows, cols))
    return torch.stack(
        [
            marlin.marlin_repack(q_packed[i], size_k, size_n, num_bits)
            for i in range(q_packed.shape[0])
        ]
    )


def _permute_experts(scales: torch.Tensor, size_k: int, size_n: int, group_size: int):
    """Per expert ``marlin_permute_scales`` of ``[E, G, size_n]``, stacked."""
    if scales.device.type == "meta":
        return scales.new_empty(tuple(scales.shape))
    return torch.stack(
        [marlin.marlin_permute_scales(s, size_k, size_n, group_size) for s in scales.unbind(0)]
    )


# --------------------------------------------------------------------------- FP8 MoE


def fp8_block_group_size(config: LayerConfig) -> int:
    """Marlin's group size along K for this FP8 MoE layer: the block's K edge
    (``weight_block_size[1]``), or -1 (channelwise) without blocks."""
    block = config.get("weight_block_size")
    return int(block[1]) if block else -1


def _fp8_padded(config: LayerConfig) -> tuple[int, int, int, int]:
    moe = moe_shape(config)
    n = moe.intermediate_size_per_partition
    g = fp8_block_group_size(config)
    return moe.num_experts, moe.hidden_size, n, marlin_moe_padded_intermediate(n, g)


@stage(
    "marlin_mx.repack_fp8_experts",
    Tag.TRANSFORM,
    reads=("w13_weight", "w2_weight"),
    writes=("w13_weight", "w2_weight"),
    source=f"{_MARLIN_FP8}::prepare_fp8_moe_layer_for_marlin (pad + per-expert "
    "pack_fp8_to_int32 + ops.gptq_marlin_repack(num_bits=8))",
)
def repack_fp8_experts(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` float8_e4m3fn ->
    Marlin int32 ``w13_weight [E, H / 16, 4 * 2Ip]`` and ``w2_weight [E, Ip / 16, 4 * H]``
    (``Ip``: the intermediate zero-padded to Marlin's MoE tiles).

    Source: marlin_utils_fp8.prepare_fp8_moe_layer_for_marlin (weights)
    """
    e, h, n, padded_n = _fp8_padded(config)
    w13 = _pad_shard_rows(tensors["w13_weight"], n, padded_n)
    w2 = _pad_last(tensors["w2_weight"], n, padded_n)
    out = {}
    for name, w in (("w13_weight", w13), ("w2_weight", w2)):
        size_n, size_k = w.shape[1], w.shape[2]
        # pack_fp8_to_int32 per expert: [N, K] fp8 -> [K / 4, N] int32
        q = w.contiguous().view(torch.int32).transpose(1, 2).contiguous()
        out[name] = repack_experts(q, size_k, size_n, 8)
    return StageOut(tensors=out)


def fp8_expert_channel_scales(
    scales: torch.Tensor, num_experts: int, size_n: int, block: tuple[int, int] | None
) -> torch.Tensor:
    """FP8 MoE scales -> Marlin's ``[E, G, size_n]`` (``G = 1`` channelwise, ``K / bk``
    with blocks), in the scales' dtype.

    Args:
        scales: per tensor ``[E]`` (or ``[E, 1]``), per shard ``[E, s]``, per channel
            ``[E, size_n, 1]``, or block ``[E, ceil(size_n / bn), K / bk]``.
        num_experts: ``E``.
        size_n: the projection's output rows (``2I`` for w13, ``H`` for w2), unpadded.
        block: ``(bn, bk)`` or None.

    Raises:
        MoeLayoutError: a scale count that does not divide ``size_n``.

    Source: ``prepare_fp8_moe_layer_for_marlin.permute_scales`` (the conversion part).
    """
    e = num_experts
    if block is not None:
        s = scales.permute(0, 2, 1).repeat_interleave(block[0], 2)
        return s[..., :size_n].contiguous()
    if scales.device.type == "meta":
        return scales.new_empty((e, 1, size_n))
    if scales.numel() == e:
        return scales.reshape(e, 1, 1).repeat_interleave(size_n, 2)
    if scales.numel() != e * size_n:
        per_expert = scales.numel() // e
        if (e * size_n) % scales.numel():
            raise MoeLayoutError(
                f"{scales.numel()} FP8 MoE scales for {e} experts of {size_n} rows: the "
                f"count divides neither; the checkpoint's scales do not fit Marlin"
            )
        return scales.reshape(e, 1, per_expert).repeat_interleave(size_n // per_expert, 2)
    return scales.reshape(e, 1, size_n)


@stage(
    "marlin_mx.permute_fp8_expert_scales",
    Tag.TRANSFORM,
    source=f"{_MARLIN_FP8}::prepare_fp8_moe_layer_for_marlin (scales: cast to the params "
    "dtype, expand to channels or groups, pad, marlin_permute_scales, "
    "fp8_fused_exponent_bias_into_scales)",
    params=lambda scale_name="weight_scale": {
        "reads": (f"w13_{scale_name}", f"w2_{scale_name}"),
        "writes": (f"w13_{scale_name}", f"w2_{scale_name}"),
    },
)
def permute_fp8_expert_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    scale_name: str,
) -> StageOut:
    """TRANSFORM the experts' FP8 scales (fp32) -> Marlin's ``[E, G, Np]`` in the params
    dtype with the FP8 exponent bias fused: ``w13_<scale_name> [E, G13, 2Ip]`` and
    ``w2_<scale_name> [E, G2, H]`` (``G = 1`` channelwise; ``H / bk`` and ``Ip / bk``
    groups for 128x128 blocks).

    Args:
        scale_name: ``"weight_scale"`` (per tensor / channel) or ``"weight_scale_inv"``
            (block).

    Source: marlin_utils_fp8.prepare_fp8_moe_layer_for_marlin (scales)
    """
    e, h, n, padded_n = _fp8_padded(config)
    moe = moe_shape(config)
    block_cfg = config.get("weight_block_size")
    block = (int(block_cfg[0]), int(block_cfg[1])) if block_cfg else None
    g = fp8_block_group_size(config)
    out = {}
    for proj in ("w13", "w2"):
        name = f"{proj}_{scale_name}"
        size_n = moe.w13_num_shards * n if proj == "w13" else h
        size_k = h if proj == "w13" else n
        s = fp8_expert_channel_scales(tensors[name].to(config.dtype), e, size_n, block)
        if padded_n != n:
            if proj == "w13":
                groups = s.shape[1]
                s = torch.nn.functional.pad(s.reshape(e, groups, 2, n), (0, padded_n - n))
                s = s.reshape(e, groups, 2 * padded_n)
                size_n = 2 * padded_n
            else:
                if g > 0:
                    s = torch.nn.functional.pad(s, (0, 0, 0, (padded_n - n) // g))
                size_k = padded_n
        s = _permute_experts(s, size_k, size_n, g)
        out[name] = marlin.fp8_fused_exponent_bias_into_scales(s)
    return StageOut(tensors=out)


# --------------------------------------------------------------------------- MXFP4 MoE


def _mxfp4_sizes(config: LayerConfig) -> dict[str, tuple[int, int]]:
    """``{"w13": (size_n, size_k), "w2": (size_n, size_k)}`` of the unpacked experts."""
    moe = moe_shape(config)
    n, k = moe.intermediate_size_per_partition, moe.hidden_size
    return {"w13": (moe.w13_num_shards * n, k), "w2": (k, n)}


@stage(
    "marlin_mx.repack_mxfp4_experts",
    Tag.TRANSFORM,
    reads=("w13_weight", "w2_weight"),
    writes=("w13_weight", "w2_weight"),
    source=f"{_MARLIN_FP4}::prepare_moe_mxfp4_layer_for_marlin (_repack_marlin_experts: "
    "ops.gptq_marlin_repack(num_bits=4) per expert)",
)
def repack_mxfp4_experts(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight [E, 2I, H / 2]`` and ``w2_weight [E, H, I / 2]`` uint8
    (E2M1 pairs) -> Marlin ``w13_weight [E, H / 16, 2 * 2I]`` and ``w2_weight [E, I / 16,
    2 * H]`` int32.

    Raises:
        MoeLayoutError: a weight is not ``[E, size_n, size_k / 2]`` uint8.

    Source: marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin (weights)
    """
    moe = moe_shape(config)
    out = {}
    for proj, (size_n, size_k) in _mxfp4_sizes(config).items():
        w = tensors[f"{proj}_weight"]
        expected = (moe.num_experts, size_n, size_k // _FP4_PER_BYTE)
        if tuple(w.shape) != expected or w.dtype != torch.uint8:
            raise MoeLayoutError(
                f"layer {config.name!r}: {proj}_weight is {list(w.shape)} {w.dtype}, "
                f"expected {list(expected)} uint8 (two E2M1 values per byte)"
            )
        # weight[i].view(int32).T: [size_k / 8, size_n], nibbles low first along K
        q = w.contiguous().view(torch.int32).transpose(1, 2).contiguous()
        out[f"{proj}_weight"] = repack_experts(q, size_k, size_n, 4)
    return StageOut(tensors=out)


@stage(
    "marlin_mx.permute_mxfp4_expert_scales",
    Tag.TRANSFORM,
    reads=("w13_weight_scale", "w2_weight_scale"),
    writes=("w13_weight_scale", "w2_weight_scale"),
    source=f"{_MARLIN_FP4}::prepare_moe_mxfp4_layer_for_marlin (scales) + "
    "mxfp4_marlin_process_scales",
)
def permute_mxfp4_expert_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight_scale [E, 2I, H / 32]`` and ``w2_weight_scale [E, H, I / 32]``
    uint8 (E8M0 codes) -> ``[E, H / 32, 2I]`` and ``[E, I / 32, H]`` float8_e8m0fnu:
    through the params dtype, transposed, Marlin-permuted (group 32), reordered
    ``[0, 2, 1, 3]`` within fours (16-bit activations).

    Source: marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin (scales) +
        mxfp4_marlin_process_scales
    """
    out = {}
    for proj, (size_n, size_k) in _mxfp4_sizes(config).items():
        name = f"{proj}_weight_scale"
        s = tensors[name].view(torch.float8_e8m0fnu).to(config.dtype).transpose(1, 2)
        s = _permute_experts(s.contiguous(), size_k, size_n, MX_GROUP_SIZE)
        reorder = list(marlin.MXFP8_SCALE_REORDER)
        s = s.reshape(-1, len(reorder))[:, reorder].reshape(s.shape)
        out[name] = s.to(torch.float8_e8m0fnu)
    return StageOut(tensors=out)


@stage(
    "marlin_mx.permute_expert_bias",
    Tag.TRANSFORM,
    reads=("w13_bias", "w2_bias"),
    writes=("w13_bias", "w2_bias"),
    optional=("w13_bias", "w2_bias"),
    source=f"{_MARLIN_FP4}::prepare_moe_mxfp4_layer_for_marlin (bias: cast to the params "
    "dtype, marlin_permute_bias per expert)",
)
def permute_expert_bias(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_bias [E, 2I]`` and ``w2_bias [E, H]`` -> the params dtype, each
    expert's row in Marlin's single-scale order; nothing without bias (vLLM permutes
    only when both are present, as it replaces only both).

    Source: marlin_utils_fp4.prepare_moe_mxfp4_layer_for_marlin (bias)
    """
    if "w13_bias" not in tensors or "w2_bias" not in tensors:
        return StageOut()
    out = {}
    for name in ("w13_bias", "w2_bias"):
        b = tensors[name].to(config.dtype)
        if b.device.type != "meta":
            b = torch.stack([marlin.marlin_permute_bias(row) for row in b.unbind(0)])
        out[name] = b.contiguous()
    return StageOut(tensors=out)
