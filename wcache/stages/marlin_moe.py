"""Marlin fused-MoE stages for int4/int8 weight-only experts (AWQ, GPTQ, compressed-tensors
W4A16 on vLLM's ``MARLIN`` WNA16 MoE backend, ``MarlinExperts``).

vLLM 0.32/0.33 run all three methods through one oracle helper,
``oracle/int_wna16.py::convert_to_wna16_moe_kernel_format`` (``_process_weights_marlin``
for GPTQ and compressed-tensors, ``_process_awq_weights_marlin`` for AWQ). Per layer,
with ``E`` experts, hidden size ``H`` (Marlin MoE never pads it: vLLM's
``check_moe_marlin_supports_config`` wants ``H % 128 == 0``), intermediate size ``I``,
its Marlin padding ``Ip = marlin_moe_padded_intermediate(I, G)`` and ``pf = 32 // bits``:

1. K-first layout: GPTQ's ``w13_qweight [E, H/pf, 2I]`` already is (vLLM transposes it
   to N-first and back); compressed-tensors' N-first ``w13_weight_packed [E, 2I, H/pf]``
   is transposed; AWQ keeps its own ``[E, H, 2I/8]`` (packed along N, AWQ order).
2. Pad each gate/up shard of w13 and the rows of w2 from ``I`` to ``Ip`` (zeros: the
   padded channels have zero scales and contribute nothing).
3. Repack each expert for Marlin (``ops.gptq_marlin_moe_repack`` /
   ``ops.awq_marlin_moe_repack``, one ``gptq_marlin_repack`` / ``awq_marlin_repack`` per
   expert): ``w13 -> [E, H/16, 2Ip*bits/2]``, ``w2 -> [E, Ip/16, H*bits/2]`` int32.
4. Permute each expert's scales (``marlin_moe_permute_scales``) and zero points
   (``moe_packed_to_marlin_zero_points``, ``moe_awq_to_marlin_zero_points``), and the
   expert biases (``marlin_permute_bias``).
5. Alias ``w13_weight``/``w2_weight`` to the repacked weights (the modular kernel's
   names).

Every step writes new bytes: TRANSFORMs the daemon runs once and a restore never
replays (the repack is a permutation: applied twice it scrambles the weights). The
per-expert ops are ported to torch from vLLM's references (``marlin_utils_test``'s
``marlin_weights``, :mod:`wcache.stages.marlin`), bit for bit, on any device and on
meta tensors. The kernel workspace is vLLM's per-stream ``get_marlin_workspace`` at
``apply`` time (0.33): nothing to allocate after load. vLLM 0.33 refuses GPTQ
act-order (``desc_act``) and asymmetric GPTQ when parsing the config, so no ``g_idx``
sort exists here.

8-bit activations (``VLLM_MARLIN_INPUT_DTYPE`` int8/fp8: ``marlin_int4_fp8_preprocess``,
``is_a_8bit`` permutations, ``marlin_act_int8_process_scales``) change the layout; the
plans refuse them before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.marlin import (
    MARLIN_SUPPORTED_GROUP_SIZES,
    MARLIN_TILE,
    MarlinLayoutError,
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_repack,
    marlin_zero_points,
)
from wcache.stages.moe import MoeLayoutError, moe_shape
from wcache.stages.packing import awq_to_standard, pack_factor, round_up, unpack_awq, unpack_int32

__all__ = [
    "LAYOUTS",
    "MARLIN_MOE_N_TILE",
    "MOE_BIASES",
    "marlin_moe_padded_intermediate",
    "pad_w13_shard_cols",
    "pad_rows",
    "moe_marlin_repack",
    "moe_awq_marlin_repack",
    "moe_permute_scales",
    "moe_packed_to_marlin_zero_points",
    "moe_awq_to_marlin_zero_points",
    "repack_weights",
    "register_weight_aliases",
    "permute_scales",
    "permute_zero_points",
    "permute_bias",
    "validate_repacked_shapes",
    "drop_unloaded_bias",
    "clear_unloaded_bias",
]

#: Marlin MoE's thread tile along the intermediate size: gate-up needs ``2 * I % 128``
#: and down ``I % 64`` (``marlin_moe_padded_intermediate``), i.e. ``I % 64 == 0``.
MARLIN_MOE_N_TILE = 64
#: The checkpoint layouts vLLM's ``convert_to_wna16_moe_kernel_format`` takes on Marlin:
#: ``gptq`` (K-first, packed along K), ``ct`` (compressed-tensors: N-first
#: ``[E, N, K/pf]``), ``awq`` (K-first, packed along N in AWQ order).
LAYOUTS = ("gptq", "ct", "awq")
#: The two expert bias tensors (vLLM's names on every MoE method).
MOE_BIASES = ("w13_bias", "w2_bias")

_INT_WNA16 = "vllm/model_executor/layers/fused_moe/oracle/int_wna16.py"
_MARLIN_UTILS = "vllm/model_executor/layers/quantization/utils/marlin_utils.py"


# --------------------------------------------------------------------------- pure helpers


def marlin_moe_padded_intermediate(intermediate_size: int, group_size: int = -1) -> int:
    """The smallest intermediate size ``>= intermediate_size`` that is a multiple of 64
    and of ``group_size`` (so the padded group count stays integral).

    Source: ``marlin_utils.marlin_moe_padded_intermediate``.
    """
    group = group_size if group_size > 0 else 1
    return round_up(intermediate_size, math.lcm(MARLIN_MOE_N_TILE, group))


def pad_w13_shard_cols(x: torch.Tensor, unit: int, padded_unit: int) -> torch.Tensor:
    """Zero-pad each of the two gate/up shards of ``x [E, rows, 2 * unit]`` along its last
    dim to ``padded_unit`` columns: ``[E, rows, 2 * padded_unit]`` (``x`` itself when equal).

    Source: ``int_wna16._pad_w13_shard_cols``.
    """
    if padded_unit == unit:
        return x
    e, rows, _ = x.shape
    x = torch.nn.functional.pad(x.reshape(e, rows, 2, unit), (0, padded_unit - unit))
    return x.reshape(e, rows, 2 * padded_unit).contiguous()


def pad_rows(x: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero-pad ``x [E, rows, cols]`` to ``[E, padded_rows, cols]`` (``x`` when equal).

    Source: ``int_wna16._pad_rows``.
    """
    if padded_rows == x.shape[1]:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, padded_rows - x.shape[1]))


def _pad_w13_bias(bias: torch.Tensor, n: int, padded_n: int) -> torch.Tensor:
    """``[E, 2n] -> [E, 2 * padded_n]``, each shard zero-padded. Source: ``_pad_w13_bias``."""
    if padded_n == n:
        return bias
    e = bias.shape[0]
    bias = torch.nn.functional.pad(bias.reshape(e, 2, n), (0, padded_n - n))
    return bias.reshape(e, 2 * padded_n).contiguous()


def _per_expert(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(x[e]) for e in range(x.shape[0])])


def moe_marlin_repack(q: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """Per expert :func:`~wcache.stages.marlin.marlin_repack`.

    Args:
        q: ``[E, size_k // pf, size_n]`` int32, packed along K (GPTQ order).

    Returns:
        ``[E, size_k // 16, size_n * num_bits // 2]`` int32.

    Source: ``_custom_ops.gptq_marlin_moe_repack`` (``gptq_marlin_repack`` per expert;
    reference ``marlin_utils_test.marlin_weights``).
    """
    return _per_expert(lambda w: marlin_repack(w, size_k, size_n, num_bits), q)


def moe_awq_marlin_repack(q: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """Per expert: AWQ packing -> standard packing along K -> Marlin.

    Args:
        q: ``[E, size_k, size_n // 8]`` int32, packed along N in AWQ order.

    Returns:
        ``[E, size_k // 16, size_n * num_bits // 2]`` int32.

    Source: ``_custom_ops.awq_marlin_moe_repack`` (``awq_marlin_repack`` per expert:
    undo the AWQ interleave, then ``gptq_marlin_repack``'s layout).
    """

    def one(w: torch.Tensor) -> torch.Tensor:
        standard, _ = awq_to_standard(w, None, num_bits)
        return marlin_repack(standard, size_k, size_n, num_bits)

    return _per_expert(one, q)


def moe_permute_scales(s: torch.Tensor, size_k: int, group_size: int) -> torch.Tensor:
    """Per expert :func:`~wcache.stages.marlin.marlin_permute_scales` (``size_k`` only
    picks the grouped or the single permutation, as in vLLM).

    Args:
        s: ``[E, groups, size_n]``, any dtype.

    Returns:
        same shape and dtype, contiguous.

    Source: ``marlin_utils.marlin_moe_permute_scales``.
    """
    size_n = s.shape[2]
    return _per_expert(lambda x: marlin_permute_scales(x, size_k, size_n, group_size), s)


def moe_packed_to_marlin_zero_points(zp: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Standard-packed zero points (along N) -> Marlin, per expert.

    Args:
        zp: ``[E, groups, size_n // pf]`` int32.

    Returns:
        same shape, int32.

    Source: ``marlin_utils.moe_packed_to_marlin_zero_points``.
    """
    rows, size_n = zp.shape[1], zp.shape[2] * pack_factor(num_bits)

    def one(z: torch.Tensor) -> torch.Tensor:
        return marlin_zero_points(unpack_int32(z, num_bits, 1), rows, size_n, num_bits)

    return _per_expert(one, zp)


def moe_awq_to_marlin_zero_points(zp: torch.Tensor, num_bits: int) -> torch.Tensor:
    """AWQ-packed zero points (along N, AWQ order) -> Marlin, per expert.

    Args:
        zp: ``[E, groups, size_n // 8]`` int32.

    Returns:
        same shape, int32.

    Source: ``marlin_utils.moe_awq_to_marlin_zero_points``.
    """
    rows, size_n = zp.shape[1], zp.shape[2] * pack_factor(num_bits)

    def one(z: torch.Tensor) -> torch.Tensor:
        return marlin_zero_points(unpack_awq(z, num_bits), rows, size_n, num_bits)

    return _per_expert(one, zp)


def _geometry(config: LayerConfig) -> tuple[int, int, int, int, int]:
    """``(bits, pf, G, I, Ip)`` of a Marlin MoE layer.

    Raises:
        MarlinLayoutError: bits or group size Marlin MoE does not take.
    """
    q = config.quant
    if q.num_bits not in (4, 8) or q.group_size not in MARLIN_SUPPORTED_GROUP_SIZES:
        raise MarlinLayoutError(
            f"layer {config.name!r}: Marlin MoE takes 4/8-bit weights with group sizes "
            f"{MARLIN_SUPPORTED_GROUP_SIZES}, got {q.num_bits}-bit, group {q.group_size}"
        )
    inter = moe_shape(config).intermediate_size_per_partition
    return (
        q.num_bits,
        pack_factor(q.num_bits),
        q.group_size,
        inter,
        marlin_moe_padded_intermediate(inter, q.group_size),
    )


def _k_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    """compressed-tensors' N-first ``[E, N, X]`` -> ``[E, X, N]`` contiguous; others as is."""
    return t.transpose(1, 2).contiguous() if layout == "ct" else t


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise MarlinLayoutError(
            f"unknown Marlin MoE checkpoint layout {layout!r}; one of {LAYOUTS}"
        )


# --------------------------------------------------------------------------- stages


def _names(w13: str, w2: str, **extra) -> dict:
    return {"reads": (w13, w2), "writes": (w13, w2), **extra}


@stage(
    "marlin_moe.repack_weights",
    Tag.TRANSFORM,
    source=f"{_INT_WNA16}::_process_weights_marlin / _process_awq_weights_marlin "
    "(pad the intermediate, ops.gptq_marlin_moe_repack / ops.awq_marlin_moe_repack)",
    params=lambda layout, w13, w2: _names(w13, w2),
)
def repack_weights(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    layout: str,
    w13: str,
    w2: str,
) -> StageOut:
    """TRANSFORM the packed experts -> Marlin, intermediate padded to ``Ip``:
    ``w13 -> [E, H/16, 2Ip * bits/2]``, ``w2 -> [E, Ip/16, H * bits/2]`` int32.

    Inputs (``layout``): ``gptq`` ``w13 [E, H/pf, 2I]``, ``w2 [E, I/pf, H]``; ``ct``
    ``w13 [E, 2I, H/pf]``, ``w2 [E, H, I/pf]``; ``awq`` ``w13 [E, H, 2I/8]``,
    ``w2 [E, I, H/8]`` (AWQ order).

    Raises:
        MarlinLayoutError: unknown layout, bits or group size.
    """
    _check_layout(layout)
    bits, pf, g, inter, padded = _geometry(config)
    q13, q2 = _k_first(t[w13], layout), _k_first(t[w2], layout)
    if layout == "awq":
        q13 = pad_w13_shard_cols(q13, inter // pf, padded // pf)
        q2 = pad_rows(q2, padded)
        out13 = moe_awq_marlin_repack(q13, q13.shape[1], q13.shape[2] * pf, bits)
        out2 = moe_awq_marlin_repack(q2, q2.shape[1], q2.shape[2] * pf, bits)
    else:
        q13 = pad_w13_shard_cols(q13, inter, padded)
        q2 = pad_rows(q2, padded // pf)
        out13 = moe_marlin_repack(q13, q13.shape[1] * pf, q13.shape[2], bits)
        out2 = moe_marlin_repack(q2, q2.shape[1] * pf, q2.shape[2], bits)
    return StageOut(tensors={w13: out13, w2: out2})


@stage(
    "marlin_moe.register_weight_aliases",
    Tag.TRANSFORM,
    source="AutoAWQMoEMethod / AutoGPTQMoEMethod / CompressedTensorsWNA16MoEMethod."
    "process_weights_after_loading: layer.w13_weight = layer.w13_<packed> (and w2)",
    params=lambda w13, w2: {"reads": (w13, w2), "writes": ("w13_weight", "w2_weight")},
)
def register_weight_aliases(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w13: str,
    w2: str,
) -> StageOut:
    """TRANSFORM (names only): ``w13_weight``/``w2_weight`` become the same tensors as the
    repacked ``w13``/``w2`` (vLLM registers the same Parameter under both names; the
    export keeps them as aliases, one copy of the bytes)."""
    return StageOut(tensors={"w13_weight": t[w13], "w2_weight": t[w2]})


@stage(
    "marlin_moe.permute_scales",
    Tag.TRANSFORM,
    source=f"{_INT_WNA16}::_process_weights_marlin / _process_awq_weights_marlin "
    "(pad, marlin_moe_permute_scales)",
    params=lambda layout, w13, w2: _names(w13, w2),
)
def permute_scales(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    layout: str,
    w13: str,
    w2: str,
) -> StageOut:
    """TRANSFORM group scales, K-first, intermediate padded, each expert permuted:
    ``w13 -> [E, H/G, 2Ip]``, ``w2 -> [E, Ip/G, H]`` (channelwise: one row), same dtype.

    Inputs: ``gptq``/``awq`` ``w13 [E, H/G, 2I]``, ``w2 [E, I/G, H]``; ``ct`` N-first
    ``w13 [E, 2I, H/G]``, ``w2 [E, H, I/G]``. vLLM passes ``size_k = I`` (the unpadded
    intermediate) for w13 (and for w2 under AWQ), ``rows * G`` for w2 otherwise; it only
    selects the grouped (``G < size_k``) or the single permutation, kept as vLLM has it.
    """
    _check_layout(layout)
    bits, pf, g, inter, padded = _geometry(config)
    s13 = pad_w13_shard_cols(_k_first(t[w13], layout), inter, padded)
    s2 = _k_first(t[w2], layout)
    if g > 0:
        s2 = pad_rows(s2, padded // g)
    w2_size_k = inter if layout == "awq" else s2.shape[1] * (g if g != -1 else pf)
    return StageOut(
        tensors={w13: moe_permute_scales(s13, inter, g), w2: moe_permute_scales(s2, w2_size_k, g)}
    )


@stage(
    "marlin_moe.permute_zero_points",
    Tag.TRANSFORM,
    source=f"{_INT_WNA16}::_process_weights_marlin / _process_awq_weights_marlin "
    "(pad, moe_packed_to_marlin_zero_points / moe_awq_to_marlin_zero_points)",
    params=lambda layout, w13, w2, optional=False: _names(
        w13, w2, optional=(w13, w2) if optional else ()
    ),
)
def permute_zero_points(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    layout: str,
    w13: str,
    w2: str,
    optional: bool,
) -> StageOut:
    """TRANSFORM packed zero points, K-first, intermediate padded, each expert permuted
    and repacked for Marlin: ``w13 -> [E, H/G, 2Ip/pf]``, ``w2 -> [E, Ip/G, H/pf]`` int32.

    Inputs: ``gptq`` ``w13 [E, H/G, 2I/pf]`` (standard order), ``awq`` the same in AWQ
    order, ``ct`` N-first ``w13 [E, 2I/pf, H/G]``. Symmetric GPTQ checkpoints carry
    zero points too (unused by the kernel); vLLM converts them all the same. With
    ``optional`` (compressed-tensors, symmetric: no zero points), nothing.
    """
    _check_layout(layout)
    if optional and (w13 not in t or w2 not in t):
        return StageOut()
    bits, pf, g, inter, padded = _geometry(config)
    z13 = pad_w13_shard_cols(_k_first(t[w13], layout), inter // pf, padded // pf)
    z2 = _k_first(t[w2], layout)
    if g > 0:
        z2 = pad_rows(z2, padded // g)
    convert = moe_awq_to_marlin_zero_points if layout == "awq" else moe_packed_to_marlin_zero_points
    return StageOut(tensors={w13: convert(z13, bits), w2: convert(z2, bits)})


@stage(
    "marlin_moe.permute_bias",
    Tag.TRANSFORM,
    reads=MOE_BIASES,
    writes=MOE_BIASES,
    optional=MOE_BIASES,
    source=f"{_INT_WNA16}::_pad_w13_bias + {_MARLIN_UTILS}::marlin_permute_bias",
)
def permute_bias(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM expert biases: ``w13_bias [E, 2I] -> [E, 2Ip]`` (each shard padded) and
    ``w2_bias [E, H]``, both permuted in Marlin's single-scale order; nothing for a
    layer without them."""
    out = {}
    if "w13_bias" in t:
        _, _, _, inter, padded = _geometry(config)
        out["w13_bias"] = marlin_permute_bias(_pad_w13_bias(t["w13_bias"], inter, padded))
    if "w2_bias" in t:
        out["w2_bias"] = marlin_permute_bias(t["w2_bias"])
    return StageOut(tensors=out)


@stage(
    "marlin_moe.validate_repacked_shapes",
    Tag.VALIDATE,
    source="vllm/model_executor/layers/fused_moe/experts/marlin_moe.py: the shapes "
    "fused_marlin_moe reads (marlin_moe_intermediate_size: w2.size(1) * 16)",
    params=lambda w13, w2, w13_s, w2_s: {"reads": (w13, w2, w13_s, w2_s)},
)
def validate_repacked_shapes(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w13: str,
    w2: str,
    w13_s: str,
    w2_s: str,
) -> StageOut:
    """VALIDATE (replayed at restore): the Marlin experts and scales have the shapes this
    engine's layer needs: ``w13 [E, H/16, 2Ip * bits/2]``, ``w2 [E, Ip/16, H * bits/2]``
    int32, ``w13_s [E, H/G, 2Ip]``, ``w2_s [E, Ip/G, H]`` (one group row channelwise). The
    engine checks exported shapes against its own model except those a TRANSFORM wrote;
    these are such, so a daemon started with other arguments is caught here.

    Raises:
        MoeLayoutError: names the tensors, their shapes and the expected ones.
    """
    moe = moe_shape(config)
    bits, _, g, _, padded = _geometry(config)
    e, h = moe.num_experts, moe.hidden_size
    shards = moe.w13_num_shards
    expected = {
        w13: (e, h // MARLIN_TILE, shards * padded * bits // 2),
        w2: (e, padded // MARLIN_TILE, h * bits // 2),
        w13_s: (e, h // g if g > 0 else 1, shards * padded),
        w2_s: (e, padded // g if g > 0 else 1, h),
    }
    bad = {
        n: (tuple(t[n].shape), shape) for n, shape in expected.items() if tuple(t[n].shape) != shape
    }
    if bad:
        raise MoeLayoutError(
            f"layer {config.name!r}: Marlin MoE tensors "
            + "; ".join(
                f"{n} is {list(got)}, expected {list(want)}" for n, (got, want) in bad.items()
            )
            + f" (E={e}, H={h}, I={moe.intermediate_size_per_partition} padded to {padded}, "
            f"{bits}-bit, group {g}): the exported experts do not fit this engine's layer; "
            f"restart the daemon with the engine's arguments"
        )
    return StageOut()


def _is_unloaded(bias: torch.Tensor) -> bool:
    """vLLM's GPTQ MoE creates zero biases and keeps them only if the checkpoint loaded
    one; the checkpoint's bytes are the only trace a pure stage has: all zero = not
    loaded (a loaded all-zero bias adds nothing, so the kernel output is the same).
    A meta tensor (no bytes) is kept."""
    return bias.device.type != "meta" and not bool(bias.any())


@stage(
    "marlin_moe.drop_unloaded_bias",
    Tag.TRANSFORM,
    reads=MOE_BIASES,
    writes=MOE_BIASES,
    drops=MOE_BIASES,
    optional=MOE_BIASES,
    source="vllm/model_executor/layers/quantization/auto_gptq.py::AutoGPTQMoEMethod."
    "process_weights_after_loading (register_parameter(name, None) for a bias the "
    "checkpoint did not load)",
)
def drop_unloaded_bias(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: drop the expert biases the checkpoint did not hold (all zero, see
    :func:`_is_unloaded`); :data:`clear_unloaded_bias` then empties their slots to
    ``None`` as vLLM does."""
    return StageOut(drop=tuple(n for n in MOE_BIASES if n in t and _is_unloaded(t[n])))


@stage(
    "marlin_moe.clear_unloaded_bias",
    Tag.METADATA,
    attrs=MOE_BIASES,
    optional=MOE_BIASES,
    source="AutoGPTQMoEMethod.process_weights_after_loading: "
    "layer.register_parameter('w13_bias', None) (and w2)",
)
def clear_unloaded_bias(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: an expert bias slot the layer holds no tensor for is ``None``
    (``getattr(layer, "w13_bias", None)`` is what vLLM's quant config reads)."""
    return StageOut(attrs={n: None for n in MOE_BIASES if n not in t})
