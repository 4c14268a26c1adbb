"""The engine-side loader in-process, without a daemon: refusals and integrity checks.

Builds SmolLM2's vLLM model on the meta device the way the loader does (no
engine start), so these run in seconds.
"""

from __future__ import annotations

import pytest
import torch

from wcache.core import NoPlan

from tests.helpers.vllm_loader import load_with_changed_model, meta_model

pytestmark = pytest.mark.slow


def _load_with_mystery_layer(vllm_cfg, monkeypatch, fallback: bool):
    """The loader on SmolLM2 with layer 3's down_proj given a quant method wcache has
    no plan for."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class MysteryMethod(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs):
            raise AssertionError("not used")

        def apply(self, *args, **kwargs):
            raise AssertionError("not used")

    def change(model):
        model.model.layers[3].mlp.down_proj.quant_method = MysteryMethod()

    return load_with_changed_model(vllm_cfg, monkeypatch, fallback, change)


def test_unplanned_layer_with_fallback_loads_from_disk_naming_it(vllm_cfg, monkeypatch):
    """plan-missing follows the fallback rule: with fallback=true the engine loads from
    disk (a real, non-meta model) and a WARNING names the unplanned layer and why,
    before the key is computed or the daemon contacted."""
    model, warnings = _load_with_mystery_layer(vllm_cfg, monkeypatch, fallback=True)
    assert [] == [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert 1 == len(warnings)
    assert "[plan-missing]" in warnings[0]
    assert "model.layers.3.mlp.down_proj" in warnings[0] and "MysteryMethod" in warnings[0]


def test_unplanned_layer_without_fallback_raises_plan_missing(vllm_cfg, monkeypatch):
    """With fallback=false an unplanned layer raises RestoreFailed [plan-missing] naming it."""
    from wcache.vllm.loader import RestoreFailed

    with pytest.raises(RestoreFailed, match=r"\[plan-missing\].*model\.layers\.3\.mlp"
                                            r"\.down_proj.*MysteryMethod") as info:
        _load_with_mystery_layer(vllm_cfg, monkeypatch, fallback=False)
    assert "plan-missing" == info.value.code


def test_unplanned_layers_are_all_named_in_one_refusal(vllm_cfg):
    """planned_layers (what `wcache serve` runs before loading) names every unplanned
    layer with its reason in one NoPlan, grouped by reason."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from wcache.vllm.model import UnplannedLayers, planned_layers
    from wcache.vllm.probe import host_target

    class OddMethod(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs):
            raise AssertionError("not used")

        def apply(self, *args, **kwargs):
            raise AssertionError("not used")

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    for i in (1, 7):
        model.model.layers[i].mlp.gate_up_proj.quant_method = OddMethod()
    with pytest.raises(UnplannedLayers) as info:
        planned_layers(model, host_target("cpu", env={}))
    assert [n for n, _ in info.value.layers] == ["model.layers.1.mlp.gate_up_proj",
                                                  "model.layers.7.mlp.gate_up_proj"]
    assert "2 layer(s) [model.layers.1.mlp.gate_up_proj, model.layers.7.mlp.gate_up_proj]" in \
        str(info.value)
    assert isinstance(info.value, NoPlan) and "plan-missing" == info.value.code


def test_every_smollm_layer_resolves_a_plan(vllm_cfg):
    """On the meta-built bf16 SmolLM2, 120 linears + 2 embeddings get the plan of the
    GEMM branch vLLM takes for bf16 on this host, and 30 attention layers theirs."""
    from collections import Counter

    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import planned_layers
    from wcache.vllm.probe import host_target

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    host = host_target("cpu", env={})
    branch = host.kernel("unquantized_gemm[bfloat16]")
    if "sgl" in (branch, host.kernel("unquantized_gemm[bfloat16,sgl_shape]")):
        pytest.skip("vLLM picks the AMX SGL kernel for some SmolLM2 layers here (no plan yet)")
    ids = Counter(p.plan.id for p in planned_layers(model, host))
    assert ids == {f"unquantized/{branch}@1": 122, "attention/default@1": 30}


def test_extra_tensor_from_daemon_is_refused(vllm_cfg):
    """An exported tensor the engine's model has no slot for raises ModelMismatch."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import ModelMismatch, install_tensors_

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    extra = {"model.layers.0.mlp.down_proj.surprise": torch.zeros(2)}
    with pytest.raises(ModelMismatch, match="surprise"):
        install_tensors_(model, extra, {"model.layers.0.mlp.down_proj.surprise": "param"}, {},
                         {}, [])


def test_meta_leftovers_include_module_attributes(vllm_cfg):
    """The leftover scan sees meta tensors held as plain module attributes (kv_cache)."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import meta_leftovers

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    left = meta_leftovers(model)
    assert "model.layers.0.self_attn.attn.kv_cache" in left
    assert "model.embed_tokens.weight" in left


@pytest.mark.parametrize("extra, message", [
    ({"sokcet_dir": "/tmp"}, "unknown model_loader_extra_config keys"),
    ({"mode": "mmap"}, "mode must be 'zero_copy' or 'copy'"),
])
def test_bad_loader_options_are_refused(extra, message):
    """Typos and bad values in model_loader_extra_config fail with the list of valid keys."""
    from wcache.vllm.loader import LoaderOptions

    with pytest.raises(ValueError, match=message):
        LoaderOptions.from_extra(extra)


def test_loader_options_parse_cli_strings():
    """Options given as strings on the vllm serve command line are parsed to their types."""
    from wcache.vllm.loader import LoaderOptions

    opts = LoaderOptions.from_extra({"fallback": "false", "strict": "1", "connect_timeout_s": "2"})
    assert (opts.fallback, opts.strict, opts.connect_timeout_s) == (False, True, 2.0)


@pytest.mark.parametrize("extra, message", [
    ({"fallback": "ture"}, "fallback must be true or false"),
    ({"fallback": None}, "fallback must be true or false"),
    ({"strict": "yes please"}, "strict must be true or false"),
    ({"connect_timeout_s": "abc"}, "connect_timeout_s must be a positive number"),
    ({"connect_timeout_s": -1}, "connect_timeout_s must be a positive number"),
    ({"connect_timeout_s": "nan"}, "connect_timeout_s must be a positive number"),
    ({"socket_dir": 123}, "socket_dir must be a string"),
    ({"profile_file": 1}, "profile_file must be a string"),
])
def test_bad_option_values_name_the_key(extra, message):
    """A typo in a value never silently changes behaviour: the key is named."""
    from wcache.vllm.loader import LoaderOptions

    with pytest.raises(ValueError, match=message):
        LoaderOptions.from_extra(extra)


def test_profile_file_holds_the_whole_load_phase(vllm_cfg, tmp_path):
    """``profile_file`` writes cProfile stats of the whole weight-load phase, the
    fallback's disk load included (no daemon here: daemon-missing, then disk)."""
    import dataclasses
    import pstats

    from vllm.config import set_current_vllm_config

    from wcache.vllm.loader import WcacheModelLoader

    prof = tmp_path / "load.prof"
    load_config = dataclasses.replace(vllm_cfg.load_config, load_format="wcache",
                                      model_loader_extra_config={
                                          "socket_dir": str(tmp_path / "none"),
                                          "profile_file": str(prof)})
    vllm_cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_cfg):
        WcacheModelLoader(load_config).load_model(vllm_cfg, vllm_cfg.model_config)
    functions = {name for (_, _, name) in pstats.Stats(str(prof)).stats}
    assert {"_load_model", "initialize_model"} <= functions
