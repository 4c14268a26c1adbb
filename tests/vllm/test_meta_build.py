"""A model whose constructor reads tensor values cannot be built on the meta device:
the engine's load refuses it with ``meta-build`` (naming the architecture and the fix)
before any daemon is contacted, and the ``fallback`` rule applies. Engine: the CPU
architecture sweep's BLOOM row (``BloomAttention`` turns its ALiBi slopes into a list)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wcache.errors import MetaBuildUnsupported, RestoreFailed

META_ERROR = "Cannot copy out of meta tensor; no data!"


def _config():
    hf = SimpleNamespace(architectures=["BloomForCausalLM"])
    model_config = SimpleNamespace(model="/m", dtype=torch.bfloat16, hf_config=hf)
    return SimpleNamespace(
        model_config=model_config,
        device_config=SimpleNamespace(device="cpu"),
        speculative_config=None,
    ), model_config


def _loader(monkeypatch, fallback: bool):
    import torch
    from vllm.config import LoadConfig

    from wcache.vllm import loader as mod

    def no_attach(*args, **kwargs):
        raise AssertionError("a daemon was contacted")

    def meta_init(**kwargs):
        assert torch.empty(1).device.type == "meta"  # built under the meta device
        raise NotImplementedError(META_ERROR)

    monkeypatch.setattr(mod, "attach", no_attach)
    monkeypatch.setattr(mod, "initialize_model", meta_init)
    monkeypatch.setattr(mod.compat, "registrations", lambda cfg: None)
    monkeypatch.setattr(mod.compat, "forget_registrations_", lambda cfg, before: None)
    monkeypatch.setattr(mod, "parallel_layout", lambda: {"tp_rank": 0, "pp_rank": 0})
    monkeypatch.setattr(mod, "device_id", lambda *a: "cpu-0")
    ld = mod.WcacheModelLoader(
        LoadConfig(load_format="wcache", model_loader_extra_config={"fallback": fallback})
    )

    class Disk:
        def load_model(self, vllm_config, model_config, prefix=""):
            return "disk-model"

    monkeypatch.setattr(ld, "_disk_loader", lambda: Disk())
    return ld


def test_meta_build_failure_falls_back_to_disk_with_its_code(monkeypatch, caplog):
    """With fallback=true a model that cannot be built on meta loads from disk, the log naming meta-build and the architecture."""
    cfg, model_config = _config()
    ld = _loader(monkeypatch, fallback=True)
    with caplog.at_level("WARNING"):
        assert "disk-model" == ld._load_model(cfg, model_config, "")
    assert "[meta-build]" in caplog.text and "BloomForCausalLM" in caplog.text


def test_meta_build_failure_raises_with_fallback_off(monkeypatch):
    """With fallback=false the load raises RestoreFailed [meta-build] naming the fix, caused by MetaBuildUnsupported."""
    cfg, model_config = _config()
    ld = _loader(monkeypatch, fallback=False)
    with pytest.raises(RestoreFailed, match=r"\[meta-build\].*load_format='auto'") as err:
        ld._load_model(cfg, model_config, "")
    assert isinstance(err.value.__cause__, MetaBuildUnsupported)
    assert META_ERROR in str(err.value)
