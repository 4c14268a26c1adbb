"""MXFP8 linear on Marlin (CUDA sm80+; what vLLM 0.32/0.33 pick on the H200): online
(``quantization="mxfp8"`` on a bf16 checkpoint, ``Mxfp8OnlineLinearMethod``) and
serialized (ModelOpt ``quant_algo: MXFP8``, ``ModelOptLinearMethod`` with weight scheme
``KMxfp8Static``).

On sm90 vLLM 0.33's MXFP8 kernel list (``_POSSIBLE_MXFP8_KERNELS``) tries FlashInfer
CuTe-DSL and CUTLASS MXFP8 (sm100 only) and then ``MarlinMxfp8LinearKernel``; its
post-load is ``prepare_mxfp8_layer_for_marlin`` (the serialized checkpoint's ModelOpt
steps before it only validate). Both plans share the Marlin stages; the online plan
quantizes first.
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.marlin import marlin_target_reason
from wcache.plans.registry import register
from wcache.stages import fp8, marlin, mxfp8, nvfp4


def _match(config: LayerConfig, target: Target) -> str | None:
    reason = marlin_target_reason(config, target)
    if reason is not None:
        return reason
    if config.size_k % mxfp8.MXFP8_BLOCK_SIZE:
        return f"MXFP8 needs size_k divisible by {mxfp8.MXFP8_BLOCK_SIZE}, got {config.size_k}"
    return None


MARLIN = register(
    Plan(
        method="mxfp8",
        kernel="marlin",
        devices="cuda",
        stages=(
            mxfp8.quantize,
            fp8.clear_input_scale,
            marlin.repack_mxfp8_weight,
            marlin.permute_mxfp8_scales,
            marlin.permute_bias,
        ),
        checkpoint=frozenset({"weight", "bias"}),
        match=_match,
        description="online MXFP8 on Marlin: quantize (fp8 values, E8M0 scale per 32), weight "
        "repacked (Kp/16, 4Np), scales (Kp/32, Np) e8m0 permuted and reordered, "
        "bias padded and permuted.",
    )
)

MODELOPT_MARLIN = register(
    Plan(
        method="modelopt_mxfp8",
        kernel="marlin",
        devices="cuda",
        stages=(
            nvfp4.set_is_w4a16_nvfp4,
            marlin.repack_mxfp8_weight,
            marlin.permute_mxfp8_scales,
            marlin.permute_bias,
        ),
        checkpoint=frozenset({"weight", "weight_scale", "bias"}),
        match=_match,
        description="serialized ModelOpt MXFP8 linear (fp8 values, E8M0 scale per 32) on "
        "Marlin: weight repacked (Kp/16, 4Np), scales (Kp/32, Np) e8m0 permuted and "
        "reordered, bias padded and permuted; is_w4a16_nvfp4 = False as ModelOpt's "
        "linear method sets it.",
    )
)
