"""oneDNN on CPU: unquantized GEMM handles and the W8A8 INT8 scaled-mm kernel.

The DERIVE stages here build a **private** oneDNN handle from final tensors
(oneDNN reorders the weight into memory it owns; the source is only read), so a
restore can rebuild it from mapped, read-only bytes. They call the ops vLLM's
``_custom_ops`` wraps through ``torch.ops._C`` (wcache never imports vLLM); when
vLLM's ``_C`` extension is not loaded they raise :class:`OpUnavailable`.

TRANSFORM stages (W8A8 INT8): per-channel weight scales for fused layers, the
static input scale / zero point folding and the ``azp_adj`` term, each a new
tensor computed with vLLM's op sequence (bit-exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.core.decisions import GEMM_ONEDNN, GEMM_SGL, W8A8_INT8_SGL, gemm_decision
from wcache.stages import cpu_gemm
from wcache.stages.common import (  # noqa: F401 (re-exported)
    OpUnavailable,
    StageInputError,
    fold_int8_static_input,
    per_channel_from_per_tensor,
    require_op,
)

__all__ = [
    "PRIMITIVE_CACHE_SIZE",
    "CPUDNNLGEMMHandler",
    "OneDNNLinear",
    "create_onednn_mm",
    "create_onednn_scaled_mm",
    "onednn_mm",
    "prepack_weight",
    "convert_scale_to_channelwise",
    "fold_input_scale",
    "compute_azp_adj",
    "prepack_scaled_weight",
    "sgl_selected",
    "ONEDNN_LINEAR_METHOD",
]

_UTILS = "vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm"
_SCALED = (
    "vllm/model_executor/kernels/linear/scaled_mm/cpu.py::"
    "CPUInt8ScaledMMLinearKernel.process_weights_for_onednn"
)

#: oneDNN primitive cache entries per handle; vLLM passes 32 in both dispatches.
PRIMITIVE_CACHE_SIZE = 32
#: The W8A8 kernel path :func:`prepack_scaled_weight` selects, as the layer's
#: ``linear_method``: vLLM's oneDNN scaled-mm apply (not the AMX SGL one). The
#: stage leaves it and ``dnnl_handler`` on the layer; ``wcache.vllm.compat``'s
#: ``KERNEL_BINDINGS`` puts both on vLLM's kernel object (``layer.scheme.kernel``).
ONEDNN_LINEAR_METHOD = "onednn"


class CPUDNNLGEMMHandler:
    """A oneDNN matmul handle; the same interface as vLLM's ``CPUDNNLGEMMHandler``
    (``handler_tensor``, ``n``, ``k``), so vLLM's ``ops.onednn_mm`` /
    ``ops.onednn_scaled_mm`` and ``apply`` accept it.

    Keeps references to the tensors the C++ handler may point into (the W8A8
    handler keeps raw pointers to the weight scales), so they outlive it.
    """

    def __init__(self, pointer: int, k: int, n: int, keepalive: tuple[torch.Tensor, ...] = ()):
        self.k, self.n = k, n
        # vLLM stores the pointer in a tensor so it is not inlined by compilation
        self.handler_tensor: torch.Tensor | None = torch.tensor(
            pointer, dtype=torch.int64, device="cpu"
        )
        self._keepalive = keepalive
        self._dtor = require_op("_C", "release_dnnl_matmul_handler")

    def __del__(self) -> None:
        handler = getattr(self, "handler_tensor", None)
        if handler is not None:
            self._dtor(handler.item())
            self.handler_tensor = None


def create_onednn_mm(
    weight_kn: torch.Tensor, primitive_cache_size: int = PRIMITIVE_CACHE_SIZE
) -> CPUDNNLGEMMHandler:
    """Prepack an unquantized weight.

    Args:
        weight_kn: ``[size_k, size_n]`` (vLLM passes ``weight.t()``), bf16/fp16/fp32.

    Raises:
        OpUnavailable: vLLM's ``_C`` is not loaded.

    Source: vllm/_custom_ops.py::create_onednn_mm.
    """
    op = require_op("_C", "create_onednn_mm_handler")
    k, n = weight_kn.size()
    return CPUDNNLGEMMHandler(op(weight_kn, primitive_cache_size), k, n)


def _prepack(weight: torch.Tensor, memo: Mapping | None) -> tuple[CPUDNNLGEMMHandler, dict]:
    """One oneDNN handle for ``weight`` ``[N, K]``, and the memo entries to add;
    with a per-restore ``memo`` (read only here), layers whose weight is the *same*
    tensor (a tied embedding and lm_head) share one handle instead of two identical
    ones.

    A memo of a pure function of read-only bytes: the shared tensors cannot
    change during a restore (the guard checks them), so the handle is the one
    vLLM would build twice. Saves one prepack of the vocabulary matrix (time and
    its RAM). ``memo`` is ``None`` in an ordinary load (one handle per layer, as
    vLLM does). The caller of the restore keeps the memo; the entry goes back
    through :attr:`StageOut.memo`.
    """
    if memo is None:
        return create_onednn_mm(weight.t(), PRIMITIVE_CACHE_SIZE), {}
    ident = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
    handle = memo.get(ident)
    if handle is not None:
        return handle, {}
    handle = create_onednn_mm(weight.t(), PRIMITIVE_CACHE_SIZE)
    return handle, {ident: handle}


def onednn_mm(
    handle: CPUDNNLGEMMHandler, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [..., K] @ W [K, N] + bias`` through the handle.

    Source: vllm/_custom_ops.py::onednn_mm.
    """
    output = torch.empty((*x.shape[0:-1], handle.n), dtype=x.dtype)
    torch.ops._C.onednn_mm(output, x.reshape(-1, handle.k), bias, handle.handler_tensor)
    return output


class OneDNNLinear:
    """``layer.cpu_linear``: ``(x, weight, bias) -> onednn_mm(handle, x, bias)``.

    A callable object (not a lambda) so it has a readable repr; the ``weight``
    argument is ignored exactly as in vLLM's closure.
    """

    def __init__(self, handle: CPUDNNLGEMMHandler):
        self.handle = handle

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return onednn_mm(self.handle, x, bias)

    def __repr__(self) -> str:
        return f"OneDNNLinear(k={self.handle.k}, n={self.handle.n})"


def create_onednn_scaled_mm(
    weight_kn: torch.Tensor,
    weight_scales: torch.Tensor,
    output_type: torch.dtype,
    dynamic_quant: bool,
    use_azp: bool,
    primitive_cache_size: int = PRIMITIVE_CACHE_SIZE,
) -> CPUDNNLGEMMHandler:
    """Prepack an int8 weight for ``onednn_scaled_mm``.

    Args:
        weight_kn: int8 ``[size_k, size_n]``.
        weight_scales: fp32 ``[size_n, 1]`` (channel) or ``[1]`` (tensor).
        output_type: activation dtype.
        dynamic_quant: activations quantized per token at run time.
        use_azp: asymmetric activations.

    Source: vllm/_custom_ops.py::create_onednn_scaled_mm.
    """
    op = require_op("_C", "create_onednn_scaled_mm_handler")
    k, n = weight_kn.size()
    ptr = op(weight_kn, weight_scales, output_type, dynamic_quant, use_azp, primitive_cache_size)
    return CPUDNNLGEMMHandler(ptr, k, n, keepalive=(weight_kn, weight_scales))


def sgl_selected(size_n: int, size_k: int, dtype: torch.dtype, target: Target) -> bool:
    """Whether vLLM picks the AMX SGL kernel (a byte TRANSFORM, not oneDNN) for an
    ``[N, K]`` weight of ``dtype`` on ``target``: the probed host decision
    (``target.kernels``) for the weight's shape class.

    Source: vllm/model_executor/layers/utils.py::check_cpu_sgl_kernel.
    """
    if dtype not in (torch.bfloat16, torch.float16, torch.int8):
        return False
    if not cpu_gemm.sgl_shape(size_n, size_k, dtype):
        return False
    if dtype == torch.int8:
        return target.kernel(W8A8_INT8_SGL) == GEMM_SGL
    return target.kernel(gemm_decision(dtype, True)) == GEMM_SGL


# --------------------------------------------------------------------------- unquantized


@stage(
    "onednn.prepack_weight",
    Tag.DERIVE,
    reads=("weight",),
    attrs=("cpu_linear",),
    source=f"{_UTILS} (oneDNN branch)",
    memoized=True,
)
def prepack_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    memo: Mapping | None = None,
) -> StageOut:
    """Build ``layer.cpu_linear`` over a private oneDNN copy of ``weight`` ``[N, K]``.

    Linear layers then release the weight (vLLM's ``remove_weight=True``: an empty
    ``(0,)`` Parameter); embeddings (``layer_kind == "embedding"``) keep it. A
    meta weight gets ``F.linear`` and keeps its slot, as in vLLM. ``memo`` (the
    caller's per-restore memo for this stage, read only) shares one handle between
    layers whose weight is the same tensor; a new handle is returned in
    ``StageOut.memo``.

    Raises:
        StageInputError: the weight is not 2-D, or the target selects the AMX SGL
            kernel or has no oneDNN path (POWER).
        OpUnavailable: vLLM's ``_C`` is not loaded.
    """
    weight = tensors["weight"]
    if weight.device.type == "meta":
        return StageOut(attrs={"cpu_linear": F.linear})
    if weight.dim() != 2:
        raise StageInputError(
            f"layer {config.name!r}: oneDNN prepack needs a 2-D weight, got {tuple(weight.shape)}"
        )
    branch = cpu_gemm.gemm_branch(config, target)
    if branch != GEMM_ONEDNN or target.has("power"):
        raise StageInputError(
            f"layer {config.name!r}: vLLM does not use oneDNN for this "
            f"weight on the target (its decision: {branch}); this stage "
            f"does not apply"
        )
    handle, new = _prepack(weight, memo)
    release = ("weight",) if config.quant.layer_kind != "embedding" else ()
    return StageOut(attrs={"cpu_linear": OneDNNLinear(handle)}, release=release, memo=new)


# --------------------------------------------------------------------------- W8A8 INT8


def _is_fused(config: LayerConfig) -> bool:
    return len(tuple(config.get("logical_widths", ()))) > 1


@stage(
    "onednn.convert_scale_to_channelwise",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source=f"{_SCALED} (convert_to_channelwise for fused per-tensor scales; "
    f"w8a8_utils.py::convert_to_channelwise)",
)
def convert_scale_to_channelwise(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Fused layers with per-tensor scales: ``weight_scale`` ``[#shards]`` -> fp32
    ``[N, 1]`` (each shard's scale repeated over its ``logical_widths`` rows);
    otherwise unchanged (returned as is). ``logical_widths`` comes from
    ``config.extra``."""
    scale = tensors["weight_scale"]
    if not _is_fused(config) or config.quant.strategy == "channel":
        return StageOut()
    widths = tuple(config.get("logical_widths"))
    return StageOut(
        tensors={"weight_scale": per_channel_from_per_tensor(scale, widths, config.name)}
    )


@stage(
    "onednn.fold_input_scale",
    Tag.TRANSFORM,
    reads=("input_scale", "input_zero_point"),
    writes=("input_scale", "input_zero_point"),
    optional=("input_scale", "input_zero_point"),
    source=f"{_SCALED} (INPUT SCALE block)",
)
def fold_input_scale(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Static activations only (dynamic: no change).

    Symmetric: ``input_scale`` fp32 ``[1]`` -> its max, 0-d. Asymmetric: rebuild the
    range from ``input_scale`` and ``input_zero_point`` (int8 ``[1]``) and return a
    0-d fp32 ``input_scale`` and a 0-d int32 ``input_zero_point``.
    """
    return StageOut(tensors=fold_int8_static_input(tensors, config, round_zero_point=True))


@stage(
    "onednn.compute_azp_adj",
    Tag.TRANSFORM,
    reads=("weight", "weight_scale"),
    writes=("azp_adj",),
    source=f"{_SCALED} (azp_adj term)",
)
def compute_azp_adj(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Unless symmetric and static: ``azp_adj`` fp32 ``[1, N]`` =
    ``sum_k W[k, n] * weight_scale[n]`` (computed on the ``[K, N]`` view as vLLM does)."""
    if config.quant.input_symmetric and config.quant.static_input:
        return StageOut()
    weight_kn = tensors["weight"].t()
    azp_adj = weight_kn.sum(dim=0, keepdim=True, dtype=torch.float32)
    azp_adj = azp_adj * tensors["weight_scale"].squeeze()
    return StageOut(tensors={"azp_adj": azp_adj})


@stage(
    "onednn.prepack_scaled_weight",
    Tag.DERIVE,
    reads=("weight", "weight_scale", "input_scale"),
    optional=("input_scale",),
    attrs=("weight", "dnnl_handler", "linear_method"),
    source=f"{_SCALED} (create_onednn_scaled_mm, then setattr(layer, 'weight', None))",
)
def prepack_scaled_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Build ``dnnl_handler`` from int8 ``weight`` ``[N, K]`` (passed as the
    ``[K, N]`` view) and ``weight_scale``; set ``linear_method`` to
    :data:`ONEDNN_LINEAR_METHOD` (the kernel's oneDNN apply); release ``weight``
    into a ``None`` slot (vLLM drops it). Both attrs are layer-local: on a vLLM layer
    ``wcache.vllm.compat.sync_kernel_state_`` moves them onto the kernel object,
    where vLLM's own post-load sets them.

    The handle's output dtype is ``config.params_dtype`` (vLLM: the default dtype
    during load, which is the model dtype).

    Raises:
        StageInputError: the target selects the AMX SGL int8 kernel.
        OpUnavailable: vLLM's ``_C`` is not loaded.
    """
    weight = tensors["weight"]
    n, k = weight.size()
    if config.quant.input_symmetric and sgl_selected(n, k, torch.int8, target):
        raise StageInputError(
            f"layer {config.name!r}: the target selects the AMX SGL int8 "
            f"kernel (a byte transform); no wcache plan for it"
        )
    if weight.device.type == "meta":  # shapes only: no handle can be built without bytes
        return StageOut(
            attrs={"weight": None, "dnnl_handler": None, "linear_method": ONEDNN_LINEAR_METHOD},
            release=("weight",),
        )
    handle = create_onednn_scaled_mm(
        weight.t(),
        tensors["weight_scale"],
        config.dtype,
        "input_scale" not in tensors,
        not config.quant.input_symmetric,
        PRIMITIVE_CACHE_SIZE,
    )
    return StageOut(
        attrs={"weight": None, "dnnl_handler": handle, "linear_method": ONEDNN_LINEAR_METHOD},
        release=("weight",),
    )
