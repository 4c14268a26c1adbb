"""AutoAWQ int4 (GEMM format, with zero points) on vLLM's CPUWNA16 kernel."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import awq, cpu_wna16


def _match(config: LayerConfig, target: Target) -> str | None:
    if not config.quant.zero_point:
        return "AWQ without zero points is not supported (AutoAWQ GEMM has them)"
    return cpu_wna16.can_implement(config, target)


CPU_WNA16 = register(Plan(
    method="awq", kernel="cpu_wna16", devices="cpu",
    stages=(awq.convert_to_standard, cpu_wna16.transpose_zero_points("qzeros"),
            cpu_wna16.set_use_w4a8, cpu_wna16.set_isa_hint("scales"),
            cpu_wna16.repack("qweight")),
    checkpoint={"qweight", "qzeros", "scales", "bias"}, match=_match,
    description="AWQ int4 on CPU (cpu_gemm_wna16, w4a16 layout): AWQ nibble order "
                "to standard order packed along K, zero points to (K/G, N/8), weight "
                "to (N/16, 2K). Restore replays isa_hint/use_w4a8 from the Target and "
                "checks them against the daemon's recorded values."))
