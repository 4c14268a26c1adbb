"""vLLM's CPUWNA16 kernel (``cpu_gemm_wna16``): the w4a16 weight layout and its
host-dependent metadata.

Input layout (GPTQ-like, what AWQ/GPTQ/compressed-tensors stages produce):
``w_q`` int32 ``[size_k // 8, size_n]`` packed along K; ``w_s`` ``[size_k // G, size_n]``;
``w_zp`` int32 ``[size_k // G, size_n // 8]`` packed along N (asymmetric only).

The kernel picks between two layouts from the host: w4a16 (``cpu_gemm_wna16``,
:func:`repack`) and w4a8 (``int4_scaled_mm_cpu``, AMX or RISC-V with bf16
activations and ``VLLM_CPU_INT4_W4A8`` on; :func:`repack_w4a8`, which blocks
weight, zero points and scales with vLLM's own ``convert_weight_packed_scale_zp``).
The choice and the ``isa_hint`` are METADATA computed from the
:class:`~wcache.core.Target` (never from this host) and **recorded**, so a restore
on a host that would choose differently fails with ``RecordedMismatch`` instead
of misreading bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages import cpu_gemm
from wcache.stages.common import StageInputError, require_op
from wcache.stages.packing import pack_factor, pack_int32, unpack_int32

__all__ = [
    "W4A8_ENV",
    "W4A8_ENV_DEFAULT",
    "CPUWNA16_NUM_BITS",
    "BLOCK_N",
    "W4A8_BLOCK_N",
    "W4A8_MAX_BLOCK_K",
    "W4A8_SYMMETRIC_ZP_WORD",
    "isa_hint_for",
    "use_w4a8_for",
    "repack_w4a16",
    "w4a8_block_k",
    "w4a8_shapes",
    "repack_w4a8_tensors",
    "set_isa_hint",
    "set_use_w4a8",
    "repack",
    "repack_w4a8",
    "cast_bias_to_float32",
    "transpose_zero_points",
    "can_implement",
    "can_implement_w4a8",
    "W4A8_OPS",
]

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
#: w4a8 layout: output channels per block of convert_weight_packed_scale_zp's
#: output (its first dimension is ``size_n // 32``; csrc/cpu/sgl-kernels).
W4A8_BLOCK_N = 32
#: w4a8 layout: the op blocks K by the group size, capped at 128 (measured on
#: vLLM 0.32's _C: group -1 / 256 / 192 give 128-row blocks, 64 / 32 / 16 their own).
W4A8_MAX_BLOCK_K = 128
#: w4a8 layout: bytes per output channel after each weight block (an int32
#: compensation term per channel, appended by the op).
W4A8_COMP_BYTES = 4
#: The fake zero-point word vLLM's w4a8 path gives a symmetric layer: eight
#: nibbles of 8 (uint4b8's bias), 0x88888888 as int32.
W4A8_SYMMETRIC_ZP_WORD = -2004318072
#: vLLM's AWQ->"standard" reordering inside each 8-value word before the op
#: (its FIXME: the op's GPTQ mode is buggy, so vLLM feeds it AWQ order).
_W4A8_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: torch.ops._C ops the w4a8 layout needs (only vLLM's ``_C`` build has them).
W4A8_OPS = ("convert_weight_packed_scale_zp", "int4_scaled_mm_cpu")
#: ops.CPUQuantAlgo.AWQ, the mode vLLM calls convert_weight_packed_scale_zp in.
_CPU_QUANT_ALGO_AWQ = 0


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
    return bool(
        env_on and act_dtype == torch.bfloat16 and (target.has("amx") or target.has("riscv"))
    )


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
        raise StageInputError(
            f"CPUWNA16 weight must be 2-D int32, got {tuple(qweight.shape)} {qweight.dtype}"
        )
    pf = pack_factor(num_bits)
    size_k = qweight.shape[0] * pf
    if qweight.shape[1] % BLOCK_N:
        raise StageInputError(f"CPUWNA16 needs size_n % {BLOCK_N} == 0, got {qweight.shape[1]}")
    w = unpack_int32(qweight, num_bits, 0)
    w = pack_int32(w, num_bits, 1)
    return (
        w.view(size_k, -1, BLOCK_N // pf)
        .permute(1, 0, 2)
        .reshape(-1, size_k * BLOCK_N // pf)
        .contiguous()
    )


def w4a8_block_k(size_k: int, group_size: int) -> int:
    """Rows of K per block of the w4a8 layout: the group size (``size_k`` for
    channelwise ``-1``), capped at :data:`W4A8_MAX_BLOCK_K`."""
    group = size_k if group_size == -1 else group_size
    return min(group, W4A8_MAX_BLOCK_K)


def w4a8_shapes(
    size_k: int, size_n: int, group_size: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Shapes ``convert_weight_packed_scale_zp`` returns: the weight (uint8) and the
    zero points (int8) / scales (fp32), which share a shape.

    Returns:
        ``((N // 32, K // block_k, 32 * block_k // 2 + 32 * 4),
        (N // 32, K // G, 32))`` with ``block_k`` from :func:`w4a8_block_k`.
    """
    groups = 1 if group_size == -1 else size_k // group_size
    block_k = w4a8_block_k(size_k, group_size)
    row = W4A8_BLOCK_N * block_k // 2 + W4A8_BLOCK_N * W4A8_COMP_BYTES
    return (
        (size_n // W4A8_BLOCK_N, size_k // block_k, row),
        (size_n // W4A8_BLOCK_N, groups, W4A8_BLOCK_N),
    )


def _awq_order(values: torch.Tensor) -> torch.Tensor:
    """Reorder each run of 8 values along dim 1 (``[R, C]`` int32) to AWQ order."""
    rows, cols = values.shape
    order = list(_W4A8_AWQ_ORDER)
    return values.view(rows, cols // len(order), len(order))[:, :, order].reshape(rows, cols)


def repack_w4a8_tensors(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    num_bits: int = CPUWNA16_NUM_BITS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-packed weight, scales and zero points to the CPUWNA16 w4a8 blocked layout.

    Args:
        qweight: int32 ``[K // 8, N]`` packed along K (any strides).
        scales: ``[K // G, N]`` (bf16/fp16/fp32).
        zeros: int32 ``[K // G, N // 8]`` packed along N, or ``None`` for a
            symmetric layer (then vLLM's fake zero points, all nibbles 8).

    Returns:
        ``(weight, zeros, scales)``: uint8 ``[N // 32, K // block_k, 16 * block_k + 128]``,
        int8 ``[N // 32, K // G, 32]``, fp32 ``[N // 32, K // G, 32]`` (new tensors).

    Raises:
        OpUnavailable: vLLM's ``_C`` with ``convert_weight_packed_scale_zp`` is not loaded.

    Source: cpu.py::CPUWNA16LinearKernel._process_gptq_weights_w4a8.
    """
    groups, size_n = scales.shape
    if zeros is None:
        zeros = torch.full(
            (groups, size_n // pack_factor(num_bits)), W4A8_SYMMETRIC_ZP_WORD, dtype=torch.int32
        )
    weight = _awq_order(unpack_int32(qweight, num_bits, 0))
    weight = pack_int32(weight, num_bits, 1).contiguous()
    zp = _awq_order(unpack_int32(zeros, num_bits, 1))
    zp = pack_int32(zp, num_bits, 1).contiguous()
    convert = require_op("_C", "convert_weight_packed_scale_zp")
    blocked_w, blocked_zp, blocked_s = convert(weight, zp, scales, _CPU_QUANT_ALGO_AWQ)
    return blocked_w, blocked_zp, blocked_s


@stage(
    "cpu_wna16.set_isa_hint",
    Tag.METADATA,
    attrs=("isa_hint",),
    source=f"{_KERNEL}::_get_isa_hint",
    params=lambda w_s: {"reads": (w_s,)},
)
def set_isa_hint(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_s: str,
) -> StageOut:
    """METADATA: ``layer.isa_hint`` from the dtype of the scales named ``w_s`` and the
    Target; recorded."""
    hint = isa_hint_for(tensors[w_s].dtype, target)
    return StageOut(attrs={"isa_hint": hint}, record={"isa_hint": hint})


@stage(
    "cpu_wna16.set_use_w4a8",
    Tag.METADATA,
    attrs=("use_w4a8",),
    source=f"{_KERNEL}::CPUWNA16LinearKernel.process_weights_after_loading (layer.use_w4a8)",
)
def set_use_w4a8(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``layer.use_w4a8`` from the activation dtype and the Target; recorded."""
    value = use_w4a8_for(config.dtype, target)
    return StageOut(attrs={"use_w4a8": value}, record={"use_w4a8": value})


@stage(
    "cpu_wna16.repack",
    Tag.TRANSFORM,
    source=f"{_KERNEL}::CPUWNA16LinearKernel._process_gptq_weights_w4a16",
    params=lambda w_q: {"reads": (w_q,), "writes": (w_q,)},
)
def repack(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_q: str,
) -> StageOut:
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
            f"{W4A8_ENV}=0 or load without wcache."
        )
    return StageOut(tensors={w_q: repack_w4a16(tensors[w_q], CPUWNA16_NUM_BITS)})


def _w4a8_params(w_q: str, w_s: str, w_zp: str) -> dict[str, tuple[str, ...]]:
    return {"reads": (w_q, w_s, w_zp), "writes": (w_q, w_s, w_zp), "optional": (w_zp,)}


@stage(
    "cpu_wna16.repack_w4a8",
    Tag.TRANSFORM,
    source=f"{_KERNEL}::CPUWNA16LinearKernel._process_gptq_weights_w4a8",
    params=_w4a8_params,
)
def repack_w4a8(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_q: str,
    w_s: str,
    w_zp: str,
) -> StageOut:
    """TRANSFORM: weight ``w_q`` int32 ``[K // 8, N]``, scales ``w_s`` ``[K // G, N]`` and
    zero points ``w_zp`` int32 ``[K // G, N // 8]`` (absent for a symmetric layer:
    vLLM's fake all-8 zero points are created) -> the w4a8 blocked layout of
    :func:`repack_w4a8_tensors` (uint8 weight, int8 zero points, fp32 scales).

    Raises:
        StageInputError: the Target selects the w4a16 layout (:func:`repack`).
        OpUnavailable: vLLM's ``_C`` with ``convert_weight_packed_scale_zp`` is not loaded.
    """
    if not use_w4a8_for(config.dtype, target):
        raise StageInputError(
            f"layer {config.name!r}: the target selects CPUWNA16's w4a16 layout; "
            f"cpu_wna16.repack_w4a8 builds w4a8 only (use the w4a16 plan)"
        )
    qweight, scales = tensors[w_q], tensors[w_s]
    # symmetric: vLLM ignores a checkpoint's zero points and makes fake ones
    zeros = tensors.get(w_zp) if config.quant.zero_point else None
    if qweight.device.type == "meta":
        w_shape, g_shape = w4a8_shapes(
            qweight.shape[0] * pack_factor(CPUWNA16_NUM_BITS),
            qweight.shape[1],
            config.quant.group_size,
        )
        return StageOut(
            tensors={
                w_q: torch.empty(w_shape, dtype=torch.uint8, device="meta"),
                w_zp: torch.empty(g_shape, dtype=torch.int8, device="meta"),
                w_s: torch.empty(g_shape, dtype=torch.float32, device="meta"),
            }
        )
    blocked_w, blocked_zp, blocked_s = repack_w4a8_tensors(qweight, scales, zeros)
    return StageOut(tensors={w_q: blocked_w, w_zp: blocked_zp, w_s: blocked_s})


@stage(
    "cpu_wna16.cast_bias_to_float32",
    Tag.TRANSFORM,
    reads=("bias",),
    writes=("bias",),
    optional=("bias",),
    source=f"{_KERNEL}::CPUWNA16LinearKernel._process_gptq_weights_w4a8 "
    f"(layer.bias.data = layer.bias.float())",
)
def cast_bias_to_float32(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM (w4a8 layout): ``bias`` ``[N]`` -> a new fp32 copy (the w4a8 kernel
    adds an fp32 bias); no bias, no change."""
    if "bias" not in tensors:
        return StageOut()
    return StageOut(tensors={"bias": tensors["bias"].to(torch.float32)})


@stage(
    "cpu_wna16.transpose_zero_points",
    Tag.TRANSFORM,
    source=f"{_KERNEL}::CPUWNA16LinearKernel.process_weights_after_loading "
    f"(zp.output_dim == 0 branch)",
    params=lambda w_zp, asymmetric_only=False: {
        "reads": (w_zp,),
        "writes": (w_zp,),
        "optional": (w_zp,) if asymmetric_only else (),
    },
)
def transpose_zero_points(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_zp: str,
    asymmetric_only: bool,
) -> StageOut:
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


def _can_implement_common(config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's ``CPUWNA16LinearKernel.can_implement`` accepts the layer and
    the loaded kernel library has ``cpu_gemm_wna16``, else the reason."""
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
    if config.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported activation dtype {config.params_dtype}"
    return None


def can_implement(config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's CPUWNA16 kernel takes the layer with the w4a16 layout
    (:func:`repack`), else the reason (the wcache counterpart of ``can_implement``).

    Source: cpu.py::CPUWNA16LinearKernel.can_implement, plus the w4a8 selection.
    """
    reason = _can_implement_common(config, target)
    if reason is None and use_w4a8_for(config.dtype, target):
        return (
            "the target selects CPUWNA16's w4a8 layout (AMX or RISC-V, bf16 "
            f"activations, {W4A8_ENV}!=0): the w4a8 plan covers it"
        )
    return reason


def can_implement_w4a8(config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's CPUWNA16 kernel takes the layer with the w4a8 layout
    (:func:`repack_w4a8`), else the reason.

    Source: cpu.py::CPUWNA16LinearKernel.can_implement and
    process_weights_after_loading (use_w4a8), _process_gptq_weights_w4a8.
    """
    reason = _can_implement_common(config, target)
    if reason is not None:
        return reason
    if not use_w4a8_for(config.dtype, target):
        return (
            "the target selects CPUWNA16's w4a16 layout (w4a8 needs AMX or RISC-V, "
            f"bf16 activations and {W4A8_ENV}!=0): the w4a16 plan covers it"
        )
    missing = cpu_gemm.missing_op_reason(target, W4A8_OPS, "CPUWNA16LinearKernel (w4a8)")
    if missing:
        return missing
    if config.size_k:
        block_k = w4a8_block_k(config.size_k, config.quant.group_size)
        if config.size_k % block_k:
            return (
                f"vLLM's convert_weight_packed_scale_zp cannot block size_k "
                f"{config.size_k} by {block_k} (group {config.quant.group_size}), so "
                f"vLLM itself cannot load this layer with {W4A8_ENV}!=0; set {W4A8_ENV}=0"
            )
    return None
