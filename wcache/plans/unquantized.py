"""Unquantized linear and embedding layers.

CUDA: vLLM does nothing after load (kernel ``none``). CPU: vLLM's
``dispatch_cpu_unquantized_gemm`` picks a branch on the host (the engine's
decision, probed by :mod:`wcache.vllm.probe` and recorded in the Target):

* ``onednn``: a private oneDNN handle (DERIVE) over the weight as loaded, so
  the weight is exported and the handle rebuilt on restore; linear layers then
  release the weight (``remove_weight=True``), embeddings keep it.
* ``torch_linear`` (oneDNN refused the dtype on this ISA, e.g. bf16 on AVX2):
  ``F.linear`` on the weight as loaded; restore binds ``cpu_linear`` (METADATA)
  and has nothing to prepack.
* ``sgl`` (AMX hosts, small tile-aligned bf16/fp16 weights): ``convert_weight_packed``
  is a TRANSFORM the daemon runs (the packed weight is exported under
  ``weight``, the bias as fp32); restore binds ``cpu_linear`` over the mapped
  packed bytes (DERIVE) and releases the slot as vLLM does. Truly zero-copy.
  An SGL *embedding* / lm_head keeps its unpacked weight for the lookup: the
  weight is exported as loaded and restore packs a private copy (DERIVE, at most
  1 MiB; one for a tied embedding and lm_head) for ``cpu_linear``, as vLLM's
  closure holds one.
* ``zentorch`` has no wcache plan yet: refused, naming the decision; the engine
  loads such models from disk under ``fallback=true``.
"""

from __future__ import annotations

import functools

import torch

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.core.decisions import GEMM_ONEDNN, GEMM_SGL, GEMM_TORCH_LINEAR, GEMM_ZENTORCH
from wcache.plans.registry import register
from wcache.stages import cpu_gemm, onednn

_LAYER_KINDS = ("linear", "embedding")
#: Branches vLLM can take that wcache has no plan for, and why (SGL has one: :data:`SGL`).
_UNPLANNED = {
    GEMM_ZENTORCH: "vLLM picks zentorch_linear_unary (zentorch's own weight prepack) for "
    "this weight; wcache has no plan for it yet",
}


def _match_cuda(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cuda":
        return f"needs a CUDA target, got {target.device_type!r}"
    if config.quant.layer_kind not in _LAYER_KINDS:
        return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
    return None


def _cpu_branch_reason(branch: str, config: LayerConfig, target: Target) -> str | None:
    """``None`` when vLLM's unquantized dispatch takes ``branch`` for this layer on
    ``target`` (the recorded decision), else why not."""
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    if config.quant.layer_kind not in _LAYER_KINDS:
        return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
    if target.has("power"):
        return "POWER CPUs: vLLM's dispatch there is not covered by a wcache plan"
    chosen = cpu_gemm.gemm_branch(config, target)
    if chosen is None:
        return (
            f"the Target records no unquantized GEMM decision for {config.params_dtype} "
            f"(build it with wcache.vllm.probe.host_target, which asks vLLM)"
        )
    if chosen != branch:
        return _UNPLANNED.get(chosen, f"vLLM's dispatch takes the {chosen!r} branch here")
    return None


def _match_branch(branch: str, config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's CPU dispatch takes ``branch`` for this layer and wcache has
    a plan for it there, else the reason."""
    reason = _cpu_branch_reason(branch, config, target)
    if reason is None and branch == GEMM_SGL:
        if config.dtype not in (torch.bfloat16, torch.float16):
            return f"the SGL plan takes bf16/fp16 weights, got {config.params_dtype}"
        return cpu_gemm.missing_op_reason(
            target, ("convert_weight_packed", "weight_packed_linear"), "the SGL kernel"
        )
    return reason


def _match_cpu_branch(branch: str) -> functools.partial:
    """The plan's match for the CPU dispatch ``branch`` (a partial of a module-level
    function, so the plan pickles)."""
    return functools.partial(_match_branch, branch)


NONE_CUDA = register(
    Plan(
        method="unquantized",
        kernel="none",
        devices="cuda",
        stages=(),
        checkpoint={"weight", "bias"},
        match=_match_cuda,
        description="Unquantized linear/embedding on CUDA: vLLM does no post-load work; "
        "the loaded weight is exported and restore replays nothing.",
    )
)

ONEDNN = register(
    Plan(
        method="unquantized",
        kernel="onednn",
        devices="cpu",
        stages=(onednn.prepack_weight,),
        checkpoint={"weight", "bias"},
        match=_match_cpu_branch(GEMM_ONEDNN),
        description="Unquantized linear/embedding on CPU where vLLM's dispatch builds a oneDNN "
        "handle: the loaded weight is exported; restore rebuilds the private "
        "oneDNN handle (layer.cpu_linear) from it. Linear layers then release the "
        "weight like vLLM (remove_weight=True); embeddings keep it. Saves load "
        "time, not RAM (oneDNN holds a copy).",
    )
)

TORCH_LINEAR = register(
    Plan(
        method="unquantized",
        kernel="torch_linear",
        devices="cpu",
        stages=(cpu_gemm.bind_torch_linear,),
        checkpoint={"weight", "bias"},
        match=_match_cpu_branch(GEMM_TORCH_LINEAR),
        description="Unquantized linear/embedding on CPU where oneDNN refuses the dtype and "
        "vLLM's dispatch falls back to F.linear (bf16/fp16 on AVX2 hosts, fp16 on "
        "AVX512 ones): the loaded weight is exported and used in place; restore "
        "binds layer.cpu_linear and rebuilds nothing (truly zero-copy).",
    )
)

SGL = register(
    Plan(
        method="unquantized",
        kernel="sgl",
        devices="cpu",
        stages=(cpu_gemm.pack_sgl_weight, cpu_gemm.cast_bias_to_float32, cpu_gemm.bind_sgl_linear),
        checkpoint={"weight", "bias"},
        # vLLM: ``layer.bias.data = layer.bias.to(torch.float32)`` (the object stays)
        # Source: vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm
        reregistered={"bias": Reregistration.DATA},
        match=_match_cpu_branch(GEMM_SGL),
        description="Unquantized linear/embedding on CPU where vLLM picks the AMX SGL kernel "
        "(small tile-aligned bf16/fp16 weights on AMX hosts). Linear: the daemon "
        "packs the weight (convert_weight_packed) and casts the bias to fp32, both "
        "exported; restore binds layer.cpu_linear over the mapped packed weight and "
        "releases the weight slot like vLLM (remove_weight=True); zero-copy. "
        "Embedding / lm_head: vLLM keeps the unpacked weight for the lookup, so it "
        "is exported as loaded and restore packs a private copy (at most 1 MiB, one "
        "for a tied pair) for layer.cpu_linear.",
    )
)
