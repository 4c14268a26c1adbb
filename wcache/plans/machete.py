"""Machete plans (CUDA sm90): AWQ int4, GPTQ symmetric int4/int8 and compressed-tensors
W4A16 (sym/asym, group and channel) on ``MacheteLinearKernel``, the kernel vLLM 0.32's
``choose_mp_linear_kernel`` picks on Hopper wherever Machete's shape rule holds.

Kernel id ``"machete"``: the plan is chosen only when vLLM chose Machete for the layer
(the adapter reads ``quant_method.kernel`` / ``scheme.kernel``; wcache does not
re-derive vLLM's choice). The prepack is the TRANSFORM the daemon runs; nothing is
replayed on restore (see :mod:`wcache.stages.machete`).
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import awq, machete

#: Machete runs on sm90 only (``MacheteLinearKernel.can_implement``:
#: ``is_device_capability(90)``).
MACHETE_CAPABILITY = (9, 0)
_CHECKPOINT_GPTQ = frozenset({"qweight", "qzeros", "scales", "bias"})
_CHECKPOINT_CT = frozenset(
    {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "bias"}
)


def _match(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cuda":
        return f"Machete is a CUDA kernel; the target is {target.device_type}"
    if target.capability is not None and tuple(target.capability) != MACHETE_CAPABILITY:
        return f"Machete runs on sm90 (Hopper) only, the target has {target.capability}"
    if config.quant.layer_kind != "linear":
        return f"Machete plans cover linear layers, not {config.quant.layer_kind}"
    if config.quant.kernel != "machete":
        return (
            "Machete is vLLM's choice per layer on Hopper; wcache takes it from the "
            "layer (kernel='machete'), it does not guess it"
        )
    if config.get(machete.B_TYPE_ID_KEY) is None:
        return (
            f"the layer config lacks {machete.B_TYPE_ID_KEY} (vLLM's weight type id, "
            "recorded by the adapter from the MacheteLinearKernel)"
        )
    return None


def _match_gptq(config: LayerConfig, target: Target) -> str | None:
    if config.quant.zero_point:
        return "asymmetric GPTQ is not supported (vLLM's AutoGPTQLinearMethod is symmetric)"
    return _match(config, target)


#: How vLLM's mixed-precision kernels re-register what they transform:
#: ``MPLinearKernel._transform_param`` passes ``Parameter(new.data)`` to layer_utils'
#: ``replace_parameter`` (a new plain Parameter in 0.32, the kept object in 0.33).
#: Source: vllm/model_executor/kernels/linear/mixed_precision/MPLinearKernel.py::_transform_param
_LAYER = Reregistration.REPLACE_LAYER

AWQ = register(
    Plan(
        method="awq",
        kernel="machete",
        devices="cuda",
        stages=(
            awq.convert_to_standard,
            machete.prepack_stage("qweight"),
            machete.fold_zero_points_stage("qzeros", "scales"),
        ),
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match,
        reregistered={"qweight": _LAYER, "qzeros": _LAYER, "scales": _LAYER},
        # where vLLM keeps them (0.33), as vLLM's AWQ conversion leaves them
        param_attrs=awq.STANDARD_PARAM_ATTRS,
        description="AWQ int4 on Machete (sm90): AWQ packing -> standard, weight prepacked "
        "(machete_prepack_B), zero points folded into -scale * zp [K/G, N].",
    )
)

GPTQ = register(
    Plan(
        method="gptq",
        kernel="machete",
        devices="cuda",
        stages=(machete.prepack_stage("qweight"),),
        checkpoint=_CHECKPOINT_GPTQ,
        match=_match_gptq,
        reregistered={"qweight": _LAYER, "scales": _LAYER},
        description="GPTQ symmetric int4/int8 on Machete (sm90): weight prepacked "
        "(machete_prepack_B); scales and qzeros kept as loaded.",
    )
)

CT_W4A16 = register(
    Plan(
        method="ct_w4a16",
        kernel="machete",
        devices="cuda",
        stages=(
            machete.prepack_stage("weight_packed", n_major=True),
            machete.permute_scales_stage("weight_scale"),
            machete.fold_zero_points_stage("weight_zero_point", "weight_scale"),
        ),
        checkpoint=_CHECKPOINT_CT,
        match=_match,
        reregistered={"weight_packed": _LAYER, "weight_scale": _LAYER, "weight_zero_point": _LAYER},
        description="compressed-tensors W4A16 (sym/asym) on Machete (sm90): (N, K/8) weight "
        "transposed and prepacked, (N, K/G) scales transposed, zero points (asym) "
        "folded into -scale * zp.",
    )
)
