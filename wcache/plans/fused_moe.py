"""Fused-MoE plans: unquantized (CUDA Triton, CPU), serialized FP8 (block and per
tensor, Triton), online FP8 per tensor (Triton).

A MoE plan's kernel id is the backend vLLM's MoE oracle resolved for the layer
(``MoeShape.backend``, lower case: ``triton``), or on CPU the backend and the
experts class's isa (``cpu_vec``, ``cpu_amx``): the layout follows the resolved
kernel, so the plan id (hence the cache key, which lists every plan id) does too.
Every plan's match checks the resolved backend and experts class again.

What vLLM 0.32/0.33 does after load, per plan (read from their source):

* ``unquantized_moe/triton``: ``UnquantizedFusedMoEMethod`` on CUDA, backend
  ``TRITON`` (sm90 moves the FlashInfer backends behind Triton), ``TritonExperts``:
  ``_maybe_pad_weight`` copies each weight into itself (ROCm only pads),
  ``convert_to_unquantized_kernel_format`` returns ``.contiguous()`` tensors,
  ``TritonExperts.process_weights_after_loading`` is the base no-op. METADATA only:
  the checkpoint bytes are the kernel's.
* ``fp8_moe_block/triton`` (block 128x128): ``Fp8MoEMethod``, backend ``TRITON`` (on sm90
  for block FP8 and TP, moved to the front); ``convert_to_fp8_moe_kernel_format``
  passes TRITON through. METADATA only.
* ``fp8_moe_tensor/triton`` (per tensor): the same method and backend (no FlashInfer in
  the bundle: FlashInfer CUTLASS is unavailable; DeepGEMM takes block FP8 only; the
  vLLM CUTLASS backend is not allowed for ``Fp8MoEMethod``); vLLM requantizes the
  w1/w3 shards to the max scale in place and, with static activations, reduces
  the input scales: TRANSFORMs the daemon runs once.
* ``fp8_per_tensor_moe/triton``: ``Fp8PerTensorOnlineMoEMethod`` (``quantization="fp8"``
  on a bf16 checkpoint), backend ``TRITON``: per-expert per-tensor quantization.
* ``fp8_moe_tensor/marlin`` and ``fp8_moe_block/marlin``: ``Fp8MoEMethod`` on vLLM's
  ``MARLIN`` backend (``MarlinExperts``: ``moe_backend="marlin"``, or any GPU below
  sm89): after the per-tensor steps above, ``prepare_fp8_moe_layer_for_marlin`` pads
  the intermediate to Marlin's MoE tiles, repacks every expert (``gptq_marlin_repack``,
  8 bits) and permutes the scales with the FP8 exponent bias fused
  (:mod:`wcache.stages.marlin_mx`): TRANSFORMs the daemon runs once.
* ``unquantized_moe/cpu_vec`` and ``cpu_amx``: vLLM-CPU pads the intermediate and
  prepacks (:mod:`wcache.stages.moe_cpu`).
* ``ct_w8a8_fp8_moe_channel/<backend>`` and ``ct_w8a8_fp8_moe_tensor/<backend>``:
  ``CompressedTensorsW8A8Fp8MoEMethod`` (channel weight scales with dynamic per-token
  activations; per-tensor weight scales, static activations). Its oracle call allows
  vLLM's CUTLASS experts (``allow_vllm_cutlass=True``), so on sm90 without FlashInfer
  it resolves ``VLLM_CUTLASS`` (``TritonOrCutlassExperts``) where vLLM's build has the
  CUTLASS grouped GEMM for the device, else ``TRITON`` (``TritonExperts``); both
  consume the checkpoint layout (``convert_to_fp8_moe_kernel_format`` passes them
  through), so channel is METADATA only and tensor runs the same two TRANSFORMs as
  ``fp8_moe_tensor/triton`` (w1/w3 requantized to the max scale, input scales
  reduced), once, in the daemon. The method has no pre-processed branch: restore
  rebuilds the kernel objects with vLLM's ``make_fp8_moe_kernel``
  (``wcache.vllm.moe``), never its post-load.

Every other backend vLLM can resolve for these methods (FlashInfer CUTLASS / TRTLLM,
DeepGEMM, Marlin, AITER, batched and EP variants, ...) is refused by name before
any weight is read (:data:`UNPLANNED_BACKENDS` gives why).
"""

from __future__ import annotations

import functools

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.registry import register
from wcache.stages import marlin_mx, moe, moe_cpu

__all__ = [
    "MOE_METHODS",
    "UNPLANNED_BACKENDS",
    "moe_kernel_id",
    "UNQUANTIZED_TRITON",
    "UNQUANTIZED_CPU_VEC",
    "UNQUANTIZED_CPU_AMX",
    "FP8_BLOCK_TRITON",
    "FP8_TENSOR_TRITON",
    "FP8_ONLINE_TRITON",
    "CT_FP8_CHANNEL_PLANS",
    "CT_FP8_TENSOR_PLANS",
    "FP8_TENSOR_MARLIN",
    "FP8_BLOCK_MARLIN",
    "MARLIN_EXPERTS",
]

#: wcache's MoE method ids (``QuantSpec.method``), one per vLLM MoE method family.
MOE_METHODS = (
    "unquantized_moe",
    "fp8_moe_block",
    "fp8_moe_tensor",
    "fp8_per_tensor_moe",
    "ct_w8a8_fp8_moe_channel",
    "ct_w8a8_fp8_moe_tensor",
    "mxfp4_moe",
    "gpt_oss_mxfp4",
)

#: Backends vLLM's oracles can resolve for these methods that no plan covers, and
#: what their post-load does to the bytes (why a restore would need its own plan).
UNPLANNED_BACKENDS = {
    "FLASHINFER_CUTLASS": "swaps w13 to w31 (and, for FP8, clamps the scales in place "
    "and pads the intermediate to 16)",
    "FLASHINFER_TRTLLM": "re-lays the weights out in FlashInfer's block-major layout",
    "DEEPGEMM": "requantizes the block scales to UE8M0 in place and transforms their layout",
    "BATCHED_DEEPGEMM": "requantizes the block scales to UE8M0 in place",
    "MARLIN": "repacks the experts for Marlin (gptq_marlin_repack per expert; wcache "
    "plans it for FP8 and canonical MXFP4 MoE only)",
    "HUMMING": "repacks the experts for Humming",
    "AITER": "shuffles the weights for ROCm AITER",
    "VLLM_CUTLASS": "keeps the checkpoint layout for CUTLASS grouped GEMMs, which wcache "
    "plans for compressed-tensors W8A8 FP8 MoE only",
    "BATCHED_VLLM_CUTLASS": "runs CUTLASS grouped GEMMs on batched (EP all-to-all) "
    "activations, which wcache does not plan yet",
    "FLASHINFER_CUTLASS_MXFP4_BF16": "de-interleaves and swaps w13 and interleaves the "
    "MXFP4 scales for FlashInfer's sm90 mixed GEMM",
    "CPU_W8A8": "packs the experts for vLLM-CPU's AMX-FP8 kernel",
    "XPU": "lays the experts out for Intel XPU kernels",
    "HPC": "runs an out-of-tree HPC kernel wcache has no layout for",
    "NONE": "resolved no kernel (vLLM's oracle found no backend)",
    "TPU": "hands the weights to the TPU plugin, whose layout wcache does not know",
    "OOT": "hands the weights to an out-of-tree plugin, whose layout wcache does not know",
    "BATCHED_TRITON": "runs with batched (EP all-to-all) activations, which wcache does "
    "not plan yet",
    "MOONEP": "moves the weights into MoonEP's [E+B] gate/down split",
}

#: Method -> the vLLM class names its plans were checked against (messages only).
_VLLM_CLASSES = {
    "unquantized_moe": "UnquantizedFusedMoEMethod",
    "fp8_moe_block": "Fp8MoEMethod",
    "fp8_moe_tensor": "Fp8MoEMethod",
    "fp8_per_tensor_moe": "Fp8PerTensorOnlineMoEMethod",
    "ct_w8a8_fp8_moe_channel": "CompressedTensorsW8A8Fp8MoEMethod",
    "ct_w8a8_fp8_moe_tensor": "CompressedTensorsW8A8Fp8MoEMethod",
}
#: The vLLM experts class each CUDA plan was checked against.
TRITON_EXPERTS = "TritonExperts"
#: vLLM's experts class for backend VLLM_CUTLASS (CUTLASS grouped GEMM, Triton fallback
#: for small batches on sm100).
CUTLASS_EXPERTS = "TritonOrCutlassExperts"
#: The experts class of vLLM's (non-batched) MARLIN MoE backend.
MARLIN_EXPERTS = "MarlinExperts"


def moe_kernel_id(backend: str, experts: str) -> str:
    """The plan kernel id for vLLM's resolved MoE ``backend`` and experts class:
    ``"triton"``; on CPU ``"cpu_<isa>"`` (``cpu_vec``), ``"cpu_zentorch"`` for a layer
    vLLM hands to zentorch, ``"cpu:<class>"`` for an experts class without a layout."""
    if backend == "CPU":
        if experts == moe_cpu.ZENTORCH_EXPERTS:
            return "cpu_zentorch"
        known = moe_cpu.CPU_EXPERTS.get(experts)
        return f"cpu_{known.isa}" if known else f"cpu:{experts}"
    return backend.lower()


def _backend_reason(config: LayerConfig, backend: str, experts: str) -> str | None:
    moe_cfg = config.moe
    method = _VLLM_CLASSES.get(config.quant.method, config.quant.method)
    if config.quant.layer_kind != "moe" or moe_cfg is None:
        return f"this plan covers fused-MoE layers, not {config.quant.layer_kind} layers"
    if moe_cfg.backend != backend:
        why = UNPLANNED_BACKENDS.get(moe_cfg.backend, "has no wcache plan")
        return (
            f"vLLM's MoE oracle resolved backend {moe_cfg.backend} for {method} here, "
            f"whose post-load {why}; wcache plans {method} only on {backend}. Load "
            f"this model without wcache, or make vLLM pick {backend} (moe_backend)"
        )
    if experts and moe_cfg.experts != experts:
        return (
            f"vLLM picked experts {moe_cfg.experts!r} on backend {backend} for {method}; "
            f"this plan covers {experts!r}"
        )
    return None


def _match_cuda(
    config: LayerConfig, target: Target, *, backend: str, experts: str, tp_one: bool = False
) -> str | None:
    if target.device_type != "cuda":
        return f"needs a CUDA target, got {target.device_type!r}"
    reason = _backend_reason(config, backend, experts)
    if reason is None and tp_one and int(config.get("moe_tp_size", 1)) != 1:
        return (
            f"online FP8 MoE under MoE tensor parallelism {config.get('moe_tp_size')} "
            f"all-reduces each expert's amax across ranks while quantizing; wcache "
            f"plans it for a MoE TP size of 1 only"
        )
    return reason


def _match_cpu(config: LayerConfig, target: Target, *, experts: str) -> str | None:
    if target.device_type != "cpu":
        return f"needs a CPU target, got {target.device_type!r}"
    if config.moe is not None and config.moe.experts == moe_cpu.ZENTORCH_EXPERTS:
        return (
            "vLLM hands this MoE layer to zentorch's fused MoE (Zen CPU with zentorch "
            "loaded), which consumes unpacked weights and keeps a flag a restore cannot "
            "rebuild; wcache has no zentorch MoE plan: load without wcache"
        )
    return _backend_reason(config, "CPU", experts)


def _cuda(backend: str, experts: str = TRITON_EXPERTS, tp_one: bool = False):
    return functools.partial(_match_cuda, backend=backend, experts=experts, tp_one=tp_one)


def _cpu(experts: str):
    return functools.partial(_match_cpu, experts=experts)


_W13_W2 = frozenset({"w13_weight", "w2_weight", "w13_bias", "w2_bias"})

UNQUANTIZED_TRITON = register(
    Plan(
        method="unquantized_moe",
        kernel="triton",
        devices="cuda",
        stages=(moe.validate_expert_shapes, moe.set_experts_kernel),
        checkpoint=_W13_W2,
        match=_cuda("TRITON"),
        description="Unquantized fused MoE on CUDA, vLLM's TRITON backend (TritonExperts; what "
        "vLLM resolves on sm90): no post-load bytes; the loaded experts are "
        "exported and restore rebuilds vLLM's MoE kernel objects (METADATA).",
    )
)

UNQUANTIZED_CPU_VEC, UNQUANTIZED_CPU_AMX = (
    register(
        Plan(
            method="unquantized_moe",
            kernel=f"cpu_{moe_cpu.CPU_EXPERTS[cls].isa}",
            devices="cpu",
            stages=(
                moe_cpu.pad_intermediate,
                moe_cpu.pack_weights,
                moe.validate_expert_shapes,
                moe.set_experts_kernel,
            ),
            checkpoint=_W13_W2,
            # the padded bias goes into the loaded object (``layer.w13_bias.data =``,
            # which vLLM's apply reads through the quant config); the weights are
            # re-registered by replace_parameter (the default)
            # Source: vllm/model_executor/layers/fused_moe/experts/cpu_moe.py::
            # _pad_intermediate (0.32)
            reregistered={"w13_bias": Reregistration.DATA},
            match=_cpu(cls),
            description=f"Unquantized fused MoE on vLLM-CPU ({cls}, isa "
            f"{moe_cpu.CPU_EXPERTS[cls].isa}): the daemon pads the intermediate and "
            f"prepacks the experts (cpu_prepack_moe_weight, a non-idempotent "
            f"permutation, exported once, never replayed); restore rebuilds vLLM's MoE "
            f"kernel objects (METADATA).",
        )
    )
    for cls in ("CPUUnquantizedExperts", "X86CPUUnquantizedExperts")
)

_FP8_CHECKPOINT = frozenset(
    {
        "w13_weight",
        "w2_weight",
        "w13_weight_scale",
        "w2_weight_scale",
        "w13_weight_scale_inv",
        "w2_weight_scale_inv",
        "w13_input_scale",
        "w2_input_scale",
        "w13_bias",
        "w2_bias",
    }
)


#: Per-tensor FP8 MoE post-load requantizes w13 in place and hands ``replace_parameter``
#: the parameter itself, whose attributes the new one carries.
#: Source: vllm/model_executor/layers/quantization/fp8.py::Fp8MoEMethod
#: ._setup_kernel, compressed_tensors_moe_w8a8_fp8.py (replace_parameter(layer,
#: "w13_weight", w13)); vllm/model_executor/utils.py::replace_parameter
_W13_REQUANTIZED = {"w13_weight": Reregistration.REPLACE_OWN}


FP8_BLOCK_TRITON = register(
    Plan(
        method="fp8_moe_block",
        kernel="triton",
        devices="cuda",
        stages=(moe.validate_expert_shapes, moe.set_experts_kernel),
        checkpoint=_FP8_CHECKPOINT,
        match=_cuda("TRITON"),
        description="Serialized block FP8 (128x128) fused MoE (Fp8MoEMethod) on vLLM's TRITON "
        "backend (what vLLM resolves on sm90 for TP): no post-load bytes; restore "
        "rebuilds vLLM's MoE kernel objects (METADATA).",
    )
)

FP8_TENSOR_TRITON = register(
    Plan(
        method="fp8_moe_tensor",
        kernel="triton",
        devices="cuda",
        stages=(
            moe.reduce_input_scales,
            moe.process_weight_tensor_strategy,
            moe.validate_expert_shapes,
            moe.set_experts_kernel,
        ),
        reregistered=_W13_REQUANTIZED,
        checkpoint=_FP8_CHECKPOINT,
        match=_cuda("TRITON"),
        description="Serialized per-tensor FP8 fused MoE (Fp8MoEMethod) on vLLM's TRITON backend "
        "(what vLLM resolves on sm90 without FlashInfer): the daemon requantizes each "
        "expert's w1/w3 shards to their max scale once (vLLM does it in place; never "
        "replayed) and reduces static input scales to their max; restore rebuilds "
        "vLLM's MoE kernel objects (METADATA).",
    )
)

FP8_ONLINE_TRITON = register(
    Plan(
        method="fp8_per_tensor_moe",
        kernel="triton",
        devices="cuda",
        stages=(moe.quantize_per_tensor, moe.validate_expert_shapes, moe.set_experts_kernel),
        checkpoint=_W13_W2,
        match=_cuda("TRITON", tp_one=True),
        description="Online per-tensor FP8 fused MoE (quantization='fp8' on a bf16 checkpoint, "
        "Fp8PerTensorOnlineMoEMethod) on vLLM's TRITON backend: the daemon quantizes "
        "each expert once (one scale per expert and projection); restore rebuilds "
        "vLLM's MoE kernel objects (METADATA).",
    )
)


#: compressed-tensors W8A8 FP8 MoE: the backends vLLM 0.32/0.33 resolves for it on sm90
#: without FlashInfer, each with its experts class. Both keep the checkpoint layout.
_CT_FP8_BACKENDS = (("VLLM_CUTLASS", CUTLASS_EXPERTS), ("TRITON", TRITON_EXPERTS))


def _match_ct_channel(
    config: LayerConfig, target: Target, *, backend: str, experts: str
) -> str | None:
    reason = _match_cuda(config, target, backend=backend, experts=experts, tp_one=False)
    if reason is None and config.quant.static_input:
        return (
            "channel-wise FP8 MoE weights need dynamic per-token activations "
            "(vLLM raises for static ones); this layer has static input scales"
        )
    return reason


def _ct_channel_match(backend: str, experts: str):
    # a partial of a module-level function, as _cuda: plans pickle (the daemon's key)
    return functools.partial(_match_ct_channel, backend=backend, experts=experts)


CT_FP8_CHANNEL_PLANS = tuple(
    register(
        Plan(
            method="ct_w8a8_fp8_moe_channel",
            kernel=backend.lower(),
            devices="cuda",
            stages=(moe.validate_expert_shapes, moe.set_experts_kernel),
            checkpoint=_FP8_CHECKPOINT,
            match=_ct_channel_match(backend, experts),
            description=f"compressed-tensors W8A8 FP8 fused MoE, channel-wise weight scales "
            f"and dynamic per-token activations (CompressedTensorsW8A8Fp8MoEMethod) on "
            f"vLLM's {backend} backend ({experts}): no post-load bytes; restore "
            f"rebuilds vLLM's MoE kernel objects with make_fp8_moe_kernel (METADATA).",
        )
    )
    for backend, experts in _CT_FP8_BACKENDS
)

CT_FP8_TENSOR_PLANS = tuple(
    register(
        Plan(
            method="ct_w8a8_fp8_moe_tensor",
            kernel=backend.lower(),
            devices="cuda",
            stages=(
                moe.reduce_input_scales,
                moe.process_weight_tensor_strategy,
                moe.validate_expert_shapes,
                moe.set_experts_kernel,
            ),
            reregistered=_W13_REQUANTIZED,
            checkpoint=_FP8_CHECKPOINT,
            match=_cuda(backend, experts),
            description=f"compressed-tensors W8A8 FP8 fused MoE, per-tensor weight scales "
            f"(CompressedTensorsW8A8Fp8MoEMethod) on vLLM's {backend} backend ({experts}): "
            f"the daemon requantizes each expert's w1/w3 shards to their max scale once "
            f"(vLLM does it in place; never replayed) and reduces static input scales to "
            f"their max; restore rebuilds vLLM's MoE kernel objects with "
            f"make_fp8_moe_kernel (METADATA).",
        )
    )
    for backend, experts in _CT_FP8_BACKENDS
)


FP8_TENSOR_MARLIN = register(
    Plan(
        method="fp8_moe_tensor",
        kernel="marlin",
        devices="cuda",
        stages=(
            moe.reduce_input_scales,
            moe.process_weight_tensor_strategy,
            marlin_mx.repack_fp8_experts,
            marlin_mx.permute_fp8_expert_scales("weight_scale"),
            moe.set_experts_kernel,
        ),
        checkpoint=_FP8_CHECKPOINT,
        match=_cuda("MARLIN", MARLIN_EXPERTS),
        description="Serialized per-tensor FP8 fused MoE (Fp8MoEMethod) on vLLM's MARLIN backend "
        "(MarlinExperts, moe_backend='marlin'): the daemon requantizes w1/w3 to their max "
        "scale, pads the intermediate to Marlin's MoE tiles, repacks every expert "
        "(8-bit gptq_marlin_repack) and permutes the channelwise scales with the FP8 "
        "exponent bias fused, once; restore rebuilds vLLM's MoE kernel objects (METADATA).",
    )
)

FP8_BLOCK_MARLIN = register(
    Plan(
        method="fp8_moe_block",
        kernel="marlin",
        devices="cuda",
        stages=(
            marlin_mx.repack_fp8_experts,
            marlin_mx.permute_fp8_expert_scales("weight_scale_inv"),
            moe.set_experts_kernel,
        ),
        checkpoint=_FP8_CHECKPOINT,
        match=_cuda("MARLIN", MARLIN_EXPERTS),
        description="Serialized block FP8 (128x128) fused MoE (Fp8MoEMethod) on vLLM's MARLIN "
        "backend (MarlinExperts, moe_backend='marlin'): the daemon pads, repacks every "
        "expert and turns the block scales into permuted group scales (group = the "
        "block's K edge) with the FP8 exponent bias fused, once; restore rebuilds "
        "vLLM's MoE kernel objects (METADATA).",
    )
)
