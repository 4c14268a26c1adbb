"""ModelOpt NVFP4: linear and fused MoE, on CUTLASS (CUDA sm100+) and on Marlin (the H200).

* ``modelopt_fp4/cutlass`` and ``modelopt_fp4/cutlass_moe``: vLLM picks these kernels
  only on Blackwell-class GPUs (``cutlass_fp4_supported``,
  ``CutlassExpertsFp4._supports_current_device``). **Contract-only**: no sm100 GPU
  has run them; the CPU contract tests check them against vLLM's Python on a
  simulated sm100. The MoE plan's activation-scale fuse is a TRANSFORM returning new
  tensors: vLLM runs it in place (``mul_``) and refuses restore for this backend;
  here the daemon exports the fused scales and restore replays only the METADATA dims.
* ``modelopt_fp4/marlin`` and ``modelopt_fp4/marlin_moe``: what vLLM 0.32/0.33 run on
  sm90 (no FP4 tensor cores): ``MarlinNvFp4LinearKernel`` is the first NVFP4 linear
  kernel whose ``is_supported`` passes there, and ``MARLIN`` (``MarlinExperts``) the
  first NVFP4 MoE backend (Humming ranks ahead of Marlin on sm90 only where its
  package is installed; the kernel vLLM picked is read from the layer, not
  re-derived). Weight-only: the global scales, ``alpha`` and the activation scales
  are reduced as for CUTLASS (the linear kernel ignores them; the MoE drops them),
  the weights repacked and the block scales re-encoded (:mod:`wcache.stages.marlin_fp4`),
  all TRANSFORMs the daemon runs once. Restore replays ``is_w4a16_nvfp4`` (linear) and
  the input scales' empty slots and the resolved backend (MoE), then the vLLM side
  rebuilds the MoE kernel objects (``wcache.vllm.moe.KERNELS``).
"""

from __future__ import annotations

import functools

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.marlin import MARLIN_MIN_CAPABILITY
from wcache.plans.registry import register
from wcache.stages import marlin, marlin_fp4, moe, nvfp4

#: CUTLASS FP4 GEMMs and CutlassExpertsFp4 need capability families 10, 11 or 12.
CUTLASS_FP4_MIN_CAPABILITY = (10, 0)
#: The NVFP4 MoE backend (``NvFp4MoeBackend``) the MoE plan covers.
CUTLASS_MOE_BACKEND = "VLLM_CUTLASS"
#: The NVFP4 MoE backend and experts class the Marlin MoE plan covers.
MARLIN_MOE_BACKEND = "MARLIN"
MARLIN_MOE_EXPERTS = "MarlinExperts"


def _reason(config: LayerConfig, target: Target, kind: str) -> str | None:
    if target.device_type != "cuda":
        return f"CUTLASS NVFP4 is a CUDA kernel; the target is {target.device_type}"
    if target.capability is None or tuple(target.capability) < CUTLASS_FP4_MIN_CAPABILITY:
        return (
            f"CUTLASS NVFP4 needs compute capability >= 10.0 (Blackwell), the target has "
            f"{target.capability}; vLLM uses Marlin NVFP4 there (kernel 'marlin' / 'marlin_moe')"
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
        # vLLM passes the loaded parameters themselves (or views keeping their
        # attributes) to replace_parameter.
        # Source: vllm/model_executor/layers/quantization/modelopt.py::
        # ModelOptNvFp4FusedMoE.process_weights_after_loading
        reregistered=dict.fromkeys(
            ("w13_weight", "w2_weight", "w2_input_scale", "w2_weight_scale_2"),
            Reregistration.REPLACE_OWN,
        ),
        description="ModelOpt NVFP4 fused MoE on CUTLASS experts: w13 global scale, a13 max, "
        "scales swizzled, activation scales fused into w*_weight_scale_2 as new "
        "tensors (vLLM: in place); restore replays only the dims.",
    )
)


def _marlin_reason(config: LayerConfig, target: Target, kind: str) -> str | None:
    if target.device_type != "cuda":
        return f"Marlin NVFP4 is a CUDA kernel; the target is {target.device_type}"
    if target.capability is not None and tuple(target.capability) < MARLIN_MIN_CAPABILITY:
        return f"Marlin needs compute capability >= 7.5, the target has {target.capability}"
    if config.quant.layer_kind != kind:
        return f"this plan covers {kind} layers, not {config.quant.layer_kind}"
    if config.moe is not None:
        moe_cfg = config.moe
        if moe_cfg.backend != MARLIN_MOE_BACKEND:
            return (
                f"vLLM's NVFP4 MoE oracle resolved backend {moe_cfg.backend} here; this plan "
                f"covers {MARLIN_MOE_BACKEND} (MarlinExperts) only"
            )
        if moe_cfg.experts != MARLIN_MOE_EXPERTS:
            return (
                f"vLLM picked experts {moe_cfg.experts!r} on backend {MARLIN_MOE_BACKEND}; "
                f"this plan covers {MARLIN_MOE_EXPERTS!r}"
            )
        try:
            marlin_fp4.nvfp4_moe_padded_intermediate(
                moe_cfg.hidden_size, moe_cfg.intermediate_size_per_partition
            )
        except marlin_fp4.MarlinFp4LayoutError as exc:
            return str(exc)
    elif config.size_k % marlin_fp4.NVFP4_GROUP_SIZE:
        return f"NVFP4 needs size_k divisible by {marlin_fp4.NVFP4_GROUP_SIZE}, got {config.size_k}"
    return None


MARLIN_LINEAR = register(
    Plan(
        method="modelopt_fp4",
        kernel="marlin",
        devices="cuda",
        stages=(
            nvfp4.validate_loaded,
            nvfp4.reduce_weight_scale_2,
            nvfp4.reduce_input_scale,
            nvfp4.compute_alpha,
            nvfp4.set_is_w4a16_nvfp4,
            marlin_fp4.repack_weight,
            marlin_fp4.process_scales,
            marlin.permute_bias,
        ),
        checkpoint=frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"}),
        match=functools.partial(_marlin_reason, kind="linear"),
        description="ModelOpt NVFP4 linear on Marlin (MarlinNvFp4LinearKernel, weight-only; "
        "what vLLM runs on sm90): global scales and alpha as for CUTLASS, weight "
        "repacked (Kp/16, 2Np) int32, block scales permuted and re-encoded as "
        "FP8-S0E5M3 with the global scale rescaled to match, bias padded and permuted.",
    )
)

MARLIN_MOE = register(
    Plan(
        method="modelopt_fp4",
        kernel="marlin_moe",
        devices="cuda",
        stages=(
            nvfp4.select_w13_weight_scale_2,
            marlin_fp4.drop_moe_input_scales,
            marlin_fp4.clear_moe_input_scales,
            marlin_fp4.repack_moe_weights,
            marlin_fp4.process_moe_scales,
            moe.set_experts_kernel,
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
        match=functools.partial(_marlin_reason, kind="moe"),
        description="ModelOpt NVFP4 fused MoE on Marlin (MARLIN backend, MarlinExperts; what "
        "vLLM runs on sm90): w13 global scale, intermediate padded to Marlin's tile, "
        "experts repacked, block scales re-encoded with one rescale per projection, "
        "activation scales dropped (empty slots replayed); restore rebuilds vLLM's "
        "MoE kernel objects (METADATA).",
    )
)
