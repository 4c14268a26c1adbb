"""vLLM quant method objects -> wcache LayerConfig (the method -> plan adapter).

This is the only place that knows vLLM's quant method and kernel class names.
Unknown methods map to a QuantSpec whose method is the class name, so
``plan_for`` refuses them with a reason instead of guessing.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import evolve

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.vllm import probe

#: vLLM kernel class name -> wcache kernel id.
KERNEL_IDS = {
    "CPUWNA16LinearKernel": "cpu_wna16",
    "MarlinLinearKernel": "marlin",
    "MacheteLinearKernel": "machete",
    "ExllamaLinearKernel": "exllama",
    "Dynamic4bitLinearKernel": "dynamic_4bit",
    "ZentorchWNA16LinearKernel": "zentorch",
    "CutlassFP8ScaledMMLinearKernel": "cutlass",
    "CPUInt8ScaledMMLinearKernel": "onednn",
}


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.get_default_dtype()).removeprefix("torch.")


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _kernel_id(obj: Any) -> str | None:
    kernel = getattr(obj, "kernel", None)
    if kernel is None:
        return None
    cls = type(kernel).__name__
    return KERNEL_IDS.get(cls, cls)


def _impl_postload_is_noop(module: torch.nn.Module) -> bool:
    from vllm.v1.attention.backend import AttentionImplBase  # noqa: PLC0415

    impl = getattr(module, "impl", None)
    if impl is None:
        return True
    fn = getattr(type(impl), "process_weights_after_loading", None)
    base = getattr(AttentionImplBase, "process_weights_after_loading", None)
    return fn is None or fn is base


def _linear_config(module: torch.nn.Module, spec: QuantSpec, name: str,
                   extra: dict | None = None) -> LayerConfig:
    size_k = getattr(module, "input_size_per_partition", None)
    size_n = getattr(module, "output_size_per_partition", None)
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
    from vllm.model_executor.layers.attention import Attention  # noqa: PLC0415
    from vllm.model_executor.layers.quantization.base_config import (  # noqa: PLC0415
        QuantizeMethodBase,
    )

    cls = type(quant_method).__name__ if quant_method is not None else None
    if isinstance(module, Attention) and (quant_method is None or cls not in
                                          ("BaseKVCacheMethod", "Fp8KVCacheMethod",
                                           "ModelOptFp8KVCacheMethod", "CompressedTensorsKVCacheMethod")):
        spec = QuantSpec("attention", layer_kind="attention")
        return LayerConfig(quant=spec, size_k=0, size_n=0, name=name,
                           params_dtype=_dtype_name(torch.get_default_dtype()),
                           extra=(("impl_postload_noop", _impl_postload_is_noop(module)),))
    if not isinstance(quant_method, QuantizeMethodBase):
        return None
    if cls in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        kind = "linear" if cls == "UnquantizedLinearMethod" else "embedding"
        config = _linear_config(module, QuantSpec("unquantized", layer_kind=kind), name)
        if target is not None and target.device_type == "cpu":
            # the branch vLLM's dispatch takes for this weight on this host, asked of vLLM
            kernel = probe.unquantized_gemm_kernel(config.size_n, config.size_k, config.dtype)
            config = evolve(config, quant=evolve(config.quant, kernel=kernel))
        return config
    if cls == "AutoAWQMarlinLinearMethod":
        qc = quant_method.quant_config
        spec = QuantSpec("awq", num_bits=qc.weight_bits, group_size=qc.group_size,
                         zero_point=bool(qc.zero_point), kernel=_kernel_id(quant_method))
        return _linear_config(module, spec, name)
    if cls == "AutoGPTQLinearMethod":
        qc = quant_method.quant_config
        spec = QuantSpec("gptq", num_bits=qc.weight_bits, group_size=qc.group_size,
                         zero_point=not getattr(qc, "is_sym", True),
                         kernel=_kernel_id(quant_method))
        return _linear_config(module, spec, name)
    if cls == "CompressedTensorsLinearMethod":
        scheme = getattr(module, "scheme", None)
        scls = type(scheme).__name__
        if scls == "CompressedTensorsWNA16":
            spec = QuantSpec("ct_w4a16", num_bits=scheme.num_bits, group_size=scheme.group_size,
                             zero_point=not scheme.symmetric, strategy=_enum_value(scheme.strategy),
                             kernel=_kernel_id(scheme))
            return _linear_config(module, spec, name)
        if scls == "CompressedTensorsW8A8Int8":
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
    if cls == "CompressedTensorsKVCacheMethod":
        return LayerConfig(quant=QuantSpec("ct_kv_cache", layer_kind="attention"), size_k=0,
                           size_n=0, name=name)
    if cls in ("BaseKVCacheMethod", "Fp8KVCacheMethod", "ModelOptFp8KVCacheMethod"):
        return LayerConfig(quant=QuantSpec("kv_cache", layer_kind="attention"), size_k=0,
                           size_n=0, name=name,
                           extra=(("kv_cache_dtype", str(getattr(module, "kv_cache_dtype", "auto"))),))
    return _linear_config(module, QuantSpec(f"vllm:{cls}"), name)
