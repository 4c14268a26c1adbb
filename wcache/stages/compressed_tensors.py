"""compressed-tensors ``pack-quantized`` (W4A16) layout to the GPTQ-like layout
vLLM's CPUWNA16 kernel expects.

Checkpoint layout: ``weight_packed`` int32 ``[size_n, size_k // 8]`` packed along K;
``weight_scale`` ``[size_n, size_k // G]``; ``weight_zero_point`` int32
``[size_n // 8, size_k // G]`` packed along N (asymmetric only); ``weight_shape``
int64 ``[2]`` (kept as is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage

__all__ = ["transpose_weight", "transpose_scales", "clear_zero_point"]

_KERNEL = (
    "vllm/model_executor/kernels/linear/mixed_precision/cpu.py::"
    "CPUWNA16LinearKernel.process_weights_after_loading"
)


@stage(
    "compressed_tensors.transpose_weight",
    Tag.TRANSFORM,
    reads=("weight_packed",),
    writes=("weight_packed",),
    source=f"{_KERNEL} (weights.input_dim == 1 branch)",
)
def transpose_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``weight_packed`` ``[N, K // 8]`` -> the transposed view ``[K // 8, N]`` (as vLLM)."""
    return StageOut(tensors={"weight_packed": tensors["weight_packed"].t()})


@stage(
    "compressed_tensors.transpose_scales",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source=f"{_KERNEL} (scales.output_dim == 0 branch)",
)
def transpose_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``weight_scale`` ``[N, K // G]`` -> ``[K // G, N]`` contiguous."""
    return StageOut(tensors={"weight_scale": tensors["weight_scale"].t().contiguous()})


@stage(
    "compressed_tensors.clear_zero_point",
    Tag.METADATA,
    attrs=("weight_zero_point",),
    optional=("weight_zero_point",),
    source=f"{_KERNEL} (setattr(layer, w_zp_name, None) when not zero_points)",
)
def clear_zero_point(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Symmetric only: ``layer.weight_zero_point = None`` (a plain attribute: vLLM
    registers no zero points for a symmetric layer). Asymmetric: nothing (the
    layer keeps its ``weight_zero_point`` tensor).

    Returns:
        ``attrs={"weight_zero_point": None}`` when ``config.quant.zero_point`` is
        false, else an empty :class:`StageOut`.

    Source: vllm/model_executor/kernels/linear/mixed_precision/cpu.py::
    CPUWNA16LinearKernel.process_weights_after_loading.
    """
    if config.quant.zero_point:
        return StageOut()
    return StageOut(attrs={"weight_zero_point": None})
