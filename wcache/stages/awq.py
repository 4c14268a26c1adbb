"""AutoAWQ (GEMM format) to the standard GPTQ-like layout.

AWQ packs eight 4-bit values per int32 along the **output** dimension in the
nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (equivalently, value ``j`` of a pack
sits in slot ``AWQ_PACK_ORDER[j]``). vLLM's kernels want the standard order,
with ``qweight`` packed along the **input** dimension. Both stages are pure
torch, mirror vLLM's op sequence exactly (bit-exact), and accept meta tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.common import StageInputError, pack_factor

__all__ = ["AWQ_PACK_ORDER", "REVERSE_AWQ_PACK_ORDER", "unpack_reorder",
           "convert_zero_points", "awq_to_standard_qweight", "awq_to_standard_qzeros"]

#: slot order AutoAWQ writes the 8 nibbles of a pack in.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: the permutation that undoes it (vLLM's ``_REVERSE_AWQ_PACK_ORDER``).
REVERSE_AWQ_PACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: AutoAWQ GEMM checkpoints are 4-bit.
AWQ_NUM_BITS = 4

_SOURCE = "vllm/model_executor/layers/quantization/auto_awq.py::_convert_awq_to_standard_format"


def _unpack_awq(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[rows, cols // pf]`` AWQ-order int32 -> ``[rows, cols]`` int32 values."""
    pf = pack_factor(num_bits)
    mask = (1 << num_bits) - 1
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
    order = torch.tensor(REVERSE_AWQ_PACK_ORDER, dtype=torch.long, device=packed.device)
    rows, cols_packed = packed.shape
    unpacked = (packed.unsqueeze(-1) >> shifts) & mask
    return unpacked[:, :, order].reshape(rows, cols_packed * pf)


def _pack_dim0(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[rows, cols]`` values -> ``[rows // pf, cols]`` int32 in standard order."""
    pf = pack_factor(num_bits)
    rows, cols = values.shape
    if rows % pf:
        raise StageInputError(f"cannot pack {rows} rows by {pf}; need a multiple of {pf}")
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=values.device)
    v = values.reshape(rows // pf, pf, cols)
    return (v.to(torch.int32) << shifts[None, :, None]).sum(dim=1, dtype=torch.int32).contiguous()


def awq_to_standard_qweight(qweight: torch.Tensor, num_bits: int = AWQ_NUM_BITS) -> torch.Tensor:
    """AWQ qweight to the standard layout.

    Args:
        qweight: int32 ``[size_k, size_n // 8]``, packed along N in AWQ order.
        num_bits: bits per value (4).

    Returns:
        int32 ``[size_k // 8, size_n]``, packed along K in standard order, contiguous.

    Raises:
        StageInputError: not 2-D int32, or ``size_k`` not a multiple of 8.

    Source: auto_awq.py::_convert_awq_to_standard_format (qweight half).
    """
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise StageInputError(f"AWQ qweight must be 2-D int32, got {tuple(qweight.shape)} "
                              f"{qweight.dtype}")
    return _pack_dim0(_unpack_awq(qweight, num_bits), num_bits)


def awq_to_standard_qzeros(qzeros: torch.Tensor, num_bits: int = AWQ_NUM_BITS) -> torch.Tensor:
    """AWQ qzeros to the compressed-tensors zero-point layout.

    Args:
        qzeros: int32 ``[size_k // group_size, size_n // 8]``, packed along N in
            AWQ order.

    Returns:
        int32 ``[size_n // 8, size_k // group_size]``, packed along N (dim 0) in
        standard order, contiguous.

    Source: auto_awq.py::_convert_awq_to_standard_format (qzeros half).
    """
    if qzeros.dim() != 2 or qzeros.dtype != torch.int32:
        raise StageInputError(f"AWQ qzeros must be 2-D int32, got {tuple(qzeros.shape)} "
                              f"{qzeros.dtype}")
    return _pack_dim0(_unpack_awq(qzeros, num_bits).T, num_bits)


def _num_bits(config: LayerConfig) -> int:
    return config.quant.num_bits if config.quant.num_bits != 16 else AWQ_NUM_BITS


@stage("awq.unpack_reorder", Tag.TRANSFORM, reads=("qweight",), writes=("qweight",),
       source=_SOURCE)
def unpack_reorder(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
                   recorded: Mapping[str, Any]) -> StageOut:
    """qweight ``[K, N // 8]`` (AWQ order, packed along N) -> ``[K // 8, N]`` (packed along K)."""
    return StageOut(tensors={"qweight": awq_to_standard_qweight(tensors["qweight"],
                                                                _num_bits(config))})


@stage("awq.convert_zero_points", Tag.TRANSFORM, reads=("qzeros",), writes=("qzeros",),
       source=_SOURCE)
def convert_zero_points(tensors: Mapping[str, torch.Tensor], config: LayerConfig,
                        target: Target, recorded: Mapping[str, Any]) -> StageOut:
    """qzeros ``[K // G, N // 8]`` (AWQ order) -> ``[N // 8, K // G]`` (standard order)."""
    return StageOut(tensors={"qzeros": awq_to_standard_qzeros(tensors["qzeros"],
                                                              _num_bits(config))})
