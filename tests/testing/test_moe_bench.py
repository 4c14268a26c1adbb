"""The Qwen3-30B-A3B-shaped benchmark writer emits vLLM's block-FP8 MoE layout, and its
size arithmetic is what it writes (checked on a shrunk geometry)."""

from __future__ import annotations

import pytest
import torch

from wcache.testing import moe_bench as mb

SMALL = {
    **mb.QWEN3_30B_A3B,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def test_layer_tensors_have_block_fp8_names_shapes_and_dtypes():
    """Experts and attention are FP8 with [N/128, K/128] scales; the router stays bf16."""
    g = torch.Generator().manual_seed(0)
    got = {
        n: (t.dtype, tuple(t.shape)) for n, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu"))
    }
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
    size = sum(
        t.numel() * t.element_size() for _, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu"))
    )
    assert mb.layer_bytes(SMALL) == size


def test_full_geometry_layer_is_about_0_62_gb():
    """Qwen3-30B-A3B's layer in block FP8: 128 x 3 x 768 x 2048 expert bytes dominate."""
    assert 0.6e9 < mb.layer_bytes(mb.QWEN3_30B_A3B) < 0.65e9


@pytest.mark.parametrize("fmt", mb.BENCH_FORMATS)
def test_layer_bytes_equals_generated_bytes_per_format(fmt):
    """layer_bytes(fmt) equals the bytes layer_tensors generates in that format."""
    g = torch.Generator().manual_seed(0)
    size = sum(
        t.numel() * t.element_size()
        for _, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu"), fmt)
    )
    assert mb.layer_bytes(SMALL, fmt) == size


def test_nvfp4_and_awq_layers_have_the_packed_layouts():
    """NVFP4: uint8 [N, K/2] E2M1 pairs, e4m3 [N, K/16] block scales, fp32 0-d global
    and input scales; AWQ: int32 [K, N/8] qweight, [K/128, N/8] qzeros, fp16 scales;
    the router stays bf16 in both."""
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp.experts.1.down_proj"
    nv = {
        n: (t.dtype, tuple(t.shape))
        for n, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu"), "nvfp4")
    }
    assert nv[f"{p}.weight"] == (torch.uint8, (256, 64))
    assert nv[f"{p}.weight_scale"] == (torch.float8_e4m3fn, (256, 8))
    assert nv[f"{p}.weight_scale_2"] == nv[f"{p}.input_scale"] == (torch.float32, ())
    assert nv["model.layers.0.mlp.gate.weight"] == (torch.bfloat16, (3, 256))
    awq = {
        n: (t.dtype, tuple(t.shape))
        for n, t in mb.layer_tensors(0, SMALL, g, torch.device("cpu"), "awq")
    }
    assert awq[f"{p}.qweight"] == (torch.int32, (128, 32))
    assert awq[f"{p}.qzeros"] == (torch.int32, (1, 32))
    assert awq[f"{p}.scales"] == (torch.float16, (1, 256))
    assert "model.layers.0.mlp.gate.qweight" not in awq


def test_full_geometry_nvfp4_and_awq_layers_are_about_0_35_and_0_33_gb():
    """Qwen3-30B-A3B's layer: 4.5 bits a weight (NVFP4) and ~4.1 (AWQ, group 128)."""
    assert 0.34e9 < mb.layer_bytes(mb.QWEN3_30B_A3B, "nvfp4") < 0.36e9
    assert 0.32e9 < mb.layer_bytes(mb.QWEN3_30B_A3B, "awq") < 0.34e9


def test_bench_configs_parse_in_vllm():
    """The AWQ config and the NVFP4 hf_quant_config.json parse in vLLM with the routers
    excluded, group 128 / 16."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc, extra = mb._quantization("awq", 2)
    assert extra == {}
    awq = AutoAWQConfig.from_config(qc)
    assert (awq.group_size, awq.modules_to_not_convert) == (
        128,
        ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
    )
    qc, extra = mb._quantization("nvfp4", 2)
    assert qc is None
    nv = ModelOptNvFp4Config.from_config(extra["hf_quant_config.json"])
    assert (nv.group_size, nv.exclude_modules[0]) == (16, "lm_head")


def test_unknown_format_is_refused():
    """A format the writer does not know raises ValueError naming the known ones."""
    with pytest.raises(ValueError, match="fp8_block"):
        mb.linear_tensors("int3", 8, 8, torch.Generator(), torch.device("cpu"))
