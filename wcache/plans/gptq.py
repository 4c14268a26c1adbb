"""GPTQ symmetric int4 (``uint4b8``) on vLLM's CPUWNA16 kernel. GPTQ int8 has no
CPU kernel in vLLM and is refused."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import cpu_wna16, gptq

#: GPTQ int8 (uint8b128) exists in checkpoints but not among vLLM's CPU kernels.
GPTQ_INT8_BITS = 8


def _match(config: LayerConfig, target: Target) -> str | None:
    if config.quant.zero_point:
        return "asymmetric GPTQ is not supported (vLLM GPTQ is symmetric)"
    if target.device_type == "cpu" and config.quant.num_bits == GPTQ_INT8_BITS:
        return ("GPTQ int8 on CPU: vLLM has no CPU kernel for uint8b128 "
                "(verify_marlin_supported raises); load it on CUDA")
    return cpu_wna16.can_implement(config, target)


CPU_WNA16 = register(Plan(
    method="gptq", kernel="cpu_wna16", devices="cpu",
    stages=(gptq.drop_zero_points, gptq.clear_zero_points, cpu_wna16.set_use_w4a8,
            cpu_wna16.set_isa_hint("scales"), cpu_wna16.repack("qweight")),
    checkpoint={"qweight", "qzeros", "scales", "bias"}, match=_match,
    description="GPTQ symmetric int4 on CPU (cpu_gemm_wna16, w4a16 layout): the unused "
                "qzeros slot is emptied, the weight repacked (K/8, N) -> (N/16, 2K). "
                "Restore replays isa_hint/use_w4a8 and checks them against the record."))
