"""FP8 plans (CUDA): CUTLASS scaled-mm layouts, CUTLASS block-scaled, and weight-only
FP8 Marlin.

* ``fp8_per_tensor`` / ``fp8_per_channel`` (online) and ``ct_w8a8_fp8`` / ``fp8``
  (serialized) on ``"cutlass"`` (sm89+): quantize or transpose to a ``[K, N]``
  column-major weight, record the logical output width
  (``layer.logical_output_size`` = ``LayerConfig.size_n``, see
  :mod:`wcache.stages.fp8`), pad K/N to 16.
* ``fp8_per_block`` (online) and ``fp8`` block (serialized) on ``"cutlass_block"``
  (sm90+): 128 x 128 block quantization, no layout change.
* ``ct_w8a8_fp8`` and ``fp8`` on ``"fp8_marlin"`` (sm75+): weight-only FP8 Marlin.
  Block FP8 on Marlin is refused.
* ``ct_w8a8_fp8`` on either kernel comes in two versions: ``@1`` mirrors vLLM 0.32's
  post-load; ``@2`` adds the layer attribute ``processed_weight_dims = (0, 1)`` that
  vLLM 0.33's compressed-tensors FP8 schemes set (the adapter passes it in the
  ``LayerConfig`` where the installed release sets it:
  ``wcache.vllm.compat.VllmRelease.layer_attrs``). Same bytes.

Online quantization computes one rank's ``amax``; vLLM all-reduces it over the
TP group first (``amax_for_tp_weight_quant``), so the online plans refuse a
tensor-parallel size above 1 (``LayerConfig`` extra ``tp_size``; absent means 1).
"""

from __future__ import annotations

from wcache.core import LayerConfig, Plan, Reregistration, Target
from wcache.plans.marlin import marlin_target_reason
from wcache.plans.registry import register
from wcache.stages import fp8, marlin

#: CUTLASS FP8 scaled-mm needs sm89+ (``cutlass_fp8_supported``).
CUTLASS_FP8_MIN_CAPABILITY = (8, 9)
#: CUTLASS block-scaled FP8 needs sm90+ (``CUTLASS_BLOCK_FP8_SUPPORTED``).
CUTLASS_BLOCK_FP8_MIN_CAPABILITY = (9, 0)
_SERIALIZED_CHECKPOINT = frozenset({"weight", "weight_scale", "input_scale", "bias"})
_ONLINE_CHECKPOINT = frozenset({"weight", "bias"})


def _cuda_reason(target: Target, min_cap: tuple[int, int], what: str) -> str | None:
    if target.device_type != "cuda":
        return f"{what} is a CUDA kernel; the target is {target.device_type}"
    if target.capability is None or tuple(target.capability) < min_cap:
        return (
            f"{what} needs compute capability >= {min_cap[0]}.{min_cap[1]}, the target "
            f"has {target.capability}"
        )
    return None


def _linear_reason(config: LayerConfig) -> str | None:
    if config.quant.layer_kind != "linear":
        return f"FP8 {config.quant.layer_kind} layers have no plan here (linear only)"
    return None


#: Online methods: the daemon quantizes the checkpoint's bf16/fp16 weight itself.
ONLINE_METHODS = frozenset({"fp8_per_tensor", "fp8_per_channel", "fp8_per_block"})


def _tp_reason(config: LayerConfig) -> str | None:
    """Online FP8 at TP > 1 is refused: its scales would not be vLLM's."""
    tp_size = int(config.get("tp_size", 1) or 1)
    if config.quant.method not in ONLINE_METHODS or tp_size <= 1:
        return None
    if config.quant.method == "fp8_per_block":
        why = (
            "vLLM quantizes each rank's shard in 128x128 blocks; wcache has not shown its "
            "blocks equal vLLM's when a shard boundary splits a block"
        )
    else:
        why = (
            "vLLM all-reduces each weight's amax over the TP group before it quantizes "
            "(quant_utils.py::amax_for_tp_weight_quant), so a rank's scale depends on every "
            "rank's shard; wcache's daemon quantizes one rank's shard alone"
        )
    return (
        f"online FP8 ({config.quant.method}) with tensor-parallel size {tp_size} is not "
        f"supported: {why}. Serve it with --tensor-parallel-size 1, use a serialized FP8 "
        f"checkpoint, or load without wcache"
    )


def _is_block(config: LayerConfig) -> bool:
    return config.quant.strategy == "block" or config.get("weight_block_size") is not None


def _match_cutlass(config: LayerConfig, target: Target) -> str | None:
    if _is_block(config):
        return "block FP8 uses the cutlass_block plan"
    return (
        _tp_reason(config)
        or _cuda_reason(target, CUTLASS_FP8_MIN_CAPABILITY, "CUTLASS FP8")
        or _linear_reason(config)
    )


def _match_cutlass_block(config: LayerConfig, target: Target) -> str | None:
    if config.quant.method == "fp8" and not _is_block(config):
        return "per-tensor/channel FP8 uses the cutlass plan"
    return (
        _tp_reason(config)
        or _cuda_reason(target, CUTLASS_BLOCK_FP8_MIN_CAPABILITY, "CUTLASS block FP8")
        or _linear_reason(config)
    )


def _match_fp8_marlin(config: LayerConfig, target: Target) -> str | None:
    if _is_block(config):
        return (
            "Marlin block FP8 is not supported by wcache (its group-scale layout has no "
            "plan); use the cutlass_block kernel on sm90+ or load without wcache"
        )
    return marlin_target_reason(config, target)


_CUTLASS_TAIL = (fp8.set_logical_output_size, fp8.pad_kn)


def _without_processed_weight_dims(config: LayerConfig) -> str | None:
    if config.get(fp8.PROCESSED_WEIGHT_DIMS_ATTR) is not None:
        return (
            f"vLLM sets {fp8.PROCESSED_WEIGHT_DIMS_ATTR} on this layer (0.33): the @2 "
            f"plan sets it too"
        )
    return None


def _with_processed_weight_dims(config: LayerConfig) -> str | None:
    dims = config.get(fp8.PROCESSED_WEIGHT_DIMS_ATTR)
    if dims is None:
        return f"vLLM sets no {fp8.PROCESSED_WEIGHT_DIMS_ATTR} on this layer (0.32): the @1 plan"
    if not fp8.is_dims_pair(dims):
        return (
            f"vLLM set {fp8.PROCESSED_WEIGHT_DIMS_ATTR} = {dims!r} on this layer, not "
            f"an (input_dim, output_dim) pair of ints: no plan knows that layout"
        )
    return None


def _match_ct_cutlass_v1(config: LayerConfig, target: Target) -> str | None:
    return _without_processed_weight_dims(config) or _match_cutlass(config, target)


def _match_ct_cutlass_v2(config: LayerConfig, target: Target) -> str | None:
    return _with_processed_weight_dims(config) or _match_cutlass(config, target)


def _match_ct_marlin_v1(config: LayerConfig, target: Target) -> str | None:
    return _without_processed_weight_dims(config) or _match_fp8_marlin(config, target)


def _match_ct_marlin_v2(config: LayerConfig, target: Target) -> str | None:
    return _with_processed_weight_dims(config) or _match_fp8_marlin(config, target)


PER_TENSOR = register(
    Plan(
        method="fp8_per_tensor",
        kernel="cutlass",
        devices="cuda",
        stages=(fp8.clear_input_scale, fp8.quantize_per_tensor_stage) + _CUTLASS_TAIL,
        checkpoint=_ONLINE_CHECKPOINT,
        match=_match_cutlass,
        description="online per-tensor FP8 on CUTLASS: quantize (amax/448, single rank), "
        "transpose to (K, N) column-major, record N, pad K/N to 16.",
    )
)

PER_CHANNEL = register(
    Plan(
        method="fp8_per_channel",
        kernel="cutlass",
        devices="cuda",
        stages=(fp8.clear_input_scale, fp8.quantize_per_channel_stage) + _CUTLASS_TAIL,
        checkpoint=_ONLINE_CHECKPOINT,
        match=_match_cutlass,
        description="online per-channel (PTPC) FP8 on CUTLASS: quantize per row, transpose, "
        "record N, pad K/N to 16 and the (N, 1) scale with 1.0.",
    )
)

PER_BLOCK = register(
    Plan(
        method="fp8_per_block",
        kernel="cutlass_block",
        devices="cuda",
        stages=(fp8.clear_input_scale, fp8.quantize_per_block),
        checkpoint=_ONLINE_CHECKPOINT,
        match=_match_cutlass_block,
        description="online 128x128 block FP8 on CUTLASS block-scaled mm: weight (N, K) fp8, "
        "weight_scale_inv (ceil(N/128), ceil(K/128)).",
    )
)

_SERIALIZED = (
    fp8.process_weight_strategy,
    fp8.reduce_input_scale,
    fp8.clear_input_scale,
) + _CUTLASS_TAIL

CT_CUTLASS = register(
    Plan(
        method="ct_w8a8_fp8",
        kernel="cutlass",
        devices="cuda",
        stages=_SERIALIZED,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_ct_cutlass_v1,
        # vLLM 0.32's scheme registers fresh Parameters (the weight re-tagged as
        # (K, N): compat's VLLM_0_32_0.param_outcomes).
        # Source: compressed_tensors_w8a8_fp8.py::process_weights_after_loading (0.32.0)
        reregistered=dict.fromkeys(("weight_scale", "input_scale"), Reregistration.NEW),
        description="compressed-tensors W8A8 FP8 (tensor/channel) on CUTLASS (vLLM 0.32): "
        "max-scale requantization into a new tensor (tensor), transpose, input "
        "scale, record N, pad K/N to 16.",
    )
)

CT_CUTLASS_V2 = register(
    Plan(
        method="ct_w8a8_fp8",
        kernel="cutlass",
        devices="cuda",
        version=2,
        stages=_SERIALIZED[:3] + (fp8.set_processed_weight_dims,) + _CUTLASS_TAIL,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_ct_cutlass_v2,
        description="compressed-tensors W8A8 FP8 (tensor/channel) on CUTLASS (vLLM 0.33): as "
        "@1, plus layer.processed_weight_dims = (0, 1).",
    )
)

SERIALIZED_CUTLASS = register(
    Plan(
        method="fp8",
        kernel="cutlass",
        devices="cuda",
        stages=_SERIALIZED,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_cutlass,
        description="serialized FP8 (Fp8LinearMethod) on CUTLASS, including the logical output "
        "width that vLLM 0.32's pre-processed branch forgets.",
    )
)

SERIALIZED_BLOCK = register(
    Plan(
        method="fp8",
        kernel="cutlass_block",
        devices="cuda",
        stages=(fp8.clear_input_scale,),
        checkpoint=frozenset({"weight", "weight_scale_inv", "bias"}),
        match=_match_cutlass_block,
        # vLLM re-registers both (same bytes) through replace_parameter
        # Source: vllm/model_executor/layers/quantization/utils/fp8_utils.py::
        # process_fp8_weight_block_strategy callers (Fp8LinearMethod)
        reregistered={
            "weight": Reregistration.REPLACE,
            "weight_scale_inv": Reregistration.REPLACE,
        },
        description="serialized block FP8 on CUTLASS block-scaled mm: bytes unchanged, "
        "input_scale = None.",
    )
)

_FP8_MARLIN = (
    marlin.repack_fp8_weight,
    marlin.permute_fp8_scales,
    fp8.drop_input_scale,
    marlin.permute_bias,
)

CT_MARLIN = register(
    Plan(
        method="ct_w8a8_fp8",
        kernel="fp8_marlin",
        devices="cuda",
        stages=_FP8_MARLIN,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_ct_marlin_v1,
        description="compressed-tensors FP8 weight-only on Marlin (W8A16, vLLM 0.32): weight "
        "packed to int32 and repacked (Kp/16, 4Np), scales to channel (1, Np) in "
        "params dtype with the exponent bias, input_scale dropped, bias padded and "
        "permuted.",
    )
)

CT_MARLIN_V2 = register(
    Plan(
        method="ct_w8a8_fp8",
        kernel="fp8_marlin",
        devices="cuda",
        version=2,
        stages=(fp8.set_processed_weight_dims,) + _FP8_MARLIN,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_ct_marlin_v2,
        description="compressed-tensors FP8 weight-only on Marlin (W8A16, vLLM 0.33): as @1, "
        "plus layer.processed_weight_dims = (0, 1).",
    )
)

SERIALIZED_MARLIN = register(
    Plan(
        method="fp8",
        kernel="fp8_marlin",
        devices="cuda",
        stages=_FP8_MARLIN,
        checkpoint=_SERIALIZED_CHECKPOINT,
        match=_match_fp8_marlin,
        description="serialized per-tensor FP8 weight-only on Marlin (no native FP8).",
    )
)
