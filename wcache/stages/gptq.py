"""GPTQ (symmetric) post-load stages.

A symmetric GPTQ checkpoint carries ``qzeros`` ``[K // G, N // pf]`` int32 that
vLLM's CPU and Marlin kernels never read (the bias of ``uint4b8`` is implicit):
vLLM empties the slot with ``setattr(layer, "qzeros", None)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage

__all__ = ["drop_zero_points", "clear_zero_points"]


_SOURCE = (
    "vllm/model_executor/kernels/linear/mixed_precision/cpu.py::"
    "CPUWNA16LinearKernel.process_weights_after_loading "
    "(setattr(layer, w_zp_name, None) when not zero_points)"
)


@stage(
    "gptq.drop_zero_points", Tag.TRANSFORM, writes=("qzeros",), drops=("qzeros",), source=_SOURCE
)
def drop_zero_points(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Drop the unused checkpoint ``qzeros`` (int32 ``[K // G, N // 8]``; symmetric
    GPTQ ignores it). TRANSFORM: the daemon does not export it, and the engine
    removes its placeholder through the manifest's drops. Reads nothing.
    """
    return StageOut(drop=("qzeros",))


@stage(
    "gptq.clear_zero_points", Tag.METADATA, attrs=("qzeros",), optional=("qzeros",), source=_SOURCE
)
def clear_zero_points(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``layer.qzeros = None``: the empty slot vLLM leaves once the tensor is gone
    (after :data:`drop_zero_points`; replayed on restore). Reads nothing.

    Raises:
        StageContractError: (from the runner) the layer still holds ``qzeros``.
    """
    return StageOut(attrs={"qzeros": None})
