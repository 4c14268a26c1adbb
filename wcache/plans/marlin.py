"""Marlin plans (CUDA): AWQ int4, GPTQ symmetric int4/int8, compressed-tensors W4A16.

Kernel id ``"marlin"``. The layout is the 16-bit-activation Marlin layout;
activation overrides (``marlin_input_dtype`` int8/fp8, from the QuantSpec option or
``VLLM_MARLIN_INPUT_DTYPE`` in the Target) change the layout and are refused.
Fused-MoE layers have their own plans (:mod:`wcache.plans.marlin_moe`).

Nothing but ``layer.input_global_scale = None`` is replayed on restore: vLLM's
``apply`` derives the padded extents from the repacked weight's shape and the
logical ``(K, N)`` from the kernel config built at ``create_weights``.
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import awq, marlin

#: Marlin runs on compute capability 7.5 and newer (``is_fp8_marlin_supported``, and
#: ``query_marlin_supported_quant_types`` for integer weights).
MARLIN_MIN_CAPABILITY = (7, 5)
#: Activation dtypes that switch Marlin to its 8-bit-activation layout.
REFUSED_INPUT_DTYPES = frozenset({"int8", "fp8"})
_CHECKPOINT_GPTQ = frozenset({"qweight", "qzeros", "scales", "bias"})
_CHECKPOINT_CT = frozenset(
    {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "bias"}
)


def marlin_target_reason(config: LayerConfig, target: Target) -> str | None:
    """Why Marlin cannot run ``config`` on ``target`` (None when it can): CUDA sm75+,
    linear layers, 16-bit activations. Shared by the FP8 and MXFP8 Marlin plans."""
    if target.device_type != "cuda":
        return f"Marlin is a CUDA kernel; the target is {target.device_type}"
    if target.capability is not None and tuple(target.capability) < MARLIN_MIN_CAPABILITY:
        return f"Marlin needs compute capability >= 7.5, the target has {target.capability}"
    if config.quant.layer_kind == "moe":
        return (
            f"{config.quant.method} is a linear-layer method; fused-MoE layers on Marlin "
            f"have their own plans (awq_moe, gptq_moe, ct_w4a16_moe: "
            f"wcache.plans.marlin_moe), which wcache's vLLM adapter picks for vLLM's MoE "
            f"methods; give a QuantSpec with the MoE method"
        )
    act = config.quant.option("marlin_input_dtype") or target.env_value(
        "VLLM_MARLIN_INPUT_DTYPE", ""
    )
    if act in REFUSED_INPUT_DTYPES:
        return (
            f"Marlin with {act} activations (marlin_input_dtype={act!r}) uses a "
            f"different layout that wcache does not build; unset the override"
        )
    if config.quant.layer_kind != "linear":
        return f"Marlin plans cover linear layers, not {config.quant.layer_kind}"
    return None


def _int_reason(config: LayerConfig, target: Target, bits: tuple[int, ...]) -> str | None:
    reason = marlin_target_reason(config, target)
    if reason is not None:
        return reason
    q = config.quant
    if q.num_bits not in bits:
        return f"{q.method} on Marlin supports {bits}-bit weights, not {q.num_bits}"
    if q.group_size not in marlin.MARLIN_SUPPORTED_GROUP_SIZES:
        return (
            f"Marlin supports group sizes {marlin.MARLIN_SUPPORTED_GROUP_SIZES}, not {q.group_size}"
        )
    if q.group_size > 0 and config.size_k % q.group_size:
        return f"size_k={config.size_k} is not a multiple of group_size={q.group_size}"
    return None


def _match_awq(config: LayerConfig, target: Target) -> str | None:
    if not config.quant.zero_point:
        return "AWQ checkpoints carry zero points (zero_point=True)"
    return _int_reason(config, target, (4,))


def _match_gptq(config: LayerConfig, target: Target) -> str | None:
    if config.quant.zero_point:
        return "asymmetric GPTQ is not supported (vLLM GPTQ is symmetric)"
    return _int_reason(config, target, (4, 8))


def _match_ct(config: LayerConfig, target: Target) -> str | None:
    return _int_reason(config, target, (4, 8))


#: How vLLM's mixed-precision kernels re-register what they transform:
#: ``MPLinearKernel._transform_param`` passes ``Parameter(new.data)`` to layer_utils'
#: ``replace_parameter`` (a new plain Parameter in 0.32, the kept object in 0.33).
#: Source: vllm/model_executor/kernels/linear/mixed_precision/MPLinearKernel.py::_transform_param
_LAYER = Reregistration.REPLACE_LAYER

AWQ = register(
    Plan(
        method="awq",
        kernel="marlin",
        devices="cuda",
        stages=(
            awq.convert_to_standard,
            marlin.permute_zero_points_stage("qzeros"),
            marlin.repack_stage("qweight"),
            marlin.permute_scales_stage("scales"),
            marlin.clear_input_global_scale,
            marlin.permute_bias,
        ),
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match_awq,
        reregistered={"qweight": _LAYER, "qzeros": _LAYER, "scales": _LAYER},
        # where vLLM keeps them (0.33), as vLLM's AWQ conversion leaves them
        param_attrs=awq.STANDARD_PARAM_ATTRS,
        description="AWQ int4 on Marlin: AWQ packing -> standard, zero points permuted and "
        "packed (Kp/G, Np/8), weight repacked (Kp/16, 2Np), scales padded and "
        "permuted, bias padded and permuted.",
    )
)

GPTQ = register(
    Plan(
        method="gptq",
        kernel="marlin",
        devices="cuda",
        stages=(
            marlin.empty_zero_points_stage("qzeros"),
            marlin.repack_stage("qweight"),
            marlin.permute_scales_stage("scales"),
            marlin.clear_input_global_scale,
            marlin.permute_bias,
        ),
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match_gptq,
        # no zero points: vLLM registers an empty plain Parameter in their place
        reregistered={"qweight": _LAYER, "qzeros": Reregistration.NEW, "scales": _LAYER},
        description="GPTQ symmetric int4/int8 on Marlin: qzeros emptied, weight repacked "
        "(Kp/16, Np*bits/2), scales padded and permuted, bias padded and permuted.",
    )
)

CT_W4A16 = register(
    Plan(
        method="ct_w4a16",
        kernel="marlin",
        devices="cuda",
        stages=(
            marlin.permute_zero_points_stage("weight_zero_point", empty_if_symmetric=True),
            marlin.repack_stage("weight_packed", n_major=True),
            marlin.permute_scales_stage("weight_scale", n_major=True),
            marlin.clear_input_global_scale,
            marlin.permute_bias,
        ),
        checkpoint=_CHECKPOINT_CT,
        match=_match_ct,
        reregistered={
            "weight_packed": _LAYER,
            "weight_scale": _LAYER,
            "weight_zero_point": _LAYER,
            # marlin_permute_bias's result re-registered with the bias's own attributes
            "bias": Reregistration.REPLACE_OWN,
        },
        description="compressed-tensors W4A16 (sym/asym) on Marlin: (N, K/8) weight "
        "transposed and repacked, (N, K/G) scales transposed, padded, permuted; "
        "zero points permuted and packed (asym) or emptied (sym).",
    )
)
