"""Unquantized linear and embedding layers.

CUDA: vLLM does nothing after load (kernel ``none``). CPU: vLLM's
``dispatch_cpu_unquantized_gemm`` builds a private oneDNN handle (DERIVE), so the
weight is exported in its loaded form and the handle is rebuilt on restore;
linear layers then release the weight (``remove_weight=True``), embeddings keep it.
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import register
from wcache.stages import onednn

_LAYER_KINDS = ("linear", "embedding")


def _match_cuda(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cuda":
        return f"needs a CUDA target, got {target.device_type!r}"
    if config.quant.layer_kind not in _LAYER_KINDS:
        return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
    return None


def _match_onednn(config: LayerConfig, target: Target) -> str | None:
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    if config.quant.layer_kind not in _LAYER_KINDS:
        return f"layer kind {config.quant.layer_kind!r} is not linear/embedding"
    if target.has("power"):
        return "POWER CPUs use F.linear, not oneDNN; no wcache plan"
    if config.size_k and config.size_n and \
            onednn.sgl_selected(config.size_n, config.size_k, config.dtype, target):
        return ("the target has AMX and vLLM picks the SGL kernel for this shape "
                "(a VNNI byte repack); no wcache plan for it")
    return None


NONE_CUDA = register(Plan(
    method="unquantized", kernel="none", stages=(), checkpoint={"weight", "bias"},
    match=_match_cuda,
    description="Unquantized linear/embedding on CUDA: vLLM does no post-load work; "
                "the loaded weight is exported and restore replays nothing."))

ONEDNN = register(Plan(
    method="unquantized", kernel="onednn", stages=(onednn.prepack_weight,),
    checkpoint={"weight", "bias"}, match=_match_onednn,
    description="Unquantized linear/embedding on CPU: the loaded weight is exported; "
                "restore rebuilds the private oneDNN handle (layer.cpu_linear) from it. "
                "Linear layers then release the weight like vLLM (remove_weight=True); "
                "embeddings keep it. Saves load time, not RAM (oneDNN holds a copy)."))
