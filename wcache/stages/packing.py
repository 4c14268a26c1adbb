"""Integer packing and layout arithmetic shared by every stage family and the fixture
builder: the one place wcache packs sub-byte values into int32 words.

Standard order (GPTQ, compressed-tensors, and AWQ after conversion): ``32 // num_bits``
unsigned values share one int32 word; value ``i`` of a word sits in bits
``[i * num_bits, (i + 1) * num_bits)``. The packed dimension ``packed_dim`` holds
``shape[packed_dim] // pack_factor`` words: GPTQ's ``qweight`` packs dim 0 (K,
``[size_k, size_n] -> [size_k // 8, size_n]``), zero points and compressed-tensors'
``weight_packed`` dim 1.

AWQ order (AutoAWQ GEMM): 4-bit only, packed along N (dim 1), slot ``j`` of a word
holds column ``AWQ_PACK_ORDER[j]`` of its group of 8; :data:`AWQ_REVERSE_PACK_ORDER`
undoes it.

Every function returns a new tensor, never writes its input, and works on CPU, CUDA
and meta tensors (no numpy, no ``.item()``).
"""

from __future__ import annotations

import torch

from wcache.stages.common import StageInputError

__all__ = [
    "BITS_PER_INT32",
    "AWQ_NUM_BITS",
    "AWQ_PACK_ORDER",
    "AWQ_REVERSE_PACK_ORDER",
    "pack_factor",
    "pack_int32",
    "unpack_int32",
    "pack_awq",
    "unpack_awq",
    "awq_to_standard",
    "round_up",
    "pad_to",
]

#: int32 words hold the packed values.
BITS_PER_INT32 = 32
#: AutoAWQ GEMM checkpoints are 4-bit (vLLM's ``AutoAWQConfig.TYPE_MAP``).
AWQ_NUM_BITS = 4
#: The slot order AutoAWQ writes the 8 nibbles of a word in: slot ``j`` holds column
#: ``AWQ_PACK_ORDER[j]`` of the word's group of 8 (vLLM's ``quant_utils.awq_pack``).
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: The permutation that undoes :data:`AWQ_PACK_ORDER` (vLLM's ``_REVERSE_AWQ_PACK_ORDER``
#: in ``auto_awq.py``): column ``j`` of a group is slot ``AWQ_REVERSE_PACK_ORDER[j]``.
AWQ_REVERSE_PACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_factor(num_bits: int) -> int:
    """Values per int32 word for ``num_bits``-bit values.

    Raises:
        StageInputError: ``num_bits`` does not divide 32.
    """
    if num_bits <= 0 or BITS_PER_INT32 % num_bits:
        raise StageInputError(
            f"num_bits={num_bits} does not divide {BITS_PER_INT32}; "
            f"only 1, 2, 4, 8, 16-bit values pack into int32 words"
        )
    return BITS_PER_INT32 // num_bits


def _to_end(ndim: int, packed_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(perm, inv_perm)`` moving ``packed_dim`` last and back (vLLM's permutation)."""
    perm = (*[i for i in range(ndim) if i != packed_dim], packed_dim)
    return perm, tuple(perm.index(i) for i in range(ndim))


def pack_int32(values: torch.Tensor, num_bits: int, packed_dim: int) -> torch.Tensor:
    """Pack unsigned ``num_bits``-bit values into int32 words along ``packed_dim``.

    Args:
        values: any integer dtype (int32, int64, uint8, ...), any rank;
            ``shape[packed_dim] % (32 // num_bits) == 0``. Only the low ``num_bits``
            bits of each value are kept. Cast to int32 before shifting, so a uint8
            input keeps the bits that vLLM's function would shift out of a byte.
        num_bits: bits per value (4 or 8 in practice).
        packed_dim: the dimension to pack (negative counts from the end).

    Returns:
        int32, ``values.shape`` with ``shape[packed_dim] // (32 // num_bits)``; the
        upstream permuted view (contiguous when ``packed_dim`` is the last dim);
        call ``.contiguous()`` where a contiguous tensor is needed.

    Raises:
        StageInputError: ``num_bits`` does not divide 32, or ``shape[packed_dim]`` is
            not a multiple of the pack factor.

    Source: vllm/model_executor/layers/quantization/utils/quant_utils.py::
        pack_quantized_values_into_int32 (same op sequence, on int32).
    """
    pf = pack_factor(num_bits)
    ndim = values.dim()
    packed_dim = packed_dim % ndim
    if values.shape[packed_dim] % pf:
        raise StageInputError(
            f"cannot pack dim {packed_dim} of size "
            f"{values.shape[packed_dim]} by {pf}; it must be a multiple "
            f"of {pf}"
        )
    perm, inv_perm = _to_end(ndim, packed_dim)
    v = values.permute(perm).to(torch.int32)
    mask = (1 << num_bits) - 1
    shape = list(v.shape)
    shape[-1] //= pf
    res = torch.zeros(shape, dtype=torch.int32, device=values.device)
    for i in range(pf):
        res = res | ((v[..., i::pf] & mask) << (num_bits * i))
    return res.permute(inv_perm)


def unpack_int32(packed: torch.Tensor, num_bits: int, packed_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words to unsigned values along ``packed_dim``.

    Args:
        packed: int32, any rank.
        num_bits: bits per value.
        packed_dim: the packed dimension (negative counts from the end).

    Returns:
        int32 values in ``[0, 2**num_bits)``, ``packed.shape`` with
        ``shape[packed_dim] * (32 // num_bits)``; the upstream permuted view
        (contiguous when ``packed_dim`` is the last dim).

    Raises:
        StageInputError: ``num_bits`` does not divide 32.

    Source: quant_utils.py::unpack_quantized_values_into_int32 (same op sequence).
    """
    pf = pack_factor(num_bits)
    ndim = packed.dim()
    perm, inv_perm = _to_end(ndim, packed_dim % ndim)
    p = packed.permute(perm)
    mask = (1 << num_bits) - 1
    shape = list(p.shape)
    shape[-1] *= pf
    res = torch.zeros(shape, dtype=torch.int32, device=packed.device)
    for i in range(pf):
        res[..., i::pf] = (p >> (num_bits * i)) & mask
    return res.permute(inv_perm)


def _check_awq(packed: torch.Tensor, what: str) -> None:
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise StageInputError(
            f"AWQ {what} must be 2-D int32, got {tuple(packed.shape)} {packed.dtype}"
        )


def _awq_orders(num_bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(pack order, reverse order)``: AWQ's for 8 values a word, identity for another
    pack factor (kept from wcache's Marlin conversion; AutoAWQ GEMM is 4-bit only)."""
    pf = pack_factor(num_bits)
    if pf == len(AWQ_PACK_ORDER):
        return AWQ_PACK_ORDER, AWQ_REVERSE_PACK_ORDER
    return tuple(range(pf)), tuple(range(pf))


def pack_awq(values: torch.Tensor, num_bits: int = AWQ_NUM_BITS) -> torch.Tensor:
    """Pack ``[rows, cols]`` values along dim 1 in AWQ order (what AutoAWQ writes).

    Args:
        values: integer ``[rows, cols]``, values in ``[0, 2**num_bits)``;
            ``cols % (32 // num_bits) == 0``.

    Returns:
        int32 ``[rows, cols // 8]``, contiguous; slot ``j`` of word ``w`` holds column
        ``8 * w + AWQ_PACK_ORDER[j]``.

    Source: quant_utils.py::awq_pack (numpy there; same bits).
    """
    pf = pack_factor(num_bits)
    rows, cols = values.shape
    order = list(_awq_orders(num_bits)[0])
    grouped = values.reshape(rows, cols // pf, pf)[:, :, order].reshape(rows, cols)
    return pack_int32(grouped, num_bits, 1)


def unpack_awq(packed: torch.Tensor, num_bits: int = AWQ_NUM_BITS) -> torch.Tensor:
    """Inverse of :func:`pack_awq`: ``[rows, cols // 8]`` AWQ-order int32 -> ``[rows, cols]``
    int32 values in column order.

    Source: auto_awq.py::_convert_awq_to_standard_format (the unpack and reorder).
    """
    pf = pack_factor(num_bits)
    rows, words = packed.shape
    order = torch.tensor(_awq_orders(num_bits)[1], dtype=torch.long, device=packed.device)
    slots = unpack_int32(packed, num_bits, 1).reshape(rows, words, pf)
    return slots[:, :, order].reshape(rows, words * pf)


def awq_to_standard(
    qweight: torch.Tensor, qzeros: torch.Tensor | None, num_bits: int = AWQ_NUM_BITS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AWQ packing -> the standard (GPTQ / compressed-tensors) packing.

    Args:
        qweight: int32 ``[size_k, size_n // 8]``, packed along N in AWQ order.
        qzeros: int32 ``[size_k // group_size, size_n // 8]``, packed along N in AWQ
            order, or None (symmetric: only the weight is converted).
        num_bits: bits per value (4; another width is unpacked in identity slot order,
            as wcache's Marlin conversion did; vLLM's raises there, at its reorder or reshape).

    Returns:
        ``(qweight, qzeros)``: int32 ``[size_k // 8, size_n]`` packed along K (dim 0)
        and int32 ``[size_n // 8, size_k // group_size]`` packed along N (dim 0; the
        compressed-tensors zero-point layout) or None, standard order, contiguous.

    Raises:
        StageInputError: a tensor is not 2-D int32, or ``size_k`` (or ``size_n``) is not
            a multiple of the pack factor.

    Source: vllm/model_executor/layers/quantization/auto_awq.py::
        _convert_awq_to_standard_format (unpack, reorder, repack along dim 0).
    """
    _check_awq(qweight, "qweight")
    w = _pack_rows_by_sum(unpack_awq(qweight, num_bits), num_bits, "qweight (size_k)")
    if qzeros is None:
        return w, None
    _check_awq(qzeros, "qzeros")
    return w, _pack_rows_by_sum(unpack_awq(qzeros, num_bits).T, num_bits, "qzeros (size_n)")


def _pack_rows_by_sum(values: torch.Tensor, num_bits: int, what: str) -> torch.Tensor:
    """Pack int32 ``[rows, cols]`` values (in ``[0, 2**num_bits)``) along dim 0 as
    vLLM's AWQ conversion does: shift each slot, then ``sum(dim=1, dtype=int32)``.

    The words equal :func:`pack_int32`'s (the slots' bits are disjoint); the result is
    a fresh tensor with row-major strides, including on a size-1 dim: a single group's
    zero points ``[size_n // 8, 1]`` have strides ``(1, 1)`` there, not the
    ``(1, size_n // 8)`` a permuted :func:`pack_int32` view leaves, which
    ``.contiguous()`` keeps.

    Args:
        values: int32 ``[rows, cols]``.
        num_bits: bits per value.
        what: the tensor and dim, for the error (``"qzeros (size_n)"``).

    Raises:
        StageInputError: ``rows`` is not a multiple of the pack factor.

    Source: auto_awq.py::_convert_awq_to_standard_format (the repack of both tensors).
    """
    pf = pack_factor(num_bits)
    rows, cols = values.shape
    if rows % pf:
        raise StageInputError(
            f"cannot pack AWQ {what} of size {rows} by {pf}; it must be a multiple of {pf}"
        )
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=values.device)
    return (
        (values.reshape(rows // pf, pf, cols).to(torch.int32) << shifts[None, :, None])
        .sum(dim=1, dtype=torch.int32)
        .contiguous()
    )


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= x`` (``x``, ``multiple`` ints,
    ``multiple > 0``)."""
    return -(-x // multiple) * multiple


def pad_to(t: torch.Tensor, shape: tuple[int, ...], value: float | int = 0) -> torch.Tensor:
    """Pad ``t`` at the end of each dimension up to ``shape`` with ``value``.

    Args:
        t: any tensor; every ``t.shape[i] <= shape[i]``.
        shape: the target shape (same rank).
        value: the fill value for the new elements.

    Returns:
        a new contiguous tensor of ``shape`` (a contiguous copy when no padding
        is needed), same dtype and device.

    Raises:
        StageInputError: rank differs or a dimension would shrink.
    """
    shape = tuple(shape)
    if len(shape) != t.dim() or any(s < d for s, d in zip(shape, t.shape)):
        raise StageInputError(f"cannot pad shape {tuple(t.shape)} to {shape}")
    out = torch.full(shape, value, dtype=t.dtype, device=t.device)
    if t.device.type == "meta":
        return out
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out
