"""The loader's speculative-decoding handling (issue 44, item 3), without an engine:
which model a load builds (target, ``draft_model`` draft, EAGLE-style head), which
methods are refused (``spec-unsupported``), the ``draft``/``draft_job`` options, and a
draft's key equal to its daemon's. Engines: tests/e2e/test_spec_decode_e2e.py (CPU),
tests/gpu_engine/test_spec_decode_engines.py (H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _vllm_config(method: str | None, draft: object = None, model: object = None):
    model = model or SimpleNamespace(model="/target")
    spec = (
        None
        if method is None
        else SimpleNamespace(method=method, draft_model_config=draft, target_model_config=model)
    )
    return SimpleNamespace(
        speculative_config=spec, model_config=model, device_config=SimpleNamespace(device="cpu")
    )


@pytest.mark.parametrize(
    "method, loading_draft, role",
    [
        (None, False, "target"),
        ("draft_model", False, "target"),
        ("draft_model", True, "draft"),
        ("eagle", True, "head"),
        ("eagle3", True, "head"),
        ("mtp", True, "head"),  # an MTP draft has the target's path: told apart by identity
    ],
)
def test_spec_role_table(method, loading_draft, role):
    """spec_role names the draft_model draft, any other drafter a head, everything else the target."""
    from wcache.vllm.loader import spec_role

    target = SimpleNamespace(model="/m")
    draft = SimpleNamespace(model="/m")  # equal fields, another object
    cfg = _vllm_config(method, draft, target)
    assert role == spec_role(cfg, draft if loading_draft else target)


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "custom_class"])
def test_a_method_whose_draft_config_is_the_targets_has_only_the_targets_load(method):
    """ngram, ngram_gpu and custom_class: vLLM sets draft_model_config to the target's
    own ModelConfig object, so the target's load is told apart by it being the target's
    (break18 D1: ngram's target was taken for a drafter and loaded from disk, silently
    with fallback off; custom_class then skipped its spec-unsupported refusal)."""
    from wcache.vllm.loader import spec_role

    target = SimpleNamespace(model="/m")
    assert spec_role(_vllm_config(method, target, target), target) == "target"


@pytest.mark.parametrize(
    "method, refused",
    [
        (None, False),
        ("ngram", False),
        ("ngram_gpu", False),
        ("suffix", False),
        ("draft_model", False),
        ("eagle", False),
        ("eagle3", False),
        ("mtp", True),
        ("medusa", True),
        ("dflash", True),
        ("custom_class", True),
        ("extract_hidden_states", True),
    ],
)
def test_spec_refusal_table(method, refused):
    """_spec_refusal names each unsupported method and the fix; supported ones pass."""
    from wcache.vllm.loader import _spec_refusal

    reason = _spec_refusal(_vllm_config(method))
    if not refused:
        assert reason is None
    else:
        assert f"method {method!r} is not supported" in reason
        assert "load_format='auto'" in reason and "'draft_model'" in reason


def test_spec_unsupported_error_class():
    """The refusal's error is a WcacheError and a ValueError with code spec-unsupported."""
    from wcache.errors import SpecDecodeUnsupported, WcacheError

    err = SpecDecodeUnsupported("x")
    assert isinstance(err, WcacheError) and isinstance(err, ValueError)
    assert "spec-unsupported" == err.code


def test_draft_options_parse_and_refuse_typos():
    """draft takes 'restore' or 'disk' (default restore, job 'draft'); anything else names the key."""
    from wcache.vllm.loader import LoaderOptions

    assert ("restore", "draft") == (LoaderOptions().draft, LoaderOptions().draft_job)
    opts = LoaderOptions.from_extra({"draft": "disk", "draft_job": "j2"})
    assert ("disk", "j2") == (opts.draft, opts.draft_job)
    with pytest.raises(ValueError, match="draft must be one of"):
        LoaderOptions.from_extra({"draft": "daemon"})
    with pytest.raises(ValueError, match="draft_job must be a string"):
        LoaderOptions.from_extra({"draft_job": 3})


def _loader(monkeypatch, **extra):
    """A WcacheModelLoader whose disk loader returns a marker and whose attach fails the test."""
    from vllm.config import LoadConfig

    from wcache.vllm import loader as mod

    def no_attach(*args, **kwargs):
        raise AssertionError("a daemon was contacted")

    monkeypatch.setattr(mod, "attach", no_attach)
    ld = mod.WcacheModelLoader(
        LoadConfig(load_format="wcache", model_loader_extra_config=dict(extra))
    )
    calls = []

    class Disk:
        def load_model(self, vllm_config, model_config, prefix=""):
            calls.append(model_config)
            return "disk-model"

    monkeypatch.setattr(ld, "_disk_loader", lambda: Disk())
    return ld, calls


@pytest.mark.parametrize(
    "method, extra",
    [("eagle", {}), ("eagle3", {}), ("draft_model", {"draft": "disk"})],
)
def test_drafters_from_disk_ask_no_daemon(monkeypatch, method, extra):
    """An EAGLE head, and a draft_model draft with draft='disk', load from disk without contacting a daemon."""
    ld, calls = _loader(monkeypatch, fallback=False, **extra)
    draft = SimpleNamespace(model="/head")
    assert "disk-model" == ld.load_model(_vllm_config(method, draft), draft)
    assert [draft] == calls


def test_external_weight_memory_counts_the_draft_daemon(monkeypatch):
    """With draft_model and draft='restore' the external bytes are the target's daemon's plus the draft's (job 'draft')."""
    ld, _ = _loader(monkeypatch, freeze_gc=False)
    asked = []

    def daemon_bytes(vllm_config, model_config, job, draft=False):
        asked.append((model_config.model, job, draft))
        return {"/target": 1000, "/draft": 24}[model_config.model]

    monkeypatch.setattr(ld, "_daemon_bytes", daemon_bytes)
    cfg = _vllm_config("draft_model", SimpleNamespace(model="/draft"))
    assert 1024 == ld.get_external_weight_memory(cfg)
    assert [("/target", "", False), ("/draft", "draft", True)] == asked
    asked.clear()
    assert 0 == ld.get_external_weight_memory(_vllm_config("mtp", SimpleNamespace(model="/t")))
    assert [] == asked  # a refused method loads from disk: nothing is mapped


@pytest.mark.slow
def test_draft_key_equals_its_daemons_key():
    """A draft_model draft's key (runner 'draft', vLLM's draft hf_overrides) equals the key of a daemon serving its checkpoint."""
    from vllm.engine.arg_utils import EngineArgs

    from wcache.core import Target
    from wcache.testing.fixtures import build
    from wcache.testing.tiny_models import build_arch
    from wcache.vllm.key import build_key

    target, draft = str(build("bf16")), str(build_arch("llama"))
    common = {"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": True}
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    engine = EngineArgs(model=target, speculative_config=spec, **common).create_engine_config()
    served = EngineArgs(model=draft, **common).create_model_config()
    layout = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1}
    cpu = Target(device_type="cpu")
    draft_cfg = engine.speculative_config.draft_model_config
    daemon_key = build_key(served, layout, [], cpu)
    assert [] == build_key(draft_cfg, layout, [], cpu, draft=True).diff(daemon_key)
    assert "draft" == draft_cfg.runner  # what draft=True maps to the served runner
    with pytest.raises(TypeError, match="normalize_value"):  # vLLM's draft hf_overrides
        build_key(draft_cfg, layout, [], cpu)


class SpeculativeConfig:
    """Stands in for vLLM's class: only its static method's ``__qualname__`` matters."""

    @staticmethod
    def hf_config_override(hf_config, transformers_mtp_overrides=None):
        return hf_config

    @staticmethod
    def _apply_composed_hf_override(target, hf_config, transformers_mtp_overrides=None):
        return target(hf_config)


def test_draft_hf_override_is_recognised_in_both_release_shapes():
    """vLLM's no-op draft override is recognised bare (0.32) and as a partial (0.33); a composed or MTP one is not."""
    import functools

    from wcache.vllm.key import _is_draft_hf_override

    bare = SpeculativeConfig.hf_config_override
    assert _is_draft_hf_override(bare)
    assert _is_draft_hf_override(functools.partial(bare, transformers_mtp_overrides=None))
    assert not _is_draft_hf_override(functools.partial(bare, transformers_mtp_overrides={"a": 1}))
    composed = functools.partial(SpeculativeConfig._apply_composed_hf_override, lambda c: c)
    assert not _is_draft_hf_override(composed)
    assert not _is_draft_hf_override({"num_hidden_layers": 1})
