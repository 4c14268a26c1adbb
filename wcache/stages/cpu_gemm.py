"""vLLM-CPU's unquantized GEMM dispatch: which branch runs, and the ``F.linear`` branch.

``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py) tries,
in order: zentorch (AMD Zen with zentorch installed), the AMX SGL kernel for
small tile-aligned weights, a oneDNN matmul handle, and, when oneDNN cannot
build a matmul for the dtype on this ISA (bf16/fp16 on AVX2-only hosts, fp16 on
AVX512 hosts without AVX512-FP16), ``torch.nn.functional.linear`` on the weight
as loaded. Which branch wins is the engine's decision, probed by
:mod:`wcache.vllm.probe` and recorded in :attr:`Target.kernels`; this module
reads those decisions (named in :mod:`wcache.core.decisions`) and implements the
``F.linear`` branch's only post-load work: binding ``layer.cpu_linear`` (METADATA, nothing to prepack).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.core.decisions import KERNEL_LIBRARY, OP_PRESENT, gemm_decision, op_decision
from wcache.stages.common import StageInputError, per_channel_from_per_tensor, require_op

__all__ = [
    "SGL_TILE_K",
    "SGL_TILE_N",
    "SGL_MAX_WEIGHT_BYTES",
    "gemm_decision",
    "sgl_shape",
    "gemm_branch",
    "missing_op_reason",
    "TorchLinear",
    "bind_torch_linear",
    "sgl_packed_shape",
    "pack_sgl_weight",
    "cast_bias_to_float32",
    "SGLLinear",
    "bind_sgl_linear",
    "SGL_INT8_BLOCK_N",
    "SGL_INT8_LINEAR_METHOD",
    "sgl_int8_packed_shape",
    "pack_sgl_int8_weight",
    "convert_int8_scale_to_channelwise",
    "copy_bias_to_float32",
    "set_int8_sgl_method",
]

_UTILS = "vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm"
#: AMX SGL kernel limit for unquantized weights (vLLM's _CPU_SGL_GEMM_MAX_WEIGHT_BYTES).
SGL_MAX_WEIGHT_BYTES = 1 * 1024 * 1024
#: SGL tile sizes along K and N (csrc/cpu/sgl-kernels/gemm.h).
SGL_TILE_K, SGL_TILE_N = 32, 16


def sgl_shape(size_n: int, size_k: int, dtype: torch.dtype) -> bool:
    """Whether an ``[N, K]`` weight falls in the shape class vLLM's
    ``check_cpu_sgl_kernel`` gives to SGL on an AMX host (the host part of that
    check is the probed decision, not this function).

    Source: vllm/model_executor/layers/utils.py::check_cpu_sgl_kernel.
    """
    if dtype == torch.int8:
        return size_k % SGL_TILE_K == 0 and size_n % SGL_TILE_N == 0
    if size_n * size_k * dtype.itemsize > SGL_MAX_WEIGHT_BYTES:
        return False
    if size_n < SGL_TILE_N:
        return True
    return size_k % SGL_TILE_K == 0 and size_n % SGL_TILE_N == 0


def gemm_branch(config: LayerConfig, target: Target) -> str | None:
    """The branch vLLM takes for this unquantized layer on ``target``.

    ``config.quant.kernel`` when set (the vLLM adapter asks vLLM per layer);
    otherwise the probed outcome in ``target.kernels`` for the layer's dtype and
    shape class. ``None`` when the Target carries no decision (nobody asked vLLM).
    """
    if config.quant.kernel is not None:
        return config.quant.kernel
    shaped = bool(
        config.size_n and config.size_k and sgl_shape(config.size_n, config.size_k, config.dtype)
    )
    return target.kernel(gemm_decision(config.dtype, shaped))


class TorchLinear:
    """``layer.cpu_linear`` of vLLM's fallback branch: ``F.linear(x, weight, bias)``
    on the weight as loaded (``[N, K]``, not released). A named callable instead of
    vLLM's lambda, so it has a readable repr; same arguments, same result."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchLinear)

    def __hash__(self) -> int:
        return hash(TorchLinear)

    def __repr__(self) -> str:
        return "TorchLinear()"


@stage(
    "cpu_gemm.bind_torch_linear",
    Tag.METADATA,
    reads=("weight",),
    attrs=("cpu_linear",),
    source=f"{_UTILS} (fallback branch: oneDNN refused the dtype on this ISA)",
)
def bind_torch_linear(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Set ``layer.cpu_linear`` to :class:`TorchLinear` and keep ``weight``
    (``[N, K]``, the params dtype) as it is: vLLM's fallback neither prepacks nor
    releases it, so a restore maps the daemon's bytes and has nothing to rebuild.
    A meta weight gets ``F.linear`` itself, as in vLLM."""
    if tensors["weight"].device.type == "meta":
        return StageOut(attrs={"cpu_linear": F.linear})
    return StageOut(attrs={"cpu_linear": TorchLinear()})


def missing_op_reason(
    target: Target, ops: tuple[str, ...], kernel: str, subject: str = "this layer"
) -> str | None:
    """``None`` when vLLM's loaded CPU kernel library has every op in ``ops``, else
    why ``kernel`` cannot run on ``target`` (names the library and the missing op, and
    says vLLM itself cannot run ``subject`` here). Reads the probed decisions only
    (``op.<name>`` in ``target.kernels``)."""
    library = target.kernel(KERNEL_LIBRARY)
    if library is None:
        return (
            "the Target records no vLLM kernel decisions (build it with "
            "wcache.vllm.probe.host_target, which asks vLLM)"
        )
    missing = [op for op in ops if target.kernel(op_decision(op)) != OP_PRESENT]
    if missing:
        names = ", ".join(f"torch.ops._C.{op}" for op in missing)
        return (
            f"vLLM's CPU kernel library {library} on this host has no {names} "
            f"({kernel} needs it), so vLLM itself cannot run {subject} here"
        )
    return None


# --------------------------------------------------------------------------- SGL (AMX)

_SGL = f"{_UTILS} (SGL branch, taken when check_cpu_sgl_kernel accepts: AMX hosts)"


def sgl_packed_shape(
    size_n: int, size_k: int, dtype: torch.dtype
) -> tuple[tuple[int, int], torch.dtype]:
    """Shape and dtype ``convert_weight_packed`` returns for an ``[N, K]`` weight:
    the VNNI-packed weight keeps ``[N, K]`` and the dtype; for ``N < 16`` it is the
    transposed fp32 weight ``[K, N]`` (csrc/cpu/sgl-kernels/gemm.cpp)."""
    if size_n < SGL_TILE_N:
        return (size_k, size_n), torch.float32
    return (size_n, size_k), dtype


@stage(
    "cpu_gemm.pack_sgl_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source=f"{_SGL}: torch.ops._C.convert_weight_packed",
)
def pack_sgl_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """A linear layer's ``weight`` ``[N, K]`` (bf16/fp16) -> the SGL kernel's packed
    weight (VNNI blocks, same shape and dtype; fp32 ``[K, N]`` when ``N < 16``), a new
    tensor. vLLM keeps it in the ``cpu_linear`` closure; wcache exports it under
    ``weight`` so a restore maps it and rebuilds the closure over the shared bytes.
    An embedding / lm_head keeps its unpacked weight (vLLM's lookup reads it): no
    change; :data:`bind_sgl_linear` packs its private copy.

    Raises:
        OpUnavailable: vLLM's ``_C`` (with the SGL ops) is not loaded.
    """
    if config.quant.layer_kind == "embedding":
        return StageOut()
    weight = tensors["weight"]
    if weight.device.type == "meta":
        size_n, size_k = weight.shape
        shape, dtype = sgl_packed_shape(size_n, size_k, weight.dtype)
        return StageOut(tensors={"weight": torch.empty(shape, dtype=dtype, device="meta")})

    return StageOut(tensors={"weight": require_op("_C", "convert_weight_packed")(weight)})


@stage(
    "cpu_gemm.cast_bias_to_float32",
    Tag.TRANSFORM,
    reads=("bias",),
    writes=("bias",),
    optional=("bias",),
    source=f"{_SGL}: layer.bias.data = layer.bias.to(torch.float32)",
)
def cast_bias_to_float32(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``bias`` ``[N]`` -> a new fp32 copy (the SGL kernel adds an fp32 bias); no bias,
    no change."""
    if "bias" not in tensors:
        return StageOut()
    return StageOut(tensors={"bias": tensors["bias"].to(torch.float32)})


class SGLLinear:
    """``layer.cpu_linear`` of vLLM's SGL branch: ``weight_packed_linear(x,
    packed_weight, bias)`` into a new ``[..., N]`` output of ``x``'s dtype. Holds the
    packed weight (on restore: the daemon's read-only bytes, never copied).

    Source: vllm/_custom_ops.py::weight_packed_linear_cpu.
    """

    def __init__(self, packed_weight: torch.Tensor, size_n: int):
        self.packed_weight, self.n = packed_weight, size_n

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        output = torch.empty((*x.shape[:-1], self.n), dtype=x.dtype)
        torch.ops._C.weight_packed_linear(
            output.reshape(-1, self.n), x.reshape(-1, x.size(-1)), self.packed_weight, bias, True
        )
        return output

    def __repr__(self) -> str:
        return f"SGLLinear(n={self.n})"


def _sgl_pack(weight: torch.Tensor, memo: Mapping | None) -> tuple[torch.Tensor, dict]:
    """vLLM's SGL packed copy of ``weight`` ``[N, K]`` and the memo entries to add; with
    a per-restore ``memo`` (read only here), layers whose weight is the *same* tensor
    (a tied embedding and lm_head) share one packed copy, as
    :func:`wcache.stages.onednn.prepack_weight` shares its handle. ``memo`` is
    ``None`` in an ordinary load (one copy per layer, as vLLM does)."""
    pack = require_op("_C", "convert_weight_packed")
    if memo is None:
        return pack(weight), {}
    ident = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
    packed = memo.get(ident)
    if packed is not None:
        return packed, {}
    packed = pack(weight)
    return packed, {ident: packed}


@stage(
    "cpu_gemm.bind_sgl_linear",
    Tag.DERIVE,
    reads=("weight",),
    attrs=("cpu_linear",),
    source=f"{_SGL}: the cpu_linear closure over the packed weight, then remove_weight "
    f"(linear) or keep the weight (embedding: remove_weight=False)",
    memoized=True,
)
def bind_sgl_linear(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    memo: Mapping | None = None,
) -> StageOut:
    """Set ``layer.cpu_linear`` to :class:`SGLLinear`.

    Linear layers: over the packed ``weight`` (:data:`pack_sgl_weight`'s output) and,
    like vLLM's ``remove_weight=True``, release the weight slot (an empty ``(0,)``
    Parameter); the packed bytes stay referenced by the closure only.
    Embeddings / lm_head (vLLM's ``remove_weight=False``: the unpacked weight stays for
    the lookup): over a **private** packed copy of the weight (``convert_weight_packed``,
    at most vLLM's 1 MiB SGL limit), shared through ``memo`` by layers whose weight is
    the same tensor (a tied embedding and lm_head). A meta weight gets ``F.linear``,
    as in vLLM.

    Raises:
        OpUnavailable: (embeddings) vLLM's ``_C`` (with the SGL ops) is not loaded.
    """

    weight = tensors["weight"]
    if weight.device.type == "meta":
        return StageOut(attrs={"cpu_linear": F.linear})
    if config.quant.layer_kind == "embedding":
        packed, new = _sgl_pack(weight, memo)
        return StageOut(attrs={"cpu_linear": SGLLinear(packed, config.size_n)}, memo=new)
    return StageOut(attrs={"cpu_linear": SGLLinear(weight, config.size_n)}, release=("weight",))


# --------------------------------------------------------------------------- SGL W8A8 INT8

_SGL_INT8 = (
    "vllm/model_executor/kernels/linear/scaled_mm/cpu.py::"
    "CPUInt8ScaledMMLinearKernel.process_weights_for_sgl"
)
#: convert_weight_packed packs int8 weights in blocks of 32 output channels: N must
#: be a multiple (vLLM's check_cpu_sgl_kernel asks N % 16 only, and vLLM itself then
#: fails with "Expected N == BLOCK_N"; measured on vLLM 0.32's _C).
SGL_INT8_BLOCK_N = 32
#: bytes convert_weight_packed appends to each int8 row (an int32 compensation term).
SGL_INT8_COMP_BYTES = 4
#: ``linear_method`` of the SGL int8 path (vLLM: ``self._apply_weights_sgl``);
#: ``wcache.vllm.compat`` binds it onto vLLM's kernel object.
SGL_INT8_LINEAR_METHOD = "sgl"


def sgl_int8_packed_shape(size_n: int, size_k: int) -> tuple[int, int]:
    """Shape of ``convert_weight_packed`` for an int8 ``[N, K]`` weight: ``[N, K + 4]``
    int8 (VNNI blocks plus an int32 compensation term per row)."""
    return size_n, size_k + SGL_INT8_COMP_BYTES


@stage(
    "cpu_gemm.pack_sgl_int8_weight",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight",),
    source=f"{_SGL_INT8}: torch.ops._C.convert_weight_packed",
)
def pack_sgl_int8_weight(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """int8 ``weight`` ``[N, K]`` -> the SGL kernel's packed int8 ``[N, K + 4]`` (a new
    tensor, exported; vLLM replaces the parameter by it).

    Raises:
        StageInputError: ``N`` is not a multiple of :data:`SGL_INT8_BLOCK_N` (vLLM's
            own op fails there).
        OpUnavailable: vLLM's ``_C`` (with the SGL ops) is not loaded.
    """
    weight = tensors["weight"]
    n, k = weight.shape
    if n % SGL_INT8_BLOCK_N:
        raise StageInputError(
            f"layer {config.name!r}: convert_weight_packed needs an int8 "
            f"N that is a multiple of {SGL_INT8_BLOCK_N}, got {n}"
        )
    if weight.device.type == "meta":
        return StageOut(
            tensors={
                "weight": torch.empty(sgl_int8_packed_shape(n, k), dtype=torch.int8, device="meta")
            }
        )
    return StageOut(tensors={"weight": require_op("_C", "convert_weight_packed")(weight)})


@stage(
    "cpu_gemm.convert_int8_scale_to_channelwise",
    Tag.TRANSFORM,
    reads=("weight_scale",),
    writes=("weight_scale",),
    source=f"{_SGL_INT8} (convert_to_channelwise unless channelwise; "
    f"w8a8_utils.py::convert_to_channelwise)",
)
def convert_int8_scale_to_channelwise(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """Per-tensor ``weight_scale`` ``[#shards]`` (or ``[1]``) -> fp32 ``[N, 1]``, each
    shard's scale over its ``logical_widths`` rows (the SGL kernel takes per-channel
    scales only, fused or not); channelwise scales unchanged.

    Raises:
        StageInputError: the number of scales is not the number of logical widths.
    """
    if config.quant.strategy == "channel":
        return StageOut()
    scale = tensors["weight_scale"]
    widths = tuple(config.get("logical_widths", ())) or (config.size_n,)
    return StageOut(
        tensors={"weight_scale": per_channel_from_per_tensor(scale, widths, config.name)}
    )


@stage(
    "cpu_gemm.copy_bias_to_float32",
    Tag.TRANSFORM,
    reads=("bias",),
    writes=("bias_fp32",),
    optional=("bias",),
    source=f"{_SGL_INT8} (register_parameter('bias_fp32', ...))",
)
def copy_bias_to_float32(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """A new ``bias_fp32`` ``[N]`` fp32 copy of ``bias`` (kept as is: vLLM's apply passes
    the fp32 one to the SGL kernel); no bias, nothing."""
    if "bias" not in tensors:
        return StageOut()
    return StageOut(tensors={"bias_fp32": tensors["bias"].float()})


@stage(
    "cpu_gemm.set_int8_sgl_method",
    Tag.METADATA,
    attrs=("linear_method",),
    source=f"{_SGL_INT8} (self.linear_method = self._apply_weights_sgl)",
)
def set_int8_sgl_method(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``linear_method`` = :data:`SGL_INT8_LINEAR_METHOD` (vLLM's SGL int8 apply, which
    reads the packed ``weight``, ``weight_scale`` and ``bias_fp32``); layer-local, moved
    onto vLLM's kernel object by ``wcache.vllm.compat.sync_kernel_state_``."""
    return StageOut(attrs={"linear_method": SGL_INT8_LINEAR_METHOD})
