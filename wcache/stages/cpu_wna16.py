"""vLLM's CPUWNA16 kernel (``cpu_gemm_wna16``): the w4a16 weight layout and its
host-dependent metadata.

Input layout (GPTQ-like, what AWQ/GPTQ/compressed-tensors stages produce):
``w_q`` int32 ``[size_k // 8, size_n]`` packed along K; ``w_s`` ``[size_k // G, size_n]``;
``w_zp`` int32 ``[size_k // G, size_n // 8]`` packed along N (asymmetric only).

The kernel picks between two layouts from the host: w4a16 (``cpu_gemm_wna16``)
and w4a8 (``int4_scaled_mm_cpu``, AMX or RISC-V with bf16 activations and
``VLLM_CPU_INT4_W4A8`` on). wcache implements w4a16; the choice and the
``isa_hint`` are METADATA computed from the :class:`~wcache.core.Target` (never
from this host) and **recorded**, so a restore on a host that would choose
differently fails with ``RecordedMismatch`` instead of misreading bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages import cpu_gemm
from wcache.stages.common import StageInputError
from wcache.stages.packing import pack_factor, pack_int32, unpack_int32

__all__ = ["W4A8_ENV", "W4A8_ENV_DEFAULT", "CPUWNA16_NUM_BITS", "BLOCK_N", "isa_hint_for",
           "use_w4a8_for", "repack_w4a16", "set_isa_hint", "set_use_w4a8", "repack",
           "transpose_zero_points", "can_implement"]

_KERNEL = "vllm/model_executor/kernels/linear/mixed_precision/cpu.py"

#: kernel-selection variable (vLLM's envs.VLLM_CPU_INT4_W4A8, default on).
W4A8_ENV = "VLLM_CPU_INT4_W4A8"
W4A8_ENV_DEFAULT = "1"
#: CPUWNA16 supports 4-bit weights only (uint4, uint4b8).
CPUWNA16_NUM_BITS = 4
#: output channels per contiguous block of the w4a16 layout.
BLOCK_N = 16
#: CPUWNA16LinearKernel.can_implement: size_k and size_n multiples of 32.
CPUWNA16_SIZE_MULTIPLE = 32


def isa_hint_for(scales_dtype: torch.dtype, target: Target) -> str:
    """The ``isa_hint`` vLLM passes to ``cpu_gemm_wna16``.

    Returns:
        ``"amx"`` (AMX and bf16 scales), ``"rvv"`` (RISC-V), ``"vsx"`` (POWER and
        bf16 scales), else ``"vec"``.

    Source: cpu.py::_get_isa_hint (host queries replaced by ``target``).
    """
    if target.has("amx") and scales_dtype == torch.bfloat16:
        return "amx"
    if target.has("riscv"):
        return "rvv"
    if scales_dtype == torch.bfloat16 and target.has("power"):
        return "vsx"
    return "vec"


def use_w4a8_for(act_dtype: torch.dtype, target: Target) -> bool:
    """Whether vLLM would choose the w4a8 (``int4_scaled_mm_cpu``) layout.

    Source: cpu.py::CPUWNA16LinearKernel.process_weights_after_loading
    (``VLLM_CPU_INT4_W4A8 and act_type == bfloat16 and (AMX or RISC-V)``).
    """
    env_on = bool(int(target.env_value(W4A8_ENV, W4A8_ENV_DEFAULT)))
    return bool(env_on and act_dtype == torch.bfloat16
                and (target.has("amx") or target.has("riscv")))


def repack_w4a16(qweight: torch.Tensor, num_bits: int = CPUWNA16_NUM_BITS) -> torch.Tensor:
    """GPTQ-packed weight to the CPUWNA16 w4a16 blocked layout.

    Args:
        qweight: int32 ``[size_k // 8, size_n]`` packed along K (any strides,
            e.g. the transposed view of a compressed-tensors weight).

    Returns:
        int32 ``[size_n // 16, 2 * size_k]`` contiguous: values re-packed along N
        (``[size_k, size_n // 8]``), then blocks of 16 output channels made
        contiguous.

    Raises:
        StageInputError: not 2-D int32, or ``size_n`` not a multiple of 16.

    Source: cpu.py::CPUWNA16LinearKernel._process_gptq_weights_w4a16.
    """
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise StageInputError(f"CPUWNA16 weight must be 2-D int32, got "
                              f"{tuple(qweight.shape)} {qweight.dtype}")
    pf = pack_factor(num_bits)
    size_k = qweight.shape[0] * pf
    if qweight.shape[1] % BLOCK_N:
        raise StageInputError(f"CPUWNA16 needs size_n % {BLOCK_N} == 0, got {qweight.shape[1]}")
    w = unpack_int32(qweight, num_bits, 0)
    w = pack_int32(w, num_bits, 1)
    return (w.view(size_k, -1, BLOCK_N // pf).permute(1, 0, 2)
            .reshape(-1, size_k * BLOCK_N // pf).contiguous())


@stage("cpu_wna16.set_isa_hint", Tag.METADATA, attrs=("isa_hint",),
       source=f"{_KERNEL}::_get_isa_hint", params=lambda w_s: {"reads": (w_s,)})
def set_isa_hint(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
                 recorded: Mapping[str, Any], *, w_s: str) -> StageOut:
    """METADATA: ``layer.isa_hint`` from the dtype of the scales named ``w_s`` and the
    Target; recorded."""
    hint = isa_hint_for(tensors[w_s].dtype, target)
    return StageOut(attrs={"isa_hint": hint}, record={"isa_hint": hint})


@stage("cpu_wna16.set_use_w4a8", Tag.METADATA, attrs=("use_w4a8",),
       source=f"{_KERNEL}::CPUWNA16LinearKernel.process_weights_after_loading (layer.use_w4a8)")
def set_use_w4a8(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
                 recorded: Mapping[str, Any]) -> StageOut:
    """``layer.use_w4a8`` from the activation dtype and the Target; recorded."""
    value = use_w4a8_for(config.dtype, target)
    return StageOut(attrs={"use_w4a8": value}, record={"use_w4a8": value})


@stage("cpu_wna16.repack", Tag.TRANSFORM,
       source=f"{_KERNEL}::CPUWNA16LinearKernel._process_gptq_weights_w4a16",
       params=lambda w_q: {"reads": (w_q,), "writes": (w_q,)})
def repack(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
           recorded: Mapping[str, Any], *, w_q: str) -> StageOut:
    """TRANSFORM: the weight named ``w_q`` ``[K // 8, N]`` -> ``[N // 16, 2K]`` (w4a16
    layout).

    Raises:
        StageInputError: the Target selects the w4a8 layout, which this stage
            does not produce.
    """
    if use_w4a8_for(config.dtype, target):
        raise StageInputError(
            f"layer {config.name!r}: the target selects CPUWNA16's w4a8 layout "
            f"(AMX/RISC-V, bf16, {W4A8_ENV}!=0); wcache only builds w4a16. Set "
            f"{W4A8_ENV}=0 or load without wcache.")
    return StageOut(tensors={w_q: repack_w4a16(tensors[w_q], CPUWNA16_NUM_BITS)})


@stage("cpu_wna16.transpose_zero_points", Tag.TRANSFORM,
       source=f"{_KERNEL}::CPUWNA16LinearKernel.process_weights_after_loading "
              f"(zp.output_dim == 0 branch)",
       params=lambda w_zp, asymmetric_only=False: {
           "reads": (w_zp,), "writes": (w_zp,),
           "optional": (w_zp,) if asymmetric_only else ()})
def transpose_zero_points(tensors: Mapping[str, torch.Tensor], config: LayerConfig,
                          target: Target, recorded: Mapping[str, Any], *, w_zp: str,
                          asymmetric_only: bool) -> StageOut:
    """TRANSFORM: the zero points ``w_zp`` int32 ``[N // 8, K // G]`` -> ``[K // G, N // 8]``
    contiguous.

    Args:
        w_zp: the zero-point tensor's name (``"qzeros"``, ``"weight_zero_point"``).
        asymmetric_only: the layer has ``w_zp`` only when ``config.quant.zero_point``
            (compressed-tensors W4A16 registers no zero points when symmetric);
            then the stage returns nothing for a symmetric layer.
    """
    if asymmetric_only and not config.quant.zero_point:
        return StageOut()
    return StageOut(tensors={w_zp: tensors[w_zp].t().contiguous()})


def can_implement(config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's CPUWNA16 kernel takes the layer with the w4a16 layout wcache
    builds, else the reason (the wcache counterpart of ``can_implement``).

    Source: cpu.py::CPUWNA16LinearKernel.can_implement, plus the w4a8 selection.
    """
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    missing = cpu_gemm.missing_op_reason(target, ("cpu_gemm_wna16",), "CPUWNA16LinearKernel")
    if missing:
        return missing
    if config.quant.num_bits != CPUWNA16_NUM_BITS:
        return f"CPUWNA16 takes 4-bit weights only, got {config.quant.num_bits}-bit"
    g = config.quant.group_size
    if g != -1 and g % 2:
        return f"CPUWNA16 needs an even group size, got {g}"
    for label, size in (("size_k", config.size_k), ("size_n", config.size_n)):
        if size and size % CPUWNA16_SIZE_MULTIPLE:
            return f"CPUWNA16 needs {label} % {CPUWNA16_SIZE_MULTIPLE} == 0, got {size}"
    if use_w4a8_for(config.dtype, target):
        return ("the target selects CPUWNA16's w4a8 layout (AMX or RISC-V, bf16 "
                f"activations, {W4A8_ENV}!=0), which wcache does not build; "
                f"set {W4A8_ENV}=0 or load without wcache")
    if config.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported activation dtype {config.params_dtype}"
    return None
