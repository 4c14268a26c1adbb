"""The engine-side loader in-process, without a daemon: refusals and integrity checks.

Builds SmolLM2's vLLM model on the meta device the way the loader does (no
engine start), so these run in seconds.
"""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch

from wcache.core import NoPlan
from wcache.vllm.process import ENGINE_ARGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_cfg():
    """A VllmConfig for the bf16 SmolLM2 with vLLM's 1-rank world initialized."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from wcache.testing.fixtures import build
    from wcache.vllm.daemon import _init_distributed, _prepare_platform, engine_config

    cfg = engine_config(str(build("bf16")), list(ENGINE_ARGS))
    with _prepare_platform(cfg), set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():  # the plan tests may have done it
            tmp = tempfile.mkdtemp(prefix="wcache-dist-")
            _init_distributed(cfg, 0, 1, f"file://{tmp}/init")
        yield cfg


def _meta_model(cfg):
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
    monkeypatch.setattr(loader_mod, "build_key",
                        lambda *a, **k: pytest.fail("checkpoint read before the plan check"))
    monkeypatch.setattr(loader_mod, "attach", lambda *a, **k: pytest.fail("daemon contacted"))
    monkeypatch.setattr(loader_mod.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    load_config = dataclasses.replace(vllm_cfg.load_config, load_format="wcache",
                                      model_loader_extra_config={"fallback": fallback})
    vllm_cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_cfg):
        model = loader_mod.WcacheModelLoader(load_config).load_model(vllm_cfg,
                                                                      vllm_cfg.model_config)
    return model, warnings


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
        model = _meta_model(vllm_cfg)
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
        model = _meta_model(vllm_cfg)
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
        model = _meta_model(vllm_cfg)
    extra = {"model.layers.0.mlp.down_proj.surprise": torch.zeros(2)}
    with pytest.raises(ModelMismatch, match="surprise"):
        install_tensors_(model, extra, {"model.layers.0.mlp.down_proj.surprise": "param"}, {},
                         {}, [])


def test_meta_leftovers_include_module_attributes(vllm_cfg):
    """The leftover scan sees meta tensors held as plain module attributes (kv_cache)."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import meta_leftovers

    with set_current_vllm_config(vllm_cfg):
        model = _meta_model(vllm_cfg)
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
])
def test_bad_option_values_name_the_key(extra, message):
    """A typo in a value never silently changes behaviour: the key is named."""
    from wcache.vllm.loader import LoaderOptions

    with pytest.raises(ValueError, match=message):
        LoaderOptions.from_extra(extra)
