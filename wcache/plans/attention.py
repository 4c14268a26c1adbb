"""Attention layers whose KV cache is not quantized (no KV-cache quant method), and
MLA attention (DeepSeek-V2/V3: ``W_UV``/``W_UK_T`` from ``kv_b_proj``)."""

from wcache.core import LayerConfig, Plan, Target
from wcache.plans.registry import refuse, register
from wcache.stages import attention as a
from wcache.stages import mla


def _match(config: LayerConfig, target: Target) -> str | None:
    if config.quant.layer_kind != "attention":
        return "not an attention layer"
    if not config.get("impl_postload_noop", True):
        return (
            "the attention backend's impl.process_weights_after_loading does work "
            "wcache has no stages for; load without wcache"
        )
    return None


ATTENTION = register(
    Plan(
        method="attention",
        kernel="default",
        devices=("cpu", "cuda"),
        stages=(
            a.set_default_scales,
            a.set_scale_floats,
            a.copy_host_scales,
            a.alloc_kv_cache_placeholder,
        ),
        checkpoint=frozenset(a.SCALE_BUFFERS),
        match=_match,
        description="Attention without KV-cache quantization: scale buffers set to 1.0 by the "
        "daemon; floats, host copies and the kv_cache placeholder replayed.",
    )
)


# Multimodal-encoder attention whose deferred post-load work (vLLM runs it after every
# quant method, ``is_deferred_attention_layer``) has no plan: refused before any
# weight is read; the adapter maps it to this method.
refuse(
    "mm_encoder_attention_fp8",
    "multimodal-encoder attention with FP8 populates its scale buffers after load "
    "(vllm/model_executor/layers/attention/mm_encoder_attention.py::MMEncoderAttention."
    "process_weights_after_loading); wcache has no plan for it. Load this model without "
    "wcache, or without FP8 encoder attention",
)


#: MLA backends whose impl packs private copies of W_UK/W_UV and empties
#: ``kv_b_proj.weight`` (vLLM-CPU's AMX backend, preferred on AMX hosts): no plan.
MLA_PACKING_BACKENDS = {
    "AMX_MLA": "vLLM's AMX_MLA backend VNNI-packs private W_UK/W_UV copies in its impl "
    "(amx_mla.py::AMXMLAImpl.process_weights_after_loading) and empties "
    "kv_b_proj.weight; wcache has no plan for it. Serve with --attention-backend "
    "CPU_MLA (the reference CPU backend, planned), or load without wcache",
}


def _match_mla(config: LayerConfig, target: Target) -> str | None:
    """None when vLLM's MLA post-load on this layer is the generic absorption
    (``W_UV``/``W_UK_T`` as views of an unquantized ``kv_b_proj`` in the model dtype,
    then the default scales), else why wcache has no plan for it."""
    if config.quant.layer_kind != "attention":
        return "not an attention layer"
    backend = str(config.get("backend", "?"))
    if backend in MLA_PACKING_BACKENDS:
        return MLA_PACKING_BACKENDS[backend]
    if not config.get("impl_postload_noop", True):
        return (
            f"the MLA backend {backend}'s impl.process_weights_after_loading does work "
            "wcache has no stages for; load without wcache"
        )
    for flag, what in (
        ("aiter_bmm", "ROCm aiter FP8/FP4 BMM re-quantizes kv_b_proj into W_K/W_V"),
        ("dcp_q_replicate", "DCP query replication all-gathers W_UK_T across ranks"),
    ):
        if config.get(flag, False):
            return f"{what}; wcache has no plan for it. Load without wcache"
    method = str(config.get("kv_b_proj_method", "?"))
    if method != "UnquantizedLinearMethod":
        return (
            f"kv_b_proj is quantized ({method}): vLLM dequantizes it into new W_UV/W_UK_T "
            "bytes; wcache's MLA plan covers an unquantized kv_b_proj only. Load without "
            "wcache, or keep kv_b_proj unquantized"
        )
    weight_dtype, act_dtype = config.get("kv_b_proj_dtype"), config.params_dtype
    if weight_dtype != act_dtype:
        return (
            f"kv_b_proj is {weight_dtype} but the model dtype is {act_dtype}: vLLM casts "
            "it into new W_UV/W_UK_T bytes; the MLA plan covers views only"
        )
    if config.get("kv_cache_method") is not None:
        return (
            f"the MLA layer has a KV-cache quant method ({config.get('kv_cache_method')}) "
            "whose scales wcache's MLA plan does not load"
        )
    return None


MLA_ABSORB = register(
    Plan(
        method="mla_attention",
        kernel="absorb",
        devices=("cpu", "cuda"),
        stages=(
            mla.select_absorbed_weights,
            a.set_default_scales,
            a.set_scale_floats,
            a.copy_host_scales,
            a.alloc_kv_cache_placeholder,
        ),
        checkpoint=frozenset({*a.SCALE_BUFFERS, mla.KV_B_PROJ_WEIGHT}),
        match=_match_mla,
        description="MLA attention (DeepSeek-V2/V3) on every backend whose impl does no "
        "post-load work (CUDA TRITON_MLA/FLASHMLA/FLASHINFER_MLA/CUTLASS_MLA, CPU_MLA): "
        "W_UV/W_UK_T are views of the unquantized kv_b_proj.weight, rebuilt on restore "
        "over the mapped bytes (DERIVE, zero-copy); default scales as for attention.",
    )
)
