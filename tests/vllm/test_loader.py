"""The engine-side loader in-process, without a daemon: refusals and integrity checks.

Builds SmolLM2's vLLM model on the meta device the way the loader does (no
engine start), so these run in seconds.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tests.helpers.vllm_loader import load_with_changed_model, meta_model
from wcache.core import NoPlan

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

    with pytest.raises(
        RestoreFailed,
        match=r"\[plan-missing\].*model\.layers\.3\.mlp"
        r"\.down_proj.*MysteryMethod",
    ) as info:
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
    assert [n for n, _ in info.value.layers] == [
        "model.layers.1.mlp.gate_up_proj",
        "model.layers.7.mlp.gate_up_proj",
    ]
    assert "2 layer(s) [model.layers.1.mlp.gate_up_proj, model.layers.7.mlp.gate_up_proj]" in str(
        info.value
    )
    assert isinstance(info.value, NoPlan) and "plan-missing" == info.value.code


def test_every_smollm_layer_resolves_a_plan(vllm_cfg):
    """On the meta-built bf16 SmolLM2, 120 linears + 2 embeddings get the plan of the
    GEMM branch vLLM takes for bf16 on this host (on AMX, SGL for the shapes it packs),
    and 30 attention layers theirs."""
    from collections import Counter

    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import planned_layers
    from wcache.vllm.probe import host_target

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    host = host_target("cpu", env={})
    # vLLM's branch for the shapes SGL takes (AMX hosts: sgl) and for the others
    branches = {
        host.kernel("unquantized_gemm[bfloat16]"),
        host.kernel("unquantized_gemm[bfloat16,sgl_shape]"),
    }
    ids = Counter(p.plan.id for p in planned_layers(model, host))
    assert ids["attention/default@1"] == 30
    assert {f"unquantized/{b}@1" for b in branches} >= set(ids) - {"attention/default@1"}
    assert sum(ids.values()) - 30 == 122


def test_extra_tensor_from_daemon_is_refused(vllm_cfg):
    """An exported tensor the engine's model has no slot for raises ModelMismatch."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import ModelMismatch, install_tensors_

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    extra = {"model.layers.0.mlp.down_proj.surprise": torch.zeros(2)}
    with pytest.raises(ModelMismatch, match="surprise"):
        install_tensors_(
            model, extra, {"model.layers.0.mlp.down_proj.surprise": "param"}, {}, {}, []
        )


def test_meta_leftovers_include_module_attributes(vllm_cfg):
    """The leftover scan sees meta tensors held as plain module attributes (kv_cache)."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import meta_leftovers

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    left = meta_leftovers(model)
    assert "model.layers.0.self_attn.attn.kv_cache" in left
    assert "model.embed_tokens.weight" in left


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sokcet_dir": "/tmp"}, "unknown model_loader_extra_config keys"),
        ({"mode": "mmap"}, "mode must be 'zero_copy' or 'copy'"),
    ],
)
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
    # JSON's integers 0 and 1, which the refusal lists (they were refused: break14 #4)
    opts = LoaderOptions.from_extra({"fallback": 0, "strict": 1})
    assert (opts.fallback, opts.strict) == (False, True)


def test_loader_options_from_json_text():
    """``LLM(model_loader_extra_config='{"fallback": false}')``: vLLM keeps the string
    as given; it is read as the JSON it is (it failed with "dictionary update sequence
    element #0 has length 1"), and text that is not a JSON object is refused by name."""
    from wcache.vllm.loader import LoaderOptions

    opts = LoaderOptions.from_extra('{"fallback": false, "job": "j"}')
    assert (opts.fallback, opts.job) == (False, "j")
    assert LoaderOptions.from_extra("") == LoaderOptions()
    with pytest.raises(ValueError, match="model_loader_extra_config is not valid JSON"):
        LoaderOptions.from_extra("{fallback: false}")
    with pytest.raises(ValueError, match="model_loader_extra_config must be a dict"):
        LoaderOptions.from_extra("[1, 2]")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"fallback": "ture"}, "fallback must be true or false"),
        ({"fallback": None}, "fallback must be true or false"),
        ({"fallback": 2}, "fallback must be true or false"),
        ({"strict": "yes please"}, "strict must be true or false"),
        ({"connect_timeout_s": "abc"}, "connect_timeout_s must be a positive number"),
        ({"connect_timeout_s": -1}, "connect_timeout_s must be a positive number"),
        ({"connect_timeout_s": "nan"}, "connect_timeout_s must be a positive number"),
        ({"socket_dir": 123}, "socket_dir must be a string"),
        ({"profile_file": 1}, "profile_file must be a string"),
        # null would name another socket than the daemon's (job digest of None, not "")
        ({"job": None}, "job must be a string"),
        ({"draft_job": None}, "draft_job must be a string"),
    ],
)
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
    load_config = dataclasses.replace(
        vllm_cfg.load_config,
        load_format="wcache",
        model_loader_extra_config={"socket_dir": str(tmp_path / "none"), "profile_file": str(prof)},
    )
    vllm_cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_cfg):
        WcacheModelLoader(load_config).load_model(vllm_cfg, vllm_cfg.model_config)
    functions = {name for (_, _, name) in pstats.Stats(str(prof)).stats}
    assert {"_load_model", "initialize_model"} <= functions


def _reload_records(model) -> dict:
    """Each module's reload record, as comparable values: per tensor its class, shape,
    dtype, device and attribute names, and the restore device."""
    from vllm.model_executor.model_loader.reload import layerwise

    out = {}
    for name, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None:
            continue
        params, buffers = info.restore_metadata
        out[name] = (
            {
                k: (type(t), tuple(t.shape), t.dtype, t.device.type, sorted(t.__dict__))
                for k, t in params.items()
            },
            {
                k: (type(t), tuple(t.shape), t.dtype, t.device.type, sorted(t.__dict__))
                for k, t in buffers.items()
            },
            str(info.restore_device),
        )
    return out


def test_reload_metadata_recorded_after_the_build_equals_vllms(vllm_cfg):
    """The loader builds on meta without vLLM's in-build reload record and records it
    afterwards (compat.record_reload_metadata_): the records equal the ones vLLM's own
    build leaves (with our device), module by module, buffers dropped or kept alike."""
    from wcache.vllm import compat

    device = torch.device("cpu")
    theirs = meta_model(vllm_cfg)
    compat.set_reload_device_(theirs, device)
    expected = _reload_records(theirs)
    with compat.without_reload_metadata():
        ours = meta_model(vllm_cfg)
    # the in-build record was skipped: only modules the two builds share (vLLM caches
    # rotary embeddings process-wide) carry one already
    shared = {n for n, m in ours.named_modules() if m is dict(theirs.named_modules()).get(n)}
    assert set(_reload_records(ours)) <= shared
    assert len(expected) == compat.record_reload_metadata_(ours, device)
    assert expected == _reload_records(ours)
    assert any(b for _, b, _ in expected.values()), "no buffer recorded: the test sees nothing"
    vllm_cfg.compilation_config.static_forward_context.clear()


def test_gptq_configs_are_copied_shallow_only_without_dynamic_rules():
    """gptq_config_copied_shallow: each layer still gets its own config object, equal
    to vLLM's deep copy after override_config; a config with dynamic rules is still
    deep-copied and the rule still applies to that layer alone."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils import gptq_utils

    from wcache.vllm import compat

    def config(dynamic):
        return AutoGPTQConfig(
            weight_bits=4,
            group_size=128,
            desc_act=False,
            is_sym=True,
            lm_head_quantized=False,
            dynamic=dynamic,
            full_config={"bits": 4, "group_size": 128, "nested": [[1]]},
        )

    def method_config(cfg, prefix):
        with torch.device("meta"):
            layer = ReplicatedLinear(256, 256, bias=False, params_dtype=torch.bfloat16)
        return gptq_utils.get_linear_quant_method(
            cfg, layer, prefix, lambda c: types.SimpleNamespace(cfg=c)
        ).cfg

    base = config({})
    deep = method_config(base, "model.layers.0.mlp.down_proj")
    with compat.gptq_config_copied_shallow():
        shallow = method_config(base, "model.layers.0.mlp.down_proj")
        ruled = config({r"+:.*\.1\..*": {"bits": 8}})
        ruled_cfg = method_config(ruled, "model.layers.1.mlp.down_proj")
    assert shallow is not base and vars(shallow) == vars(deep)
    assert shallow.full_config is base.full_config  # shared, not copied
    assert (8, 4) == (ruled_cfg.weight_bits, ruled.weight_bits)  # deep copy, rule applied
    assert ruled_cfg.full_config is not ruled.full_config
    assert gptq_utils.deepcopy is copy.deepcopy  # the patch is undone


def test_reload_record_drops_parameter_alias_buffers_as_vllm_does():
    """A non-persistent buffer aliasing a parameter's storage is left out of the record
    and any other buffer kept, by record_reload_metadata_ exactly as by vLLM's own
    record_metadata_for_reloading (whose storage pointers ours computes on demand)."""
    from vllm.model_executor.model_loader.reload import layerwise

    from wcache.vllm import compat

    def model():
        inner = torch.nn.Linear(4, 4)
        inner.register_buffer("alias", inner.weight.data, persistent=False)
        inner.register_buffer("own", torch.zeros(2), persistent=False)
        return torch.nn.Sequential(inner)

    theirs, ours = model(), model()
    layerwise.record_metadata_for_reloading(theirs)
    compat.set_reload_device_(theirs, torch.device("cpu"))
    compat.record_reload_metadata_(ours, torch.device("cpu"))
    assert _reload_records(theirs) == _reload_records(ours)
    assert ["own"] == sorted(_reload_records(ours)["0"][1])


def _parallel_key(dtype: str = "torch.bfloat16"):
    from wcache.store import CacheKey

    ranks = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0}
    return CacheKey({"dtype": dtype, "parallel": ranks})


@pytest.mark.parametrize(
    ("job", "daemon_dtype", "named"),
    [
        (
            "",
            "torch.bfloat16",
            "serves the same configuration (an equal key) under another job: give the "
            "engine that daemon's `wcache serve --job` (model_loader_extra_config job; "
            "`wcache verify --job`), or start a daemon without --job.",
        ),
        ("j2", "torch.bfloat16", "under job 'j2'"),
        ("", "torch.float16", 'key differs in dtype: engine="torch.bfloat16"'),
    ],
)
def test_missing_daemon_with_a_daemon_of_another_job_names_the_job(
    job, daemon_dtype, named, monkeypatch
):
    """No daemon on this engine's socket while the only one there has an equal key:
    the refusal names the job and how to pass it; it said "key differs in ." (no
    field) and "Start `wcache serve` with the engine's arguments", which does not help.
    A daemon of another key still gets the differing fields."""
    from wcache.errors import DaemonMissing, KeyMismatch
    from wcache.vllm.loader import _diagnose_missing

    theirs = _parallel_key(daemon_dtype)
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: [f"{d}/other.sock"])
    monkeypatch.setattr("wcache.store.daemon_status", lambda s, **k: {"key_fields": theirs.fields})
    err = _diagnose_missing(DaemonMissing("no socket"), _parallel_key(), "/s", job)
    assert named in str(err) and "key differs in ." not in str(err)
    if daemon_dtype == "torch.bfloat16":
        # an equal key under another job: no daemon of this job, so daemon-missing (it
        # was key-mismatch, whose text said the keys were equal: break16 #8)
        assert type(err) is DaemonMissing and err.code == "daemon-missing"
    else:
        assert isinstance(err, KeyMismatch) and ["dtype"] == err.fields


@pytest.mark.parametrize("job", ["", "train"])
def test_the_engines_own_stalled_daemon_is_not_reported_as_another_job(job, monkeypatch):
    """The engine's own daemon (equal key, same job) answered ``status`` but not the
    request within the timeout: the engine's daemon-missing error stands, not a
    key-mismatch advising the job it already has (break11 #3)."""
    from wcache.errors import DaemonMissing
    from wcache.vllm.loader import _diagnose_missing

    fields = _parallel_key().fields
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: [f"{d}/ours.sock"])
    monkeypatch.setattr(
        "wcache.store.daemon_status", lambda s, **k: {"key_fields": fields, "job": job}
    )
    exc = DaemonMissing("did not answer 'get' within 5.0 s; it is stalled or overloaded")
    assert exc is _diagnose_missing(exc, _parallel_key(), "/s", job)


def test_the_other_daemons_job_is_named_where_its_status_gives_it(monkeypatch):
    """A daemon's status carries its --job (only a digest of it is in the socket's
    name): the refusal names that job, so the engine's user can pass it (break pass 9:
    nothing said which job)."""
    from wcache.errors import DaemonMissing
    from wcache.vllm.loader import _diagnose_missing

    fields = _parallel_key().fields
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: [f"{d}/other.sock"])
    monkeypatch.setattr(
        "wcache.store.daemon_status", lambda s, **k: {"key_fields": fields, "job": "train"}
    )
    err = _diagnose_missing(DaemonMissing("no socket"), _parallel_key(), "/s", "")
    assert "serves the same configuration (an equal key) under job 'train': give" in str(err)


def test_a_mismatch_names_a_daemon_of_this_key_under_another_job(monkeypatch):
    """The engine's own socket serves another key (its job was forgotten) while a
    daemon of the same dir serves exactly its key under job 'b': the key-mismatch
    keeps its fields and says which job to pass (it named only the differing fields:
    break12 #3); without such a daemon it is left as it was."""
    from wcache.errors import KeyMismatch
    from wcache.vllm.loader import _diagnose_mismatch

    ours, other = _parallel_key(), _parallel_key("torch.float16")
    status = {
        "/s/own.sock": {"key_fields": other.fields, "job": ""},
        "/s/b.sock": {"key_fields": ours.fields, "job": "b"},
    }
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: sorted(status))
    monkeypatch.setattr("wcache.store.daemon_status", lambda s, **k: status[s])
    exc = KeyMismatch("daemon on /s/own.sock: key differs in dtype", fields=["dtype"])
    err = _diagnose_mismatch(exc, ours, "/s", "")
    assert str(err).startswith("daemon on /s/own.sock: key differs in dtype; but the daemon at ")
    assert "/s/b.sock serves the same configuration (an equal key) under job 'b': give" in str(err)
    assert str(err).endswith("`wcache verify --job`).")  # its own socket is taken: no second way
    assert (err.code, err.fields) == ("key-mismatch", ["dtype"])
    del status["/s/b.sock"]
    assert _diagnose_mismatch(exc, ours, "/s", "") is exc
