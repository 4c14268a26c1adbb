"""Generic, pure tensor helpers shared by stage families (CPU and CUDA plans).

Packing convention (GPTQ / compressed-tensors "standard" order): ``32 // num_bits``
unsigned values share one int32; value ``i`` of a pack sits in bits
``[i * num_bits, (i + 1) * num_bits)``. "Along rows" packs dimension 0
(``[size_k, size_n] -> [size_k // pack_factor, size_n]``), "along cols" packs
dimension 1 (``[size_k, size_n] -> [size_k, size_n // pack_factor]``).

Every helper returns a new tensor, never writes its input, and works on CPU,
CUDA and meta tensors (no numpy, no ``.item()``).
"""

from __future__ import annotations

import torch

from wcache.core import WcacheError

__all__ = [
    "BITS_PER_INT32", "StageInputError", "OpUnavailable", "pack_factor", "pack_along",
    "unpack_along", "pack_rows", "pack_cols", "unpack_rows", "unpack_cols", "pad_to",
    "round_up", "require_op", "fold_int8_static_input", "high_precision_weight",
]

#: int32 words hold the packed values.
BITS_PER_INT32 = 32


class StageInputError(WcacheError, ValueError):
    """A stage got tensors whose shape, dtype or packing it cannot handle."""

    code = "stage-input"


class OpUnavailable(WcacheError, RuntimeError):
    """A native op a stage needs is not registered in this process."""

    code = "op-unavailable"


def pack_factor(num_bits: int) -> int:
    """Values per int32 word for ``num_bits``-bit values.

    Raises:
        StageInputError: ``num_bits`` does not divide 32.
    """
    if num_bits <= 0 or BITS_PER_INT32 % num_bits:
        raise StageInputError(f"num_bits={num_bits} does not divide {BITS_PER_INT32}; "
                              f"only 1, 2, 4, 8, 16-bit values pack into int32 words")
    return BITS_PER_INT32 // num_bits


def pack_along(values: torch.Tensor, num_bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``num_bits``-bit values into int32 words along ``dim``.

    Args:
        values: int tensor, any rank; ``values.shape[dim] % (32 // num_bits) == 0``;
            only the low ``num_bits`` bits of each value are kept.
        num_bits: bits per value.
        dim: the dimension to pack.

    Returns:
        int32, the shape of ``values`` with ``shape[dim] // (32 // num_bits)``;
        contiguous in the permuted order of the upstream function (a permuted
        view, exactly as upstream returns it).

    Raises:
        StageInputError: ``shape[dim]`` is not a multiple of the pack factor.

    Source: vllm/model_executor/layers/quantization/utils/quant_utils.py::
        pack_quantized_values_into_int32 (same op sequence, so bit-exact).
    """
    pf = pack_factor(num_bits)
    ndim = values.dim()
    dim = dim % ndim
    if values.shape[dim] % pf:
        raise StageInputError(f"cannot pack dim {dim} of size {values.shape[dim]} by "
                              f"{pf}; it must be a multiple of {pf}")
    perm = (*[i for i in range(ndim) if i != dim], dim)
    inv_perm = tuple(perm.index(i) for i in range(ndim))
    v = values.permute(perm)
    mask = (1 << num_bits) - 1
    shape = list(v.shape)
    shape[-1] //= pf
    res = torch.zeros(shape, dtype=torch.int32, device=values.device)
    for i in range(pf):
        res = res | ((v[..., i::pf] & mask) << (num_bits * i))
    return res.permute(inv_perm)


def unpack_along(packed: torch.Tensor, num_bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_along`: int32 words to unsigned values along ``dim``.

    Args:
        packed: int32, any rank.
        num_bits: bits per value.
        dim: the packed dimension.

    Returns:
        int32 values in ``[0, 2**num_bits)``, ``shape[dim] * (32 // num_bits)``.

    Source: quant_utils.py::unpack_quantized_values_into_int32.
    """
    pf = pack_factor(num_bits)
    ndim = packed.dim()
    dim = dim % ndim
    perm = (*[i for i in range(ndim) if i != dim], dim)
    inv_perm = tuple(perm.index(i) for i in range(ndim))
    p = packed.permute(perm)
    mask = (1 << num_bits) - 1
    parts = [(p >> (num_bits * i)) & mask for i in range(pf)]
    # interleave: element j*pf + i comes from word j, slot i
    res = torch.stack(parts, dim=-1).reshape(*p.shape[:-1], p.shape[-1] * pf)
    return res.to(torch.int32).permute(inv_perm)


def pack_rows(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[size_k, size_n]`` values -> ``[size_k // pf, size_n]`` int32 (GPTQ qweight).

    Source: quant_utils.py::pack_rows / gptq_pack (numpy there; same bits).
    """
    return pack_along(values, num_bits, 0).contiguous()


def pack_cols(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[size_k, size_n]`` values -> ``[size_k, size_n // pf]`` int32 (GPTQ qzeros).

    Source: quant_utils.py::pack_cols (numpy there; same bits).
    """
    return pack_along(values, num_bits, 1).contiguous()


def unpack_rows(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[size_k // pf, size_n]`` int32 -> ``[size_k, size_n]`` int32 values."""
    return unpack_along(packed, num_bits, 0).contiguous()


def unpack_cols(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[size_k, size_n // pf]`` int32 -> ``[size_k, size_n]`` int32 values.

    Source: quant_utils.py::unpack_cols (numpy there; same bits).
    """
    return unpack_along(packed, num_bits, 1).contiguous()


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= x``."""
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
    if len(shape) != t.dim() or any(s < d for s, d in zip(shape, t.shape)):
        raise StageInputError(f"cannot pad shape {tuple(t.shape)} to {tuple(shape)}")
    out = torch.full(shape, value, dtype=t.dtype, device=t.device)
    if t.device.type == "meta":
        return out
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out


def require_op(namespace: str, name: str):
    """The registered native op ``torch.ops.<namespace>.<name>``.

    Raises:
        OpUnavailable: the op is not registered (vLLM's ``_C`` extension is not
            loaded in this process). Import ``vllm._custom_ops`` (the vLLM
            integration does) or run the plan where vLLM's CPU build is installed.
    """
    try:
        ns = getattr(torch.ops, namespace)
        return getattr(ns, name)
    except (AttributeError, RuntimeError) as e:
        raise OpUnavailable(
            f"torch.ops.{namespace}.{name} is not registered: vLLM's {namespace} "
            f"extension is not loaded in this process. Import vllm._custom_ops first "
            f"(wcache.vllm does) or use a plan that does not need this op.") from e


_INT8 = torch.iinfo(torch.int8)


def fold_int8_static_input(tensors, config, *, round_zero_point: bool) -> dict[str, torch.Tensor]:
    """The static-activation part of vLLM's W8A8 INT8 post-load, shared by its CUTLASS
    and oneDNN kernels; ``{}`` for dynamic activations.

    Symmetric: ``input_scale`` fp32 ``[S]`` -> its max (0-d). Asymmetric: one 0-d fp32
    scale over the range ``[min_s scale_s * (-128 - zp_s), max_s scale_s * (127 - zp_s)]``
    of ``input_scale`` and ``input_zero_point`` (int8 ``[S]``), and the 0-d int32 zero
    point ``-128 - range_min / scale``, rounded (oneDNN) or truncated (CUTLASS).

    Raises:
        StageInputError: static without ``input_scale``, or asymmetric static without
            ``input_zero_point``.

    Source: vLLM's ``CutlassInt8ScaledMMLinearKernel`` / ``CPUInt8ScaledMMLinearKernel``
    ``process_weights_after_loading`` (INPUT SCALE).
    """
    if not config.quant.static_input:
        return {}
    if "input_scale" not in tensors:
        raise StageInputError(f"layer {config.name!r}: static W8A8 INT8 without input_scale")
    input_scale = tensors["input_scale"]
    if config.quant.input_symmetric:
        return {"input_scale": input_scale.max()}
    if "input_zero_point" not in tensors:
        raise StageInputError(f"layer {config.name!r}: asymmetric static W8A8 INT8 without "
                              "input_zero_point")
    azps = tensors["input_zero_point"].to(dtype=torch.int32)
    range_max = (input_scale * (_INT8.max - azps)).max()
    range_min = (input_scale * (_INT8.min - azps)).min()
    scale = (range_max - range_min) / (_INT8.max - _INT8.min)
    azp = _INT8.min - range_min / scale
    azp = (azp.round() if round_zero_point else azp).to(dtype=torch.int32)
    return {"input_scale": scale, "input_zero_point": azp}


#: dtypes an online quantization stage takes: a checkpoint's unquantized weight.
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def high_precision_weight(tensors, config, what: str) -> torch.Tensor:
    """``tensors["weight"]`` when it is a checkpoint's bf16/fp16/fp32 weight.

    Raises:
        StageInputError: it is already quantized (e.g. float8): the daemon was handed
            vLLM's processed layer, not the checkpoint's (vLLM 0.32 quantizes online
            methods while loading; ``wcache serve`` defers that), so quantizing again
            would serve other bytes than an ordinary load. Names the layer, the step
            and the dtype and shape found.
    """
    weight = tensors["weight"]
    if weight.dtype not in HIGH_PRECISION_DTYPES:
        raise StageInputError(
            f"layer {config.name!r}: {what} expects the checkpoint's bf16/fp16/fp32 weight, "
            f"got {str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}: the weight "
            f"is already quantized (vLLM quantized it while loading). Report this as a "
            f"wcache bug with the vLLM version, or serve the model without wcache.")
    return weight
