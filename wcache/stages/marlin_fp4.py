"""ModelOpt NVFP4 on Marlin (CUDA sm75+, what vLLM runs on the H200): the linear
layout (``MarlinNvFp4LinearKernel``) and the fused-MoE layout (``MarlinExperts``,
backend ``MARLIN``).

Without FP4 tensor cores vLLM runs NVFP4 weight-only (W4A16) on Marlin:

* the packed E2M1 weight ``[N, K/2]`` uint8 is viewed as GPTQ-layout int32
  ``[K/8, N]`` (eight nibbles per word, low nibble first along K, which is
  ModelOpt's byte order) and repacked as a 4-bit Marlin weight (the pure
  reference of ``ops.gptq_marlin_repack`` in :func:`wcache.stages.marlin.marlin_repack`);
* the float8_e4m3fn block scales (one per 16 values) are cast to the model dtype,
  transposed to ``[K/16, N]``, Marlin-permuted and re-encoded as a special
  FP8-S0E5M3 (``nvfp4_marlin_process_scales``); a data-dependent power-of-two
  ``scale_factor`` lifts small scales so their top bit is set, and the global scale
  is divided by it (``nvfp4_marlin_process_global_scale``). The two are therefore
  one TRANSFORM here: the factor couples their bytes.

Every step is a TRANSFORM the daemon runs once; restore replays nothing but the
MoE METADATA (the input scales' empty slots and the resolved backend). Shapes that
fit no Marlin thread tile are zero-padded (linear: ``marlin_padded_nk``; MoE: the
intermediate size per gate/up shard, as ``prepare_nvfp4_moe_layer_for_marlin``).

vLLM's scale re-encoding assumes non-negative block scales (it logs a warning and
degrades accuracy otherwise, as ModelOpt never writes them); the functions here
produce vLLM's bytes for any input, negative scales included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, WcacheError, stage
from wcache.stages import marlin
from wcache.stages.moe import moe_shape
from wcache.stages.packing import round_up

__all__ = [
    "NVFP4_GROUP_SIZE",
    "MarlinFp4LayoutError",
    "nvfp4_marlin_scale_factor",
    "nvfp4_marlin_process_scales",
    "nvfp4_marlin_process_global_scale",
    "fp4_marlin_repack",
    "nvfp4_moe_padded_intermediate",
    "repack_weight",
    "process_scales",
    "repack_moe_weights",
    "process_moe_scales",
    "drop_moe_input_scales",
    "clear_moe_input_scales",
]

#: Values per NVFP4 block scale along K (``FP4_MARLIN_SUPPORTED_GROUP_SIZES`` for NVFP4).
NVFP4_GROUP_SIZE = 16
#: Bits of one E2M1 value: Marlin repacks NVFP4 as a 4-bit weight.
FP4_BITS = 4
#: E2M1 values per int32 word when the packed bytes are viewed as GPTQ-layout int32.
FP4_PER_INT32 = 8
#: E2M1 values per byte.
FP4_PER_BYTE = 2
#: Marlin dequantizes a scale as ``scale * 2**7`` in FP8-S0E5M3 (``nvfp4_marlin_process_scales``).
SCALE_SHIFT_EXPONENT = 7
#: A re-encoded scale below 2 (after the ``2**7`` shift) has no top bit and is zeroed.
SCALE_MIN_SHIFTED = 2
#: Largest float8_e4m3fn value: the rescale targets ``448 * 2**7``.
FP8_E4M3_MAX = 448
#: Reorder of scales inside groups of four for Marlin's FP8 dequantization.
SCALE_REORDER = (0, 2, 1, 3)
#: Exponent bits of E2M1 and of the activation dtypes (``nvfp4_marlin_process_global_scale``).
FP4_EXPONENT_BITS = 2
_TARGET_EXPONENT_BITS = {torch.float16: 5, torch.bfloat16: 8}
#: MoE: with a hidden size divisible by 128 the intermediate is padded to 64, else to
#: 128 (the hidden size must then divide by 64): Marlin's two thread-tile families.
MOE_HIDDEN_TILE_WIDE, MOE_HIDDEN_TILE_NARROW = 128, 64
MOE_INTERMEDIATE_TILE_NARROW, MOE_INTERMEDIATE_TILE_WIDE = 64, 128

_FP4_UTILS = "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4"


class MarlinFp4LayoutError(WcacheError, ValueError):
    """An NVFP4 tensor cannot be put in Marlin layout (shape, dtype or tile)."""

    code = "marlin-fp4-layout"


# --------------------------------------------------------------------------- pure helpers


def nvfp4_marlin_scale_factor(scales: torch.Tensor, a_dtype: torch.dtype | None = None) -> float:
    """The power-of-two factor (>= 1) that lifts every non-zero ``scale * 2**7`` to
    at least 2 without passing ``448 * 2**7``; 1.0 for fp16 activations (no rescale),
    for all-zero scales and on the meta device (no values to read).

    Args:
        scales: block scales in any float dtype, any shape.
        a_dtype: the activation dtype the scales serve.

    Source: ``marlin_utils_fp4._nvfp4_compute_scale_factor``.
    """
    if a_dtype == torch.half or scales.device.type == "meta":
        return 1.0
    shifted = scales.float() * (2**SCALE_SHIFT_EXPONENT)
    nonzero = shifted > 0
    if nonzero.any():
        max_val = shifted[nonzero].max()
        if max_val < FP8_E4M3_MAX * (2**SCALE_SHIFT_EXPONENT):
            return float((FP8_E4M3_MAX * (2**SCALE_SHIFT_EXPONENT) / max_val).log2().floor().exp2())
    return 1.0


def nvfp4_marlin_process_scales(
    marlin_scales: torch.Tensor,
    scale_factor: float | None = None,
    a_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, float]:
    """Marlin-permuted block scales -> Marlin's FP8-S0E5M3 encoding.

    Args:
        marlin_scales: ``[rows, N]`` (rows = K/16), any float dtype, already
            permuted by :func:`wcache.stages.marlin.marlin_permute_scales`.
        scale_factor: the power-of-two rescale (MoE: one for all experts); None
            computes it (:func:`nvfp4_marlin_scale_factor`).
        a_dtype: the activation dtype.

    Returns:
        ``([rows, N] float8_e4m3fn bit patterns, scale_factor)``; the caller divides
        the global scale by ``scale_factor``. The input is not modified.

    Source: ``marlin_utils_fp4.nvfp4_marlin_process_scales``.
    """
    s = marlin_scales.to(torch.half)
    s = s.view(-1, len(SCALE_REORDER))[:, list(SCALE_REORDER)].view(marlin_scales.size(0), -1)
    if scale_factor is None:
        scale_factor = nvfp4_marlin_scale_factor(s, a_dtype)
    if scale_factor > 1.0:
        s = (s.float() * scale_factor).to(torch.half)
    s = s * (2**SCALE_SHIFT_EXPONENT)
    # vLLM: s[s < 2] = 0 (in place on its own copy); +0.0 either way
    s = torch.where(s < SCALE_MIN_SHIFTED, torch.zeros_like(s), s)
    s = (s.view(torch.int16) << 1).view(torch.float8_e4m3fn)
    return s[:, 1::2].contiguous(), scale_factor


def nvfp4_marlin_process_global_scale(
    global_scale: torch.Tensor, a_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``global_scale * 2**(bias - 7)`` with the FP4 -> activation exponent bias
    (``2**(e-1) - 2**1``: 14 for fp16, 126 for bf16); same shape and dtype.

    Raises:
        MarlinFp4LayoutError: ``a_dtype`` is neither float16 nor bfloat16.

    Source: ``marlin_utils_fp4.nvfp4_marlin_process_global_scale``.
    """
    a_dtype = global_scale.dtype if a_dtype is None else a_dtype
    if a_dtype not in _TARGET_EXPONENT_BITS:
        raise MarlinFp4LayoutError(
            f"NVFP4 on Marlin runs with float16 or bfloat16 activations, got {a_dtype}; "
            f"load the model in one of them"
        )
    bias = 2 ** (_TARGET_EXPONENT_BITS[a_dtype] - 1) - 2 ** (FP4_EXPONENT_BITS - 1)
    return global_scale * (2.0 ** (bias - SCALE_SHIFT_EXPONENT))


def fp4_marlin_repack(
    weight: torch.Tensor, size_n: int, size_k: int, padded_n: int, padded_k: int
) -> torch.Tensor:
    """Packed E2M1 ``[size_n, size_k/2]`` uint8 -> Marlin 4-bit layout.

    Args:
        weight: ``[size_n, size_k // 2]`` uint8, two values per byte (low nibble first).
        size_n, size_k: the logical extents.
        padded_n, padded_k: the Marlin tile extents (>= the logical ones); the pad
            is zero (E2M1 0 decodes to 0.0).

    Returns:
        ``[padded_k // 16, padded_n * 2]`` int32.

    Raises:
        MarlinFp4LayoutError: ``weight`` is not ``[size_n, size_k/2]`` uint8.

    Source: ``marlin_utils_fp4.prepare_fp4_layer_for_marlin`` (weight):
    ``weight.view(int32).T`` + ``marlin_pad_qweight`` + ``ops.gptq_marlin_repack(num_bits=4)``.
    """
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (size_n, size_k // FP4_PER_BYTE):
        raise MarlinFp4LayoutError(
            f"NVFP4 weight must be [{size_n}, {size_k // FP4_PER_BYTE}] uint8, got "
            f"{list(weight.shape)} {weight.dtype}"
        )
    q = weight.view(torch.int32).t().contiguous()  # [size_k / 8, size_n]
    if (padded_n, padded_k) != (size_n, size_k):  # marlin_pad_qweight
        q = torch.nn.functional.pad(
            q, (0, padded_n - size_n, 0, (padded_k - size_k) // FP4_PER_INT32)
        )
    return marlin.marlin_repack(q, padded_k, padded_n, FP4_BITS)


def nvfp4_moe_padded_intermediate(hidden_size: int, intermediate: int) -> int:
    """The intermediate size per gate/up shard NVFP4 Marlin MoE pads to (vLLM's
    ``padded_N``; not ``marlin_utils.marlin_moe_padded_intermediate``, which the int4,
    FP8 and MXFP4 Marlin MoE use: :mod:`wcache.stages.marlin_moe`).

    Raises:
        MarlinFp4LayoutError: the hidden size divides by neither 128 nor 64.

    Source: ``marlin_utils_fp4.prepare_nvfp4_moe_layer_for_marlin`` (padded_N).
    """
    if hidden_size % MOE_HIDDEN_TILE_WIDE == 0:
        return round_up(intermediate, MOE_INTERMEDIATE_TILE_NARROW)
    if hidden_size % MOE_HIDDEN_TILE_NARROW:
        raise MarlinFp4LayoutError(
            f"hidden_size = {hidden_size} unsupported by Marlin tiles (it must divide by "
            f"{MOE_HIDDEN_TILE_NARROW}); vLLM asserts the same"
        )
    return round_up(intermediate, MOE_INTERMEDIATE_TILE_WIDE)


def _linear_geometry(config: LayerConfig) -> tuple[int, int, int, int]:
    size_k, size_n = config.size_k, config.size_n
    if size_k % NVFP4_GROUP_SIZE:
        raise MarlinFp4LayoutError(
            f"layer {config.name!r}: NVFP4 needs size_k divisible by {NVFP4_GROUP_SIZE}, "
            f"got {size_k}"
        )
    padded_n, padded_k = marlin.marlin_padded_nk(size_n, size_k, NVFP4_GROUP_SIZE)
    return size_k, size_n, padded_k, padded_n


def _permute_block_scales(
    scales_nk: torch.Tensor, size_n: int, size_k: int, padded_n: int, padded_k: int, dtype
) -> torch.Tensor:
    """``[size_n, size_k/16]`` fp8 -> ``[padded_k/16, padded_n]`` in ``dtype``, padded
    (``marlin_pad_scales``) and Marlin-permuted (group 16)."""
    s = scales_nk.t().contiguous().to(dtype)
    if (padded_n, padded_k) != (size_n, size_k):
        rows = padded_k // NVFP4_GROUP_SIZE - s.size(0)
        s = torch.nn.functional.pad(s, (0, padded_n - size_n, 0, rows))
    return marlin.marlin_permute_scales(s, padded_k, padded_n, NVFP4_GROUP_SIZE)


# --------------------------------------------------------------------------- linear stages


@stage(
    "marlin_fp4.repack_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source=f"{_FP4_UTILS}.prepare_fp4_layer_for_marlin (weight): view int32 + "
    "marlin_pad_qweight + ops.gptq_marlin_repack(num_bits=4)",
)
def repack_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K/2]`` uint8 (E2M1 pairs) -> Marlin ``[Kp/16, 2 * Np]`` int32.

    Source: marlin_utils_fp4.prepare_fp4_layer_for_marlin (weight): view int32 +
        marlin_pad_qweight + ops.gptq_marlin_repack(num_bits=4)
    """
    size_k, size_n, padded_k, padded_n = _linear_geometry(config)
    value = fp4_marlin_repack(tensors["weight"], size_n, size_k, padded_n, padded_k)
    return StageOut(tensors={"weight": value})


@stage(
    "marlin_fp4.process_scales",
    Tag.TRANSFORM,
    reads=("weight_scale", "weight_global_scale"),
    writes=("weight_scale", "weight_global_scale"),
    source=f"{_FP4_UTILS}.prepare_fp4_layer_for_marlin (scales): marlin_pad_scales + "
    "marlin_permute_scales + nvfp4_marlin_process_scales + nvfp4_marlin_process_global_scale",
)
def process_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight_scale [N, K/16]`` float8_e4m3fn -> ``[Kp/16, Np]`` float8_e4m3fn
    (FP8-S0E5M3 bit patterns, Marlin order) and ``weight_global_scale`` (0-d fp32) ->
    ``weight_global_scale * 2**(bias - 7) / scale_factor`` (0-d fp32).

    One stage for both: the rescale factor is read off the scales' values and divides
    the global scale.

    Source: marlin_utils_fp4.prepare_fp4_layer_for_marlin (scales): marlin_pad_scales +
        marlin_permute_scales + nvfp4_marlin_process_scales +
        nvfp4_marlin_process_global_scale
    """
    size_k, size_n, padded_k, padded_n = _linear_geometry(config)
    dtype = config.dtype
    s = _permute_block_scales(tensors["weight_scale"], size_n, size_k, padded_n, padded_k, dtype)
    s, scale_factor = nvfp4_marlin_process_scales(s, a_dtype=dtype)
    g = nvfp4_marlin_process_global_scale(tensors["weight_global_scale"].to(torch.float32), dtype)
    return StageOut(tensors={"weight_scale": s, "weight_global_scale": g / scale_factor})


# --------------------------------------------------------------------------- MoE stages

_MOE_PREP = f"{_FP4_UTILS}.prepare_nvfp4_moe_layer_for_marlin"


def _moe_dims(config: LayerConfig) -> tuple[int, int, int, int, int]:
    """``(E, K = hidden, N = intermediate, padded N, shards)``."""
    moe = moe_shape(config)
    k, n = moe.hidden_size, moe.intermediate_size_per_partition
    return moe.num_experts, k, n, nvfp4_moe_padded_intermediate(k, n), moe.w13_num_shards


def _pad_w13(x: torch.Tensor, shards: int, n: int, padded_n: int) -> torch.Tensor:
    """Zero-pad each gate/up shard of ``[E, shards * n, cols]`` to ``padded_n`` rows."""
    if padded_n == n:
        return x
    e = x.shape[0]
    x = x.reshape(e, shards, n, x.shape[-1])
    x = torch.nn.functional.pad(x, (0, 0, 0, padded_n - n))
    return x.reshape(e, shards * padded_n, -1)


def _pad_w2(x: torch.Tensor, n: int, padded_n: int, packing: int) -> torch.Tensor:
    """Zero-pad the packed intermediate (last) dim of ``[E, K, n / packing]``."""
    if padded_n == n:
        return x
    return torch.nn.functional.pad(x, (0, (padded_n - n) // packing))


def _check_expert_tensor(config: LayerConfig, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise MarlinFp4LayoutError(
            f"layer {config.name!r}: {name} is {list(t.shape)}, expected {list(shape)} "
            f"(from the layer's MoeShape); restart the daemon with the engine's arguments"
        )


def _repack_experts(weight: torch.Tensor, size_n: int, size_k: int) -> torch.Tensor:
    """``[E, size_n, size_k/2]`` uint8 -> ``[E, size_k/16, 2 * size_n]`` int32, per expert.

    Source: ``marlin_utils_fp4._repack_marlin_experts``."""
    if weight.shape[0] == 0:
        return torch.empty(
            (0, size_k // marlin.MARLIN_TILE, size_n * FP4_BITS // 2),
            dtype=torch.int32,
            device=weight.device,
        )
    return torch.stack(
        [fp4_marlin_repack(w, size_n, size_k, size_n, size_k) for w in weight.unbind(0)]
    )


@stage(
    "marlin_fp4.repack_moe_weights",
    Tag.TRANSFORM,
    reads=("w13_weight", "w2_weight"),
    writes=("w13_weight", "w2_weight"),
    source=f"{_MOE_PREP} (weights): pad the intermediate per shard + _repack_marlin_experts",
)
def repack_moe_weights(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM the experts to Marlin: ``w13_weight [E, S*I, H/2]`` uint8 ->
    ``[E, H/16, 2*S*Ip]`` int32 and ``w2_weight [E, H, I/2]`` -> ``[E, Ip/16, 2*H]``
    int32, with ``S`` the gate/up shards and ``Ip`` the intermediate padded to
    Marlin's tile (zero rows / columns: they never reach the MoE output).

    Raises:
        MarlinFp4LayoutError: a weight does not fit the layer's MoeShape, or the
            hidden size fits no Marlin tile.

    Source: marlin_utils_fp4.prepare_nvfp4_moe_layer_for_marlin (weights): pad the
        intermediate per shard + _repack_marlin_experts
    """
    e, k, n, padded_n, shards = _moe_dims(config)
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    _check_expert_tensor(config, "w13_weight", w13, (e, shards * n, k // FP4_PER_BYTE))
    _check_expert_tensor(config, "w2_weight", w2, (e, k, n // FP4_PER_BYTE))
    w13 = _pad_w13(w13, shards, n, padded_n)
    w2 = _pad_w2(w2, n, padded_n, FP4_PER_BYTE)
    return StageOut(
        tensors={
            "w13_weight": _repack_experts(w13, shards * padded_n, k),
            "w2_weight": _repack_experts(w2, k, padded_n),
        }
    )


def _process_expert_scales(
    scales: torch.Tensor, global_scale: torch.Tensor, size_n: int, size_k: int, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, size_n, size_k/16]`` (padded, in ``dtype``) -> ``([E, size_k/16, size_n]``
    FP8-S0E5M3 Marlin scales, the processed global scale ``[E]``), one rescale factor
    for all experts (they share the global-scale convention)."""
    scale_factor = nvfp4_marlin_scale_factor(scales, dtype)
    out = [
        nvfp4_marlin_process_scales(
            marlin.marlin_permute_scales(s.t(), size_k, size_n, NVFP4_GROUP_SIZE),
            scale_factor=scale_factor,
            a_dtype=dtype,
        )[0]
        for s in scales.unbind(0)
    ]
    if out:
        stacked = torch.stack(out)
    else:
        stacked = torch.empty(
            (0, size_k // NVFP4_GROUP_SIZE, size_n), dtype=torch.float8_e4m3fn, device=scales.device
        )
    return stacked, nvfp4_marlin_process_global_scale(global_scale, dtype) / scale_factor


@stage(
    "marlin_fp4.process_moe_scales",
    Tag.TRANSFORM,
    reads=("w13_weight_scale", "w13_weight_scale_2", "w2_weight_scale", "w2_weight_scale_2"),
    writes=("w13_weight_scale", "w13_weight_scale_2", "w2_weight_scale", "w2_weight_scale_2"),
    source=f"{_MOE_PREP} (scales): pad, one scale_factor per projection, per expert "
    "marlin_permute_scales + nvfp4_marlin_process_scales, nvfp4_marlin_process_global_scale",
)
def process_moe_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM the expert scales to Marlin: ``w13_weight_scale [E, S*I, H/16]`` fp8 ->
    ``[E, H/16, S*Ip]`` and ``w2_weight_scale [E, H, I/16]`` -> ``[E, Ip/16, H]``
    (FP8-S0E5M3 bit patterns, float8_e4m3fn), and the global scales
    ``w13_weight_scale_2 [E]`` (after :data:`wcache.stages.nvfp4.select_w13_weight_scale_2`)
    and ``w2_weight_scale_2 [E]`` fp32 processed and divided by each projection's
    rescale factor (one factor for all experts).

    Raises:
        MarlinFp4LayoutError: a scale does not fit the layer's MoeShape.

    Source: marlin_utils_fp4.prepare_nvfp4_moe_layer_for_marlin (scales): pad, one
        scale_factor per projection, per expert marlin_permute_scales +
        nvfp4_marlin_process_scales, nvfp4_marlin_process_global_scale
    """
    e, k, n, padded_n, shards = _moe_dims(config)
    dtype = config.dtype
    s13, s2 = tensors["w13_weight_scale"], tensors["w2_weight_scale"]
    _check_expert_tensor(config, "w13_weight_scale", s13, (e, shards * n, k // NVFP4_GROUP_SIZE))
    _check_expert_tensor(config, "w2_weight_scale", s2, (e, k, n // NVFP4_GROUP_SIZE))
    _check_expert_tensor(config, "w13_weight_scale_2", tensors["w13_weight_scale_2"], (e,))
    _check_expert_tensor(config, "w2_weight_scale_2", tensors["w2_weight_scale_2"], (e,))
    s13 = _pad_w13(s13.to(dtype), shards, n, padded_n)
    s2 = _pad_w2(s2.to(dtype), n, padded_n, NVFP4_GROUP_SIZE)
    w13_s, w13_g = _process_expert_scales(
        s13, tensors["w13_weight_scale_2"], shards * padded_n, k, dtype
    )
    w2_s, w2_g = _process_expert_scales(s2, tensors["w2_weight_scale_2"], k, padded_n, dtype)
    return StageOut(
        tensors={
            "w13_weight_scale": w13_s,
            "w13_weight_scale_2": w13_g,
            "w2_weight_scale": w2_s,
            "w2_weight_scale_2": w2_g,
        }
    )


_INPUT_SCALES = ("w13_input_scale", "w2_input_scale")


@stage(
    "marlin_fp4.drop_moe_input_scales",
    Tag.TRANSFORM,
    reads=(),
    writes=_INPUT_SCALES,
    optional=_INPUT_SCALES,
    drops=_INPUT_SCALES,
    source="oracle.nvfp4.convert_to_nvfp4_moe_kernel_format (MARLIN): a13_scale = a2_scale "
    "= None (W4A16: the activation scales are unused)",
)
def drop_moe_input_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: the checkpoint's ``w13_input_scale [E, S]`` and ``w2_input_scale [E]``
    are not exported (Marlin runs NVFP4 weight-only). Reads nothing.

    Source: oracle.nvfp4.convert_to_nvfp4_moe_kernel_format (MARLIN): a13_scale =
        a2_scale = None (W4A16: the activation scales are unused)
    """
    return StageOut(drop=tuple(n for n in _INPUT_SCALES if n in tensors))


@stage(
    "marlin_fp4.clear_moe_input_scales",
    Tag.METADATA,
    attrs=_INPUT_SCALES,
    optional=_INPUT_SCALES,
    source="ModelOptNvFp4FusedMoE.process_weights_after_loading: "
    "replace_parameter(layer, 'w*_input_scale', None)",
)
def clear_moe_input_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.w13_input_scale = layer.w2_input_scale = None``, the empty
    parameter slots vLLM leaves (replayed on restore, after
    :data:`drop_moe_input_scales`).

    Source: ModelOptNvFp4FusedMoE.process_weights_after_loading:
        replace_parameter(layer, 'w*_input_scale', None)
    """
    return StageOut(attrs=dict.fromkeys(_INPUT_SCALES))
