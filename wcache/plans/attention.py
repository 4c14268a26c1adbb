"""Attention layers whose KV cache is not quantized (no KV-cache quant method)."""

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import refuse, register
from wcache.stages import attention as a


def _match(config: LayerConfig, target: Target) -> str | None:
    if config.quant.layer_kind != "attention":
        return "not an attention layer"
    if not config.get("impl_postload_noop", True):
        return (
            "the attention backend's impl.process_weights_after_loading does work "
            "wcache has no stages for; load without wcache"
        )
    return None


ATTENTION = register(
    Plan(
        method="attention",
        kernel="default",
        devices=("cpu", "cuda"),
        stages=(
            a.set_default_scales,
            a.set_scale_floats,
            a.copy_host_scales,
            a.alloc_kv_cache_placeholder,
        ),
        checkpoint=frozenset(a.SCALE_BUFFERS),
        match=_match,
        description="Attention without KV-cache quantization: scale buffers set to 1.0 by the "
        "daemon; floats, host copies and the kv_cache placeholder replayed.",
    )
)


# Attention layers whose deferred post-load work (vLLM runs it after every quant
# method, ``is_deferred_attention_layer``) has no plan: refused before any weight
# is read; the adapter maps them to these methods.
refuse(
    "mla_attention",
    "MLA attention derives W_UK_T / W_UV from kv_b_proj after load "
    "(vllm/model_executor/layers/attention/mla_attention.py::MLAAttention."
    "process_weights_after_loading: dequantize, split, transpose); wcache has no plan "
    "for it. Load this model without wcache (load_format='auto')",
)
refuse(
    "mm_encoder_attention_fp8",
    "multimodal-encoder attention with FP8 populates its scale buffers after load "
    "(vllm/model_executor/layers/attention/mm_encoder_attention.py::MMEncoderAttention."
    "process_weights_after_loading); wcache has no plan for it. Load this model without "
    "wcache, or without FP8 encoder attention",
)
