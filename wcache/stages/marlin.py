"""Marlin layout stages (CUDA kernel; the layout itself is pure torch).

The Marlin GEMM consumes weights in a tiled, permuted, bit-interleaved int32
layout, scales in a permuted layout, and zero points permuted and packed along N.
vLLM builds that layout with the CUDA op ``gptq_marlin_repack``; its pure
reference is ``marlin_weights(q_w, K, N, bits, get_weight_perm(bits))`` from
``marlin_utils_test.py``, which this module ports to torch (no numpy, no host
round trip), so the daemon can prepare the layout on any device and the tests
check it bit for bit against vLLM on CPU.

Padding: shapes that fit no Marlin thread tile are zero-padded to
``marlin_padded_nk(N, K, G)``; the padded weight, scales and zero points are zero,
so the padded region contributes nothing. The logical ``(K, N)`` stay in the
layer config (vLLM's ``kernel.config.partition_weight_shape``); ``apply`` derives
the padded extents from the repacked weight's shape, so nothing else is recorded.

Activation overrides (``marlin_input_dtype`` int8/fp8) change the layout
(``is_a_8bit`` permutations, ``marlin_int4_fp8_preprocess``); wcache refuses them
at plan resolution, so every function here builds the 16-bit-activation layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, WcacheError, stage
from wcache.stages.packing import pack_factor, pack_int32, round_up, unpack_int32

__all__ = [
    "MARLIN_TILE",
    "MARLIN_SUPPORTED_GROUP_SIZES",
    "MarlinLayoutError",
    "marlin_padded_nk",
    "marlin_weight_perm",
    "marlin_scale_perms",
    "marlin_repack",
    "marlin_permute_scales",
    "marlin_zero_points",
    "marlin_permute_bias",
    "pack_fp8_to_int32",
    "fp8_exponent_bias",
    "fp8_fused_exponent_bias_into_scales",
    "repack_stage",
    "permute_scales_stage",
    "permute_zero_points_stage",
    "empty_zero_points_stage",
    "clear_input_global_scale",
    "permute_bias",
    "repack_fp8_weight",
    "permute_fp8_scales",
    "repack_mxfp8_weight",
    "permute_mxfp8_scales",
]

#: Marlin's tile edge (``GPTQ_MARLIN_TILE``): the repacked weight has ``K / 16`` rows.
MARLIN_TILE = 16
#: The two Marlin thread-tile families ``(n_multiple, k_multiple)``.
MARLIN_TILE_FAMILIES = ((64, 128), (128, 64))
#: Group sizes the Marlin kernel supports (``MARLIN_SUPPORTED_GROUP_SIZES``).
MARLIN_SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
#: Interleave of the values packed in one int32 word, per weight width
#: (``get_weight_perm`` / ``marlin_zero_points`` for 16-bit activations).
_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}
#: MX block size along K (``MXFP8_BLOCK_SIZE``): one e8m0 scale per 32 values.
MXFP8_GROUP_SIZE = 32
#: Reorder of e8m0 scales inside groups of four (``mxfp8_marlin_process_scales``).
MXFP8_SCALE_REORDER = (0, 2, 1, 3)
#: Exponent bits of float8_e4m3fn, used by ``fp8_fused_exponent_bias_into_scales``.
FP8_E4M3_EXPONENT_BITS = 4
#: Exponent bits of the scale dtypes Marlin FP8 supports.
_TARGET_EXPONENT_BITS = {torch.float16: 5, torch.bfloat16: 8}


class MarlinLayoutError(WcacheError, ValueError):
    """A tensor cannot be put in Marlin layout (bits, group size or shape)."""

    code = "marlin-layout"


# --------------------------------------------------------------------------- pure helpers


def marlin_padded_nk(size_n: int, size_k: int, group_size: int = -1) -> tuple[int, int]:
    """The cheaper Marlin tile family that fits ``(size_n, size_k)``.

    Returns:
        ``(padded_n, padded_k)``; equal to the inputs when already aligned.

    Source: ``vllm.model_executor.layers.quantization.utils.marlin_utils.marlin_padded_nk``.
    """
    group = group_size if group_size > 0 else 1
    candidates = tuple(
        (round_up(size_n, n_mult), round_up(size_k, math.lcm(k_mult, group)))
        for n_mult, k_mult in MARLIN_TILE_FAMILIES
    )
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def _check_bits(num_bits: int) -> None:
    if num_bits not in _INTERLEAVE:
        raise MarlinLayoutError(
            f"Marlin packs 4- or 8-bit values, got num_bits={num_bits}; "
            f"use a plan for another kernel"
        )


def marlin_weight_perm(num_bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 1024-entry permutation applied to each row of 16x64 Marlin tiles.

    Returns:
        ``[1024]`` int64.

    Source: ``marlin_utils_test.get_weight_perm`` (``is_a_8bit=False``).
    """
    _check_bits(num_bits)
    perm: list[int] = []
    for i in range(32):
        col = i // 4
        perm1 = [
            16 * row + col + 8 * block
            for block in (0, 1)
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        ]
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    interleave = _INTERLEAVE[num_bits]
    out = torch.tensor(perm, dtype=torch.int64).reshape(-1, len(interleave))
    out = out[:, list(interleave)].reshape(-1)
    return out.to(device)


def marlin_scale_perms() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(scale_perm [64], scale_perm_single [32])``. Source: ``marlin_utils.get_scale_perms``."""
    scale_perm = tuple(i + 8 * j for i in range(8) for j in range(8))
    single = tuple(2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25))
    return scale_perm, single


def marlin_repack(q_packed: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """GPTQ-layout packed weight -> Marlin layout (what ``gptq_marlin_repack`` computes).

    Args:
        q_packed: ``[size_k // (32 // num_bits), size_n]`` int32, packed along K
            (GPTQ order, low bits first). ``size_k % 16 == 0`` and ``size_n % 64 == 0``
            (call after :func:`marlin_padded_nk` padding).
        size_k: rows of the unpacked weight (padded K).
        size_n: columns (padded N).
        num_bits: 4 or 8.

    Returns:
        ``[size_k // 16, size_n * num_bits // 2]`` int32.

    Raises:
        MarlinLayoutError: bad bits or shape.

    Source: ``marlin_utils_test.marlin_weights(q_w, K, N, bits, get_weight_perm(bits))``,
    the reference for ``ops.gptq_marlin_repack``.
    """
    _check_bits(num_bits)
    pf = pack_factor(num_bits)
    min_n = min(n_mult for n_mult, _ in MARLIN_TILE_FAMILIES)
    if tuple(q_packed.shape) != (size_k // pf, size_n) or size_k % MARLIN_TILE or size_n % min_n:
        raise MarlinLayoutError(
            f"marlin_repack expects [{size_k // pf}, {size_n}] with K a multiple of "
            f"{MARLIN_TILE} and N of {min_n}, got {tuple(q_packed.shape)}; pad with "
            f"marlin_padded_nk first"
        )
    q_w = unpack_int32(q_packed, num_bits, 0)  # [K, N]
    tile = MARLIN_TILE
    q_w = q_w.reshape(size_k // tile, tile, size_n // tile, tile).permute(0, 2, 1, 3)
    q_w = q_w.reshape(size_k // tile, size_n * tile)
    perm = marlin_weight_perm(num_bits, q_w.device)
    q_w = q_w.reshape(-1, perm.numel())[:, perm].reshape(size_k // tile, size_n * tile)
    return pack_int32(q_w, num_bits, -1)


def marlin_permute_scales(
    s: torch.Tensor, size_k: int, size_n: int, group_size: int
) -> torch.Tensor:
    """Permute scales (or a bias-like row) into Marlin order.

    Args:
        s: ``[size_k // group_size, size_n]`` (``[1, size_n]`` channelwise), any dtype.

    Returns:
        Same shape and dtype, contiguous.

    Source: ``marlin_utils.marlin_permute_scales`` (``is_a_8bit=False``).
    """
    scale_perm, single = marlin_scale_perms()
    perm = list(scale_perm) if (group_size < size_k and group_size != -1) else list(single)
    out = s.reshape(-1, len(perm))[:, perm]
    return out.reshape(-1, size_n).contiguous()


def marlin_zero_points(zp: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """Unpacked zero points -> Marlin-permuted, interleaved, packed along N.

    Args:
        zp: ``[size_k, size_n]`` integer values (``size_k`` = number of groups).

    Returns:
        ``[size_k, size_n // (32 // num_bits)]`` int32.

    Source: ``marlin_utils.marlin_zero_points`` (``is_a_8bit=False``).
    """
    _check_bits(num_bits)
    scale_perm, _ = marlin_scale_perms()
    out = zp.reshape(-1, len(scale_perm))[:, list(scale_perm)]
    interleave = list(_INTERLEAVE[num_bits])
    out = out.reshape(-1, len(interleave))[:, interleave].reshape(-1, size_n)
    return pack_int32(out.reshape(size_k, size_n), num_bits, -1)


def marlin_permute_bias(bias: torch.Tensor) -> torch.Tensor:
    """``[n]`` -> ``[n]``, Marlin's single-scale permutation. Source: ``marlin_permute_bias``."""
    _, single = marlin_scale_perms()
    return bias.reshape(-1, len(single))[:, list(single)].reshape(bias.shape).contiguous()


def pack_fp8_to_int32(weight_nk: torch.Tensor) -> torch.Tensor:
    """FP8 ``[N, K]`` -> GPTQ-layout int32 ``[K // 4, N]`` (four bytes per word, K-packed).

    Source: ``marlin_utils_fp8.pack_fp8_to_int32(w, size_k_first=False).T.contiguous()``.
    """
    return weight_nk.contiguous().view(torch.int32).t().contiguous()


def fp8_exponent_bias(dtype: torch.dtype) -> int:
    """``2**(e-1) - 2**3``: 8 for fp16, 120 for bf16 scales.

    Raises:
        MarlinLayoutError: another scale dtype.
    """
    if dtype not in _TARGET_EXPONENT_BITS:
        raise MarlinLayoutError(f"FP8 Marlin scales must be float16 or bfloat16, got {dtype}")
    return 2 ** (_TARGET_EXPONENT_BITS[dtype] - 1) - 2 ** (FP8_E4M3_EXPONENT_BITS - 1)


def fp8_fused_exponent_bias_into_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales * 2**bias`` in the scales' dtype (Marlin dequantizes FP8 by a bit shift).

    Source: ``marlin_utils_fp8.fp8_fused_exponent_bias_into_scales``.
    """
    s = torch.ones_like(scales) * 2
    return scales * s ** fp8_exponent_bias(scales.dtype)


def _pad2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor to ``[rows, cols]`` (no copy when already that size).

    Not :func:`wcache.stages.packing.pad_to`: ``torch.nn.functional.pad`` crops where a
    size exceeds the target (a checkpoint with more groups than the config says, as in
    the README example), and the Marlin stages keep that behaviour unchanged.
    """
    if tuple(x.shape) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _geometry(config: LayerConfig, group_size: int | None = None) -> tuple[int, int, int, int, int]:
    g = config.quant.group_size if group_size is None else group_size
    if g not in MARLIN_SUPPORTED_GROUP_SIZES:
        raise MarlinLayoutError(
            f"layer {config.name!r}: Marlin supports group sizes "
            f"{MARLIN_SUPPORTED_GROUP_SIZES}, got {g}"
        )
    size_k, size_n = config.size_k, config.size_n
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, g)
    return size_k, size_n, padded_k, padded_n, g


# --------------------------------------------------------------------------- stages


@stage(
    "marlin.repack",
    Tag.TRANSFORM,
    source="MarlinLinearKernel.process_weights_after_loading: marlin_pad_qweight + "
    "ops.gptq_marlin_repack (reference marlin_utils_test.marlin_weights)",
    params=lambda w_q, n_major=False: {"reads": (w_q,), "writes": (w_q,)},
)
def repack_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_q: str,
    n_major: bool,
) -> StageOut:
    """TRANSFORM ``w_q`` -> Marlin layout ``[Kp / 16, Np * bits / 2]`` int32.

    Args:
        w_q: tensor name (``"qweight"``, ``"weight_packed"``).
        n_major: the checkpoint stores ``[N, K / pf]`` (compressed-tensors,
            ``input_dim == 1``); it is transposed first (``permute_param_layout_``).
    """
    size_k, size_n, padded_k, padded_n, _ = _geometry(config)
    bits = config.quant.num_bits
    _check_bits(bits)
    q = t[w_q].t() if n_major else t[w_q]
    q = _pad2(q.contiguous(), padded_k // pack_factor(bits), padded_n)
    return StageOut(tensors={w_q: marlin_repack(q, padded_k, padded_n, bits)})


@stage(
    "marlin.permute_scales",
    Tag.TRANSFORM,
    source="marlin_utils.marlin_pad_scales + marlin_permute_scales",
    params=lambda w_s, n_major=False: {"reads": (w_s,), "writes": (w_s,)},
)
def permute_scales_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_s: str,
    n_major: bool,
) -> StageOut:
    """TRANSFORM ``w_s [K/G, N]`` -> padded, permuted ``[Kp/G, Np]`` (same dtype)."""
    size_k, size_n, padded_k, padded_n, g = _geometry(config)
    s = t[w_s].t() if n_major else t[w_s]
    rows = padded_k // g if g > 0 else s.shape[0]
    s = _pad2(s.contiguous(), rows, padded_n)
    return StageOut(tensors={w_s: marlin_permute_scales(s, padded_k, padded_n, g)})


@stage(
    "marlin.permute_zero_points",
    Tag.TRANSFORM,
    source="MarlinLinearKernel.process_weights_after_loading: unpack_cols + "
    "marlin_pad_scales + marlin_zero_points (or marlin_make_empty)",
    params=lambda w_zp, empty_if_symmetric=False: {
        "reads": (w_zp,),
        "writes": (w_zp,),
        "optional": (w_zp,) if empty_if_symmetric else (),
    },
)
def permute_zero_points_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_zp: str,
    empty_if_symmetric: bool,
) -> StageOut:
    """TRANSFORM standard zero points ``[N/pf, K/G]`` -> Marlin ``[Kp/G, Np/pf]`` int32.

    Args:
        w_zp: tensor name (``"qzeros"``, ``"weight_zero_point"``).
        empty_if_symmetric: for methods with both variants in one plan
            (compressed-tensors W4A16): a symmetric layer gets the empty ``[0]``
            int32 tensor instead (``marlin_make_empty``).
    """
    if empty_if_symmetric and not config.quant.zero_point:
        device = next(iter(t.values())).device if t else torch.device("cpu")
        return StageOut(tensors={w_zp: torch.empty(0, dtype=torch.int32, device=device)})
    size_k, size_n, padded_k, padded_n, g = _geometry(config)
    bits = config.quant.num_bits
    zp = unpack_int32(t[w_zp], bits, 0).t()  # [K/G, N]
    rows = padded_k // g if g > 0 else 1
    zp = _pad2(zp, rows, padded_n)
    return StageOut(tensors={w_zp: marlin_zero_points(zp, rows, padded_n, bits)})


@stage(
    "marlin.empty_zero_points",
    Tag.TRANSFORM,
    source="marlin_utils.marlin_make_empty",
    params=lambda w_zp: {"reads": (), "writes": (w_zp,), "optional": (w_zp,)},
)
def empty_zero_points_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_zp: str,
) -> StageOut:
    """TRANSFORM: ``w_zp`` becomes an empty ``[0]`` int32 tensor (symmetric weights).

    vLLM's ``marlin_make_empty`` is an allocation, but it replaces a checkpoint
    tensor (GPTQ's ``qzeros``), so it is a TRANSFORM here: the daemon exports the
    0-byte tensor and restore never replaces a mapped name.
    """
    device = next(iter(t.values())).device if t else torch.device("cpu")
    return StageOut(tensors={w_zp: torch.empty(0, dtype=torch.int32, device=device)})


@stage(
    "marlin.clear_input_global_scale",
    Tag.METADATA,
    attrs=("input_global_scale",),
    source="MarlinLinearKernel.process_weights_after_loading: layer.input_global_scale = None",
)
def clear_input_global_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.input_global_scale = None`` (16-bit activations).

    Source: MarlinLinearKernel.process_weights_after_loading: layer.input_global_scale =
        None
    """
    return StageOut(attrs={"input_global_scale": None})


@stage(
    "marlin.permute_bias",
    Tag.TRANSFORM,
    reads=("bias",),
    writes=("bias",),
    optional=("bias",),
    source="marlin_utils.marlin_pad_dim + marlin_permute_bias",
)
def permute_bias(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``bias [N]`` -> zero-padded to ``[Np]`` and permuted (no-op without bias).

    Source: marlin_utils.marlin_pad_dim + marlin_permute_bias
    """
    if "bias" not in tensors:
        return StageOut()
    g = config.quant.group_size if config.quant.group_size in MARLIN_SUPPORTED_GROUP_SIZES else -1
    if config.quant.method == "mxfp8":
        g = MXFP8_GROUP_SIZE
    padded_n, _ = marlin_padded_nk(config.size_n, config.size_k, g)
    bias = tensors["bias"]
    if padded_n != bias.shape[0]:
        bias = torch.nn.functional.pad(bias, (0, padded_n - bias.shape[0]))
    return StageOut(tensors={"bias": marlin_permute_bias(bias)})


# ----------------------------------------------------------------- FP8 / MXFP8 on Marlin


def _fp8_marlin_repack(weight_nk: torch.Tensor, config: LayerConfig, g: int) -> torch.Tensor:
    size_k, size_n, padded_k, padded_n, _ = _geometry(config, g)
    q = _pad2(pack_fp8_to_int32(weight_nk), padded_k // pack_factor(8), padded_n)
    return marlin_repack(q, padded_k, padded_n, 8)


@stage(
    "marlin.repack_fp8_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source="marlin_utils_fp8.prepare_fp8_layer_for_marlin: pack_fp8_to_int32 + "
    "marlin_pad_qweight + ops.gptq_marlin_repack(num_bits=8)",
)
def repack_fp8_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` float8_e4m3fn -> ``[Kp/16, 4 * Np]`` int32 (Marlin).

    Source: marlin_utils_fp8.prepare_fp8_layer_for_marlin: pack_fp8_to_int32 +
        marlin_pad_qweight + ops.gptq_marlin_repack(num_bits=8)
    """
    return StageOut(tensors={"weight": _fp8_marlin_repack(tensors["weight"], config, -1)})


def _channel_scales(s: torch.Tensor, config: LayerConfig) -> torch.Tensor:
    """Per-tensor / per-shard / channel scale -> ``[1, N]`` (``prepare_fp8_layer_for_marlin``)."""
    n = config.size_n
    widths = tuple(config.get("logical_widths", ()) or ())
    if s.device.type == "meta":  # repeat_interleave by a tensor needs its values
        return s.new_empty((1, n))
    if s.numel() == 1:
        return s.reshape(1, 1).repeat_interleave(n, 1)
    if widths and s.numel() == len(widths):
        if sum(widths) != n:
            raise MarlinLayoutError(
                f"layer {config.name!r}: logical_widths {widths} do not sum to size_n={n}"
            )
        lw = torch.tensor(widths, dtype=torch.int64, device=s.device)
        return s.reshape(1, -1).repeat_interleave(lw, dim=1)
    if s.numel() != n:
        if n % s.numel():
            raise MarlinLayoutError(f"layer {config.name!r}: {s.numel()} scales for N={n}")
        return s.reshape(1, -1).repeat_interleave(n // s.numel(), 1)
    return s.reshape(1, n)


@stage(
    "marlin.permute_fp8_scales",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source="marlin_utils_fp8.prepare_fp8_layer_for_marlin (scales): cast to orig dtype, "
    "expand to channel, marlin_pad_scales, marlin_permute_scales, "
    "fp8_fused_exponent_bias_into_scales",
)
def permute_fp8_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight_scale`` (0-d, ``[#shards]``, ``[N, 1]``) fp32 -> ``[1, Np]`` in
    ``params_dtype`` with the FP8 exponent bias fused (x 2**8 fp16, x 2**120 bf16).

    Source: marlin_utils_fp8.prepare_fp8_layer_for_marlin (scales): cast to orig dtype,
        expand to channel, marlin_pad_scales, marlin_permute_scales,
        fp8_fused_exponent_bias_into_scales
    """
    size_k, size_n, padded_k, padded_n, _ = _geometry(config, -1)
    s = _channel_scales(tensors["weight_scale"].to(config.dtype), config)
    s = _pad2(s, 1, padded_n)
    s = marlin_permute_scales(s, padded_k, padded_n, -1)
    return StageOut(tensors={"weight_scale": fp8_fused_exponent_bias_into_scales(s)})


@stage(
    "marlin.repack_mxfp8_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source="marlin_utils_fp8.prepare_mxfp8_layer_for_marlin (weight)",
)
def repack_mxfp8_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` float8_e4m3fn -> ``[Kp/16, 4 * Np]`` int32 (Marlin, G=32).

    Source: marlin_utils_fp8.prepare_mxfp8_layer_for_marlin (weight)
    """
    value = _fp8_marlin_repack(tensors["weight"], config, MXFP8_GROUP_SIZE)
    return StageOut(tensors={"weight": value})


@stage(
    "marlin.permute_mxfp8_scales",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source="marlin_utils_fp8.prepare_mxfp8_layer_for_marlin (scales) + mxfp8_marlin_process_scales",
)
def permute_mxfp8_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight_scale [N, K/32]`` uint8 (E8M0 codes) -> ``[Kp/32, Np]``
    float8_e8m0fnu, padded, permuted, reordered ``[0, 2, 1, 3]`` within groups of 4.

    Source: marlin_utils_fp8.prepare_mxfp8_layer_for_marlin (scales) +
        mxfp8_marlin_process_scales
    """
    size_k, size_n, padded_k, padded_n, g = _geometry(config, MXFP8_GROUP_SIZE)
    s = tensors["weight_scale"][:size_n, : size_k // g].contiguous()
    s = s.view(torch.float8_e8m0fnu).to(config.dtype).t().contiguous()
    s = _pad2(s, padded_k // g, padded_n)
    s = marlin_permute_scales(s, padded_k, padded_n, g)
    s = s.view(-1, 4)[:, list(MXFP8_SCALE_REORDER)].view(s.shape[0], -1)
    return StageOut(tensors={"weight_scale": s.to(torch.float8_e8m0fnu)})
