"""A tiny random-weight Qwen3-MoE checkpoint for the CPU MoE tests (issue 42).

2 layers, hidden 256, 8 experts, top-2, ``moe_intermediate_size`` 96 (not a multiple
of 128), SmolLM2's tokenizer and vocabulary, bf16, seeded: every build is the same.
Built with transformers (``AutoConfig.for_model`` + ``from_config`` +
``save_pretrained``) into the fixtures folder and reused while its stamp matches.
Its text is from random weights: tests compare outputs, not quality. To be replaced
by the fixtures module of issue 42 item 4 when it lands.

    python -m wcache.testing.tiny_moe      # prints the folder
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from wcache.testing import fixtures as fx

MOE_VERSION = 1
QWEN3_MOE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
#: Standard deviation of the random weights (as wcache.testing.tiny): activations stay
#: in bf16's comfortable range over 2 layers, logits still differ between tokens.
WEIGHT_STD = 0.05
SEED = 4242


def _stamp() -> dict:
    return {"moe_version": MOE_VERSION, "arch": "qwen3_moe", "config": QWEN3_MOE}


def path(out=None) -> Path:
    return fx.fixtures_root(out) / "tiny-qwen3-moe-bf16"


def build(out=None) -> Path:
    """Build (or reuse) the tiny Qwen3-MoE checkpoint; returns its folder."""
    final = path(out)
    try:
        if json.loads((final / fx.STAMP_FILE).read_text()) == _stamp():
            return final
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 (transformers ~3 s: only on a cache miss)

    smollm = fx.build("bf16", out)
    base = json.loads((smollm / fx.CONFIG_FILE).read_text())
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=base["vocab_size"],
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        **QWEN3_MOE,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, WEIGHT_STD)
    with fx.atomic_folder(final) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        for src in smollm.iterdir():
            if src.is_file() and ("token" in src.name or src.name == "special_tokens_map.json"):
                shutil.copy2(src, tmp / src.name)
        (tmp / fx.STAMP_FILE).write_text(json.dumps(_stamp()) + "\n")
    return final


if __name__ == "__main__":
    print(build())
