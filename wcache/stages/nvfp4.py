"""ModelOpt NVFP4 stages: global scales, alpha, the CUTLASS block-scale swizzle,
CUTLASS weight padding, and the fused-MoE scale preparation.

NVFP4: E2M1 values, two per uint8 byte (low nibble first) along K; one
float8_e4m3fn block scale per 16 values; one fp32 global scale per tensor
(``weight_scale_2``; the dequantized value is ``fp4 * block_scale * scale_2``).

The swizzle (``swizzle_blockscale``) is ported without vLLM's hard-coded
``.cuda()``; :func:`unswizzle_blockscale` is its exact inverse for every K
(vLLM's ``convert_swizzled_to_linear`` slices columns by K elements instead of
K / 16 groups and so returns padded columns when ``K / 16 % 4 != 0``).

The fused-MoE activation-scale fuse (``CutlassExpertsFp4.process_weights_after_loading``)
is done by vLLM *in place* (``w13_weight_scale_2.mul_(w13_input_scale)``).
:data:`fuse_moe_activation_scale` is a TRANSFORM that returns new tensors; it
must never be replayed on restore (the plan rules and the restore guard refuse
any replayable variant).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, WcacheError, stage
from wcache.stages.packing import round_up

__all__ = [
    "NVFP4_GROUP_SIZE",
    "SWIZZLE_ROW_TILE",
    "SWIZZLE_COL_TILE",
    "CUTLASS_FP4_ALIGNMENT",
    "Nvfp4LayoutError",
    "swizzle_blockscale",
    "unswizzle_blockscale",
    "pad_nvfp4_weight_for_cutlass",
    "validate_loaded",
    "reduce_weight_scale_2",
    "reduce_input_scale",
    "compute_alpha",
    "set_is_w4a16_nvfp4",
    "swizzle_scales",
    "pad_weight",
    "select_w13_weight_scale_2",
    "reduce_w13_input_scale",
    "swizzle_moe_scales",
    "fuse_moe_activation_scale",
    "set_moe_dims",
]

#: Values per block scale along K.
NVFP4_GROUP_SIZE = 16
#: The swizzled scale layout tiles rows by 128 (4 x 32) ...
SWIZZLE_ROW_TILE = 128
#: ... and scale columns by 4.
SWIZZLE_COL_TILE = 4
#: Row sub-tiles in the 128-row swizzle tile.
_SWIZZLE_ROW_SPLIT = (4, 32)
#: CUTLASS / FlashInfer FP4 GEMMs need N and K (in FP4 elements) multiples of 32.
CUTLASS_FP4_ALIGNMENT = 32
#: FP4 values per byte.
FP4_PER_BYTE = 2


class Nvfp4LayoutError(WcacheError, ValueError):
    """An NVFP4 tensor has an unexpected shape, dtype or NaN content."""

    code = "nvfp4-layout"


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """Pad and block-interleave FP4 block scales for CUTLASS / FlashInfer.

    Args:
        scale: ``[M, K/16]`` or ``[E, M, K/16]`` float8_e4m3fn.

    Returns:
        ``[round_up(M, 128), round_up(K/16, 4)]`` (or with the leading E),
        float8_e4m3fn, on the input's device; padding is zero.

    Raises:
        Nvfp4LayoutError: wrong dtype or rank.

    Source: ``nvfp4_utils.swizzle_blockscale`` (minus its ``.cuda()``).
    """
    if scale.dtype != torch.float8_e4m3fn:
        raise Nvfp4LayoutError(f"block scales must be float8_e4m3fn, got {scale.dtype}")
    if scale.ndim not in (2, 3):
        raise Nvfp4LayoutError(f"block scales must be 2-D or 3-D, got {tuple(scale.shape)}")
    s = scale.unsqueeze(0) if scale.ndim == 2 else scale
    b, m, k = s.shape
    mp, kp = round_up(m, SWIZZLE_ROW_TILE), round_up(k, SWIZZLE_COL_TILE)
    padded = torch.nn.functional.pad(s.view(torch.uint8), (0, kp - k, 0, mp - m)).view(
        torch.float8_e4m3fn
    )
    out = (
        padded.reshape(
            b, mp // SWIZZLE_ROW_TILE, *_SWIZZLE_ROW_SPLIT, kp // SWIZZLE_COL_TILE, SWIZZLE_COL_TILE
        )
        .permute(0, 1, 4, 3, 2, 5)
        .contiguous()
    )
    return out.reshape(mp, kp) if scale.ndim == 2 else out.reshape(b, mp, kp)


def unswizzle_blockscale(swizzled: torch.Tensor, m: int, k_groups: int) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_blockscale`, cropped to ``[m, k_groups]``.

    Args:
        swizzled: ``[Mp, Kp]`` or ``[E, Mp, Kp]`` float8_e4m3fn.
        m: logical rows.
        k_groups: logical scale columns (``K / 16``).

    Returns:
        ``[m, k_groups]`` (or ``[E, m, k_groups]``) float8_e4m3fn.
    """
    s = swizzled.unsqueeze(0) if swizzled.ndim == 2 else swizzled
    b, mp, kp = s.shape
    tiles = s.reshape(
        b,
        mp // SWIZZLE_ROW_TILE,
        kp // SWIZZLE_COL_TILE,
        _SWIZZLE_ROW_SPLIT[1],
        _SWIZZLE_ROW_SPLIT[0],
        SWIZZLE_COL_TILE,
    )
    lin = tiles.permute(0, 1, 4, 3, 2, 5).reshape(b, mp, kp)[:, :m, :k_groups].contiguous()
    return lin[0] if swizzled.ndim == 2 else lin


def pad_nvfp4_weight_for_cutlass(weight: torch.Tensor) -> torch.Tensor:
    """Zero-pad a packed ``[N, K/2]`` uint8 weight so N and K are multiples of 32.

    Returns:
        ``[round_up(N, 32), round_up(K, 32) / 2]`` uint8 (the input when aligned).

    Source: ``nvfp4_utils.pad_nvfp4_weight_for_cutlass``.
    """
    n, kb = weight.shape
    pad_rows = round_up(n, CUTLASS_FP4_ALIGNMENT) - n
    pad_bytes = (
        round_up(kb * FP4_PER_BYTE, CUTLASS_FP4_ALIGNMENT) - kb * FP4_PER_BYTE
    ) // FP4_PER_BYTE
    if pad_rows == 0 and pad_bytes == 0:
        return weight
    return torch.nn.functional.pad(weight, (0, pad_bytes, 0, pad_rows)).contiguous()


# --------------------------------------------------------------------------- linear stages

_MODELOPT = "vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod"


@stage(
    "nvfp4.validate_loaded",
    Tag.VALIDATE,
    reads=("weight_scale",),
    source=f"{_MODELOPT}.process_weights_after_loading (NaN check)",
)
def validate_loaded(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """VALIDATE: ``weight_scale`` holds no NaN (an unloaded placeholder is NaN-filled).

    Raises:
        Nvfp4LayoutError: NaN found (the checkpoint lacks this layer's scales).

    Source:
        vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod.process_weights_after_loading
        (NaN check)
    """
    s = tensors["weight_scale"]
    if s.device.type != "meta" and torch.isnan(s.float()).any():
        raise Nvfp4LayoutError(
            f"layer {config.name!r}: weight_scale contains NaN; the "
            f"checkpoint did not provide this layer's block scales"
        )
    return StageOut()


@stage(
    "nvfp4.reduce_weight_scale_2",
    Tag.TRANSFORM,
    reads=("weight_scale_2",),
    writes=("weight_global_scale", "weight_scale_2"),
    drops=("weight_scale_2",),
    source=f"{_MODELOPT}: weight_global_scale = weight_scale_2.max(); del weight_scale_2",
)
def reduce_weight_scale_2(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight_scale_2 [#shards]`` fp32 -> ``weight_global_scale`` 0-d fp32 (max);
    drops ``weight_scale_2``.

    Source: vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod:
        weight_global_scale = weight_scale_2.max(); del weight_scale_2
    """
    value = tensors["weight_scale_2"].max().to(torch.float32)
    return StageOut(tensors={"weight_global_scale": value}, drop=("weight_scale_2",))


@stage(
    "nvfp4.reduce_input_scale",
    Tag.TRANSFORM,
    reads=("input_scale",),
    writes=("input_global_scale", "input_global_scale_inv", "input_scale"),
    drops=("input_scale",),
    source=f"{_MODELOPT}: input_global_scale = input_scale.max(); inv = 1 / it; del input_scale",
)
def reduce_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``input_scale [#shards]`` -> ``input_global_scale`` and
    ``input_global_scale_inv`` (0-d fp32); drops ``input_scale``.

    Source: vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod:
        input_global_scale = input_scale.max(); inv = 1 / it; del input_scale
    """
    g = tensors["input_scale"].max().to(torch.float32)
    return StageOut(
        tensors={"input_global_scale": g, "input_global_scale_inv": (1.0 / g).to(torch.float32)},
        drop=("input_scale",),
    )


@stage(
    "nvfp4.compute_alpha",
    Tag.TRANSFORM,
    reads=("input_global_scale", "weight_global_scale"),
    writes=("alpha",),
    source="modelopt.maybe_fuse_global_scales: alpha = input_global_scale * weight_global_scale",
)
def compute_alpha(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: ``alpha = input_global_scale * weight_global_scale`` (new 0-d fp32 tensor).

    Source: modelopt.maybe_fuse_global_scales: alpha = input_global_scale *
        weight_global_scale
    """
    value = tensors["input_global_scale"] * tensors["weight_global_scale"]
    return StageOut(tensors={"alpha": value})


@stage(
    "nvfp4.set_is_w4a16_nvfp4",
    Tag.METADATA,
    attrs=("is_w4a16_nvfp4",),
    source=f"{_MODELOPT}: layer.is_w4a16_nvfp4",
)
def set_is_w4a16_nvfp4(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.is_w4a16_nvfp4 = False`` (W4A4 with an activation scale).

    Source: vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod:
        layer.is_w4a16_nvfp4
    """
    return StageOut(attrs={"is_w4a16_nvfp4": False})


@stage(
    "nvfp4.swizzle_scales",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source="CutlassNvFp4LinearKernel.process_weights_after_loading: swizzle_blockscale",
)
def swizzle_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight_scale [N, K/16]`` -> swizzled ``[round_up(N,128), round_up(K/16,4)]``.

    Source: CutlassNvFp4LinearKernel.process_weights_after_loading: swizzle_blockscale
    """
    return StageOut(tensors={"weight_scale": swizzle_blockscale(tensors["weight_scale"])})


@stage(
    "nvfp4.pad_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source="CutlassNvFp4LinearKernel.process_weights_after_loading: pad_nvfp4_weight_for_cutlass",
)
def pad_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K/2]`` uint8 -> ``[round_up(N,32), round_up(K,32)/2]`` (zeros).

    The K padding is derived at run time from shapes
    (``nvfp4_weight_padding_bytes = weight.shape[1] - K / 2``); the output is sliced
    to ``output_size_per_partition``, a create-time field. Nothing to record.

    Source: CutlassNvFp4LinearKernel.process_weights_after_loading:
        pad_nvfp4_weight_for_cutlass
    """
    w = pad_nvfp4_weight_for_cutlass(tensors["weight"])
    return StageOut(tensors={"weight": w} if w is not tensors["weight"] else {})


# --------------------------------------------------------------------------- MoE stages

_MOE = "vllm.model_executor.layers.quantization.modelopt.ModelOptNvFp4FusedMoE"


@stage(
    "nvfp4.select_w13_weight_scale_2",
    Tag.TRANSFORM,
    reads=("w13_weight_scale_2",),
    writes=("w13_weight_scale_2",),
    source=f"{_MOE}.process_weights_after_loading: w13_weight_scale_2[:, 0]",
)
def select_w13_weight_scale_2(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight_scale_2 [E, 2]`` -> ``[E]`` (the w1 column; w1 and w3 share it).

    Source:
        vllm.model_executor.layers.quantization.modelopt.ModelOptNvFp4FusedMoE.process_weights_after_loading:
        w13_weight_scale_2[:, 0]
    """
    value = tensors["w13_weight_scale_2"][:, 0].contiguous()
    return StageOut(tensors={"w13_weight_scale_2": value})


@stage(
    "nvfp4.reduce_w13_input_scale",
    Tag.TRANSFORM,
    reads=("w13_input_scale",),
    writes=("w13_input_scale",),
    source="flashinfer_fp4_moe.prepare_nvfp4_moe_layer_for_fi_or_cutlass: "
    "a13_scale.max(dim=1) (VLLM_CUTLASS, no global sf)",
)
def reduce_w13_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_input_scale [E, 2]`` -> ``[E]`` fp32 (max over w1/w3).

    Source: flashinfer_fp4_moe.prepare_nvfp4_moe_layer_for_fi_or_cutlass:
        a13_scale.max(dim=1) (VLLM_CUTLASS, no global sf)
    """
    return StageOut(
        tensors={"w13_input_scale": tensors["w13_input_scale"].max(dim=1).values.to(torch.float32)}
    )


@stage(
    "nvfp4.swizzle_moe_scales",
    Tag.TRANSFORM,
    reads=("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    writes=("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    source="flashinfer_fp4_moe.prepare_nvfp4_moe_layer_for_fi_or_cutlass "
    "(swizzle_blockscale, non-gated padding)",
)
def swizzle_moe_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM expert block scales ``[E, R, C/16]`` -> swizzled ``[E, round_up(R,128),
    round_up(C/16,4)]``; for non-gated experts whose w13 rows were padded by the
    swizzle, ``w13_weight``, ``w2_weight`` and the w2 scales are zero-padded to match.

    Raises:
        Nvfp4LayoutError: a gated (act-and-mul) layer would need intermediate padding,
            which vLLM does not support either (NotImplementedError there).

    Source: flashinfer_fp4_moe.prepare_nvfp4_moe_layer_for_fi_or_cutlass
        (swizzle_blockscale, non-gated padding)
    """
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    w13_scale = swizzle_blockscale(tensors["w13_weight_scale"])
    w2_scale = tensors["w2_weight_scale"]
    out = {"w13_weight_scale": w13_scale}
    pad = w13_scale.shape[1] - w13.shape[1]
    if pad > 0:
        if config.get("is_act_and_mul", True):
            raise Nvfp4LayoutError(
                f"layer {config.name!r}: gated NVFP4 MoE with 2*I={w13.shape[1]} not a "
                f"multiple of {SWIZZLE_ROW_TILE} needs intermediate padding, which the "
                f"CUTLASS experts do not support; use another MoE backend"
            )
        out["w13_weight"] = torch.nn.functional.pad(w13, (0, 0, 0, pad))
        out["w2_weight"] = torch.nn.functional.pad(w2, (0, pad // FP4_PER_BYTE, 0, 0))
        w2_scale = torch.nn.functional.pad(
            w2_scale.view(torch.uint8), (0, pad // NVFP4_GROUP_SIZE)
        ).view(w2_scale.dtype)
    out["w2_weight_scale"] = swizzle_blockscale(w2_scale)
    return StageOut(tensors=out)


@stage(
    "nvfp4.fuse_moe_activation_scale",
    Tag.TRANSFORM,
    reads=("w13_weight_scale_2", "w13_input_scale", "w2_weight_scale_2", "w2_input_scale"),
    writes=("w13_weight_scale_2", "w2_weight_scale_2"),
    source="fused_moe.experts.cutlass_moe.CutlassExpertsFp4.process_weights_after_loading "
    "(vLLM: in-place mul_)",
)
def fuse_moe_activation_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: ``w13_weight_scale_2 * w13_input_scale`` and ``w2_weight_scale_2 *
    w2_input_scale`` as *new* ``[E]`` fp32 tensors (the inputs are untouched).

    Never replayable: a second application would square the activation scale, and
    vLLM's in-place form would write into the daemon's shared bytes.

    Source: fused_moe.experts.cutlass_moe.CutlassExpertsFp4.process_weights_after_loading
        (vLLM: in-place mul_)
    """
    return StageOut(
        tensors={
            "w13_weight_scale_2": tensors["w13_weight_scale_2"] * tensors["w13_input_scale"],
            "w2_weight_scale_2": tensors["w2_weight_scale_2"] * tensors["w2_input_scale"],
        }
    )


@stage(
    "nvfp4.set_moe_dims",
    Tag.METADATA,
    reads=("w13_weight", "w2_weight"),
    attrs=("moe_num_experts", "moe_hidden_dim", "moe_intermediate_size_per_partition"),
    source=f"{_MOE}._restore_padded_moe_dims (dims recovered from exported shapes)",
)
def set_moe_dims(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: expert count, (padded) hidden dim and intermediate size from the final
    ``w2_weight [E, H, I/2]`` shape, as vLLM's pre-processed TRTLLM branch does.

    Source:
        vllm.model_executor.layers.quantization.modelopt.ModelOptNvFp4FusedMoE._restore_padded_moe_dims
        (dims recovered from exported shapes)
    """
    w2 = tensors["w2_weight"]
    return StageOut(
        attrs={
            "moe_num_experts": int(w2.shape[0]),
            "moe_hidden_dim": int(w2.shape[1]),
            "moe_intermediate_size_per_partition": int(w2.shape[2]) * FP4_PER_BYTE,
        }
    )
