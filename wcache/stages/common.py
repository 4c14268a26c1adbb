"""What stage families share besides packing: the stage errors, the native-op lookup,
vLLM's static INT8 input folding and the online-quantization input check.

Packing, AWQ order, round-up and padding live in :mod:`wcache.stages.packing`.
"""

from __future__ import annotations

import torch

from wcache.core import WcacheError

__all__ = [
    "StageInputError",
    "OpUnavailable",
    "require_op",
    "fold_int8_static_input",
    "high_precision_weight",
    "per_channel_from_per_tensor",
]


class StageInputError(WcacheError, ValueError):
    """A stage got tensors whose shape, dtype or packing it cannot handle."""

    code = "stage-input"


class OpUnavailable(WcacheError, RuntimeError):
    """A native op a stage needs is not registered in this process."""

    code = "op-unavailable"


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
            f"(wcache.vllm does) or use a plan that does not need this op."
        ) from e


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
        raise StageInputError(
            f"layer {config.name!r}: asymmetric static W8A8 INT8 without input_zero_point"
        )
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
            f"wcache bug with the vLLM version, or serve the model without wcache."
        )
    return weight


def per_channel_from_per_tensor(
    scale: torch.Tensor, widths: tuple[int, ...], layer: str
) -> torch.Tensor:
    """One per-tensor scale per fused shard, repeated over that shard's output channels.

    Args:
        scale: ``[len(widths)]`` (any trailing 1-sized dims), one scale per shard.
        widths: each shard's logical output width (``logical_widths``).
        layer: the layer's name, for the error.

    Returns:
        ``[sum(widths), 1]`` float32 (meta when ``scale`` is meta).

    Raises:
        StageInputError: ``scale`` does not hold one value per width.

    Source: vllm/model_executor/layers/quantization/utils/w8a8_utils.py::convert_to_channelwise.
    """
    if scale.numel() != len(widths):
        raise StageInputError(
            f"layer {layer!r}: {scale.numel()} per-tensor scales for {len(widths)} logical "
            f"widths {widths}"
        )
    out = torch.empty((sum(widths), 1), dtype=torch.float32, device=scale.device)
    if scale.device.type != "meta":
        start = 0
        for idx, width in enumerate(widths):
            out[start : start + width, :] = scale[idx]
            start += width
    return out
