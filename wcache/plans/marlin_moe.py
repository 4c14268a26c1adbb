"""Marlin fused-MoE plans (CUDA): AWQ, GPTQ (symmetric) and compressed-tensors W4A16
(group and channel) experts on vLLM's ``MARLIN`` WNA16 MoE backend.

What vLLM 0.32/0.33 select on sm90 by default: the WNA16 MoE oracle
(``oracle/int_wna16.py::select_wna16_moe_backend``) tries RDNA3 (gfx1100 only), then
FLASHINFER_TRTLLM (sm100 family, and no zero points or bias: AWQ and GPTQ declare
both), then ``MARLIN`` with ``MarlinExperts``. Kernel id ``"marlin"`` (the resolved
backend, :func:`wcache.plans.fused_moe.moe_kernel_id`); every plan's match checks the
backend and experts class again, so another resolution (BATCHED_MARLIN under EP
all-to-all, Humming, Triton, FlashInfer) is refused by name before a weight is read.

The daemon runs every repack once (:mod:`wcache.stages.marlin_moe`, all TRANSFORM);
restore replays only METADATA and VALIDATE: the repacked shapes checked against the
engine's layer, the resolved backend against the daemon's (``moe.set_experts_kernel``)
and, for GPTQ, the ``None`` slots of the expert biases the checkpoint did not hold. vLLM's kernel objects (``moe_quant_config``, ``moe_kernel``)
are rebuilt from the restored tensors by ``wcache.vllm.moe.KERNELS``. Nothing is
allocated after load (the Marlin workspace is per stream, at ``apply``).

Refused here: 8-bit activations (``VLLM_MARLIN_INPUT_DTYPE`` int8/fp8: another
layout), bits or group sizes Marlin MoE does not take. vLLM itself refuses GPTQ
act-order and asymmetric GPTQ when parsing the config (no plan is needed for them).
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.fused_moe import _match_cuda
from wcache.plans.marlin import MARLIN_MIN_CAPABILITY, REFUSED_INPUT_DTYPES
from wcache.plans.registry import register
from wcache.stages import marlin_moe as mm
from wcache.stages import moe
from wcache.stages.marlin import MARLIN_SUPPORTED_GROUP_SIZES

__all__ = ["MARLIN_MOE_METHODS", "MARLIN_EXPERTS", "AWQ_MOE", "GPTQ_MOE", "CT_W4A16_MOE"]

#: wcache's method ids of the Marlin MoE plans (``QuantSpec.method``).
MARLIN_MOE_METHODS = ("awq_moe", "gptq_moe", "ct_w4a16_moe")
#: The vLLM experts class these plans were checked against.
MARLIN_EXPERTS = "MarlinExperts"
#: Marlin MoE's hidden-size tile (``check_moe_marlin_supports_config``: never padded).
MARLIN_MOE_HIDDEN_TILE = 128


def _match(config: LayerConfig, target: Target, *, bits: tuple[int, ...]) -> str | None:
    """Why a Marlin MoE plan does not apply (None when it does)."""
    reason = _match_cuda(config, target, backend="MARLIN", experts=MARLIN_EXPERTS)
    if reason is not None:
        return reason
    if target.capability is not None and tuple(target.capability) < MARLIN_MIN_CAPABILITY:
        return f"Marlin needs compute capability >= 7.5, the target has {target.capability}"
    q = config.quant
    act = q.option("marlin_input_dtype")
    if act in REFUSED_INPUT_DTYPES:
        return (
            f"Marlin MoE with {act} activations (VLLM_MARLIN_INPUT_DTYPE={act}) uses another "
            f"layout (marlin_int4_fp8_preprocess / int8 scales) that wcache does not build; "
            f"unset VLLM_MARLIN_INPUT_DTYPE"
        )
    if q.num_bits not in bits:
        return f"{q.method} on Marlin MoE takes {bits}-bit weights, not {q.num_bits}"
    if q.group_size not in MARLIN_SUPPORTED_GROUP_SIZES:
        return f"Marlin MoE takes group sizes {MARLIN_SUPPORTED_GROUP_SIZES}, not {q.group_size}"
    if config.moe is not None and config.moe.hidden_size % MARLIN_MOE_HIDDEN_TILE:
        return f"Marlin MoE needs hidden_size % 128 == 0, got {config.moe.hidden_size}"
    return None


def _match_awq(config: LayerConfig, target: Target) -> str | None:
    if not config.quant.zero_point:
        return "AWQ MoE checkpoints carry zero points (zero_point=True)"
    return _match(config, target, bits=(4,))


def _match_gptq(config: LayerConfig, target: Target) -> str | None:
    if config.quant.zero_point:
        return "asymmetric GPTQ MoE is refused by vLLM (AutoGPTQConfig: sym=False)"
    return _match(config, target, bits=(4, 8))


def _match_ct(config: LayerConfig, target: Target) -> str | None:
    return _match(config, target, bits=(4, 8))


_GPTQ_NAMES = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros")
_CHECKPOINT_GPTQ = frozenset(_GPTQ_NAMES + mm.MOE_BIASES)
_CHECKPOINT_CT = frozenset(
    {
        "w13_weight_packed",
        "w2_weight_packed",
        "w13_weight_scale",
        "w2_weight_scale",
        "w13_weight_zero_point",
        "w2_weight_zero_point",
        "w13_weight_shape",
        "w2_weight_shape",
        *mm.MOE_BIASES,
    }
)


#: AutoAWQ/AutoGPTQ MoE post-load re-registers every tensor it converts through the
#: layer_utils ``replace_parameter`` (and ``_replace_or_register_parameter``).
#: Source: vllm/model_executor/layers/quantization/auto_awq.py,
#: auto_gptq.py::process_weights_after_loading
_AUTO_REREGISTERED = dict.fromkeys(
    (f"{w}_{t}" for w in ("w13", "w2") for t in ("qweight", "scales", "qzeros", "bias")),
    Reregistration.REPLACE_LAYER,
)


def _int_stages(layout: str, weights: tuple[str, str], scales: tuple[str, str], zeros, optional_zp):
    return (
        mm.repack_weights(layout, *weights),
        mm.permute_scales(layout, *scales),
        mm.permute_zero_points(layout, *zeros, optional=optional_zp),
        mm.permute_bias,
        mm.register_weight_aliases(*weights),
        mm.validate_repacked_shapes(*weights, *scales),
    )


AWQ_MOE = register(
    Plan(
        method="awq_moe",
        kernel="marlin",
        devices="cuda",
        stages=(
            *_int_stages(
                "awq",
                ("w13_qweight", "w2_qweight"),
                ("w13_scales", "w2_scales"),
                ("w13_qzeros", "w2_qzeros"),
                False,
            ),
            moe.set_experts_kernel,
        ),
        reregistered=_AUTO_REREGISTERED,
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match_awq,
        description="AWQ int4 fused MoE (AutoAWQMoEMethod) on vLLM's MARLIN backend "
        "(MarlinExperts, what vLLM resolves on sm90): the daemon pads the intermediate to "
        "Marlin's tile and repacks every expert once (awq_marlin_moe_repack), permutes "
        "scales and AWQ zero points; restore rebuilds vLLM's MoE kernel (METADATA).",
    )
)

GPTQ_MOE = register(
    Plan(
        method="gptq_moe",
        kernel="marlin",
        devices="cuda",
        stages=(
            mm.drop_unloaded_bias,
            *_int_stages(
                "gptq",
                ("w13_qweight", "w2_qweight"),
                ("w13_scales", "w2_scales"),
                ("w13_qzeros", "w2_qzeros"),
                False,
            ),
            mm.clear_unloaded_bias,
            moe.set_experts_kernel,
        ),
        reregistered=_AUTO_REREGISTERED,
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match_gptq,
        description="GPTQ symmetric int4/int8 fused MoE (AutoGPTQMoEMethod) on vLLM's MARLIN "
        "backend (MarlinExperts): the daemon pads the intermediate and repacks every "
        "expert once (gptq_marlin_moe_repack), permutes scales and zero points; expert "
        "biases the checkpoint lacks become None slots (replayed); restore rebuilds "
        "vLLM's MoE kernel (METADATA).",
    )
)

CT_W4A16_MOE = register(
    Plan(
        method="ct_w4a16_moe",
        kernel="marlin",
        devices="cuda",
        stages=(
            *_int_stages(
                "ct",
                ("w13_weight_packed", "w2_weight_packed"),
                ("w13_weight_scale", "w2_weight_scale"),
                ("w13_weight_zero_point", "w2_weight_zero_point"),
                True,
            ),
            moe.set_experts_kernel,
        ),
        checkpoint=_CHECKPOINT_CT,
        match=_match_ct,
        description="compressed-tensors W4A16/W8A16 fused MoE, group or channel, sym or asym "
        "(CompressedTensorsWNA16MoEMethod) on vLLM's MARLIN backend (MarlinExperts): the "
        "daemon transposes the N-first experts, pads the intermediate and repacks them "
        "once (gptq_marlin_moe_repack), permutes scales (and zero points); restore "
        "rebuilds vLLM's MoE kernel (METADATA).",
    )
)
