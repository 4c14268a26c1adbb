"""AutoAWQ (GEMM format) to the standard GPTQ-like layout: the one AWQ stage every AWQ
plan (CPUWNA16, Marlin, Machete) starts with.

AWQ packs eight 4-bit values per int32 along the **output** dimension in the slot
order :data:`~wcache.stages.packing.AWQ_PACK_ORDER`. vLLM's kernels want the
standard order, with ``qweight`` packed along the **input** dimension and ``qzeros``
in compressed-tensors' ``[N // 8, K // G]`` layout. The packing itself is
:func:`wcache.stages.packing.awq_to_standard`; the stage is pure torch, bit-exact
with vLLM, and accepts meta tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.packing import AWQ_NUM_BITS, awq_to_standard

__all__ = ["convert_to_standard"]

_SOURCE = "vllm/model_executor/layers/quantization/auto_awq.py::_convert_awq_to_standard_format"


def _num_bits(config: LayerConfig) -> int:
    """The layer's weight bits; a config left at the unquantized default (16) is AWQ's 4."""
    return config.quant.num_bits if config.quant.num_bits != 16 else AWQ_NUM_BITS


@stage(
    "awq.convert_to_standard",
    Tag.TRANSFORM,
    reads=("qweight", "qzeros"),
    writes=("qweight", "qzeros"),
    source=_SOURCE,
)
def convert_to_standard(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM AWQ packing -> standard packing.

    ``qweight`` int32 ``[K, N // 8]`` (AWQ order, packed along N) -> ``[K // 8, N]``
    (packed along K); ``qzeros`` int32 ``[K // G, N // 8]`` (AWQ order) ->
    ``[N // 8, K // G]`` (standard order, packed along N). Both contiguous.

    Raises:
        StageInputError: a tensor is not 2-D int32 or a size is not a multiple of 8.

    Source: vllm/model_executor/layers/quantization/auto_awq.py::
        _convert_awq_to_standard_format
    """
    qweight, qzeros = awq_to_standard(tensors["qweight"], tensors["qzeros"], _num_bits(config))
    return StageOut(tensors={"qweight": qweight, "qzeros": qzeros})
