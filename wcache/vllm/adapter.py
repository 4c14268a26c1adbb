"""vLLM quant method objects -> wcache LayerConfig (the method -> plan adapter).

This is the only place that maps vLLM's quant method, scheme and kernel classes
(imported through :mod:`wcache.vllm.compat`, compared by exact type) to plans.
Unknown methods map to a QuantSpec whose method is the class name, so
``plan_for`` refuses them with a reason instead of guessing; so do attention
layers whose deferred post-load work has no plan (MLA, FP8 multimodal-encoder
attention, an overriding subclass).
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import evolve

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.vllm import compat, probe

#: KV-cache quant methods whose post-load work is BaseKVCacheMethod's (the
#: ``kv_cache`` plan); the compressed-tensors one has its own plan.
_KV_CACHE_METHODS = ("BaseKVCacheMethod", "Fp8KVCacheMethod", "ModelOptKVCacheMethod")
#: Deferred attention post-load work wcache refuses -> the QuantSpec method that
#: ``plan_for`` refuses with its reason (registered in :mod:`wcache.plans.attention`).
_ATTENTION_REFUSALS = {"mla": "mla_attention", "mm_encoder_fp8": "mm_encoder_attention_fp8"}


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.get_default_dtype()).removeprefix("torch.")


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _kernel_id(obj: Any, attr: str = "kernel") -> str | None:
    kernel = getattr(obj, attr, None)
    return None if kernel is None else compat.kernel_id(kernel)


def _mp_kernel_extra(owner: Any) -> dict[str, Any]:
    """What a Machete plan needs of vLLM's kernel config (``owner.kernel.config``, an
    ``MPLinearLayerConfig``): the weight's ScalarType id and the activation dtype, the
    arguments vLLM passes to ``machete_prepack_B``. Empty for every other kernel (their
    LayerConfig, hence their keys, stay as they were)."""
    kernel = getattr(owner, "kernel", None)
    if kernel is None or compat.kernel_id(kernel) != "machete":
        return {}
    cfg = kernel.config
    return {"machete_b_type_id": int(cfg.weight_type.id),
            "machete_act_type": _dtype_name(cfg.act_type)}


#: vLLM's online FP8 linear methods -> wcache method (``quantization/online/fp8.py``).
_ONLINE_FP8 = {"Fp8PerTensorOnlineLinearMethod": "fp8_per_tensor",
               "Fp8PtpcOnlineLinearMethod": "fp8_per_channel",
               "Fp8PerBlockOnlineLinearMethod": "fp8_per_block"}


def _fp8_config(quant_method: Any, module: torch.nn.Module, method: str, name: str,
                static_input: bool = False, strategy: str | None = None) -> LayerConfig:
    """Online or serialized FP8 on vLLM's scaled-mm kernel (``quant_method.fp8_linear``).

    ``quant_method`` is the object holding ``fp8_linear`` (a compressed-tensors
    scheme for ``ct_w8a8_fp8``); ``strategy`` the checkpoint's weight strategy
    (``"tensor"``, ``"channel"``, ``"block"``) where the method has one."""
    block = getattr(module, "weight_block_size", None) or getattr(
        quant_method, "weight_block_size", None)
    if strategy is None:
        strategy = "block" if block else ("channel" if method == "fp8_per_channel" else "tensor")
    extra = {"logical_widths": tuple(int(w) for w in module.logical_widths),
             "tp_size": int(getattr(module, "tp_size", 1) or 1)}
    if block:
        extra["weight_block_size"] = tuple(int(b) for b in block)
    spec = QuantSpec(method, num_bits=8, act_bits=8, strategy=strategy,
                     static_input=static_input, kernel=_kernel_id(quant_method, "fp8_linear"))
    return _linear_config(module, spec, name, extra)


def _modelopt_config(quant_method: Any, module: torch.nn.Module, name: str) -> LayerConfig:
    """ModelOpt's generic linear method (``ModelOptLinearMethod``): NVFP4 W4A4 ->
    ``modelopt_fp4`` with vLLM's NVFP4 kernel (``quant_method.kernel``; only CUTLASS has
    a plan); NVFP4 W4A16 -> ``modelopt_fp4_w4a16`` (no plan); other ModelOpt formats
    keep their weight scheme's class name (no plan)."""
    wkey = quant_method.wkey
    if not compat.is_type(wkey, "KNvfp4Static"):
        return _linear_config(module, QuantSpec(f"modelopt:{type(wkey).__name__}",
                                                kernel=_kernel_id(quant_method)), name)
    if quant_method.akey is None:
        return _linear_config(module, QuantSpec("modelopt_fp4_w4a16", num_bits=4,
                                                group_size=quant_method.ctx.group_size), name)
    kernel = quant_method.kernel
    kid = "cutlass" if compat.is_type(kernel, "CutlassNvFp4LinearKernel") \
        else type(kernel).__name__
    spec = QuantSpec("modelopt_fp4", num_bits=4, act_bits=4,
                     group_size=quant_method.ctx.group_size, kernel=kid)
    return _linear_config(module, spec, name,
                          {"logical_widths": tuple(int(w) for w in module.logical_widths)})


def _modelopt_fp4_moe_config(quant_method: Any, module: torch.nn.Module,
                             name: str) -> LayerConfig:
    """ModelOpt NVFP4 fused MoE: kernel ``cutlass_moe`` for vLLM's ``VLLM_CUTLASS`` backend
    (CutlassExpertsFp4, W4A4); any other backend, W4A16 or per-token activations keep
    the backend's name (no plan)."""
    backend = getattr(quant_method.nvfp4_backend, "name", str(quant_method.nvfp4_backend))
    kid = "cutlass_moe" if backend == "VLLM_CUTLASS" else f"nvfp4_moe:{backend}"
    if quant_method.use_a16 or quant_method.per_token_activation:
        kid = f"{kid}+{'w4a16' if quant_method.use_a16 else 'per_token_activation'}"
    moe = quant_method.moe
    spec = QuantSpec("modelopt_fp4", num_bits=4, act_bits=4,
                     group_size=quant_method.quant_config.group_size, layer_kind="moe",
                     kernel=kid)
    return LayerConfig(quant=spec, size_k=int(module.hidden_size),
                       size_n=int(module.intermediate_size_per_partition),
                       params_dtype=_dtype_name(getattr(module, "params_dtype", None)),
                       name=name, extra=(("is_act_and_mul", bool(moe.is_act_and_mul)),
                                         ("num_experts", int(module.local_num_experts))))


def sync_kernel_state_(module: torch.nn.Module) -> None:
    """Copy kernel state that plans keep on the layer into vLLM's kernel object.

    wcache's CUTLASS stages record the logical (unpadded) output width as
    ``layer.logical_output_size`` (:data:`wcache.stages.fp8.LOGICAL_OUTPUT_ATTR`);
    vLLM's ``CutlassFP8ScaledMMLinearKernel.apply_scaled_mm`` reads it from the
    kernel object, ``quant_method.fp8_linear`` (Fp8LinearMethod, online FP8) or
    ``layer.scheme.fp8_linear`` (compressed-tensors W8A8 FP8), and asserts it is not
    None on the first forward. ModelOpt NVFP4 MoE's modular kernel (process-local,
    built from the final tensors) is rebuilt by
    :func:`wcache.vllm.compat.build_nvfp4_moe_kernel_`; the "already processed" flag
    of the methods whose own post-load sets it, by
    :func:`wcache.vllm.compat.mark_postload_done_`. The width attribute is then
    deleted: vLLM's own layer has none, and the restored layer must equal it. Call
    after a plan's load or restore; a no-op elsewhere.
    """
    compat.build_nvfp4_moe_kernel_(module)
    compat.mark_postload_done_(module)
    width = getattr(module, "logical_output_size", None)
    if width is None:
        return
    moved = False
    for owner in (getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        kernel = getattr(owner, "fp8_linear", None)
        if kernel is not None and hasattr(kernel, "logical_output_size"):
            kernel.logical_output_size = int(width)
            moved = True
    if moved and "logical_output_size" in vars(module):
        # vLLM keeps the width on its kernel only; a layer attribute of wcache's own
        # would make the restored layer differ from vLLM's (wcache verify, H200)
        del module.logical_output_size


def _linear_config(module: torch.nn.Module, spec: QuantSpec, name: str,
                   extra: dict | None = None) -> LayerConfig:
    size_k = getattr(module, "input_size_per_partition", None)
    size_n = getattr(module, "output_size_per_partition", None)
    if size_k is None and getattr(module, "input_size", None) is not None:
        # ReplicatedLinear sets no per-partition sizes (its weight is unsharded)
        size_k, size_n = module.input_size, module.output_size
    if size_k is None:  # embeddings / lm_head
        size_k = getattr(module, "embedding_dim", 0)
        size_n = getattr(module, "num_embeddings_per_partition", 0)
    return LayerConfig(
        quant=spec, size_k=int(size_k), size_n=int(size_n),
        params_dtype=_dtype_name(getattr(module, "params_dtype", None)),
        has_bias=getattr(module, "bias", None) is not None, name=name,
        extra=tuple(sorted((extra or {}).items())))


def layer_config(quant_method: Any, module: torch.nn.Module, target: Target | None = None,
                 name: str = "") -> LayerConfig | None:
    """The LayerConfig of a vLLM module, or ``None`` when it has no post-load work.

    Args:
        quant_method: ``module.quant_method`` (may be ``None``).
        module: the vLLM layer (built on any device, meta included).
        target: where the layer runs; on CPU the unquantized GEMM and W8A8 INT8
            branch is asked of vLLM for this layer (:mod:`wcache.vllm.probe`).
        name: the module's qualified name, for messages.
    """
    c = compat.classes()
    cls = type(quant_method).__name__ if quant_method is not None else None

    def is_(name: str) -> bool:
        return compat.is_type(quant_method, name)

    is_kv_method = any(is_(n) for n in (*_KV_CACHE_METHODS, "CompressedTensorsKVCacheMethod"))
    postload = compat.attention_postload(module)
    if postload in _ATTENTION_REFUSALS or postload == "other":
        # vLLM's deferred attention post-load that no plan replays: refused by plan_for
        # (before any weight is read), whatever the layer's KV-cache method.
        method = _ATTENTION_REFUSALS.get(postload, f"vllm-attention:{type(module).__name__}")
        return LayerConfig(quant=QuantSpec(method, layer_kind="attention"), size_k=0, size_n=0,
                           name=name)
    if postload == "attention" and not is_kv_method:
        spec = QuantSpec("attention", layer_kind="attention")
        return LayerConfig(quant=spec, size_k=0, size_n=0, name=name,
                           params_dtype=_dtype_name(torch.get_default_dtype()),
                           extra=(("impl_postload_noop", compat.impl_postload_is_noop(module)),))
    if not isinstance(quant_method, c.QuantizeMethodBase):
        return None
    if is_("UnquantizedLinearMethod") or is_("UnquantizedEmbeddingMethod"):
        kind = "linear" if is_("UnquantizedLinearMethod") else "embedding"
        config = _linear_config(module, QuantSpec("unquantized", layer_kind=kind), name)
        if target is not None and target.device_type == "cpu":
            # the branch vLLM's dispatch takes for this weight on this host, asked of vLLM
            kernel = probe.unquantized_gemm_kernel(config.size_n, config.size_k, config.dtype)
            config = evolve(config, quant=evolve(config.quant, kernel=kernel))
        return config
    if is_("AutoAWQMarlinLinearMethod"):
        qc = quant_method.quant_config
        spec = QuantSpec("awq", num_bits=qc.weight_bits, group_size=qc.group_size,
                         zero_point=bool(qc.zero_point), kernel=_kernel_id(quant_method))
        return _linear_config(module, spec, name, _mp_kernel_extra(quant_method))
    if is_("AutoGPTQLinearMethod"):
        qc = quant_method.quant_config
        spec = QuantSpec("gptq", num_bits=qc.weight_bits, group_size=qc.group_size,
                         zero_point=not getattr(qc, "is_sym", True),
                         kernel=_kernel_id(quant_method))
        return _linear_config(module, spec, name, _mp_kernel_extra(quant_method))
    online_fp8 = next((m for n, m in _ONLINE_FP8.items() if is_(n)), None)
    if online_fp8 is not None:
        if getattr(quant_method, "requantization_source", None) is not None:
            # requantizing a serialized checkpoint: another post-load; no plan
            return _linear_config(module, QuantSpec(f"vllm:{cls}+requantization"), name)
        return _fp8_config(quant_method, module, online_fp8, name)
    if is_("Mxfp8OnlineLinearMethod"):
        if getattr(quant_method, "requantization_source", None) is not None:
            return _linear_config(module, QuantSpec(f"vllm:{cls}+requantization"), name)
        kernel = quant_method.kernel
        # MXFP8 kernels are their own family (Mxfp8LinearKernel): named here, not in
        # compat's scaled-mm / mixed-precision kernel table
        kid = "marlin" if compat.is_type(kernel, "MarlinMxfp8LinearKernel") \
            else type(kernel).__name__
        spec = QuantSpec("mxfp8", num_bits=8, group_size=32, kernel=kid)
        return _linear_config(module, spec, name)
    if is_("ModelOptNvFp4FusedMoE"):
        return _modelopt_fp4_moe_config(quant_method, module, name)
    if is_("ModelOptLinearMethod"):
        return _modelopt_config(quant_method, module, name)
    if is_("Fp8LinearMethod"):
        static = getattr(quant_method.quant_config, "activation_scheme", "dynamic") == "static"
        return _fp8_config(quant_method, module, "fp8", name, static_input=static)
    if is_("CompressedTensorsLinearMethod"):
        scheme = getattr(module, "scheme", None)
        scls = type(scheme).__name__
        if compat.is_type(scheme, "CompressedTensorsWNA16"):
            spec = QuantSpec("ct_w4a16", num_bits=scheme.num_bits, group_size=scheme.group_size,
                             zero_point=not scheme.symmetric, strategy=_enum_value(scheme.strategy),
                             kernel=_kernel_id(scheme))
            return _linear_config(module, spec, name, _mp_kernel_extra(scheme))
        if compat.is_type(scheme, "CompressedTensorsW8A8Fp8"):
            return _fp8_config(scheme, module, "ct_w8a8_fp8", name,
                               static_input=bool(scheme.is_static_input_scheme),
                               strategy=_enum_value(scheme.strategy))
        if compat.is_type(scheme, "CompressedTensorsW8A16Fp8"):
            # what vLLM builds for an FP8 W8A8 checkpoint below sm89: weight-only FP8
            # on scheme.linear_kernel (Marlin); the checkpoint format is ct_w8a8_fp8's
            spec = QuantSpec("ct_w8a8_fp8", num_bits=8, act_bits=16,
                             strategy=_enum_value(scheme.strategy),
                             static_input=bool(scheme.is_static_input_scheme),
                             kernel=_kernel_id(scheme, "linear_kernel"))
            extra = {"logical_widths": tuple(int(w) for w in module.logical_widths)}
            if scheme.weight_block_size:
                extra["weight_block_size"] = tuple(int(b) for b in scheme.weight_block_size)
            return _linear_config(module, spec, name, extra)
        if compat.is_type(scheme, "CompressedTensorsW8A8Int8"):
            kernel = _kernel_id(scheme)
            if kernel == "onednn":  # CPUInt8ScaledMMLinearKernel: SGL or oneDNN, vLLM's check
                kernel = probe.w8a8_int8_kernel(
                    int(module.output_size_per_partition), int(module.input_size_per_partition),
                    bool(scheme.input_symmetric))
            spec = QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8,
                             strategy=_enum_value(scheme.strategy),
                             static_input=bool(scheme.is_static_input_scheme),
                             input_symmetric=bool(scheme.input_symmetric), kernel=kernel)
            return _linear_config(module, spec, name, {
                "logical_widths": tuple(int(w) for w in module.logical_widths)})
        return _linear_config(module, QuantSpec(f"compressed-tensors:{scls}"), name)
    if is_("CompressedTensorsKVCacheMethod"):
        return LayerConfig(quant=QuantSpec("ct_kv_cache", layer_kind="attention"), size_k=0,
                           size_n=0, name=name)
    if any(is_(n) for n in _KV_CACHE_METHODS):
        return LayerConfig(quant=QuantSpec("kv_cache", layer_kind="attention"), size_k=0,
                           size_n=0, name=name,
                           extra=(("kv_cache_dtype", str(getattr(module, "kv_cache_dtype", "auto"))),))
    return _linear_config(module, QuantSpec(f"vllm:{cls}"), name)
