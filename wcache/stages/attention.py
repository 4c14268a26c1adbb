"""Attention layers without a KV-cache quant method: default scales and host copies.

vLLM 0.32 ``Attention.process_weights_after_loading`` calls
``set_default_quant_scales(layer, register_buffer=False)``, which ``fill_``s the
four scale buffers in place (the one write into mapped memory the CPU prototype
caught) and sets host-side floats and CPU copies. Here the fill is a TRANSFORM
that returns new buffers (the daemon runs it), and everything host-side is
replayed from the exported buffers, never written back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage

#: The four scale buffers the Attention layer registers (all 0-d float32).
SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
#: Python floats vLLM keeps beside them, read by host-side backends.
SCALE_FLOATS = ("_q_scale_float", "_k_scale_float", "_v_scale_float", "_prob_scale_float")
#: Host copies vLLM keeps for backends that need scales on the CPU.
HOST_COPIES = ("_k_scale_cpu", "_v_scale_cpu")
#: vLLM's default scale when no KV-cache scales are loaded.
DEFAULT_SCALE = 1.0


@stage(
    "attention.set_default_scales",
    Tag.TRANSFORM,
    reads=SCALE_BUFFERS,
    writes=SCALE_BUFFERS,
    source="vllm attention.py::set_default_quant_scales (fill_ 1.0)",
)
def set_default_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """New 0-d float32 buffers holding 1.0, replacing ``_k/_v/_q/_prob_scale``.

    vLLM fills the existing buffers in place; returning new ones gives the same
    values without a write into the old storage.
    """
    out = {name: torch.full_like(tensors[name], DEFAULT_SCALE) for name in SCALE_BUFFERS}
    return StageOut(tensors=out, buffers=frozenset(SCALE_BUFFERS))


@stage(
    "attention.set_scale_floats",
    Tag.METADATA,
    reads=SCALE_BUFFERS,
    attrs=SCALE_FLOATS,
    source="vllm attention.py::set_default_quant_scales (host floats)",
)
def set_scale_floats(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``_q/_k/_v/_prob_scale_float`` as Python floats, recorded at prepare.

    Args:
        tensors: the four 0-d float32 buffers ``_k/_v/_q/_prob_scale``.
        recorded: the floats the daemon recorded; a restore reads them from here
            (no device sync, no ``.item()`` on mapped bytes). Load and prepare
            (nothing recorded) read the buffers; meta buffers give ``None``.

    Returns:
        ``attrs`` and ``record``: ``{"_q_scale_float": float, ...}`` (four floats).

    Source: vllm/model_executor/layers/attention/attention.py::set_default_quant_scales.
    """
    if recorded:
        values = {k: recorded[k] for k in SCALE_FLOATS}
    else:
        values = {
            f"{name}_float": (
                None if tensors[name].device.type == "meta" else float(tensors[name].item())
            )
            for name in SCALE_BUFFERS
        }
    values = {k: values[k] for k in SCALE_FLOATS}
    return StageOut(attrs=values, record=values)


@stage(
    "attention.copy_host_scales",
    Tag.DERIVE,
    reads=("_k_scale", "_v_scale"),
    attrs=HOST_COPIES,
    source="vllm attention.py::set_default_quant_scales (_k/_v_scale_cpu)",
)
def copy_host_scales(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Private 0-d float32 CPU copies ``_k_scale_cpu`` and ``_v_scale_cpu``."""
    return StageOut(
        attrs={
            f"{n}_cpu": (
                tensors[n].detach().clone()  # meta: no bytes to copy
                if tensors[n].device.type == "meta"
                else tensors[n].detach().to("cpu", copy=True)
            )
            for n in ("_k_scale", "_v_scale")
        }
    )


@stage(
    "attention.alloc_kv_cache_placeholder",
    Tag.ALLOCATE,
    attrs=("kv_cache",),
    source="vllm attention.py::Attention.__init__ (self.kv_cache = torch.tensor([]))",
)
def alloc_kv_cache_placeholder(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """An empty ``kv_cache`` placeholder on the target device (the model runner binds
    the real cache later); replaces the meta tensor a meta-device build leaves."""
    device = "cpu" if target.device_type in ("cpu", "meta") else target.device_type
    return StageOut(attrs={"kv_cache": torch.tensor([], device=device)})
