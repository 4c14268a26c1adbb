"""Fused-MoE stages every MoE plan shares, and the FP8 fused-MoE stages.

A fused-MoE layer (vLLM's ``RoutedExperts``) holds all local experts in two
tensors (:class:`~wcache.core.MoeShape`): ``w13_weight [E, shards * I, H]`` (gate
then up, ``shards`` = 2 for gated experts) and ``w2_weight [E, H, I]``, with
``E`` = ``num_experts`` (local), ``H`` = ``hidden_size``, ``I`` =
``intermediate_size_per_partition``. Stages read those sizes from
``config.moe``, never from ``size_k``/``size_n``.

After the tensors, vLLM builds process-local kernel objects from them
(``moe_quant_config``, the ``FusedMoEKernel`` with its experts). A pure stage
cannot build vLLM objects: :data:`set_experts_kernel` (METADATA, replayed on
restore) records the backend and experts class the daemon's vLLM resolved and
checks them against the engine's at restore (a mismatch is a
:class:`~wcache.core.RecordedMismatch`: the bytes were laid out for another
kernel); the vLLM integration then builds the kernel objects from one table
keyed by (method class, backend) (``wcache.vllm.moe``).

FP8 (serialized per-tensor, vLLM's ``Fp8MoEMethod`` without a block size): the
w1 and w3 shards of each expert carry their own scale on disk, the kernels one
per expert; vLLM requantizes both shards to the max scale **in place**
(``process_fp8_weight_tensor_strategy_moe``). :data:`process_weight_tensor_strategy`
is that TRANSFORM returning new tensors: the daemon runs it once, a restore never
(twice would requantize already requantized bytes and, under vLLM's in-place
form, write into the shared arena). Online FP8 (``Fp8PerTensorOnlineMoEMethod``):
:data:`quantize_per_tensor` quantizes the checkpoint's bf16 experts, one scale per
expert and projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, MoeShape, StageOut, Tag, Target, WcacheError, stage
from wcache.stages.fp8 import FP8_DTYPE, FP8_MAX, weight_amax

__all__ = [
    "MoeLayoutError",
    "moe_shape",
    "validate_expert_shapes",
    "set_experts_kernel",
    "requantize_w13_to_max_scale",
    "process_weight_tensor_strategy",
    "reduce_input_scales",
    "quantize_experts_per_tensor",
    "quantize_per_tensor",
    "W13_W2",
]

#: The two expert weight tensors of every fused-MoE layer.
W13_W2 = ("w13_weight", "w2_weight")

_FP8_UTILS = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
_FP8_MOE = "vllm.model_executor.layers.quantization.fp8.Fp8MoEMethod"
_ONLINE_MOE = "vllm.model_executor.layers.quantization.online.fp8.Fp8PerTensorOnlineMoEMethod"


class MoeLayoutError(WcacheError, ValueError):
    """A fused-MoE tensor's shape or dtype is not what the layer's MoeShape says."""

    code = "moe-layout"


def moe_shape(config: LayerConfig) -> MoeShape:
    """``config.moe``.

    Raises:
        MoeLayoutError: the config has no MoE shape (a MoE plan bound to another layer).
    """
    if config.moe is None:
        raise MoeLayoutError(
            f"layer {config.name!r}: a fused-MoE stage needs LayerConfig.moe "
            f"(the adapter sets it for vLLM's RoutedExperts); got none"
        )
    return config.moe


# --------------------------------------------------------------------------- every MoE plan


@stage(
    "moe.validate_expert_shapes",
    Tag.VALIDATE,
    reads=W13_W2,
    source="vllm/model_executor/layers/fused_moe/*: create_weights (w13/w2 shapes)",
)
def validate_expert_shapes(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """VALIDATE: ``w13_weight [E, shards * I', H]`` and ``w2_weight [E, H, I']`` agree with
    each other and with ``config.moe`` (E and H exactly; ``I' >= I``: a CPU plan pads
    the intermediate dim).

    Raises:
        MoeLayoutError: names the layer, both shapes and the MoeShape.
    """
    moe = moe_shape(config)
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    problems = []
    if w13.dim() != 3 or w2.dim() != 3:
        problems.append("w13_weight and w2_weight must be 3-D")
    else:
        e, rows, h = w13.shape
        if (e, h) != (moe.num_experts, moe.hidden_size):
            problems.append(f"w13_weight holds {e} experts of hidden size {h}")
        if tuple(w2.shape[:2]) != (moe.num_experts, moe.hidden_size):
            problems.append(f"w2_weight is {list(w2.shape)}")
        if rows != moe.w13_num_shards * w2.shape[2]:
            problems.append(
                f"w13_weight has {rows} rows for {moe.w13_num_shards} shard(s) of "
                f"w2's intermediate size {w2.shape[2]}"
            )
        if w2.shape[2] < moe.intermediate_size_per_partition:
            problems.append(
                f"intermediate size {w2.shape[2]} < {moe.intermediate_size_per_partition}"
            )
    if problems:
        raise MoeLayoutError(
            f"layer {config.name!r}: {'; '.join(problems)} (w13 {list(w13.shape)}, w2 "
            f"{list(w2.shape)}; expected E={moe.num_experts}, H={moe.hidden_size}, "
            f"I={moe.intermediate_size_per_partition}): the exported experts do not fit "
            f"this engine's layer; restart the daemon with the engine's arguments"
        )
    return StageOut()


@stage(
    "moe.set_experts_kernel",
    Tag.METADATA,
    source="vllm FusedMoEMethodBase subclasses: _init_moe_kernel / _setup_kernel "
    "(moe_quant_config + FusedMoEKernel), built by wcache.vllm.moe's table",
)
def set_experts_kernel(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """METADATA: record the backend and experts class vLLM's MoE oracle resolved for
    the layer (``config.moe.backend``, ``config.moe.experts``); on restore the engine's
    resolution must equal the daemon's (else :class:`~wcache.core.RecordedMismatch`:
    the exported bytes are laid out for another kernel).

    The kernel objects themselves (``quant_method.moe_quant_config`` and
    ``quant_method.moe_kernel``) are built after the plan by the vLLM integration
    from one table keyed by (method class, backend) (``wcache.vllm.moe``), from the
    layer's final tensors, as vLLM's ``_init_moe_kernel`` does.
    """
    moe = moe_shape(config)
    return StageOut(record={"backend": moe.backend, "experts": moe.experts})


# --------------------------------------------------------------------------- FP8


def requantize_w13_to_max_scale(
    w13: torch.Tensor, w13_scale: torch.Tensor, intermediate_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert, requantize the w1 and w3 shards of ``w13`` to the larger of their
    two scales.

    Args:
        w13: ``[E, 2 * I, H]`` float8_e4m3fn, shard ``s`` in rows ``[s*I, (s+1)*I)``.
        w13_scale: ``[E, 2]`` fp32, one scale per expert and shard.
        intermediate_size: ``I`` (vLLM's ``layer.intermediate_size_per_partition``).

    Returns:
        ``(w13 [E, 2 * I, H] float8_e4m3fn, a new tensor; max scale [E] fp32)``. Each
        shard is dequantized in fp16 (``per_tensor_dequantize``) and quantized with
        the max scale (``scaled_fp8_quant`` static: ``x * (1 / s)``, clamped to
        +-448), as vLLM does in place.

    Source: ``fp8_utils.process_fp8_weight_tensor_strategy_moe`` (is_act_and_mul)
    with ``w8a8_utils.per_tensor_dequantize`` and ``QuantFP8.forward_native``.
    """
    max_scales = w13_scale.max(dim=1).values
    if w13.device.type == "meta" or w13_scale.device.type == "meta":
        return torch.empty_like(w13), max_scales
    out = torch.empty_like(w13)
    for expert in range(w13.shape[0]):
        inv = max_scales[expert].to(torch.float32).reciprocal()
        for shard in range(2):
            rows = slice(shard * intermediate_size, (shard + 1) * intermediate_size)
            # a 0-d fp32 scale keeps the product fp16, as per_tensor_dequantize's does
            dq = w13[expert, rows].to(torch.float16) * w13_scale[expert, shard]
            out[expert, rows] = (dq.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX).to(w13.dtype)
    return out, max_scales


@stage(
    "fp8_moe.process_weight_tensor_strategy",
    Tag.TRANSFORM,
    reads=("w13_weight", "w13_weight_scale"),
    writes=("w13_weight", "w13_weight_scale"),
    source=f"{_FP8_UTILS}::process_fp8_weight_tensor_strategy_moe (vLLM: in place)",
)
def process_weight_tensor_strategy(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight [E, 2I, H]`` fp8 with ``w13_weight_scale [E, 2]`` -> the
    same weight requantized to ``w13_weight_scale [E]`` = the max of each expert's two
    scales (:func:`requantize_w13_to_max_scale`); non-gated experts keep their weight
    and take ``scale[:, 0]``-shaped ``[E]`` max.

    Never replayable: vLLM writes the requantized shards into the checkpoint tensor
    in place; here they are new bytes the daemon exports once.

    Raises:
        MoeLayoutError: the scale is not ``[E, shards]``.

    Source: fp8_utils.process_fp8_weight_tensor_strategy_moe (vLLM: in place)
    """
    moe = moe_shape(config)
    w13, scale = tensors["w13_weight"], tensors["w13_weight_scale"]
    if tuple(scale.shape) != (moe.num_experts, moe.w13_num_shards):
        raise MoeLayoutError(
            f"layer {config.name!r}: w13_weight_scale is {list(scale.shape)}, "
            f"expected [{moe.num_experts}, {moe.w13_num_shards}] (one scale per "
            f"expert and shard, vLLM's per-tensor FP8 MoE checkpoint)"
        )
    if not moe.is_act_and_mul:
        return StageOut(tensors={"w13_weight_scale": scale.max(dim=1).values})
    w13, max_scales = requantize_w13_to_max_scale(w13, scale, moe.intermediate_size_per_partition)
    return StageOut(tensors={"w13_weight": w13, "w13_weight_scale": max_scales})


@stage(
    "fp8_moe.reduce_input_scales",
    Tag.TRANSFORM,
    reads=("w13_input_scale", "w2_input_scale"),
    writes=("w13_input_scale", "w2_input_scale"),
    optional=("w13_input_scale", "w2_input_scale"),
    source=f"{_FP8_UTILS}::process_fp8_input_tensor_strategy_moe "
    "(amax_for_moe_activation_quant, no EPLB)",
)
def reduce_input_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM static activation scales ``w13_input_scale [E]`` and ``w2_input_scale
    [E]`` fp32 -> their max over experts, 0-d fp32 each; nothing for dynamic
    activations (vLLM keeps ``None`` attributes there, no tensors).

    Source: fp8_utils.process_fp8_input_tensor_strategy_moe (amax_for_moe_activation_quant)
    """
    return StageOut(
        tensors={
            n: tensors[n].max().to(torch.float32)
            for n in ("w13_input_scale", "w2_input_scale")
            if n in tensors
        }
    )


def quantize_experts_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online per-tensor FP8 of stacked experts, one scale per expert.

    Args:
        weight: ``[E, R, C]`` bf16/fp16/fp32.

    Returns:
        ``(qweight [E, R, C] float8_e4m3fn, scale [E] fp32 = amax_e / 448)``, each
        expert quantized as ``scaled_fp8_quant`` static does (``x * (1 / s)``,
        clamped to +-448).

    Source: ``Fp8PerTensorOnlineMoEMethod.process_weights_after_loading``
    (``weight_amax(w.flatten(1), dim=-1)``, ``_fp8_scale``, per-expert
    ``ops.scaled_fp8_quant``).
    """
    amax = weight_amax(weight.flatten(1), dim=-1).to(torch.float32)
    scale = amax / torch.tensor(FP8_MAX, dtype=torch.float32, device=weight.device)
    inv = scale.reciprocal().view(-1, 1, 1)
    q = (weight.to(torch.float32) * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@stage(
    "fp8_moe.quantize_per_tensor",
    Tag.TRANSFORM,
    reads=W13_W2,
    writes=("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
    source=f"{_ONLINE_MOE}.process_weights_after_loading",
)
def quantize_per_tensor(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM the checkpoint's bf16 ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]``
    -> float8_e4m3fn, with new ``w13_weight_scale [E]`` and ``w2_weight_scale [E]`` fp32
    (:func:`quantize_experts_per_tensor`).

    Raises:
        MoeLayoutError: a weight is already float8 (the daemon was handed vLLM's
            quantized layer, not the checkpoint's).

    Source: vllm.model_executor.layers.quantization.online.fp8.Fp8PerTensorOnlineMoEMethod
        .process_weights_after_loading
    """
    out = {}
    for name in W13_W2:
        w = tensors[name]
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise MoeLayoutError(
                f"layer {config.name!r}: online FP8 MoE expects the checkpoint's bf16/fp16 "
                f"{name}, got {str(w.dtype).removeprefix('torch.')}: it is already "
                f"quantized; report this as a wcache bug, or serve without wcache"
            )
        q, s = quantize_experts_per_tensor(w)
        out[name] = q
        out[name.replace("_weight", "_weight_scale")] = s
    return StageOut(tensors=out)
