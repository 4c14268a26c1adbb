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

__all__ = ["drop_zero_points"]


@stage("gptq.drop_zero_points", Tag.METADATA, attrs=("qzeros",),
       source="vllm/model_executor/kernels/linear/mixed_precision/cpu.py::"
              "CPUWNA16LinearKernel.process_weights_after_loading "
              "(setattr(layer, w_zp_name, None) when not zero_points)")
def drop_zero_points(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
                     recorded: Mapping[str, Any]) -> StageOut:
    """Drop the unused checkpoint ``qzeros`` and leave an empty ``None`` slot, as vLLM does.

    METADATA: it decides from the config alone and writes no tensor; on restore
    it removes the engine's placeholder. Reads nothing.
    """
    return StageOut(drop=("qzeros",), attrs={"qzeros": None})
