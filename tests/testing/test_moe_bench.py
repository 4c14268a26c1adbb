"""The Qwen3-30B-A3B-shaped benchmark writer emits vLLM's block-FP8 MoE layout, and its
size arithmetic is what it writes (checked on a shrunk geometry)."""

from __future__ import annotations

import torch

from wcache.testing import moe_bench as mb

SMALL = {**mb.QWEN3_30B_A3B, "hidden_size": 256, "moe_intermediate_size": 128,
         "num_experts": 3, "num_attention_heads": 2, "num_key_value_heads": 1}


def test_layer_tensors_have_block_fp8_names_shapes_and_dtypes():
    """Experts and attention are FP8 with [N/128, K/128] scales; the router stays bf16."""
    g = torch.Generator().manual_seed(0)
    got = {n: (t.dtype, tuple(t.shape)) for n, t in
           mb.layer_tensors(0, SMALL, g, torch.device("cpu"))}
    p = "model.layers.0"
    assert got[f"{p}.mlp.experts.2.down_proj.weight"] == (torch.float8_e4m3fn, (256, 128))
    assert got[f"{p}.mlp.experts.2.down_proj.weight_scale_inv"] == (torch.float32, (2, 1))
    assert got[f"{p}.self_attn.k_proj.weight_scale_inv"] == (torch.float32, (1, 2))
    assert got[f"{p}.mlp.gate.weight"] == (torch.bfloat16, (3, 256))
    assert f"{p}.mlp.gate.weight_scale_inv" not in got
    assert sum(".experts." in n for n in got) == 3 * 3 * 2


def test_layer_bytes_equals_the_bytes_generated():
    """layer_bytes (the disk estimate) equals the generated tensors' bytes."""
    g = torch.Generator().manual_seed(0)
    size = sum(t.numel() * t.element_size()
               for _, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu")))
    assert mb.layer_bytes(SMALL) == size


def test_full_geometry_layer_is_about_0_62_gb():
    """Qwen3-30B-A3B's layer in block FP8: 128 x 3 x 768 x 2048 expert bytes dominate."""
    assert 0.6e9 < mb.layer_bytes(mb.QWEN3_30B_A3B) < 0.65e9
