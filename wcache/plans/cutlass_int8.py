"""compressed-tensors W8A8 INT8 on CUTLASS (CUDA): ``CutlassInt8ScaledMMLinearKernel``,
vLLM 0.32's first INT8 scaled-mm kernel on CUDA (symmetric and asymmetric
activations, static and dynamic). Every stage is a TRANSFORM the daemon runs; nothing
is replayed on restore (see :mod:`wcache.stages.cutlass_int8`).
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import cutlass_int8, onednn

#: CUTLASS INT8 scaled mm runs on sm75+ (``cutlass_scaled_mm`` int8 paths).
CUTLASS_INT8_MIN_CAPABILITY = (7, 5)


def _match(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cuda":
        return f"CUTLASS INT8 is a CUDA kernel; the target is {target.device_type}"
    if target.capability is not None and tuple(target.capability) < CUTLASS_INT8_MIN_CAPABILITY:
        return f"CUTLASS INT8 needs compute capability >= 7.5, the target has {target.capability}"
    if config.quant.strategy not in (None, "tensor", "channel"):
        return f"CUTLASS W8A8 INT8 takes tensor/channel scales, got {config.quant.strategy!r}"
    if config.quant.layer_kind != "linear":
        return f"CUTLASS INT8 plans cover linear layers, not {config.quant.layer_kind}"
    return None


W8A8_INT8 = register(
    Plan(
        method="ct_w8a8_int8",
        kernel="cutlass_int8",
        devices="cuda",
        stages=(
            cutlass_int8.transpose_weight,
            onednn.convert_scale_to_channelwise,
            cutlass_int8.fold_input_scale,
            cutlass_int8.compute_azp_adj,
        ),
        checkpoint={"weight", "weight_scale", "input_scale", "input_zero_point", "bias"},
        match=_match,
        # Source: vllm/model_executor/kernels/linear/scaled_mm/cutlass.py (layer_utils'
        # replace_parameter with a fresh Parameter)
        reregistered=dict.fromkeys(
            ("weight", "weight_scale", "input_scale", "input_zero_point"),
            Reregistration.REPLACE_LAYER,
        ),
        description="compressed-tensors W8A8 INT8 on CUTLASS: weight transposed to (K, N) "
        "column-major, fused per-tensor scales to per-channel, static input "
        "scale/zero point folded, azp_adj (int32, asymmetric activations).",
    )
)
