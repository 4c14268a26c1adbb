"""Serialized quantized MoE checkpoints, produced offline by wcache's own code (no
llm-compressor, no ModelOpt, no network) from the tiny MoE models of
:mod:`wcache.testing.tiny_models`.

Formats (:data:`MOE_FORMATS`), every decoder linear and every expert quantized (but
``mxfp4``: experts only), the routers (``mlp.gate``, ``mlp.shared_expert_gate``,
``mlp.router``), the embedding, the norms and the LM head left in bf16.

FP8 (:data:`FP8_FORMATS`):

* ``fp8``: vLLM's serialized FP8 (``quant_method: fp8``), per-tensor weight scales
  (``weight_scale`` fp32 0-d per linear and per expert), dynamic activations.
* ``fp8_static``: the same with static activations: ``input_scale`` fp32 0-d per
  linear and per expert, from a calibration forward (:func:`calibrate_moe_input_amax`).
* ``fp8_block``: ``weight_block_size`` [128, 128]: ``weight_scale_inv`` fp32
  ``[ceil(N / 128), ceil(K / 128)]``, dynamic activations. Its base must have every
  quantized dimension a multiple of 128 (``qwen3_moe_128``).
* ``ct_w8a8_fp8``: compressed-tensors ``float-quantized``, channel weight scales
  ``[N, 1]``, dynamic per-token activations (llm-compressor's FP8_DYNAMIC).
* ``ct_w8a8_fp8_static``: tensor weight scales ``[1]`` and static tensor
  ``input_scale`` ``[1]`` (llm-compressor's FP8).

Checkpoint names are transformers' per-expert layout
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``), which vLLM's
``FusedMoE.make_expert_params_mapping`` maps onto ``experts.w13_*`` / ``experts.w2_*``:
``weight_scale`` -> ``w13_weight_scale [E, 2]`` (tensor) or ``[E, 2N, 1]`` (channel),
``weight_scale_inv`` -> ``w13_weight_scale_inv [E, 2N/128, K/128]``, ``input_scale`` ->
``w13_input_scale [E]``.

int4 and FP4/FP8-microscaled (:data:`INT4_FORMATS`, :data:`MX_FORMATS`; quantizers in
:mod:`wcache.testing.moe_quant`). ``G`` is :func:`moe_group_size` of the base (128 for
``qwen3_moe_128``, 32 for the 96-wide ``qwen3_moe``):

* ``awq``: AutoAWQ GEMM (``quant_method: awq``, ``zero_point: true``), per projection
  ``qweight`` int32 ``[K, N/8]`` (AWQ nibble order), ``qzeros`` int32 ``[K/G, N/8]``,
  ``scales`` fp16 ``[K/G, N]``; the routers in ``modules_to_not_convert``. vLLM 0.33:
  ``AutoAWQMoEMethod`` (Marlin MoE) -> ``w13_qweight [E, K, 2N/8]`` etc.
* ``gptq``: GPTQ v1 symmetric uint4b8, ``desc_act: false``: ``qweight`` int32
  ``[K/8, N]``, ``qzeros`` ``[K/G, N/8]`` (nibbles 7), ``scales`` fp16 ``[K/G, N]``,
  ``g_idx`` ``[K]`` (vLLM drops it). vLLM 0.33: ``AutoGPTQMoEMethod`` (Marlin MoE).
* ``gptq_asym`` (``sym: false``, real zero points) and ``gptq_act_order``
  (``desc_act: true``, a permuted ``g_idx``): the same tensors; **vLLM 0.32 and 0.33
  refuse both at config time** (``AutoGPTQConfig``: "Unsupported quantization config:
  bits=4, sym=False"; ``normalize_and_validate_gptq_desc_act``: "GPTQ group activation
  ordering (desc_act=True) is no longer supported"). Built so refusal cases exist.
* ``ct_w4a16`` / ``ct_w4a16_channel``: compressed-tensors ``pack-quantized`` int4
  symmetric, GROUP G / CHANNEL: ``weight_packed`` int32 ``[N, K/8]``, ``weight_scale``
  bf16 ``[N, K/G]`` / ``[N, 1]``, ``weight_shape`` ``[2]``. vLLM:
  ``CompressedTensorsWNA16MoEMethod``.
* ``nvfp4``: ModelOpt NVFP4 in nvidia/Qwen3-30B-A3B-NVFP4's layout: ``weight`` uint8
  ``[N, K/2]`` (E2M1 pairs), ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
  ``weight_scale_2`` fp32 0-d (shared by an expert's gate and up, and by q/k/v),
  ``input_scale`` fp32 0-d (calibrated); the config only in ``hf_quant_config.json``
  (``producer: modelopt``, ``quantization: {quant_algo: NVFP4, group_size: 16,
  kv_cache_quant_algo: null, exclude_modules: [lm_head, <routers>]}``), none in
  ``config.json``. vLLM: ``ModelOptNvFp4FusedMoE``.
* ``mxfp4``: vLLM's canonical ``quant_method: mxfp4`` (``Mxfp4MoEMethod``): experts
  only, ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` uint8 E8M0 ``[N, K/32]``;
  attention stays bf16 (``Mxfp4Config`` quantizes no linear). On ``gpt_oss`` the same
  bits in GPT-OSS's own layout: ``mlp.experts.gate_up_proj_blocks`` uint8
  ``[E, 2N, K/32, 16]``, ``..._scales`` uint8 ``[E, 2N, K/32]``, ``down_proj_blocks``
  ``[E, K, N/32, 16]``, biases bf16, ``modules_to_not_convert`` as openai/gpt-oss
  (vLLM: ``GptOssMxfp4MoEMethod``).
* ``mxfp8``: ModelOpt MXFP8 (``quant_algo: MXFP8``, flat ``config.json`` form):
  ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` uint8 E8M0 ``[N, K/32]``.
  vLLM 0.33: ``ModelOptMxFp8FusedMoE`` (backends FlashInfer TRTLLM, DeepGEMM,
  Marlin, ..., emulation).

    python -m wcache.testing.moe_fixtures [--bases qwen3_moe,...] [--formats fp8,...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from wcache.errors import FixtureError
from wcache.testing import fixtures as fx
from wcache.testing import moe_quant as mq
from wcache.testing import tiny_models as tm

__all__ = [
    "MOE_FORMATS",
    "FP8_FORMATS",
    "INT4_FORMATS",
    "MX_FORMATS",
    "VLLM_REFUSED",
    "MOE_BASES",
    "FP8_BLOCK",
    "fp8_block_quantize",
    "is_moe_quantized",
    "ignored_modules",
    "convert_moe_state_dict",
    "convert_gpt_oss_mxfp4",
    "moe_quantization_config",
    "side_files",
    "moe_group_size",
    "calibrate_moe_input_amax",
    "build_moe",
]

FP8_FORMATS = ("fp8", "fp8_static", "fp8_block", "ct_w8a8_fp8", "ct_w8a8_fp8_static")
INT4_FORMATS = ("awq", "gptq", "gptq_asym", "gptq_act_order", "ct_w4a16", "ct_w4a16_channel")
MX_FORMATS = ("nvfp4", "mxfp4", "mxfp8")
MOE_FORMATS = FP8_FORMATS + INT4_FORMATS + MX_FORMATS
#: Formats vLLM 0.32/0.33 refuses when parsing the config (the reason it gives).
VLLM_REFUSED = {
    "gptq_asym": "Unsupported quantization config: bits=4, sym=False",
    "gptq_act_order": "GPTQ group activation ordering (desc_act=True) is no longer supported",
}
#: int4 group sizes vLLM's Marlin MoE takes (``check_moe_marlin_supports_config``),
#: largest first: a base uses the largest dividing its hidden and expert widths.
INT4_GROUP_SIZES = (128, 64, 32)
#: ModelOpt version written into ``hf_quant_config.json``'s producer (the release
#: line of nvidia/Qwen3-30B-A3B-NVFP4's export; vLLM reads only the name).
MODELOPT_VERSION = "0.29.0"
HF_QUANT_CONFIG = "hf_quant_config.json"
#: openai/gpt-oss's ``modules_to_not_convert`` (attention, routers, embedding, head).
GPT_OSS_NOT_CONVERTED = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)
#: vLLM's FP8 block shape ([block_n, block_k]).
FP8_BLOCK = tm.FP8_BLOCK
#: Base architecture -> the formats built from it. ``qwen3_moe_128`` is the one base
#: whose dims are multiples of the block; the others exercise padding (96-wide
#: experts, 6 and 12 experts, a shared expert) in the per-tensor and channel formats.
#: ``qwen3_moe`` (experts of 96) takes the int4 formats with G = 32, so vLLM's Marlin
#: MoE pads the expert width; ``mixtral`` takes ``awq`` too (Marlin MoE on a second
#: architecture, ``block_sparse_moe.experts.E.w1/w2/w3``); ``gpt_oss`` is the GPT-OSS
#: MXFP4 layout.
MOE_BASES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": (
        "fp8",
        "fp8_static",
        "ct_w8a8_fp8",
        "ct_w8a8_fp8_static",
        "awq",
        "gptq",
        "ct_w4a16",
    ),
    "qwen3_moe_128": MOE_FORMATS,
    "qwen2_moe": ("fp8", "ct_w8a8_fp8"),
    "mixtral": ("fp8", "awq"),
    "gpt_oss": ("mxfp4",),
}
#: Formats with static activation scales (a calibration forward sets them).
STATIC_FORMATS = ("fp8_static", "ct_w8a8_fp8_static")
#: Formats whose quantizer takes each projection's calibrated input amax.
AMAX_FORMATS = STATIC_FORMATS + ("nvfp4",)
#: Checkpoint projections vLLM fuses into one parameter: NVFP4 needs one
#: ``weight_scale_2`` across them (q/k/v; an expert's or shared expert's gate/up).
_FUSED_LEAVES = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}
#: A decoder linear or an expert projection (transformers' names); routers (``gate``,
#: ``shared_expert_gate``) do not match: vLLM builds them unquantized or ignores them.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*\.(\w+_proj|w1|w2|w3)\.weight$")
#: The routers of each layer that the quantization config must name as ignored.
_ROUTER = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:gate|router))\.weight$")
#: compressed-tensors ignore patterns for the routers (llm-compressor's MoE recipes).
CT_IGNORE = ("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*block_sparse_moe.gate$")


def is_moe_quantized(name: str, tensor: torch.Tensor) -> bool:
    """True for a 2-D decoder linear or expert weight that the formats quantize."""
    return tensor.ndim == 2 and bool(_QUANTIZED.match(name))


def ignored_modules(names: Mapping[str, Any] | list[str]) -> list[str]:
    """The router modules (``model.layers.L.mlp.gate``) of a state dict, sorted: what
    vLLM's FP8 config must skip (``ignored_layers``)."""
    return sorted({m.group(1) for n in names if (m := _ROUTER.match(n))})


def fp8_block_quantize(weight: torch.Tensor, block: int = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """vLLM's block FP8 tensors for one linear: one scale per ``block x block`` tile.

    Math (float32): ``scale[i, j] = max|w[tile i, j]| / 448`` (the float32 tiny for
    an all-zero tile); ``q = clamp(w / scale, -448, 448)`` in float8_e4m3fn.

    Args:
        weight: ``[size_n, size_k]`` float; both multiples of ``block``.
        block: tile edge (vLLM's ``weight_block_size`` [block, block]).

    Returns:
        ``weight`` float8_e4m3fn ``[size_n, size_k]``; ``weight_scale_inv`` fp32
        ``[size_n // block, size_k // block]`` (vLLM's name: the dequantization
        multiplier, despite "inv").

    Raises:
        FixtureError: not 2-D float, or a dimension not a multiple of ``block``.

    Source: vLLM ``Fp8LinearMethod.create_weights`` (block) and
    ``per_block_cast_to_fp8`` (tests/kernels/quant_utils.py); DeepSeek-V3's FP8 layout.
    """
    if (
        weight.ndim != 2
        or not weight.is_floating_point()
        or weight.shape[0] % block
        or weight.shape[1] % block
    ):
        raise FixtureError(
            f"block FP8 needs a 2-D float weight with both dims multiples of "
            f"{block}, got {tuple(weight.shape)} {weight.dtype}; build the "
            "block fixture from a base whose dims are (qwen3_moe_128)"
        )
    n, k = weight.shape
    tiles = weight.to(torch.float32).reshape(n // block, block, k // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / fx.FP8_E4M3_MAX).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    q = (tiles / scale[:, None, :, None]).clamp(-fx.FP8_E4M3_MAX, fx.FP8_E4M3_MAX)
    return {"weight": q.reshape(n, k).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def moe_group_size(hidden_size: int, moe_intermediate_size: int) -> int:
    """The int4 group size of a base: the largest of :data:`INT4_GROUP_SIZES` that
    divides both widths.

    Raises:
        FixtureError: none divides both.
    """
    for g in INT4_GROUP_SIZES:
        if hidden_size % g == 0 and moe_intermediate_size % g == 0:
            return g
    raise FixtureError(
        f"no int4 group size in {INT4_GROUP_SIZES} divides hidden "
        f"{hidden_size} and expert width {moe_intermediate_size}; use a base "
        "whose widths are multiples of 32"
    )


def _quantize(
    weight: torch.Tensor,
    fmt: str,
    amax: float | None,
    *,
    group_size: int | None = None,
    weight_amax: float | None = None,
) -> dict[str, torch.Tensor]:
    # The caller (moe_quantized_state_dict) has refused a static or NVFP4 format
    # without its amax and a grouped int4 format without its group size.
    if fmt in ("fp8", "fp8_static"):
        out = fx.fp8_quantize(weight)
        if fmt == "fp8_static":
            assert amax is not None
            out["input_scale"] = torch.tensor(
                float(amax) * fx.CALIBRATION_HEADROOM / fx.FP8_E4M3_MAX, dtype=torch.float32
            )
        return out
    if fmt == "fp8_block":
        return fp8_block_quantize(weight)
    if fmt == "awq":
        assert group_size is not None
        return fx.awq_quantize(weight, group_size)
    if fmt.startswith("gptq"):
        assert group_size is not None
        return mq.gptq_quantize(
            weight, group_size, sym=fmt != "gptq_asym", act_order=fmt == "gptq_act_order"
        )
    if fmt in ("ct_w4a16", "ct_w4a16_channel"):
        group = group_size if fmt == "ct_w4a16" else -1
        assert group is not None
        return mq.ct_w4a16_compress(weight, group)
    if fmt == "nvfp4":
        assert amax is not None
        return fx.nvfp4_quantize(weight, amax, weight_amax)
    if fmt == "mxfp4":
        return mq.mxfp4_quantize(weight)
    if fmt == "mxfp8":
        return fx.mxfp8_quantize(weight)
    return fx.ct_compress(weight, fmt, amax)


def _fusion_key(prefix: str) -> str:
    """``model.layers.0.mlp.experts.3.up_proj`` -> ``model.layers.0.mlp.experts.3.gate_up``:
    one key per group of projections vLLM fuses."""
    parent, _, leaf = prefix.rpartition(".")
    return f"{parent}.{_FUSED_LEAVES.get(leaf, leaf)}"


def _fused_weight_amax(state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """quantized prefix -> ``max|w|`` over its fusion group (:func:`_fusion_key`)."""
    group: dict[str, float] = {}
    for name, t in state_dict.items():
        if is_moe_quantized(name, t):
            key = _fusion_key(name[: -len(".weight")])
            group[key] = max(group.get(key, 0.0), float(t.abs().max()))
    return {
        n[: -len(".weight")]: group[_fusion_key(n[: -len(".weight")])]
        for n, t in state_dict.items()
        if is_moe_quantized(n, t)
    }


def _selected(name: str, tensor: torch.Tensor, fmt: str) -> bool:
    """Whether ``fmt`` quantizes this tensor: canonical MXFP4 the experts only."""
    return is_moe_quantized(name, tensor) and (fmt != "mxfp4" or ".experts." in name)


def convert_moe_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    fmt: str,
    input_amax: Mapping[str, float] | None = None,
    *,
    group_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """A bf16 MoE state dict in ``fmt``; pure (the input is not changed).

    Args:
        state_dict: name -> tensor of a tiny MoE checkpoint (transformers' per-expert
            layout).
        fmt: one of :data:`MOE_FORMATS`.
        input_amax: module prefix (``model.layers.0.mlp.experts.3.down_proj``) ->
            calibrated ``max|x|`` of its input; required for :data:`AMAX_FORMATS`.
        group_size: the int4 group size (:func:`moe_group_size`); required for the
            grouped :data:`INT4_FORMATS`.

    Returns:
        name -> tensor, sorted: each quantized ``<prefix>.weight`` replaced by the
        format's tensors under ``<prefix>.``; other tensors unchanged (bf16).

    Raises:
        FixtureError: unknown format, a static format without ``input_amax`` (or
            without an entry for a quantized linear), an int4 format without
            ``group_size``, or dims the format cannot tile.
    """
    if fmt not in MOE_FORMATS:
        raise FixtureError(f"unknown MoE fixture format {fmt!r}; use one of {MOE_FORMATS}")
    if fmt in AMAX_FORMATS and input_amax is None:
        raise FixtureError(
            f"{fmt} has static activation scales: pass input_amax (calibrate_moe_input_amax)"
        )
    if fmt in INT4_FORMATS and fmt != "ct_w4a16_channel" and group_size is None:
        raise FixtureError(f"{fmt} is grouped: pass group_size (moe_group_size of the base)")
    weight_amax = _fused_weight_amax(state_dict) if fmt == "nvfp4" else {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not _selected(name, tensor, fmt):
            out[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        amax = None
        if fmt in AMAX_FORMATS and input_amax is not None:  # not None: refused above
            if prefix not in input_amax:
                raise FixtureError(
                    f"no calibrated input amax for {prefix}; calibrate on the same bf16 checkpoint"
                )
            amax = input_amax[prefix]
        out.update(
            {
                f"{prefix}.{k}": v
                for k, v in _quantize(
                    tensor, fmt, amax, group_size=group_size, weight_amax=weight_amax.get(prefix)
                ).items()
            }
        )
    return dict(sorted(out.items()))


def convert_gpt_oss_mxfp4(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 GPT-OSS state dict in GPT-OSS's own MXFP4 checkpoint layout; pure.

    transformers keeps each layer's experts fused: ``mlp.experts.gate_up_proj`` bf16
    ``[E, hidden, 2 * inter]`` (gate/up interleaved on the last dim) and
    ``mlp.experts.down_proj`` ``[E, inter, hidden]``. Each becomes
    ``<name>_blocks`` uint8 ``[E, out, in / 32, 16]`` and ``<name>_scales`` uint8
    ``[E, out, in / 32]`` of its out-major transpose (:func:`moe_quant.gpt_oss_mxfp4_pack`);
    the biases (``*_proj_bias``), attention, router, norms and embeddings stay bf16.

    Raises:
        FixtureError: no fused GPT-OSS experts in ``state_dict``, or widths not
            multiples of 32.

    Source: openai/gpt-oss-20b checkpoint names; transformers ``Mxfp4GptOssExperts``.
    """
    out: dict[str, torch.Tensor] = {}
    found = 0
    for name, tensor in state_dict.items():
        if (
            name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
            and tensor.ndim == 3
        ):
            packed = mq.gpt_oss_mxfp4_pack(tensor.transpose(1, 2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = packed["blocks"], packed["scales"]
            found += 1
        else:
            out[name] = tensor
    if not found:
        raise FixtureError(
            "no GPT-OSS fused experts (mlp.experts.gate_up_proj) in the "
            "state dict; build the mxfp4 GPT-OSS layout from the gpt_oss base"
        )
    return dict(sorted(out.items()))


def _ct_w4a16_config(group_size: int) -> dict[str, Any]:
    """compressed-tensors' own ``quantization_config`` for W4A16 pack-quantized."""
    from compressed_tensors.compressors import ModelCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))
    from compressed_tensors.config import CompressionFormat  # noqa: PLC0415 (optional dependency (the fixtures extra))
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus  # noqa: PLC0415 (optional dependency (the fixtures extra))

    qconfig = QuantizationConfig(
        config_groups={"group_0": mq.ct_w4a16_scheme(group_size)},
        format=CompressionFormat.pack_quantized.value,
        ignore=list(CT_IGNORE),
        quantization_status=QuantizationStatus.COMPRESSED,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ModelCompressor(quantization_config=qconfig).update_config(tmp)
        return json.loads((Path(tmp) / fx.CONFIG_FILE).read_text())["quantization_config"]


def moe_quantization_config(
    fmt: str, ignored: list[str], group_size: int | None = None, base: str | None = None
) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``fmt`` for ``config.json`` (None for ``nvfp4``,
    whose config is only in ``hf_quant_config.json``: :func:`side_files`); ``ignored``
    are the router modules.

    Source: vLLM ``Fp8Config``, ``AutoAWQConfig``, ``AutoGPTQConfig``,
    ``CompressedTensorsConfig``, ``Mxfp4Config``, ``ModelOptMxFp8Config``
    ``from_config``; AutoAWQ / AutoGPTQ ``quantize_config``; Qwen's Qwen3-30B-A3B-FP8;
    openai/gpt-oss's config.
    """
    config: dict[str, Any]
    if fmt in ("fp8", "fp8_static", "fp8_block"):
        config = {
            "quant_method": "fp8",
            "ignored_layers": list(ignored),
            "activation_scheme": "static" if fmt == "fp8_static" else "dynamic",
        }
        if fmt == "fp8_block":
            config["weight_block_size"] = [FP8_BLOCK, FP8_BLOCK]
        return config
    if fmt in ("ct_w8a8_fp8", "ct_w8a8_fp8_static"):
        ct_config = fx.quantization_config(fmt)
        assert ct_config is not None  # None only for bf16
        return {**ct_config, "ignore": list(CT_IGNORE)}
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": fx.INT4_BITS,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(ignored),
        }
    if fmt.startswith("gptq") and fmt in INT4_FORMATS:
        return {
            "quant_method": "gptq",
            "bits": fx.INT4_BITS,
            "group_size": group_size,
            "desc_act": fmt == "gptq_act_order",
            "sym": fmt != "gptq_asym",
            "static_groups": False,
            "true_sequential": True,
            "lm_head": False,
            "checkpoint_format": "gptq",
        }
    if fmt in ("ct_w4a16", "ct_w4a16_channel"):
        group = group_size if fmt == "ct_w4a16" else -1
        assert group is not None, "ct_w4a16 is grouped: pass group_size"
        return _ct_w4a16_config(group)
    if fmt == "nvfp4":
        return None
    if fmt == "mxfp4":
        config = {"quant_method": "mxfp4"}
        if base == "gpt_oss":
            config["modules_to_not_convert"] = list(GPT_OSS_NOT_CONVERTED)
        return config
    if fmt == "mxfp8":
        # the flat config.json form names its excluded modules "ignore"
        return {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
            "kv_cache_quant_algo": None,
            "ignore": ["lm_head", *ignored],
        }
    raise FixtureError(f"unknown MoE fixture format {fmt!r}; use one of {MOE_FORMATS}")


def side_files(fmt: str, ignored: list[str]) -> dict[str, dict[str, Any]]:
    """Config files besides ``config.json`` a format's checkpoint carries.

    ``nvfp4``: ``hf_quant_config.json`` as ModelOpt's unified HF export writes it
    (nvidia/Qwen3-30B-A3B-NVFP4's layout): ``producer`` and a nested ``quantization``
    with ``quant_algo`` NVFP4, ``kv_cache_quant_algo`` null (BF16 KV cache),
    ``group_size`` 16 and ``exclude_modules`` (``lm_head`` and every router).
    vLLM's ``ModelOptNvFp4Config`` requires all three of group_size,
    kv_cache_quant_algo and exclude_modules in that form.

    Source: ModelOpt ``export_hf_checkpoint`` (unified HF checkpoint); vLLM
    ``get_config`` (reads hf_quant_config.json when config.json has no
    quantization_config) and ``_normalize_quantization_config`` (producer modelopt
    + NVFP4 -> ``modelopt_fp4``).
    """
    if fmt != "nvfp4":
        return {}
    return {
        HF_QUANT_CONFIG: {
            "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": fx.NVFP4_BLOCK,
                "exclude_modules": ["lm_head", *ignored],
            },
        }
    }


def _act(name: str):
    return {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[name]


def calibrate_moe_input_amax(
    bf16_dir: Path, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """``max|x|`` of each quantized linear's input over the calibration prompts, from a
    transformers forward of the bf16 checkpoint on the CPU.

    Attention and shared-expert linears: hooks on their ``nn.Linear``. Experts (fused
    inside transformers' experts module): the experts module's input ``x`` (every
    token, routed or not: an upper bound of what each expert sees) is the input of
    ``gate_proj``/``up_proj``; ``act(x @ gate.T) * (x @ up.T)`` over the same tokens,
    per expert, is the input of ``down_proj``.

    Returns:
        module prefix -> amax (float).

    Source: llm-compressor's static activation calibration (min-max observer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (transformers import ~1 s: only when called)

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(bf16_dir)
    act = _act(getattr(model.config, "hidden_act", "silu"))
    amax: dict[str, float] = {}

    def bump(key: str, value: float) -> None:
        amax[key] = max(amax.get(key, 0.0), value)

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(
                module.register_forward_hook(
                    lambda mod, inp, out, _n=name: bump(_n, float(inp[0].abs().max()))
                )
            )
        elif name.endswith(".experts") and not isinstance(module, torch.nn.ModuleList):

            def record(mod, inp, out, _n=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).to(torch.float32)
                for e in range(1_000_000):
                    gate = state_dict.get(f"{_n}.{e}.gate_proj.weight")
                    if gate is None:
                        break
                    up = state_dict[f"{_n}.{e}.up_proj.weight"].to(torch.float32)
                    bump(f"{_n}.{e}.gate_proj", float(x.abs().max()))
                    bump(f"{_n}.{e}.up_proj", float(x.abs().max()))
                    h = act(x @ gate.to(torch.float32).t()) * (x @ up.t())
                    bump(f"{_n}.{e}.down_proj", float(h.abs().max()))

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for prompt in fx.CALIBRATION_PROMPTS:
            model(**tokenizer(prompt, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    return amax


def build_moe(base: str, fmt: str, out: str | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) ``base`` (a tiny MoE architecture) in ``fmt``; the static and
    NVFP4 formats run a calibration forward of the bf16 model (CPU, seconds).

    Returns:
        The checkpoint folder (``tiny-<base>-<fmt>``).

    Raises:
        FixtureError: ``fmt`` is not built from ``base`` (:data:`MOE_BASES`).
    """
    if fmt not in MOE_BASES.get(base, ()):
        raise FixtureError(
            f"{base} in {fmt} is not a MoE fixture; built are "
            f"{ {b: list(f) for b, f in MOE_BASES.items()} }"
        )
    a = tm.arch(base)
    final = tm.arch_path(base, out, fmt)
    if tm.is_built(final, a, fmt) and not force:
        return final
    with fx.build_lock(final):
        if tm.is_built(final, a, fmt) and not force:  # another process built it meanwhile
            return final
        _write_moe(a, base, fmt, final, out)
    return final


def _write_moe(a: tm.Arch, base: str, fmt: str, final: Path, out: str | None) -> None:
    """Convert ``base``'s bf16 fixture to ``fmt`` and publish it at ``final``
    (:func:`build_moe` holds ``final``'s build lock)."""
    bf16_dir = tm.build_arch(base, out)
    state = fx.load_state_dict(bf16_dir)
    config = json.loads((bf16_dir / fx.CONFIG_FILE).read_text())
    if base == "gpt_oss":
        converted = convert_gpt_oss_mxfp4(state)
        group = None
    else:
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        group = moe_group_size(config["hidden_size"], inter) if fmt in INT4_FORMATS else None
        amax = calibrate_moe_input_amax(bf16_dir, state) if fmt in AMAX_FORMATS else None
        converted = convert_moe_state_dict(state, fmt, amax, group_size=group)
    ignored = ignored_modules(state)
    with fx.atomic_folder(final) as tmp:
        tm.copy_tokenizer(bf16_dir, tmp)
        for extra in ("generation_config.json",):
            if (bf16_dir / extra).is_file():
                (tmp / extra).write_bytes((bf16_dir / extra).read_bytes())
        fx._save_state_dict(converted, tmp)
        qc = moe_quantization_config(fmt, ignored, group, base)
        if qc is not None:
            config["quantization_config"] = qc
        (tmp / fx.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for fname, body in side_files(fmt, ignored).items():
            (tmp / fname).write_text(json.dumps(body, indent=2) + "\n")
        fx.write_stamp(tmp, tm._stamp(a, fmt))


def main(argv: list[str] | None = None) -> int:
    """Command line: build the MoE fixtures and print their folders."""
    ap = argparse.ArgumentParser(
        prog="python -m wcache.testing.moe_fixtures", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--bases", default=",".join(MOE_BASES))
    ap.add_argument("--formats", default=",".join(MOE_FORMATS))
    ap.add_argument("--out")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    for base in filter(None, args.bases.split(",")):
        for fmt in filter(None, args.formats.split(",")):
            if fmt in MOE_BASES.get(base, ()):
                print(
                    f"{base:14s} {fmt:20s} {build_moe(base, fmt, args.out, force=args.force)}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
