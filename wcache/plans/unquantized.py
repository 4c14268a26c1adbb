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
* ``sgl`` (AMX) and ``zentorch`` have no wcache plan yet: refused, naming the
  decision, and the engine loads those models from disk under ``fallback=true``.
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import cpu_gemm, onednn

_LAYER_KINDS = ("linear", "embedding")
#: Branches vLLM can take that wcache has no plan for, and why.
_UNPLANNED = {
    "sgl": "vLLM picks the AMX SGL kernel (convert_weight_packed, a VNNI byte repack "
           "held in a closure) for this weight; wcache has no plan for it yet",
    "zentorch": "vLLM picks zentorch_linear_unary (zentorch's own weight prepack) for "
                "this weight; wcache has no plan for it yet",
}


def _match_cuda(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cuda":
        return f"needs a CUDA target, got {target.device_type!r}"
    if config.quant.layer_kind not in _LAYER_KINDS:
        return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
    return None


def _match_cpu_branch(branch: str):
    def match(config: LayerConfig, target: Target) -> str | None:
        if target.device_type != "cpu":
            return f"needs a CPU target, got {target.device_type!r}"
        if config.quant.layer_kind not in _LAYER_KINDS:
            return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
        if target.has("power"):
            return "POWER CPUs: vLLM's dispatch there is not covered by a wcache plan"
        chosen = cpu_gemm.gemm_branch(config, target)
        if chosen is None:
            return (f"the Target records no unquantized GEMM decision for "
                    f"{config.params_dtype} (build it with wcache.vllm.probe.host_target, "
                    f"which asks vLLM)")
        if chosen != branch:
            return _UNPLANNED.get(chosen, f"vLLM's dispatch takes the {chosen!r} branch here")
        return None
    match.__name__ = f"_match_{branch}"
    return match


NONE_CUDA = register(Plan(
    method="unquantized", kernel="none", stages=(), checkpoint={"weight", "bias"},
    match=_match_cuda,
    description="Unquantized linear/embedding on CUDA: vLLM does no post-load work; "
                "the loaded weight is exported and restore replays nothing."))

ONEDNN = register(Plan(
    method="unquantized", kernel="onednn", stages=(onednn.prepack_weight,),
    checkpoint={"weight", "bias"}, match=_match_cpu_branch("onednn"),
    description="Unquantized linear/embedding on CPU where vLLM's dispatch builds a oneDNN "
                "handle: the loaded weight is exported; restore rebuilds the private "
                "oneDNN handle (layer.cpu_linear) from it. Linear layers then release the "
                "weight like vLLM (remove_weight=True); embeddings keep it. Saves load "
                "time, not RAM (oneDNN holds a copy)."))

TORCH_LINEAR = register(Plan(
    method="unquantized", kernel="torch_linear", stages=(cpu_gemm.bind_torch_linear,),
    checkpoint={"weight", "bias"}, match=_match_cpu_branch("torch_linear"),
    description="Unquantized linear/embedding on CPU where oneDNN refuses the dtype and "
                "vLLM's dispatch falls back to F.linear (bf16/fp16 on AVX2 hosts, fp16 on "
                "AVX512 ones): the loaded weight is exported and used in place; restore "
                "binds layer.cpu_linear and rebuilds nothing (truly zero-copy)."))
