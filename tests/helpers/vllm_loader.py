"""The engine-side loader in-process on SmolLM2 (no engine start, no daemon): a meta
build of the model, and a load after a change to that build. Used by the tests of
tests/vllm/ that take the ``vllm_cfg`` fixture (tests/vllm/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def meta_model(cfg):
    """SmolLM2's vLLM model built on the meta device, as the loader builds it."""
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg.compilation_config.static_forward_context.clear()
    with set_default_torch_dtype(cfg.model_config.dtype), torch.device("meta"):
        return initialize_model(vllm_config=cfg, model_config=cfg.model_config)


def load_with_changed_model(vllm_cfg, monkeypatch, fallback: bool, change):
    """Run the wcache loader on SmolLM2 after ``change(model)`` edits its meta build
    (e.g. gives a layer a method wcache has no plan for); the key and the daemon must
    never be reached. Returns ``(model, warnings logged by the loader)``."""
    from vllm.config import set_current_vllm_config

    import wcache.vllm.loader as loader_mod

    real_init = loader_mod.initialize_model

    def init_and_change(**kwargs):
        model = real_init(**kwargs)
        change(model)
        return model

    warnings: list[str] = []
    monkeypatch.setattr(loader_mod, "initialize_model", init_and_change)
    monkeypatch.setattr(
        loader_mod,
        "build_key",
        lambda *a, **k: pytest.fail("checkpoint read before the plan check"),
    )
    monkeypatch.setattr(loader_mod, "attach", lambda *a, **k: pytest.fail("daemon contacted"))
    monkeypatch.setattr(
        loader_mod.logger, "warning", lambda msg, *args: warnings.append(msg % args)
    )
    load_config = dataclasses.replace(
        vllm_cfg.load_config, load_format="wcache", model_loader_extra_config={"fallback": fallback}
    )
    vllm_cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_cfg):
        model = loader_mod.WcacheModelLoader(load_config).load_model(
            vllm_cfg, vllm_cfg.model_config
        )
    return model, warnings
