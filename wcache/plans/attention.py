"""Attention layers whose KV cache is not quantized (no KV-cache quant method)."""

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import attention as a


def _match(config: LayerConfig, target: Target) -> str | None:
    if config.quant.layer_kind != "attention":
        return "not an attention layer"
    if not config.get("impl_postload_noop", True):
        return ("the attention backend's impl.process_weights_after_loading does work "
                "wcache has no stages for; load without wcache")
    return None


ATTENTION = register(Plan(
    method="attention", kernel="default",
    stages=(a.set_default_scales, a.set_scale_floats, a.copy_host_scales,
            a.alloc_kv_cache_placeholder),
    checkpoint=frozenset(a.SCALE_BUFFERS),
    match=_match,
    description="Attention without KV-cache quantization: scale buffers set to 1.0 by the "
                "daemon; floats, host copies and the kv_cache placeholder replayed.",
))
