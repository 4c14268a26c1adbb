"""A random EAGLE-1 head for a Llama-style target checkpoint, offline.

An EAGLE-1 head (``speculative_config={"method": "eagle", "model": HEAD_DIR}``) is one
Llama decoder layer without its input layernorm, fed by ``fc`` (``[hidden, 2 *
hidden]``: the token's embedding concatenated with the target's hidden state). A head
checkpoint without ``embed_tokens`` and ``lm_head`` gets the target's: vLLM's proposer
points the head's modules at the target's after the load. :func:`write_random_eagle_head`
writes such a head with the target's hidden size, heads, vocabulary and tokenizer, so it
fits the target (SmolLM2-135M: hidden 576). Random weights draft poorly, which changes
nothing in greedy speculative decoding's output (the target's greedy tokens); the
acceptance rate is low, and that is all. Used by tests/e2e/test_spec_decode_e2e.py (CPU)
and tests/gpu_engine/test_spec_decode_engines.py (H200).

    python -m wcache.testing.spec_decode TARGET_DIR OUT_DIR   # prints OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys

#: Decoder layers in the head: EAGLE-1's single layer.
HEAD_LAYERS = 1
#: Standard deviation of the head's linear weights: a Llama initializer's 0.02 keeps the
#: head's hidden states (and the target's logits of them) finite in bf16.
INIT_STD = 0.02
SEED = 4343
#: Config fields copied from the target: the head must have the target's sizes,
#: vocabulary, special tokens and rotary embedding.
TARGET_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
)
#: The target's tokenizer files copied next to the head (vLLM reads the draft's
#: tokenizer config when it builds the draft's ModelConfig).
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")


def eagle_head_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an EAGLE-1 Llama head, by checkpoint name (no ``model.`` prefix:
    vLLM's ``EagleLlamaForCausalLM.load_weights`` adds it).

    Args:
        config: a Llama-style HF config (``hidden_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size``; ``head_dim`` optional).

    Returns:
        ``name -> shape``: ``fc.weight`` ``[hidden, 2 * hidden]``; per layer ``i`` the
        q/k/v/o projections (``[heads * head_dim, hidden]``, ``[kv_heads * head_dim,
        hidden]`` x2, ``[hidden, heads * head_dim]``), ``post_attention_layernorm``
        ``[hidden]`` and gate/up/down ``[intermediate, hidden]`` x2,
        ``[hidden, intermediate]``. Layer 0 has no ``input_layernorm`` (EAGLE skips it).

    Raises:
        KeyError: ``config`` lacks a size field.

    Source: vllm/model_executor/models/llama_eagle.py (``LlamaModel``: ``fc``, layer 0's
        ``input_layernorm`` an ``nn.Identity``); SafeAILab/EAGLE ``eagle/model/cnets.py``.
    """
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (hidden, 2 * hidden)}
    for i in range(HEAD_LAYERS):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
        if i:
            shapes[f"{p}.input_layernorm.weight"] = (hidden,)
    return shapes


def write_random_eagle_head(target_dir: str, out_dir: str, *, seed: int = SEED) -> str:
    """Write a random bf16 EAGLE-1 head for the Llama checkpoint in ``target_dir``.

    Linear weights drawn from N(0, :data:`INIT_STD`^2), norms ones; no
    ``embed_tokens``, no ``lm_head`` (vLLM shares the target's). ``config.json`` is the
    target's sizes (:data:`TARGET_FIELDS`) with :data:`HEAD_LAYERS` layers and
    ``architectures: ["LlamaForCausalLM"]`` (vLLM's ``EAGLEConfig`` makes it
    ``EagleLlamaForCausalLM`` for ``method="eagle"``); the target's tokenizer files
    are copied. Deterministic in ``seed``.

    Returns:
        ``out_dir`` (created if missing).

    Raises:
        KeyError: the target's ``config.json`` lacks a size field.

    Source: vllm/transformers_utils/configs/eagle.py::EAGLEConfig,
        vllm/model_executor/models/llama_eagle.py::EagleLlamaForCausalLM.load_weights.
    """
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)
    from safetensors.torch import save_file  # noqa: PLC0415 (imported with torch)

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in eagle_head_shapes(target).items():
        if name.endswith("layernorm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * INIT_STD).to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    config = {k: target[k] for k in TARGET_FIELDS if k in target}
    config |= {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": HEAD_LAYERS,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in sorted(os.listdir(target_dir)):
        if name.startswith(TOKENIZER_PREFIXES):
            shutil.copy2(os.path.join(target_dir, name), os.path.join(out_dir, name))
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m wcache.testing.spec_decode TARGET_DIR OUT_DIR")
    print(write_random_eagle_head(sys.argv[1], sys.argv[2]))
