"""KV-cache scales of an attention layer (vLLM's ``BaseKVCacheMethod``).

Checkpoint: Parameters ``k_scale``, ``v_scale``, ``q_scale``, ``prob_scale`` (0-d,
``-1.0`` when absent from the checkpoint) and the Attention layer's buffers
``_k_scale``, ``_v_scale``, ``_q_scale``, ``_prob_scale`` (0-d fp32, 1.0 at init).

The TRANSFORM computes the final buffers as **new** tensors (vLLM ``copy_``s in
place) and drops the four Parameters. The METADATA replay follows vLLM's own
pre-processed branch: Python floats and host copies are rebuilt from the
exported buffers, never written back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.common import StageInputError

__all__ = [
    "SCALE_PARAMS",
    "SCALE_BUFFERS",
    "is_quantized_kv_cache",
    "uses_per_token_head_scales",
    "written_buffers",
    "select_scales",
    "set_scale_floats",
    "final_scale_values",
]

_SOURCE = (
    "vllm/model_executor/layers/quantization/kv_cache.py::"
    "BaseKVCacheMethod.process_weights_after_loading"
)

SCALE_PARAMS = ("k_scale", "v_scale", "q_scale", "prob_scale")
SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
#: vLLM's default when a checkpoint scale is missing (the -1.0 sentinel).
DEFAULT_SCALE = 1.0
PER_TOKEN_HEAD_SUFFIX = "_per_token_head"


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """Source: vllm/utils/torch_utils.py::is_quantized_kv_cache."""
    return (
        kv_cache_dtype.startswith("fp8")
        or kv_cache_dtype.endswith(PER_TOKEN_HEAD_SUFFIX)
        or kv_cache_dtype.startswith("nvfp4")
    )


def uses_per_token_head_scales(kv_cache_dtype: str) -> bool:
    """Source: vllm/v1/kv_cache_interface.py::kv_cache_uses_per_token_head_scales."""
    return kv_cache_dtype in ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head")


def written_buffers(kv_cache_dtype: str) -> tuple[str, ...]:
    """The buffers vLLM overwrites for ``kv_cache_dtype`` (independent of the values)."""
    if uses_per_token_head_scales(kv_cache_dtype):
        return ("_k_scale", "_v_scale")
    if is_quantized_kv_cache(kv_cache_dtype):
        return SCALE_BUFFERS
    return ("_q_scale", "_prob_scale")


def final_scale_values(
    params: Mapping[str, torch.Tensor], kv_cache_dtype: str
) -> dict[str, float | torch.Tensor | None]:
    """The values vLLM copies into ``_k/_v/_q/_prob_scale`` (``None``: left as is).

    Raises:
        StageInputError: non-scalar scales (vLLM raises ValueError too), or only
            ``v_scale`` set on a quantized cache (vLLM asserts).

    Source: BaseKVCacheMethod.process_weights_after_loading (non-FNUZ platforms).
    """
    if uses_per_token_head_scales(kv_cache_dtype):
        return {
            "_k_scale": DEFAULT_SCALE,
            "_v_scale": DEFAULT_SCALE,
            "_q_scale": None,
            "_prob_scale": None,
        }
    out: dict[str, Any] = {"_k_scale": None, "_v_scale": None}
    k, v, q, p = (params[n] for n in SCALE_PARAMS)
    if is_quantized_kv_cache(kv_cache_dtype):
        # tolist() of a 0-d scale is a float, of a [n] one a list (refused below)
        k_scale: float | list[Any]
        v_scale: float | list[Any]
        if k > 0.0 and v > 0.0:
            k_scale, v_scale = k.to("cpu").tolist(), v.to("cpu").tolist()
        elif k < 0.0 and v < 0.0:
            k_scale = v_scale = DEFAULT_SCALE
        else:
            if not k > 0.0:
                raise StageInputError(
                    "KV-cache scales: v_scale is set but k_scale is not; a single "
                    "checkpoint kv_scale must load into k_scale (vLLM asserts this)"
                )
            dup = max(k, v)
            k_scale, v_scale = dup.to("cpu").tolist(), dup.to("cpu").tolist()
        if not isinstance(k_scale, float) or not isinstance(v_scale, float):
            raise StageInputError(
                "Only per-tensor KV-cache scales are supported "
                "(vLLM: 'Only support per-tensor scaling factor')"
            )
        out["_k_scale"], out["_v_scale"] = k_scale, v_scale
    q_scale = q if q > 0.0 else DEFAULT_SCALE
    prob_scale = p if p > 0.0 else DEFAULT_SCALE
    for x in (q_scale, prob_scale):
        if isinstance(x, torch.Tensor) and (x.numel() != 1 or not x.is_floating_point()):
            raise StageInputError("Only per-tensor q/prob scales are supported")
    out["_q_scale"], out["_prob_scale"] = q_scale, prob_scale
    return out


@stage(
    "kv_cache.select_scales",
    Tag.TRANSFORM,
    reads=SCALE_PARAMS + SCALE_BUFFERS,
    writes=SCALE_PARAMS + SCALE_BUFFERS,
    drops=SCALE_PARAMS,
    source=_SOURCE,
)
def select_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """New 0-d fp32 buffers ``_k/_v/_q/_prob_scale`` with vLLM's final values; drops
    the four checkpoint Parameters. ``kv_cache_dtype`` comes from ``config.extra``."""
    kv_dtype = config.get("kv_cache_dtype", "auto")
    if any(tensors[n].device.type == "meta" for n in SCALE_PARAMS):
        # which buffers change depends on the dtype only; their values need data
        return StageOut(
            tensors={n: torch.empty_like(tensors[n]) for n in written_buffers(kv_dtype)},
            buffers=frozenset(written_buffers(kv_dtype)),
            drop=SCALE_PARAMS,
        )
    values = final_scale_values(tensors, kv_dtype)
    new = {}
    for name, value in values.items():
        if value is None:
            continue
        buf = tensors[name]
        new[name] = (
            value.to(buf.dtype).reshape(buf.shape).clone()
            if isinstance(value, torch.Tensor)
            else torch.full_like(buf, value)
        )
    return StageOut(tensors=new, buffers=frozenset(new), drop=SCALE_PARAMS)


@stage(
    "kv_cache.set_scale_floats",
    Tag.METADATA,
    reads=SCALE_BUFFERS[:3],
    attrs=("_k_scale_float", "_v_scale_float", "_q_scale_float", "_k_scale_cpu", "_v_scale_cpu"),
    source=f"{_SOURCE} (is_weights_pre_processed branch)",
)
def set_scale_floats(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``_k/_v/_q_scale_float`` via ``.item()`` and fresh host copies
    ``_k/_v_scale_cpu`` of the final buffers (never aliases of shared bytes).
    Floats are recorded, so a restore whose buffers differ fails loudly.
    ``_prob_scale_float`` is left alone, as in vLLM."""
    floats = {
        f"{n}_float": (tensors[n].item() if tensors[n].device.type != "meta" else None)
        for n in SCALE_BUFFERS[:3]
    }
    cpu = {f"{n}_cpu": _host_copy(tensors[n]) for n in ("_k_scale", "_v_scale")}
    return StageOut(attrs={**floats, **cpu}, record=floats)


# --------------------------------------------------------------------------- compressed-tensors

_CT_SOURCE = (
    "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py::"
    "CompressedTensorsKVCacheMethod.process_weights_after_loading"
)
CT_SCALE_PARAMS = ("k_scale", "v_scale", "q_scale")
CT_ZERO_POINTS = ("k_zero_point", "v_zero_point", "q_zero_point")
CT_BUFFERS = ("_k_scale", "_v_scale", "_q_scale")


@stage(
    "ct_kv_cache.register_scales",
    Tag.TRANSFORM,
    reads=CT_SCALE_PARAMS + CT_ZERO_POINTS + CT_BUFFERS,
    writes=CT_SCALE_PARAMS + CT_ZERO_POINTS + CT_BUFFERS,
    drops=CT_SCALE_PARAMS + CT_ZERO_POINTS,
    source=_CT_SOURCE,
)
def ct_register_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Buffers ``_k/_v/_q_scale`` become copies of the loaded ``k/v/q_scale``
    Parameters (``[n_scales]`` fp32: 1, or ``num_kv_heads`` for the attn_head
    strategy; vLLM registers ``.detach()`` views, which hold the same values), and
    the six checkpoint Parameters (scales and unused zero points) are dropped."""
    new = {f"_{n}": tensors[n].detach().clone() for n in CT_SCALE_PARAMS}
    return StageOut(tensors=new, buffers=frozenset(new), drop=CT_SCALE_PARAMS + CT_ZERO_POINTS)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of ``t`` (a meta tensor stays meta: it has no bytes)."""
    return t.detach().clone() if t.device.type == "meta" else t.detach().to("cpu").clone()


def _to_scalar(t: torch.Tensor) -> float | None:
    """vLLM's ``_to_scalar``: the max for multi-element scales (attn_head)."""
    if t.device.type == "meta":
        return None
    return (t.max() if t.numel() > 1 else t).item()


@stage(
    "ct_kv_cache.set_scale_floats",
    Tag.METADATA,
    reads=CT_BUFFERS,
    attrs=("_k_scale_float", "_v_scale_float", "_q_scale_float"),
    source=_CT_SOURCE,
)
def ct_set_scale_floats(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``_k/_v/_q_scale_float`` from the exported buffers (max over heads), recorded."""
    floats = {f"{n}_float": _to_scalar(tensors[n]) for n in CT_BUFFERS}
    return StageOut(attrs=floats, record=floats)


@stage(
    "ct_kv_cache.copy_host_scales",
    Tag.DERIVE,
    reads=("_k_scale", "_v_scale"),
    attrs=("_k_scale_cpu", "_v_scale_cpu"),
    source=_CT_SOURCE,
)
def ct_copy_host_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Private 0-d fp32 host tensors holding the scalar scales (vLLM ``fill_``s the
    ``_k/_v_scale_cpu`` tensors it created at init)."""
    return StageOut(
        attrs={
            f"{n}_cpu": torch.empty((), dtype=torch.float32, device="meta")
            if tensors[n].device.type == "meta"
            else torch.tensor(_to_scalar(tensors[n]), dtype=torch.float32)
            for n in ("_k_scale", "_v_scale")
        }
    )
