"""Machete layout stages (CUDA, sm90): the int4/int8 mixed-precision GEMM vLLM picks
on Hopper for AWQ, GPTQ and compressed-tensors W4A16 where its shape rule holds
(``MacheteLinearKernel.can_implement``: K % 64 == 0, N % 128 == 0, group size -1,
64 or 128).

vLLM's post-load work (``MacheteLinearKernel.process_weights_after_loading``):

* the packed weight, in ``[K / pf, N]`` order (packed along K, ``pf = 32 / bits``), is
  made column-major and handed to ``ops.machete_prepack_B(w, a_type, b_type,
  group_scales_type)``, a CUTLASS reorder into Machete's tiled layout (same shape,
  int32, contiguous): **the TRANSFORM the daemon runs** (:func:`prepack_stage`);
* scales become ``[K / G, N]`` contiguous (:func:`permute_scales_stage`, a transpose for
  compressed-tensors' ``[N, K / G]``; AWQ/GPTQ scales are already in that order);
* zero points (AWQ after its standard conversion, asymmetric compressed-tensors),
  standard-packed ``[N / pf, K / G]``, are unpacked and folded into the scales: ``-scale * zp`` in the scales' dtype,
  ``[K / G, N]`` (:func:`fold_zero_points_stage`).

Nothing is replayed on restore: ``apply_weights`` reads the three tensors by name and
the logical shapes and types from the kernel config built at ``create_weights``.

The prepack is the CUDA op ``torch.ops._C.machete_prepack_B`` of vLLM's kernel library
(present in a process that imported vLLM's CUDA build: the daemon). Its arguments
come from vLLM's own kernel config, recorded by the adapter in the layer config:
``machete_b_type_id`` (``MPLinearLayerConfig.weight_type.id``, vLLM's ScalarType id)
and ``machete_act_type`` (the activation dtype, also the group scales' type). On the
meta device the result is vLLM's own fake (``empty_like``, contiguous).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.common import StageInputError, require_op
from wcache.stages.packing import unpack_int32

__all__ = [
    "machete_prepack",
    "prepack_stage",
    "permute_scales_stage",
    "fold_zero_points_stage",
    "B_TYPE_ID_KEY",
    "ACT_TYPE_KEY",
]

#: LayerConfig extra keys the adapter fills from vLLM's MPLinearLayerConfig.
B_TYPE_ID_KEY = "machete_b_type_id"
ACT_TYPE_KEY = "machete_act_type"
_SOURCE = (
    "vllm.model_executor.kernels.linear.mixed_precision.machete."
    "MacheteLinearKernel.process_weights_after_loading"
)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StageInputError(f"machete: unknown activation dtype {name!r} in the layer config")
    return dtype


def machete_prepack(w_kn: torch.Tensor, config: LayerConfig) -> torch.Tensor:
    """Machete's prepacked weight from the standard packed ``w_kn`` ``[K / pf, N]``
    int32 (any strides; passed column-major, as vLLM does).

    Returns:
        ``[K / pf, N]`` int32, contiguous, in Machete's tiled order.

    Raises:
        OpUnavailable: vLLM's ``_C`` library (with ``machete_prepack_B``) is not
            loaded in this process.
        StageInputError: the layer config lacks the recorded kernel types.

    Source: ``MacheteLinearKernel.process_weights_after_loading`` (``transform_w_q``:
    ``ops.machete_prepack_B(x.t().contiguous().t(), a_type, b_type, a_type)``).
    """
    if w_kn.device.type == "meta":
        return torch.empty_like(w_kn, memory_format=torch.contiguous_format)
    b_type_id, act = config.get(B_TYPE_ID_KEY), config.get(ACT_TYPE_KEY)
    if b_type_id is None or act is None:
        raise StageInputError(
            f"layer {config.name!r}: the layer config has no "
            f"{B_TYPE_ID_KEY}/{ACT_TYPE_KEY} (recorded by the vLLM "
            "adapter from the layer's MacheteLinearKernel)"
        )
    op = require_op("_C", "machete_prepack_B")  # vLLM's CUDA build (the daemon, sm90)
    act_dtype = _dtype(act)
    return op(w_kn.t().contiguous().t(), act_dtype, int(b_type_id), act_dtype)


@stage(
    "machete.prepack",
    Tag.TRANSFORM,
    source=f"{_SOURCE} (permute_param_layout_ + ops.machete_prepack_B)",
    params=lambda w_q, n_major=False: {"reads": (w_q,), "writes": (w_q,)},
)
def prepack_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_q: str,
    n_major: bool,
) -> StageOut:
    """TRANSFORM ``w_q`` -> Machete's prepacked ``[K / pf, N]`` int32.

    Args:
        w_q: tensor name (``"qweight"``; ``"weight_packed"`` for compressed-tensors).
        n_major: the checkpoint stores ``[N, K / pf]`` (compressed-tensors,
            ``input_dim == 1``): transposed first (``permute_param_layout_``).
    """
    q = t[w_q].t() if n_major else t[w_q]
    return StageOut(tensors={w_q: machete_prepack(q, config)})


@stage(
    "machete.permute_scales",
    Tag.TRANSFORM,
    source=f"{_SOURCE} (transform_w_s: permute_param_layout_ + contiguous)",
    params=lambda w_s: {"reads": (w_s,), "writes": (w_s,)},
)
def permute_scales_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_s: str,
) -> StageOut:
    """TRANSFORM ``w_s`` ``[N, K / G]`` -> ``[K / G, N]`` contiguous (same dtype)."""
    return StageOut(tensors={w_s: t[w_s].t().contiguous()})


@stage(
    "machete.fold_zero_points",
    Tag.TRANSFORM,
    source=f"{_SOURCE} (transform_w_zp: permute_param_layout_, "
    f"unpack_quantized_values_into_int32, then -w_s * zp)",
    params=lambda w_zp, w_s: {"reads": (w_zp, w_s), "writes": (w_zp,), "optional": (w_zp,)},
)
def fold_zero_points_stage(
    t: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    w_zp: str,
    w_s: str,
) -> StageOut:
    """TRANSFORM standard zero points ``[N / pf, K / G]`` (packed along N, the layout
    AWQ's conversion and compressed-tensors both give) -> ``-scale * zp``
    ``[K / G, N]`` in the scales' dtype.

    Reads ``w_s`` in Machete's ``[K / G, N]`` order (after its own stage, if any). A
    no-op for symmetric weights (``zero_point`` false: vLLM's ``c.zero_points``).
    """
    if not config.quant.zero_point or w_zp not in t:  # symmetric: no zero points
        return StageOut()
    zp = t[w_zp].t()  # [K/G, N/pf]
    scales = t[w_s]
    if zp.device.type == "meta":
        return StageOut(
            tensors={w_zp: torch.empty(scales.shape, dtype=scales.dtype, device="meta")}
        )
    unpacked = unpack_int32(zp, config.quant.num_bits, 1)  # [K/G, N]
    return StageOut(tensors={w_zp: (-1.0 * scales * unpacked.to(scales.dtype)).contiguous()})
