"""KV-cache scales of attention layers (vLLM's BaseKVCacheMethod)."""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import kv_cache


def _match(config: LayerConfig, target: Target) -> str | None:
    if target.device_type not in ("cpu", "cuda"):
        return f"needs a CPU or CUDA target (no FNUZ fp8), got {target.device_type!r}"
    return None


SCALES = register(Plan(
    method="kv_cache", kernel="scales",
    stages=(kv_cache.select_scales, kv_cache.set_scale_floats),
    checkpoint=set(kv_cache.SCALE_PARAMS + kv_cache.SCALE_BUFFERS), match=_match,
    description="KV-cache scales: the daemon computes the final _k/_v/_q/_prob_scale "
                "buffers and drops the checkpoint scale parameters; restore is "
                "METADATA-only (floats and host copies from the exported buffers, "
                "recorded and checked), like vLLM's pre-processed branch."))
