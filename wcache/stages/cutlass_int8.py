"""CUTLASS INT8 scaled-mm stages (CUDA): compressed-tensors W8A8 INT8 on
``CutlassInt8ScaledMMLinearKernel``, the kernel vLLM 0.32 picks first on CUDA.

vLLM's post-load work, in order (``CutlassInt8ScaledMMLinearKernel.process_weights_after_loading``):

1. the int8 weight ``[N, K]`` becomes its transpose ``[K, N]`` (a column-major view:
   CUTLASS takes B column-major) (:data:`transpose_weight`);
2. fused layers with per-tensor scales get per-channel ones
   (``convert_to_channelwise``; the stage :func:`wcache.stages.onednn.convert_scale_to_channelwise`,
   the same vLLM helper);
3. static activations: the input scale is reduced (symmetric: its max) or the
   asymmetric range rebuilt into one scale and an int32 zero point
   (:data:`fold_input_scale`);
4. asymmetric activations: ``azp_adj = sum_k W[k, n]`` int32 ``[1, N]``, times the
   static zero point when static (:data:`compute_azp_adj`).

All four write tensor bytes and are exported; nothing is replayed on restore
(``apply_weights`` reads the five tensors by name; the flags live in the kernel
config built at ``create_weights``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.common import StageInputError, fold_int8_static_input

__all__ = ["transpose_weight", "fold_input_scale", "compute_azp_adj"]

_SOURCE = (
    "vllm.model_executor.kernels.linear.scaled_mm.cutlass."
    "CutlassInt8ScaledMMLinearKernel.process_weights_after_loading"
)


@stage(
    "cutlass_int8.transpose_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source=f"{_SOURCE} (WEIGHT: weight.t())",
)
def transpose_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """int8 ``weight`` ``[N, K]`` -> its ``[K, N]`` transpose (a view, strides ``(1, K)``)."""
    return StageOut(tensors={"weight": tensors["weight"].t()})


@stage(
    "cutlass_int8.fold_input_scale",
    Tag.TRANSFORM,
    reads=("input_scale", "input_zero_point"),
    writes=("input_scale", "input_zero_point"),
    optional=("input_scale", "input_zero_point"),
    source=f"{_SOURCE} (INPUT SCALE)",
)
def fold_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Static activations only (dynamic: no change).

    Symmetric: ``input_scale`` fp32 ``[1]`` -> its max (0-d). Asymmetric: from
    ``input_scale`` and ``input_zero_point`` (int8 ``[1]``) rebuild the range
    ``[scale * (-128 - zp), scale * (127 - zp)]`` and return one 0-d fp32 scale over it
    and the 0-d int32 zero point ``-128 - range_min / scale``, truncated as vLLM does.

    Raises:
        StageInputError: static without ``input_scale``, or asymmetric static without
            ``input_zero_point``.
    """
    # the zero point truncated, as vLLM's CUTLASS post-load does (oneDNN's rounds)
    return StageOut(tensors=fold_int8_static_input(tensors, config, round_zero_point=False))


@stage(
    "cutlass_int8.compute_azp_adj",
    Tag.TRANSFORM,
    reads=("weight", "input_zero_point"),
    writes=("azp_adj",),
    optional=("input_zero_point",),
    source=f"{_SOURCE} (azp_adj; csrc/quantization/w8a8/cutlass/Epilogues.md)",
)
def compute_azp_adj(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Asymmetric activations only: ``azp_adj`` int32 ``[1, N]`` = ``sum_k W[k, n]`` of
    the transposed ``[K, N]`` weight; static: times the folded 0-d zero point.

    Raises:
        StageInputError: asymmetric static without ``input_zero_point``.
    """
    if config.quant.input_symmetric:
        return StageOut()
    azp_adj = tensors["weight"].sum(dim=0, keepdim=True, dtype=torch.int32)
    if config.quant.static_input:
        if "input_zero_point" not in tensors:
            raise StageInputError(
                f"layer {config.name!r}: asymmetric static W8A8 INT8 without input_zero_point"
            )
        azp_adj = tensors["input_zero_point"] * azp_adj
    return StageOut(tensors={"azp_adj": azp_adj})
