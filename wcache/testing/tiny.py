"""A tiny Llama with an even head count, for tensor-parallel tests.

SmolLM2 has 9 attention heads and 3 KV heads, so it cannot split across 2
ranks. This builds a random-weight Llama (seeded, so every build is the same)
that can: hidden 256, intermediate 512, 2 layers, 4 heads, 2 KV heads, tied
embeddings, with SmolLM2's tokenizer and vocabulary; then its AWQ int4
variant with the same converter as the SmolLM2 fixtures. Output identity, not
quality, is what the tests check.

    python -m wcache.testing.tiny            # prints the AWQ folder
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from wcache.testing import fixtures as fx

TINY_VERSION = 1
TINY_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
#: Standard deviation of the random weights: small enough that 2 layers keep
#: activations in bf16's comfortable range, large enough to make logits differ.
WEIGHT_STD = 0.05
SEED = 1234


def _stamp(fmt: str) -> dict:
    return {"tiny_version": TINY_VERSION, "format": fmt, "builder_version": fx.BUILDER_VERSION}


def tiny_path(fmt: str, out: str | os.PathLike | None = None) -> Path:
    return fx.fixtures_root(out) / f"tiny-llama-tp-{fmt.replace('_', '-')}"


def _built(path: Path, fmt: str) -> bool:
    return fx.unbuilt_reason(path, _stamp(fmt)) is None


def _write_bf16(tmp: Path, smollm: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (transformers import ~1 s: only when called)

    base = json.loads((smollm / fx.CONFIG_FILE).read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        **TINY_CONFIG,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, WEIGHT_STD)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    for src in smollm.iterdir():
        if src.is_file() and ("token" in src.name or src.name == "special_tokens_map.json"):
            shutil.copy2(src, tmp / src.name)


def build_tiny(fmt: str = "awq", out: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) the tiny Llama in ``fmt`` (``bf16`` or ``awq``); returns its folder."""
    final = tiny_path(fmt, out)
    if _built(final, fmt):
        return final
    with fx.build_lock(final):
        if _built(final, fmt):  # another process built it meanwhile
            return final
        bf16_dir = None if fmt == "bf16" else build_tiny("bf16", out)
        with fx.atomic_folder(final) as tmp:
            if bf16_dir is None:
                _write_bf16(tmp, fx.build("bf16", out))
            else:
                fx._build_quantized(fmt, tmp, bf16_dir)
            fx.write_stamp(tmp, _stamp(fmt))
    return final


if __name__ == "__main__":
    print(build_tiny(sys.argv[1] if len(sys.argv) > 1 else "awq"))
