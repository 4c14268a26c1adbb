"""Canonical MXFP4 fused MoE (``quant_method: mxfp4``, vLLM's ``Mxfp4MoEMethod``) on
Marlin, and GPT-OSS MXFP4 refused by name.

What vLLM 0.33 resolves on sm90 (H200) for ``Mxfp4MoEMethod``
(``oracle/mxfp4.py::select_deepseek_v4_mxfp4_moe_backend``, priority list
``_get_priority_backends``): FlashInfer TRTLLM MXFP4xMXFP8 and DeepGEMM MXFP4 need
sm100; Humming is moved ahead of Marlin on sm90 (``prioritize_humming``) but only
where the optional ``humming`` package is installed, which the CUDA bundle
(tools/gpu/deps-vllm-0.33.0.txt) does not carry; so **MARLIN** (``MarlinExperts``).
Its post-load is ``prepare_moe_mxfp4_layer_for_marlin``: every expert repacked
(4-bit ``gptq_marlin_repack``), the E8M0 scales permuted and reordered, the bias
permuted (:mod:`wcache.stages.marlin_mx`); vLLM's ``ipc_cache`` refuses this backend
(its pre-processed branch raises unless FLASHINFER_TRTLLM_MXFP4_MXFP8).

GPT-OSS MXFP4 (``GptOssMxfp4MoEMethod``): on sm90 vLLM's GPT-OSS priority list puts
**TRITON** (OpenAI's ``triton_kernels``) ahead of Marlin, and vLLM's CUDA wheel ships
``triton_kernels`` as ``vllm.third_party.triton_kernels`` (``has_triton_kernels``),
which the bundle keeps (tools/gpu/build-bundle.sh removes only DeepGEMM and FMHA
sm100). That backend swizzles the experts into ``triton_kernels`` wrapper tensors
held as plain attributes and keeps the swizzled scales inside Python
``PrecisionConfig`` objects (``w13_weight_scale``/``w2_weight_scale`` deleted): not
named Parameters an arena can export, so it is refused by name before any weight is
read (:data:`GPT_OSS_TRITON_REASON`). On **MARLIN** (``--moe-backend marlin``, or
wherever vLLM falls back to it) GPT-OSS's post-load is the canonical one
(``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` calls the same
``prepare_moe_mxfp4_layer_for_marlin``; its biases are permuted too): the
``gpt_oss_mxfp4/marlin`` plan, the same stages under GPT-OSS's own method id (its own
kernel row: vLLM's GPT-OSS quant config carries the SwiGLU alpha/limit).
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.fused_moe import MARLIN_EXPERTS, UNPLANNED_BACKENDS
from wcache.plans.marlin import REFUSED_INPUT_DTYPES
from wcache.plans.registry import register
from wcache.stages import marlin_mx, moe

__all__ = [
    "MARLIN",
    "GPT_OSS_MARLIN",
    "MARLIN_BACKEND",
    "GPT_OSS_METHOD",
    "GPT_OSS_TRITON_REASON",
    "marlin_moe_reason",
]

#: The MXFP4 MoE backend (``Mxfp4MoeBackend``) the plan covers.
MARLIN_BACKEND = "MARLIN"
#: wcache's method id for vLLM's ``GptOssMxfp4MoEMethod``.
GPT_OSS_METHOD = "gpt_oss_mxfp4"
#: vLLM's GPT-OSS MXFP4 backends that hand the experts to OpenAI's triton_kernels.
GPT_OSS_TRITON_BACKENDS = frozenset({"TRITON", "TRITON_UNFUSED"})
#: Why the triton_kernels backends have no plan (plan_for's message).
GPT_OSS_TRITON_REASON = (
    "GPT-OSS MXFP4 experts (GptOssMxfp4MoEMethod) on vLLM's triton_kernels backend: "
    "vLLM 0.33 resolves TRITON on sm90 (OpenAI triton_kernels ships in vLLM's wheel as "
    "vllm.third_party.triton_kernels), whose post-load swizzles the experts into "
    "triton_kernels wrapper tensors held as plain attributes and moves the scales into "
    "Python PrecisionConfig objects (deleting w13/w2_weight_scale): nothing a weight "
    "arena can export as named tensors (vLLM's own ipc_cache refuses the method too). "
    "wcache plans GPT-OSS MXFP4 on Marlin only: serve with --moe-backend marlin (on the "
    "daemon and every engine), or load this model without wcache (load_format='auto')"
)

_CHECKPOINT = frozenset(
    {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias"}
)


def marlin_moe_reason(
    config: LayerConfig, target: Target, experts: str = MARLIN_EXPERTS
) -> str | None:
    """Why a Marlin MoE plan does not fit: not CUDA, not a MoE layer, another resolved
    backend or experts class, or an 8-bit Marlin activation override
    (``VLLM_MARLIN_INPUT_DTYPE``, read from the Target's environment as the dense
    Marlin plans do: int8/fp8 activations change the layout and scales)."""
    if target.device_type != "cuda":
        return f"Marlin MoE is a CUDA kernel; the target is {target.device_type!r}"
    moe_cfg = config.moe
    if config.quant.layer_kind != "moe" or moe_cfg is None:
        return f"this plan covers fused-MoE layers, not {config.quant.layer_kind} layers"
    if moe_cfg.backend != MARLIN_BACKEND:
        why = UNPLANNED_BACKENDS.get(moe_cfg.backend, "has no wcache plan")
        return (
            f"vLLM's MoE oracle resolved backend {moe_cfg.backend} here, whose post-load "
            f"{why}; this plan covers {MARLIN_BACKEND} only"
        )
    if moe_cfg.experts != experts:
        return f"vLLM picked experts {moe_cfg.experts!r}; this plan covers {experts!r}"
    act = config.quant.option("marlin_input_dtype") or target.env_value(
        "VLLM_MARLIN_INPUT_DTYPE", ""
    )
    if act in REFUSED_INPUT_DTYPES:
        return (
            f"Marlin MoE with {act} activations (VLLM_MARLIN_INPUT_DTYPE={act}) uses "
            f"another weight and scale layout that wcache does not build; unset it"
        )
    return None


MARLIN = register(
    Plan(
        method="mxfp4_moe",
        kernel="marlin",
        devices="cuda",
        stages=(
            marlin_mx.repack_mxfp4_experts,
            marlin_mx.permute_mxfp4_expert_scales,
            marlin_mx.permute_expert_bias,
            moe.set_experts_kernel,
        ),
        checkpoint=_CHECKPOINT,
        match=marlin_moe_reason,
        description="Canonical MXFP4 fused MoE (Mxfp4MoEMethod, quant_method mxfp4) on vLLM's "
        "MARLIN backend (MarlinExperts; what vLLM 0.33 resolves on sm90 without "
        "FlashInfer or Humming): the daemon repacks every expert (4-bit "
        "gptq_marlin_repack), permutes and reorders the E8M0 scales and permutes the "
        "bias, once; restore rebuilds vLLM's MoE kernel objects (METADATA).",
    )
)


def _gpt_oss_reason(config: LayerConfig, target: Target) -> str | None:
    """:func:`marlin_moe_reason`, naming the triton_kernels swizzle for its backends."""
    if config.moe is not None and config.moe.backend in GPT_OSS_TRITON_BACKENDS:
        return GPT_OSS_TRITON_REASON
    return marlin_moe_reason(config, target)


GPT_OSS_MARLIN = register(
    Plan(
        method=GPT_OSS_METHOD,
        kernel="marlin",
        devices="cuda",
        stages=MARLIN.stages,
        checkpoint=_CHECKPOINT,
        match=_gpt_oss_reason,
        description="GPT-OSS MXFP4 fused MoE (GptOssMxfp4MoEMethod) on vLLM's MARLIN backend "
        "(--moe-backend marlin; vLLM's sm90 default is triton_kernels, refused by name): "
        "the canonical MXFP4 Marlin stages (every expert repacked, E8M0 scales permuted, "
        "biases permuted), once; restore rebuilds vLLM's MoE kernel objects (METADATA).",
    )
)
