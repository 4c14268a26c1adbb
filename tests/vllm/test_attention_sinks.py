"""GPT-OSS's attention sinks on a restored engine: vLLM's attention backend impl keeps
the sinks parameter it was built with (``impl.sinks = sinks``); the engine builds the
model on meta, and wcache's install must point that reference at the mapped tensor
(issue 42: GPT-OSS bf16 killed the daemon-backed H200 engine at its first forward)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers import vllm_layers as VL
from wcache.shell import install_tensors_
from wcache.vllm.model import meta_leftovers

pytest.importorskip("vllm")

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64


@pytest.fixture
def model_config(monkeypatch):
    """What vLLM's Attention and its CPU impl read of the model config; the layers a
    test builds register in a forward context of their own."""
    VL.ensure_vllm()
    monkeypatch.setattr(VL._STATE["cfg"].compilation_config, "static_forward_context", {})
    monkeypatch.setattr(
        VL._STATE["cfg"],
        "model_config",
        types.SimpleNamespace(
            dtype=torch.bfloat16,
            is_mm_prefix_lm=False,
            hf_config=None,
            use_mla=False,
            rswa_window=None,
        ),
    )


def _oai_attention() -> torch.nn.Module:
    """GPT-OSS's OAIAttention, reduced to its sinks parameter and vLLM's Attention
    built with it, on the meta device (as wcache's engine side builds the model)."""
    from vllm.model_executor.layers.attention import Attention

    with VL.vllm_context("meta", torch.bfloat16):
        holder = torch.nn.Module()
        holder.sinks = torch.nn.Parameter(torch.empty(NUM_HEADS), requires_grad=False)
        holder.attn = Attention(
            NUM_HEADS,
            HEAD_SIZE,
            HEAD_SIZE**-0.5,
            num_kv_heads=NUM_KV_HEADS,
            sinks=holder.sinks,
            prefix="model.layers.0.self_attn.attn",
        )
    return holder


def test_installed_sinks_reach_vllms_attention_impl(model_config):
    """vLLM's own attention impl, built on meta with the sinks parameter, holds the
    installed (mapped) sinks after install, not the meta tensor; nothing is left on
    meta."""
    holder = _oai_attention()
    assert holder.attn.impl.sinks is holder.sinks  # vLLM keeps the very object
    mapped = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.bfloat16)
    install_tensors_(
        holder, {"sinks": mapped}, {"sinks": "param"}, {}, {}, writes={}, transformed={}
    )
    assert holder.attn.impl.sinks is holder.sinks
    assert torch.equal(holder.attn.impl.sinks, mapped)
    assert [] == [n for n in meta_leftovers(holder) if "sinks" in n]


def test_a_stale_impl_sinks_is_reported(model_config):
    """Without the rebind (the parameter swapped behind vLLM's back) the impl's meta
    sinks is named by meta_leftovers, so the engine refuses (restore-incomplete)
    instead of launching a kernel on a meta tensor."""
    holder = _oai_attention()
    holder._parameters["sinks"] = torch.nn.Parameter(torch.zeros(NUM_HEADS), requires_grad=False)
    assert "attn.impl.sinks" in meta_leftovers(holder)
