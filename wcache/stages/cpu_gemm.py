"""vLLM-CPU's unquantized GEMM dispatch: which branch runs, and the ``F.linear`` branch.

``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py) tries,
in order: zentorch (AMD Zen with zentorch installed), the AMX SGL kernel for
small tile-aligned weights, a oneDNN matmul handle, and, when oneDNN cannot
build a matmul for the dtype on this ISA (bf16/fp16 on AVX2-only hosts, fp16 on
AVX512 hosts without AVX512-FP16), ``torch.nn.functional.linear`` on the weight
as loaded. Which branch wins is the engine's decision, probed by
:mod:`wcache.vllm.probe` and recorded in :attr:`Target.kernels`; this module
only names those decisions and implements the ``F.linear`` branch's only
post-load work: binding ``layer.cpu_linear`` (METADATA, nothing to prepack).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from wcache.core import LayerConfig, StageOut, Tag, Target, stage

__all__ = ["GEMM_BRANCHES", "SGL_TILE_K", "SGL_TILE_N", "SGL_MAX_WEIGHT_BYTES", "gemm_decision",
           "sgl_shape", "gemm_branch", "TorchLinear", "bind_torch_linear"]

_UTILS = "vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm"
#: The branches of ``dispatch_cpu_unquantized_gemm``, as wcache kernel ids.
GEMM_BRANCHES = ("zentorch", "sgl", "onednn", "torch_linear")
#: AMX SGL kernel limit for unquantized weights (vLLM's _CPU_SGL_GEMM_MAX_WEIGHT_BYTES).
SGL_MAX_WEIGHT_BYTES = 1 * 1024 * 1024
#: SGL tile sizes along K and N (csrc/cpu/sgl-kernels/gemm.h).
SGL_TILE_K, SGL_TILE_N = 32, 16


def gemm_decision(dtype: torch.dtype, sgl: bool = False) -> str:
    """The :attr:`Target.kernels` key of the unquantized GEMM decision for
    ``dtype``, for general weights or (``sgl``) small tile-aligned ones."""
    name = str(dtype).removeprefix("torch.")
    return f"unquantized_gemm[{name}{',sgl_shape' if sgl else ''}]"


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
    shaped = bool(config.size_n and config.size_k and
                  sgl_shape(config.size_n, config.size_k, config.dtype))
    return target.kernel(gemm_decision(config.dtype, shaped))


class TorchLinear:
    """``layer.cpu_linear`` of vLLM's fallback branch: ``F.linear(x, weight, bias)``
    on the weight as loaded (``[N, K]``, not released). A named callable instead of
    vLLM's lambda, so it has a readable repr; same arguments, same result."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchLinear)

    def __hash__(self) -> int:
        return hash(TorchLinear)

    def __repr__(self) -> str:
        return "TorchLinear()"


@stage("cpu_gemm.bind_torch_linear", Tag.METADATA, reads=("weight",), attrs=("cpu_linear",),
       source=f"{_UTILS} (fallback branch: oneDNN refused the dtype on this ISA)")
def bind_torch_linear(tensors: Mapping[str, torch.Tensor], config: LayerConfig, target: Target,
                      recorded: Mapping[str, Any]) -> StageOut:
    """Set ``layer.cpu_linear`` to :class:`TorchLinear` and keep ``weight``
    (``[N, K]``, the params dtype) as it is: vLLM's fallback neither prepacks nor
    releases it, so a restore maps the daemon's bytes and has nothing to rebuild.
    A meta weight gets ``F.linear`` itself, as in vLLM."""
    if tensors["weight"].device.type == "meta":
        return StageOut(attrs={"cpu_linear": F.linear})
    return StageOut(attrs={"cpu_linear": TorchLinear()})


def missing_op_reason(target: Target, ops: tuple[str, ...], kernel: str) -> str | None:
    """``None`` when vLLM's loaded CPU kernel library has every op in ``ops``, else
    why ``kernel`` cannot run on ``target`` (names the library and the missing op).
    Reads the probed decisions only (``op.<name>`` in ``target.kernels``)."""
    library = target.kernel("cpu.kernel_library")
    if library is None:
        return ("the Target records no vLLM kernel decisions (build it with "
                "wcache.vllm.probe.host_target, which asks vLLM)")
    missing = [op for op in ops if target.kernel(f"op.{op}") != "present"]
    if missing:
        names = ", ".join(f"torch.ops._C.{op}" for op in missing)
        return (f"vLLM's CPU kernel library {library} on this host has no {names} "
                f"({kernel} needs it), so vLLM itself cannot run this layer here")
    return None
