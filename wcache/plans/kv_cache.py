"""KV-cache scales of attention layers (vLLM's BaseKVCacheMethod)."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import kv_cache
from wcache.stages.attention import alloc_kv_cache_placeholder


def _match(config: LayerConfig, target: Target) -> str | None:
    if target.device_type not in ("cpu", "cuda"):
        return f"needs a CPU or CUDA target (no FNUZ fp8), got {target.device_type!r}"
    return None


SCALES = register(
    Plan(
        method="kv_cache",
        kernel="scales",
        devices=("cpu", "cuda"),
        stages=(kv_cache.select_scales, kv_cache.set_scale_floats, alloc_kv_cache_placeholder),
        checkpoint=set(kv_cache.SCALE_PARAMS + kv_cache.SCALE_BUFFERS),
        match=_match,
        description="KV-cache scales: the daemon computes the final _k/_v/_q/_prob_scale "
        "buffers and drops the checkpoint scale parameters; restore is "
        "METADATA-only (floats and host copies from the exported buffers, "
        "recorded and checked), like vLLM's pre-processed branch.",
    )
)


CT_SCALES = register(
    Plan(
        method="ct_kv_cache",
        kernel="scales",
        devices=("cpu", "cuda"),
        stages=(
            kv_cache.ct_register_scales,
            kv_cache.ct_set_scale_floats,
            kv_cache.ct_copy_host_scales,
            alloc_kv_cache_placeholder,
        ),
        checkpoint=set(kv_cache.CT_SCALE_PARAMS + kv_cache.CT_ZERO_POINTS + kv_cache.CT_BUFFERS),
        match=_match,
        description="compressed-tensors KV-cache scales: the daemon registers the loaded "
        "k/v/q scales as the _k/_v/_q_scale buffers and drops the placeholders; "
        "restore rebuilds the floats (recorded), host copies and kv_cache placeholder.",
    )
)
