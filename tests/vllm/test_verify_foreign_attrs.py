"""`wcache verify` compares load state, not another library's construction bookkeeping
(issue 47 item 1: ``~_is_hf_initialized: True != '<absent>'`` on OLMo2 and Starcoder2,
which vLLM runs on its Transformers modeling backend)."""

from __future__ import annotations

import pytest
import torch

from wcache.vllm.verify import first_difference, foreign_private_attrs, module_state


class _ForeignModule(torch.nn.Module):
    """A module class of neither vLLM nor wcache (this test module's)."""


class _VllmModule(torch.nn.Module):
    """A module class that claims to be vLLM's."""


_VllmModule.__module__ = "vllm.model_executor.layers.fake"


def _pair(cls: type[torch.nn.Module], **only_loaded: object) -> tuple[dict, dict]:
    loaded, restored = cls(), cls()
    for name, value in only_loaded.items():
        setattr(loaded, name, value)
    return module_state(loaded), module_state(restored)


def test_foreign_private_flag_on_one_side_is_not_a_difference():
    """A transformers-style private flag set on vLLM's load only is equal state."""
    assert first_difference(*_pair(_ForeignModule, _is_hf_initialized=True)) is None


def test_foreign_public_attribute_is_still_compared():
    """A public attribute of a foreign module that differs is reported."""
    assert (
        first_difference(*_pair(_ForeignModule, rope_type="yarn"))
        == "~rope_type: 'yarn' != '<absent>'"
    )


def test_private_attribute_of_vllm_module_is_still_compared():
    """vLLM's own modules keep every attribute compared, private ones included."""
    assert (
        first_difference(*_pair(_VllmModule, _already_processed=True))
        == "~_already_processed: True != '<absent>'"
    )


def test_foreign_private_attrs_names_only_underscored_names():
    """The rule selects the underscored names of a foreign module and nothing of vLLM's."""
    foreign, ours = _ForeignModule(), _VllmModule()
    for m in (foreign, ours):
        m._is_hf_initialized, m.scaling = True, 0.125
    assert {"_is_hf_initialized"} <= foreign_private_attrs(foreign)
    assert "scaling" not in foreign_private_attrs(foreign)
    assert foreign_private_attrs(ours) == frozenset()


def test_transformers_meta_build_differs_from_device_build_only_by_private_state():
    """transformers' own tree built under torch.device("meta") (wcache's restore) and on
    the CPU (vLLM's load) has equal attribute state module by module, and the raw
    attributes do differ (the flag), so the rule is what makes them equal."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "olmo2",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
    )
    on_cpu = transformers.AutoModel.from_config(config)
    with torch.device("meta"):
        on_meta = transformers.AutoModel.from_config(config)
    raw = [
        n
        for n, m in on_cpu.named_modules()
        if getattr(m, "_is_hf_initialized", None)
        != getattr(on_meta.get_submodule(n), "_is_hf_initialized", None)
    ]
    assert raw, "transformers no longer skips init_weights on meta: revisit the rule"

    def attrs_only(module: torch.nn.Module) -> dict:
        return {k: v for k, v in module_state(module).items() if k.startswith("~")}

    assert {n: attrs_only(m) for n, m in on_cpu.named_modules()} == {
        n: attrs_only(m) for n, m in on_meta.named_modules()
    }


def test_empty_private_scratch_is_no_state_but_a_filled_one_is():
    """On a vLLM module, an empty private container (a weight reader's drained
    scratch, as DeepSeek's _pending_indexer_wk_fp8) equals its absence; a non-empty
    one, or a public empty container, is still a difference."""

    class DeepseekV2Model(torch.nn.Module):
        pass

    DeepseekV2Model.__module__ = "vllm.model_executor.models.deepseek_v2"
    loaded, restored = DeepseekV2Model(), DeepseekV2Model()
    loaded._pending_indexer_wk_fp8 = {}
    assert first_difference(module_state(loaded), module_state(restored)) is None
    loaded._pending_indexer_wk_fp8 = {"wk": 1}
    assert "_pending_indexer_wk_fp8" in first_difference(
        module_state(loaded), module_state(restored)
    )
    loaded = DeepseekV2Model()
    loaded.pending = {}
    assert "pending" in first_difference(module_state(loaded), module_state(restored))
