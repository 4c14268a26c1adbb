"""Online MXFP8 on Marlin (CUDA sm75+, the H200 choice in vLLM 0.32)."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.marlin import marlin_target_reason
from wcache.plans.registry import register
from wcache.stages import fp8, marlin, mxfp8


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
