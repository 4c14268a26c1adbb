"""vLLM quant method objects -> wcache LayerConfig (the method -> plan adapter).

This is the only place that maps vLLM's quant method, scheme and kernel classes
(imported through :mod:`wcache.vllm.compat`, compared by exact type) to plans: a
registry from class name (a key of compat's class table) to one small function
``(quant_method, module, target, name) -> LayerConfig`` each, :data:`METHODS` for
quant methods and :data:`SCHEMES` for compressed-tensors schemes
(``tests/vllm/test_one_door.py`` checks that they cover every quant method and
scheme class of compat's table). Unknown methods map to a QuantSpec whose method
is the class name, so ``plan_for`` refuses them with a reason instead of
guessing; so do attention layers whose deferred post-load work has no plan (FP8
multimodal-encoder attention, an overriding subclass). MLA layers get the facts of
vLLM's MLA post-load (:func:`_mla_config`); the plan's match decides.

The adapter reads vLLM objects and writes none; what a plan leaves for vLLM's
kernel objects is bound by :func:`sync_kernel_state_` (compat's bindings, then a
fused-MoE layer's kernel objects from :mod:`wcache.vllm.moe`'s table).

Fused-MoE layers (vLLM's ``RoutedExperts``) get a :class:`~wcache.core.MoeShape`
with the backend vLLM's MoE oracle resolved (not the requested ``moe_backend``),
and the plan kernel id for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from attrs import evolve

from wcache.core import LayerConfig, MoeShape, QuantSpec, Target
from wcache.core.decisions import GEMM_TORCH_LINEAR
from wcache.plans.fused_moe import moe_kernel_id
from wcache.stages import cpu_wna16
from wcache.stages.moe_cpu import ZENTORCH_EXPERTS
from wcache.vllm import compat, moe, probe

#: Deferred attention post-load work wcache refuses -> the QuantSpec method that
#: ``plan_for`` refuses with its reason (registered in :mod:`wcache.plans.attention`).
_ATTENTION_REFUSALS = {"mm_encoder_fp8": "mm_encoder_attention_fp8"}


class _LinearLayer(Protocol):
    """The sizes vLLM's linear layers set in ``__init__`` and the adapters read
    (``vllm/model_executor/layers/linear.py::LinearBase`` and its subclasses;
    ``ReplicatedLinear`` has only ``input_size``/``output_size``)."""

    logical_widths: Sequence[int]
    input_size_per_partition: int
    output_size_per_partition: int
    input_size: int
    output_size: int


class _MoeLayer(Protocol):
    """The sizes vLLM's fused-MoE layer sets in ``__init__``
    (``vllm/model_executor/layers/fused_moe/layer.py::FusedMoE``)."""

    local_num_experts: int
    global_num_experts: int
    hidden_size: int
    intermediate_size_per_partition: int


class _MlaLayer(Protocol):
    """What vLLM's ``MLAAttention`` sets in ``__init__`` and :func:`_mla_config` reads
    (``vllm/model_executor/layers/attention/mla_attention.py``)."""

    kv_b_proj: torch.nn.Module
    kv_lora_rank: int
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    attn_backend: Any


def _linear(module: torch.nn.Module) -> _LinearLayer:
    """``module`` read as the vLLM linear layer it is: torch types a Module's unknown
    attributes ``Tensor | Module``, vLLM (not type-checked here) sets these as ints."""
    return cast(_LinearLayer, module)


def _logical_widths(module: torch.nn.Module) -> tuple[int, ...]:
    """vLLM's ``logical_widths``: the output width of each fused projection."""
    return tuple(int(w) for w in _linear(module).logical_widths)


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
    return {
        "machete_b_type_id": int(cfg.weight_type.id),
        "machete_act_type": _dtype_name(cfg.act_type),
    }


def _wna16_layout(config: LayerConfig, target: Target | None) -> LayerConfig:
    """vLLM's ``CPUWNA16LinearKernel`` serves two weight layouts, chosen per layer from
    the host in its post-load (``use_w4a8``); name the w4a8 one ``cpu_wna16_w4a8`` so
    the plan of that layout is the one that resolves. The choice is
    :func:`wcache.stages.cpu_wna16.use_w4a8_for` on the Target (vLLM's expression),
    and both plans record it, so a restore on a host that chooses otherwise raises."""
    if (
        config.quant.kernel != "cpu_wna16"
        or target is None
        or not cpu_wna16.use_w4a8_for(config.dtype, target)
    ):
        return config
    return evolve(config, quant=evolve(config.quant, kernel="cpu_wna16_w4a8"))


def _release_layer_attrs(obj: Any) -> dict[str, Any]:
    """The layer attributes the installed vLLM release's post-load of ``obj`` adds
    (``compat.VllmRelease.layer_attrs``; vLLM 0.33's compressed-tensors FP8 schemes:
    ``processed_weight_dims``), as ``LayerConfig`` extras: the plan that sets them is
    chosen by their presence (its tensor/channel branches only; block FP8 sets none)."""
    return dict(compat.postload_layer_attrs(obj))


def _fp8_config(
    quant_method: Any,
    module: torch.nn.Module,
    method: str,
    name: str,
    static_input: bool = False,
    strategy: str | None = None,
) -> LayerConfig:
    """Online or serialized FP8 on vLLM's scaled-mm kernel (``quant_method.fp8_linear``).

    ``quant_method`` is the object holding ``fp8_linear`` (a compressed-tensors
    scheme for ``ct_w8a8_fp8``); ``strategy`` the checkpoint's weight strategy
    (``"tensor"``, ``"channel"``, ``"block"``) where the method has one."""
    block = getattr(module, "weight_block_size", None) or getattr(
        quant_method, "weight_block_size", None
    )
    if strategy is None:
        strategy = "block" if block else ("channel" if method == "fp8_per_channel" else "tensor")
    extra = {
        "logical_widths": _logical_widths(module),
        "tp_size": int(getattr(module, "tp_size", 1) or 1),
    }
    if block:
        extra["weight_block_size"] = tuple(int(b) for b in block)
    else:
        extra.update(_release_layer_attrs(quant_method))
    spec = QuantSpec(
        method,
        num_bits=8,
        act_bits=8,
        strategy=strategy,
        static_input=static_input,
        kernel=_kernel_id(quant_method, "fp8_linear"),
    )
    return _linear_config(module, spec, name, extra)


#: wcache kernel id -> vLLM NVFP4 linear kernel class (a name in compat's class table).
_NVFP4_LINEAR_KERNELS = {"cutlass": "CutlassNvFp4LinearKernel", "marlin": "MarlinNvFp4LinearKernel"}
#: vLLM NVFP4 MoE backend (``NvFp4MoeBackend`` member name) -> wcache kernel id.
_NVFP4_MOE_KERNELS = {"VLLM_CUTLASS": "cutlass_moe", "MARLIN": "marlin_moe"}


def _modelopt_config(quant_method: Any, module: torch.nn.Module, name: str) -> LayerConfig:
    """ModelOpt's generic linear method (``ModelOptLinearMethod``): NVFP4 W4A4 ->
    ``modelopt_fp4`` with vLLM's NVFP4 kernel (``quant_method.kernel``; CUTLASS and
    Marlin have plans); NVFP4 W4A16 -> ``modelopt_fp4_w4a16`` (no plan); MXFP8 ->
    ``modelopt_mxfp8`` with vLLM's MXFP8 kernel (Marlin has a plan); other ModelOpt
    formats keep their weight scheme's class name (no plan)."""
    wkey = quant_method.wkey
    if compat.is_type(wkey, "KMxfp8Static"):
        kernel = quant_method.kernel
        kid = (
            "marlin" if compat.is_type(kernel, "MarlinMxfp8LinearKernel") else type(kernel).__name__
        )
        spec = QuantSpec("modelopt_mxfp8", num_bits=8, group_size=32, kernel=kid)
        return _linear_config(module, spec, name)
    if not compat.is_type(wkey, "KNvfp4Static"):
        return _linear_config(
            module,
            QuantSpec(f"modelopt:{type(wkey).__name__}", kernel=_kernel_id(quant_method)),
            name,
        )
    if quant_method.akey is None:
        return _linear_config(
            module,
            QuantSpec("modelopt_fp4_w4a16", num_bits=4, group_size=quant_method.ctx.group_size),
            name,
        )
    kernel = quant_method.kernel
    kid = next(
        (k for k, cls in _NVFP4_LINEAR_KERNELS.items() if compat.is_type(kernel, cls)),
        type(kernel).__name__,
    )
    spec = QuantSpec(
        "modelopt_fp4", num_bits=4, act_bits=4, group_size=quant_method.ctx.group_size, kernel=kid
    )
    return _linear_config(module, spec, name, {"logical_widths": _logical_widths(module)})


def _moe_config(
    quant_method: Any,
    module: torch.nn.Module,
    spec: QuantSpec,
    name: str,
    extra: dict | None = None,
) -> LayerConfig:
    """A fused-MoE layer (vLLM's ``RoutedExperts``): its :class:`~wcache.core.MoeShape`
    with the backend and experts class vLLM's oracle resolved for ``quant_method``
    (:func:`wcache.vllm.moe.resolved_backend`), and ``spec.kernel`` the plan kernel id
    for them (:func:`wcache.plans.fused_moe.moe_kernel_id`) unless ``spec`` names one."""
    backend, experts = moe.resolved_backend(quant_method)
    moe_config = quant_method.moe
    activation = _enum_value(getattr(moe_config, "activation", "silu"))
    if backend == "CPU":
        from vllm.model_executor.kernels.linear.zentorch_utils import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
            is_zentorch_moe_supported,
        )

        if is_zentorch_moe_supported(module):  # vLLM's own post-load check (zentorch op)
            experts = ZENTORCH_EXPERTS
    layer = cast(_MoeLayer, module)  # torch types it Module; vLLM sets these sizes (ints)
    shape = MoeShape(
        num_experts=int(layer.local_num_experts),
        global_num_experts=int(layer.global_num_experts),
        hidden_size=int(layer.hidden_size),
        intermediate_size_per_partition=int(layer.intermediate_size_per_partition),
        backend=backend,
        experts=experts,
        is_act_and_mul=bool(moe_config.is_act_and_mul),
        has_bias=bool(getattr(moe_config, "has_bias", False)),
        activation=str(activation).lower(),
    )
    if spec.kernel is None:
        spec = evolve(spec, kernel=moe_kernel_id(backend, experts))
    extra = {"moe_tp_size": int(getattr(moe_config, "tp_size", 1) or 1), **(extra or {})}
    return LayerConfig(
        quant=evolve(spec, layer_kind="moe"),
        size_k=0,
        size_n=0,
        params_dtype=_dtype_name(getattr(module, "params_dtype", None)),
        has_bias=shape.has_bias,
        name=name,
        moe=shape,
        extra=tuple(sorted(extra.items())),
    )


def _modelopt_fp4_moe_config(quant_method: Any, module: torch.nn.Module, name: str) -> LayerConfig:
    """ModelOpt NVFP4 fused MoE: kernel ``cutlass_moe`` for vLLM's ``VLLM_CUTLASS`` backend
    (CutlassExpertsFp4, W4A4), ``marlin_moe`` for ``MARLIN`` (MarlinExperts, weight-only,
    the sm90 choice); any other backend, W4A16 checkpoints or per-token activations
    keep the backend's name (no plan)."""
    backend = getattr(quant_method.nvfp4_backend, "name", str(quant_method.nvfp4_backend))
    kid = _NVFP4_MOE_KERNELS.get(backend, f"nvfp4_moe:{backend}")
    if quant_method.use_a16 or quant_method.per_token_activation:
        kid = f"{kid}+{'w4a16' if quant_method.use_a16 else 'per_token_activation'}"
    spec = QuantSpec(
        "modelopt_fp4",
        num_bits=4,
        act_bits=4,
        group_size=quant_method.quant_config.group_size,
        layer_kind="moe",
        kernel=kid,
    )
    return _moe_config(
        quant_method, module, spec, name, {"is_act_and_mul": bool(quant_method.moe.is_act_and_mul)}
    )


def _unquantized_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """``UnquantizedFusedMoEMethod``: the resolved backend decides the plan (TRITON on
    CUDA sm90, CPU on vLLM-CPU; any other is refused naming it)."""
    return _moe_config(quant_method, module, QuantSpec("unquantized_moe"), name)


def _fp8_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """Serialized FP8 fused MoE (``Fp8MoEMethod``): block (``weight_block_size``) or per
    tensor, with static or dynamic activation scales."""
    static = getattr(quant_method.quant_config, "activation_scheme", "dynamic") == "static"
    block = getattr(quant_method, "weight_block_size", None)
    method = "fp8_moe_block" if block else "fp8_moe_tensor"
    spec = QuantSpec(
        method, num_bits=8, act_bits=8, strategy="block" if block else "tensor", static_input=static
    )
    extra = {"weight_block_size": tuple(int(b) for b in block)} if block else {}
    return _moe_config(quant_method, module, spec, name, extra)


def _mxfp4_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """Canonical MXFP4 fused MoE (``Mxfp4MoEMethod``): the resolved backend decides the
    plan (MARLIN on sm90 without FlashInfer or Humming; any other is refused naming it)."""
    return _moe_config(
        quant_method, module, QuantSpec("mxfp4_moe", num_bits=4, group_size=32), name
    )


def _gpt_oss_mxfp4_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """GPT-OSS MXFP4 fused MoE (``GptOssMxfp4MoEMethod``): planned on MARLIN, refused by
    name on vLLM's triton_kernels backends (:mod:`wcache.plans.mxfp4` gives why)."""
    spec = QuantSpec("gpt_oss_mxfp4", num_bits=4, group_size=32)
    return _moe_config(quant_method, module, spec, name)


def _online_fp8_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """``Fp8PerTensorOnlineMoEMethod`` (``quantization="fp8"`` on a bf16 checkpoint)."""
    if getattr(quant_method, "requantization_source", None) is not None:
        spec = QuantSpec(f"vllm:{type(quant_method).__name__}+requantization")
    else:
        spec = QuantSpec("fp8_per_tensor_moe", num_bits=8, act_bits=8, strategy="tensor")
    return _moe_config(quant_method, module, spec, name)


def _marlin_input_option(quant_method: Any) -> tuple[tuple[str, str], ...]:
    """``(("marlin_input_dtype", "int8"|"fp8"...),)`` where vLLM set 8-bit Marlin
    activations on the MoE method (``get_marlin_input_dtype``), else ``()``: the Marlin
    MoE plans refuse that layout by name."""
    dtype = getattr(quant_method, "input_dtype", None)
    if dtype is None or dtype.itemsize != 1:
        return ()
    return (("marlin_input_dtype", "fp8" if dtype.is_floating_point else "int8"),)


def _awq_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """``AutoAWQMoEMethod``: AWQ int4 experts (Marlin on sm90)."""
    qc = quant_method.quant_config
    spec = QuantSpec(
        "awq_moe",
        num_bits=qc.weight_bits,
        group_size=qc.group_size,
        zero_point=bool(qc.zero_point),
        options=_marlin_input_option(quant_method),
    )
    return _moe_config(quant_method, module, spec, name)


def _gptq_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """``AutoGPTQMoEMethod``: GPTQ int4/int8 experts (Marlin on sm90)."""
    qc = quant_method.quant_config
    spec = QuantSpec(
        "gptq_moe",
        num_bits=qc.weight_bits,
        group_size=qc.group_size,
        zero_point=not qc.is_sym,
        options=_marlin_input_option(quant_method),
    )
    return _moe_config(quant_method, module, spec, name)


def _ct_wna16_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """``CompressedTensorsWNA16MoEMethod``: pack-quantized int4/int8 experts, group or
    channel (Marlin on sm90)."""
    spec = QuantSpec(
        "ct_w4a16_moe",
        num_bits=quant_method.num_bits,
        group_size=quant_method.group_size,
        zero_point=not quant_method.symmetric,
        strategy=_enum_value(quant_method.strategy),
        options=_marlin_input_option(quant_method),
    )
    return _moe_config(quant_method, module, spec, name)


def _ct_w8a8_fp8_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """compressed-tensors W8A8 FP8 fused MoE (``CompressedTensorsW8A8Fp8MoEMethod``):
    method ``ct_w8a8_fp8_moe_<weight strategy>`` (``channel``: dynamic per-token
    activations; ``tensor``: one scale per expert and shard, static or dynamic
    activations; ``block``: no plan, refused by ``plan_for`` naming the method)."""
    strategy = str(_enum_value(quant_method.weight_quant.strategy)).lower()
    spec = QuantSpec(
        f"ct_w8a8_fp8_moe_{strategy}",
        num_bits=8,
        act_bits=8,
        strategy=strategy,
        static_input=bool(quant_method.static_input_scales),
    )
    block = getattr(quant_method, "weight_block_size", None)
    extra = {"weight_block_size": tuple(int(b) for b in block)} if block else {}
    return _moe_config(quant_method, module, spec, name, extra)


def _linear_config(
    module: torch.nn.Module, spec: QuantSpec, name: str, extra: dict | None = None
) -> LayerConfig:
    layer = _linear(module)
    if getattr(module, "input_size_per_partition", None) is not None:
        size_k, size_n = layer.input_size_per_partition, layer.output_size_per_partition
    elif getattr(module, "input_size", None) is not None:
        # ReplicatedLinear sets no per-partition sizes (its weight is unsharded)
        size_k, size_n = layer.input_size, layer.output_size
    else:  # embeddings / lm_head
        size_k = getattr(module, "embedding_dim", 0)
        size_n = getattr(module, "num_embeddings_per_partition", 0)
    return LayerConfig(
        quant=spec,
        size_k=int(size_k),
        size_n=int(size_n),
        params_dtype=_dtype_name(getattr(module, "params_dtype", None)),
        has_bias=getattr(module, "bias", None) is not None,
        name=name,
        extra=tuple(sorted((extra or {}).items())),
    )


#: ``(quant_method, module, target, name) -> LayerConfig``: one vLLM class's mapping.
Adapter = Callable[[Any, torch.nn.Module, "Target | None", str], LayerConfig]


def _mla_config(module: torch.nn.Module, name: str) -> LayerConfig:
    """vLLM's ``MLAAttention``: the dimensions ``split_kv_b_proj`` uses, the backend
    vLLM selected and the branch flags of its ``process_weights_after_loading`` (AMX
    BMM, ROCm aiter BMM, DCP query replication), ``kv_b_proj``'s quant method and
    weight dtype, the layer's KV-cache method (``None`` without one); ``params_dtype``
    is the model dtype (``kv_b_proj.params_dtype``, what vLLM passes as ``act_dtype``).

    Source: vllm/model_executor/layers/attention/mla_attention.py::MLAAttention."""
    # torch types a Module's unknown attributes Tensor | Module; vLLM sets these
    mla = cast(_MlaLayer, module)
    kv_b_proj = mla.kv_b_proj
    kv_method = getattr(module, "quant_method", None)
    weight = getattr(kv_b_proj, "weight", None)
    extra = {
        "kv_lora_rank": int(mla.kv_lora_rank),
        "num_heads": int(mla.num_heads),
        "qk_nope_head_dim": int(mla.qk_nope_head_dim),
        "v_head_dim": int(mla.v_head_dim),
        "backend": str(mla.attn_backend.get_name()),
        "impl_postload_noop": compat.impl_postload_is_noop(module),
        "amx_bmm": bool(getattr(module, "is_amx_bmm_enabled", False)),
        "aiter_bmm": bool(
            getattr(module, "is_aiter_triton_fp8_bmm_enabled", False)
            or getattr(module, "is_aiter_triton_fp4_bmm_enabled", False)
        ),
        "dcp_q_replicate": bool(getattr(module, "dcp_q_replicate", False)),
        "kv_b_proj_method": type(getattr(kv_b_proj, "quant_method", None)).__name__,
        "kv_b_proj_dtype": _dtype_name(None if weight is None else weight.dtype),
        "kv_cache_method": None if kv_method is None else type(kv_method).__name__,
    }
    # the model dtype vLLM passes as act_dtype (model_config.dtype): kv_b_proj was built
    # under it (params_dtype), whatever the default dtype is when the adapter runs
    act_dtype = getattr(kv_b_proj, "params_dtype", None)
    return LayerConfig(
        quant=QuantSpec("mla_attention", layer_kind="attention"),
        size_k=0,
        size_n=0,
        name=name,
        params_dtype=_dtype_name(act_dtype),
        extra=tuple(sorted(extra.items())),
    )


#: vLLM-CPU's unquantized post-load leaves a layer carrying this flag (MLA's
#: ``kv_b_proj``, set by ``MLAAttention.__init__``) on ``F.linear`` over the weight as
#: loaded, whatever its dispatch would pick (vllm/model_executor/layers/linear.py::
#: UnquantizedLinearMethod.process_weights_after_loading).
CPU_SKIP_GEMM_DISPATCH = "_cpu_skip_gemm_dispatch"


def _unquantized(kind: str) -> Adapter:
    def adapt(
        quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
    ) -> LayerConfig:
        """Unquantized linear / embedding; on CPU the branch vLLM's dispatch takes for
        this weight on this host, asked of vLLM (:mod:`wcache.vllm.probe`)."""
        config = _linear_config(module, QuantSpec("unquantized", layer_kind=kind), name)
        if target is not None and target.device_type == "cpu":
            if getattr(module, CPU_SKIP_GEMM_DISPATCH, False):
                kernel = GEMM_TORCH_LINEAR
            else:
                kernel = probe.unquantized_gemm_kernel(config.size_n, config.size_k, config.dtype)
            config = evolve(config, quant=evolve(config.quant, kernel=kernel))
        return config

    return adapt


def _awq(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    qc = quant_method.quant_config
    spec = QuantSpec(
        "awq",
        num_bits=qc.weight_bits,
        group_size=qc.group_size,
        zero_point=bool(qc.zero_point),
        kernel=_kernel_id(quant_method),
    )
    return _wna16_layout(_linear_config(module, spec, name, _mp_kernel_extra(quant_method)), target)


def _gptq(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    qc = quant_method.quant_config
    spec = QuantSpec(
        "gptq",
        num_bits=qc.weight_bits,
        group_size=qc.group_size,
        zero_point=not getattr(qc, "is_sym", True),
        kernel=_kernel_id(quant_method),
    )
    return _wna16_layout(_linear_config(module, spec, name, _mp_kernel_extra(quant_method)), target)


def _requantization(quant_method: Any, module: torch.nn.Module, name: str) -> LayerConfig | None:
    """An online method requantizing a serialized checkpoint: another post-load; no plan."""
    if getattr(quant_method, "requantization_source", None) is None:
        return None
    return _linear_config(
        module, QuantSpec(f"vllm:{type(quant_method).__name__}+requantization"), name
    )


def _online_fp8(method: str) -> Adapter:
    def adapt(
        quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
    ) -> LayerConfig:
        """vLLM's online FP8 linear methods (``quantization/online/fp8.py``)."""
        return _requantization(quant_method, module, name) or _fp8_config(
            quant_method, module, method, name
        )

    return adapt


def _online_mxfp8(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    requantized = _requantization(quant_method, module, name)
    if requantized is not None:
        return requantized
    kernel = quant_method.kernel
    # MXFP8 kernels are their own family (Mxfp8LinearKernel): named here, not in
    # compat's scaled-mm / mixed-precision kernel table
    kid = "marlin" if compat.is_type(kernel, "MarlinMxfp8LinearKernel") else type(kernel).__name__
    return _linear_config(module, QuantSpec("mxfp8", num_bits=8, group_size=32, kernel=kid), name)


def _modelopt_fp4_moe(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    return _modelopt_fp4_moe_config(quant_method, module, name)


def _modelopt_linear(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    return _modelopt_config(quant_method, module, name)


def _fp8(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    static = getattr(quant_method.quant_config, "activation_scheme", "dynamic") == "static"
    return _fp8_config(quant_method, module, "fp8", name, static_input=static)


def _compressed_tensors(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """compressed-tensors: the layer's scheme decides (:data:`SCHEMES`)."""
    scheme = getattr(module, "scheme", None)
    adapt = _lookup(SCHEMES, scheme)
    if adapt is None:
        return _linear_config(
            module, QuantSpec(f"compressed-tensors:{type(scheme).__name__}"), name
        )
    return adapt(scheme, module, target, name)


def _ct_kv_cache(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    return LayerConfig(
        quant=QuantSpec("ct_kv_cache", layer_kind="attention"), size_k=0, size_n=0, name=name
    )


def _kv_cache(
    quant_method: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """KV-cache methods whose post-load work is BaseKVCacheMethod's (``kv_cache`` plan)."""
    return LayerConfig(
        quant=QuantSpec("kv_cache", layer_kind="attention"),
        size_k=0,
        size_n=0,
        name=name,
        extra=(("kv_cache_dtype", str(getattr(module, "kv_cache_dtype", "auto"))),),
    )


def _ct_wna16(
    scheme: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    spec = QuantSpec(
        "ct_w4a16",
        num_bits=scheme.num_bits,
        group_size=scheme.group_size,
        zero_point=not scheme.symmetric,
        strategy=_enum_value(scheme.strategy),
        kernel=_kernel_id(scheme),
    )
    return _wna16_layout(_linear_config(module, spec, name, _mp_kernel_extra(scheme)), target)


def _ct_w8a8_fp8(
    scheme: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    return _fp8_config(
        scheme,
        module,
        "ct_w8a8_fp8",
        name,
        static_input=bool(scheme.is_static_input_scheme),
        strategy=_enum_value(scheme.strategy),
    )


def _ct_w8a16_fp8(
    scheme: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    """What vLLM builds for an FP8 W8A8 checkpoint below sm89: weight-only FP8 on
    ``scheme.linear_kernel`` (Marlin); the checkpoint format is ct_w8a8_fp8's."""
    spec = QuantSpec(
        "ct_w8a8_fp8",
        num_bits=8,
        act_bits=16,
        strategy=_enum_value(scheme.strategy),
        static_input=bool(scheme.is_static_input_scheme),
        kernel=_kernel_id(scheme, "linear_kernel"),
    )
    extra = {"logical_widths": _logical_widths(module)}
    if scheme.weight_block_size:
        extra["weight_block_size"] = tuple(int(b) for b in scheme.weight_block_size)
    else:
        extra.update(_release_layer_attrs(scheme))
    return _linear_config(module, spec, name, extra)


def _ct_w8a8_int8(
    scheme: Any, module: torch.nn.Module, target: Target | None, name: str
) -> LayerConfig:
    kernel = _kernel_id(scheme)
    if kernel == "onednn":  # CPUInt8ScaledMMLinearKernel: SGL or oneDNN, vLLM's check
        kernel = probe.w8a8_int8_kernel(
            int(_linear(module).output_size_per_partition),
            int(_linear(module).input_size_per_partition),
            bool(scheme.input_symmetric),
        )
    spec = QuantSpec(
        "ct_w8a8_int8",
        num_bits=8,
        act_bits=8,
        strategy=_enum_value(scheme.strategy),
        static_input=bool(scheme.is_static_input_scheme),
        input_symmetric=bool(scheme.input_symmetric),
        kernel=kernel,
    )
    return _linear_config(module, spec, name, {"logical_widths": _logical_widths(module)})


#: vLLM quant-method class (a name in compat's class table) -> its adapter.
METHODS: dict[str, Adapter] = {
    "UnquantizedLinearMethod": _unquantized("linear"),
    "UnquantizedEmbeddingMethod": _unquantized("embedding"),
    "AutoAWQMarlinLinearMethod": _awq,
    "AutoGPTQLinearMethod": _gptq,
    "Fp8PerTensorOnlineLinearMethod": _online_fp8("fp8_per_tensor"),
    "Fp8PtpcOnlineLinearMethod": _online_fp8("fp8_per_channel"),
    "Fp8PerBlockOnlineLinearMethod": _online_fp8("fp8_per_block"),
    "Mxfp8OnlineLinearMethod": _online_mxfp8,
    "ModelOptNvFp4FusedMoE": _modelopt_fp4_moe,
    "UnquantizedFusedMoEMethod": _unquantized_moe,
    "Fp8MoEMethod": _fp8_moe,
    "Fp8PerTensorOnlineMoEMethod": _online_fp8_moe,
    "AutoAWQMoEMethod": _awq_moe,
    "AutoGPTQMoEMethod": _gptq_moe,
    "CompressedTensorsWNA16MoEMethod": _ct_wna16_moe,
    "CompressedTensorsW8A8Fp8MoEMethod": _ct_w8a8_fp8_moe,
    "Mxfp4MoEMethod": _mxfp4_moe,
    "GptOssMxfp4MoEMethod": _gpt_oss_mxfp4_moe,
    "ModelOptLinearMethod": _modelopt_linear,
    "Fp8LinearMethod": _fp8,
    "CompressedTensorsLinearMethod": _compressed_tensors,
    "CompressedTensorsKVCacheMethod": _ct_kv_cache,
    "BaseKVCacheMethod": _kv_cache,
    "Fp8KVCacheMethod": _kv_cache,
    "ModelOptKVCacheMethod": _kv_cache,
}

#: compressed-tensors scheme class (a name in compat's class table) -> its adapter
#: (called with the scheme in place of the quant method).
SCHEMES: dict[str, Adapter] = {
    "CompressedTensorsWNA16": _ct_wna16,
    "CompressedTensorsW8A8Fp8": _ct_w8a8_fp8,
    "CompressedTensorsW8A16Fp8": _ct_w8a16_fp8,
    "CompressedTensorsW8A8Int8": _ct_w8a8_int8,
}

#: The KV-cache methods (their layers are attention layers with a plan of their own).
_KV_CACHE_METHODS = frozenset(n for n, f in METHODS.items() if f in (_kv_cache, _ct_kv_cache))


def _lookup(registry: dict[str, Adapter], obj: Any) -> Adapter | None:
    """The adapter of ``obj``'s exact vLLM class (by name, then identity with compat's
    class), or None."""
    cls_name = type(obj).__name__
    adapt = registry.get(cls_name)
    return adapt if adapt is not None and compat.is_type(obj, cls_name) else None


def layer_config(
    quant_method: Any, module: torch.nn.Module, target: Target | None = None, name: str = ""
) -> LayerConfig | None:
    """The LayerConfig of a vLLM module, or ``None`` when it has no post-load work.

    Args:
        quant_method: ``module.quant_method`` (may be ``None``).
        module: the vLLM layer (built on any device, meta included).
        target: where the layer runs; on CPU the unquantized GEMM and W8A8 INT8
            branch is asked of vLLM for this layer (:mod:`wcache.vllm.probe`).
        name: the module's qualified name, for messages.
    """
    is_kv_method = (
        _lookup(METHODS, quant_method) is not None
        and type(quant_method).__name__ in _KV_CACHE_METHODS
    )
    postload = compat.attention_postload(module)
    if postload in _ATTENTION_REFUSALS or postload == "other":
        # vLLM's deferred attention post-load that no plan replays: refused by plan_for
        # (before any weight is read), whatever the layer's KV-cache method.
        method = _ATTENTION_REFUSALS.get(postload, f"vllm-attention:{type(module).__name__}")
        return LayerConfig(
            quant=QuantSpec(method, layer_kind="attention"), size_k=0, size_n=0, name=name
        )
    if postload == "mla":
        return _mla_config(module, name)
    if postload == "attention" and not is_kv_method:
        spec = QuantSpec("attention", layer_kind="attention")
        return LayerConfig(
            quant=spec,
            size_k=0,
            size_n=0,
            name=name,
            params_dtype=_dtype_name(torch.get_default_dtype()),
            extra=(("impl_postload_noop", compat.impl_postload_is_noop(module)),),
        )
    if not isinstance(quant_method, compat.classes().QuantizeMethodBase):
        return None
    adapt = _lookup(METHODS, quant_method)
    if adapt is None:
        return _linear_config(module, QuantSpec(f"vllm:{type(quant_method).__name__}"), name)
    return adapt(quant_method, module, target, name)


def sync_kernel_state_(module: torch.nn.Module) -> None:
    """Put the kernel state a plan left on ``module`` where vLLM keeps it; call after a
    plan's load or restore (a no-op elsewhere, and idempotent):
    :func:`wcache.vllm.compat.sync_kernel_state_` (kernel bindings, the "already
    processed" flag), then a fused-MoE layer's kernel objects
    (:func:`wcache.vllm.moe.rebuild_moe_kernel_`, from the one table).

    Raises:
        NoPlan: a fused-MoE layer without kernel objects whose (method, backend) has no
            row in :data:`wcache.vllm.moe.KERNELS`.
    """
    compat.sync_kernel_state_(module)
    moe.rebuild_moe_kernel_(module)
