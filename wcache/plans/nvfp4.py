"""ModelOpt NVFP4 on CUTLASS (CUDA sm100+): linear W4A4 and fused MoE experts.

vLLM 0.32 picks these kernels only on Blackwell-class GPUs (``cutlass_fp4_supported``,
``CutlassExpertsFp4._supports_current_device``); on H100/H200 it uses Marlin NVFP4,
which has no plan here.

The MoE plan's activation-scale fuse is a TRANSFORM returning new tensors: vLLM
runs it in place (``mul_``) and refuses restore for this backend; here the daemon
exports the fused scales and restore replays only the METADATA dims.
"""

from __future__ import annotations

import functools

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import nvfp4

#: CUTLASS FP4 GEMMs and CutlassExpertsFp4 need capability families 10, 11 or 12.
CUTLASS_FP4_MIN_CAPABILITY = (10, 0)
#: The NVFP4 MoE backend (``NvFp4MoeBackend``) the MoE plan covers.
CUTLASS_MOE_BACKEND = "VLLM_CUTLASS"


def _reason(config: LayerConfig, target: Target, kind: str) -> str | None:
    if target.device_type != "cuda":
        return f"CUTLASS NVFP4 is a CUDA kernel; the target is {target.device_type}"
    if target.capability is None or tuple(target.capability) < CUTLASS_FP4_MIN_CAPABILITY:
        return (
            f"CUTLASS NVFP4 needs compute capability >= 10.0 (Blackwell), the target has "
            f"{target.capability}; vLLM uses Marlin NVFP4 there, which has no plan"
        )
    if config.quant.layer_kind != kind:
        return f"this plan covers {kind} layers, not {config.quant.layer_kind}"
    if config.moe is not None and config.moe.backend != CUTLASS_MOE_BACKEND:
        return (
            f"vLLM's NVFP4 MoE oracle resolved backend {config.moe.backend} here; this plan "
            f"covers {CUTLASS_MOE_BACKEND} (CutlassExpertsFp4) only"
        )
    return None


LINEAR = register(
    Plan(
        method="modelopt_fp4",
        kernel="cutlass",
        devices="cuda",
        stages=(
            nvfp4.validate_loaded,
            nvfp4.reduce_weight_scale_2,
            nvfp4.reduce_input_scale,
            nvfp4.compute_alpha,
            nvfp4.set_is_w4a16_nvfp4,
            nvfp4.swizzle_scales,
            nvfp4.pad_weight,
        ),
        checkpoint=frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"}),
        match=functools.partial(_reason, kind="linear"),
        description="ModelOpt NVFP4 linear on CUTLASS: global scales and alpha as new tensors, "
        "block scales swizzled (no .cuda()), weight padded to 32.",
    )
)

MOE = register(
    Plan(
        method="modelopt_fp4",
        kernel="cutlass_moe",
        devices="cuda",
        stages=(
            nvfp4.select_w13_weight_scale_2,
            nvfp4.reduce_w13_input_scale,
            nvfp4.swizzle_moe_scales,
            nvfp4.fuse_moe_activation_scale,
            nvfp4.set_moe_dims,
        ),
        checkpoint=frozenset(
            {
                "w13_weight",
                "w13_weight_scale",
                "w13_weight_scale_2",
                "w13_input_scale",
                "w2_weight",
                "w2_weight_scale",
                "w2_weight_scale_2",
                "w2_input_scale",
            }
        ),
        match=functools.partial(_reason, kind="moe"),
        description="ModelOpt NVFP4 fused MoE on CUTLASS experts: w13 global scale, a13 max, "
        "scales swizzled, activation scales fused into w*_weight_scale_2 as new "
        "tensors (vLLM: in place); restore replays only the dims.",
    )
)
