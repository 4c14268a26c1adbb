"""Issue 12 items 2, 3 and 5 in-process (no engine start): the daemon keeps no
model reference after building its arena; attention variants and any other
module with post-load work are planned or refused before any weight is read;
vLLM internals are reached through wcache.vllm.compat, and the plugin refuses an
untested vLLM."""

from __future__ import annotations

import ast
import gc
import pathlib
import weakref

import pytest
import torch

from tests.helpers.vllm_loader import load_with_changed_model, meta_model
from wcache.core import NoPlan

pytestmark = pytest.mark.slow

WCACHE_VLLM = pathlib.Path(__file__).resolve().parents[2] / "wcache" / "vllm"


# ------------------------------------------------------------------ item 2


def test_build_server_keeps_no_model_reference(vllm_cfg, tmp_path, monkeypatch, sock_dir):
    """After build_server the loaded model, every one of its parameters and buffers,
    and its forward-context/rope registrations are gone: only the arena remains."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from wcache.daemon.process import ENGINE_ARGS
    from wcache.vllm import compat
    from wcache.vllm.build import build_server, engine_config
    from wcache.vllm.key import device_id, parallel_layout

    refs: list[weakref.ref] = []
    real_create = DefaultModelLoader.create_model

    def create_and_watch(self, **kwargs):
        model = real_create(self, **kwargs)
        refs.append(weakref.ref(model))
        return model

    real_export = __import__("wcache.vllm.model", fromlist=["x"]).export_tensors

    def export_and_watch(model):
        out = real_export(model)
        refs.extend(weakref.ref(t) for _, t in model.named_parameters(remove_duplicate=False))
        refs.extend(weakref.ref(t) for _, t in model.named_buffers(remove_duplicate=False))
        refs.extend(weakref.ref(m) for m in model.modules())
        return out

    # as in a fresh daemon process: no rotary embedding cached by an earlier build in this
    # process (vLLM's _ROPE_DICT would hand this model that older, still-owned module)
    from vllm.model_executor.layers import rotary_embedding

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    monkeypatch.setattr(DefaultModelLoader, "create_model", create_and_watch)
    monkeypatch.setattr("wcache.vllm.model.export_tensors", export_and_watch)
    cfg = engine_config(str(vllm_cfg.model_config.model), list(ENGINE_ARGS))
    dev = device_id(torch.device("cpu"), cfg.model_config, parallel_layout())
    emptied: list[str] = []
    monkeypatch.setattr(
        compat,
        "free_device_memory",
        lambda device_type, real=compat.free_device_memory: (
            emptied.append(device_type),
            real(device_type),
        ),
    )
    with set_current_vllm_config(cfg):
        before = compat.registrations(cfg)
        server = build_server(cfg, socket_dir=sock_dir, device_id=dev, progress=False)
    try:
        gc.collect()
        assert server.nbytes > 0
        assert len(refs) > 10  # the model and its parameters were watched
        assert [] == [r for r in refs if r() is not None]
        assert before == compat.registrations(cfg)
        assert ["cpu"] == emptied
    finally:
        server.stop()


def test_free_device_memory_empties_the_cuda_cache(monkeypatch):
    """On CUDA the daemon returns the caching allocator's unused blocks (empty_cache);
    on CPU it only collects garbage."""
    from wcache.vllm import compat

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    compat.free_device_memory("cpu")
    assert [] == calls
    compat.free_device_memory("cuda")
    assert ["empty_cache"] == calls


# ------------------------------------------------------------------ item 3


def _bare(cls):
    """An instance of a vLLM module class without its constructor (only its type
    and nn.Module state matter to the adapter)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    return obj


def _planned(model):
    from wcache.vllm.model import planned_layers
    from wcache.vllm.probe import host_target

    return planned_layers(model, host_target(torch.device("cpu")))


def _mla():
    """An MLA layer on vLLM-CPU's AMX_MLA backend (the one MLA backend refused)."""
    from tests.helpers import vllm_layers as vl

    return vl.mla_layer(backend="AMX_MLA")


def _mm_encoder(fp8: bool):
    from vllm.model_executor.layers.attention import MMEncoderAttention

    module = _bare(MMEncoderAttention)
    module.fp8_enabled = fp8
    return module


def _overriding_attention():
    from vllm.model_executor.layers.attention import Attention

    class PackingAttention(Attention):
        def process_weights_after_loading(self, act_dtype):
            raise AssertionError("not called by wcache")

    return _bare(PackingAttention)


class _Holder(torch.nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class _WorkingMethod:
    """A quant method outside QuantizeMethodBase that does post-load work."""

    def process_weights_after_loading(self, layer):
        raise AssertionError("not called by wcache")


class _HookedModel(torch.nn.Module):
    def process_weights_after_loading(self):
        raise AssertionError("not called by wcache")


@pytest.mark.parametrize(
    "make,name,reason",
    [
        (_mla, "attn", "AMX_MLA backend VNNI-packs private W_UK/W_UV copies"),
        (
            lambda: _mm_encoder(True),
            "attn",
            "multimodal-encoder attention with FP8 populates its scale buffers",
        ),
        (_overriding_attention, "attn", "no plan for method 'vllm-attention:PackingAttention'"),
    ],
)
def test_attention_without_a_plan_is_refused_naming_the_module(vllm_cfg, make, name, reason):
    """MLA on AMX_MLA, FP8 multimodal-encoder attention and an Attention subclass with its
    own post-load work are refused by planned_layers, naming the module and why."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import UnplannedLayers

    with set_current_vllm_config(vllm_cfg), pytest.raises(UnplannedLayers) as err:
        _planned(_Holder(block=_Holder(**{name: make()})))
    assert [f"block.{name}"] == [n for n, _ in err.value.layers]
    assert reason in str(err.value)
    assert "plan-missing" == err.value.code


def test_mm_encoder_attention_without_fp8_has_no_postload_work(vllm_cfg):
    """Multimodal-encoder attention without FP8 does nothing after load: no plan, no refusal."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_cfg):
        assert [] == _planned(_Holder(attn=_mm_encoder(False)))


@pytest.mark.parametrize("cls_name", ["Conv2dLayer", "Conv3dLayer"])
def test_vision_conv_layers_need_no_plan_unless_they_gain_postload_work(vllm_cfg, cls_name):
    """vLLM's vision-tower convolutions (CLIP/SigLIP patch embeddings, Qwen2.5-VL's
    Conv3d) have no quant method and no post-load work: no plan, no refusal, their
    weight is exported and installed as loaded; the same layer given a post-loading
    quant method is refused by name."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import conv

    from wcache.vllm.model import UnplannedLayers

    with set_current_vllm_config(vllm_cfg):
        layer = getattr(conv, cls_name)(3, 8, kernel_size=2, stride=2, bias=False)
        assert [] == _planned(_Holder(patch_embedding=layer))
        layer.quant_method = _WorkingMethod()
        with pytest.raises(UnplannedLayers) as err:
            _planned(_Holder(patch_embedding=layer))
    assert [("patch_embedding", "its quant method _WorkingMethod runs")] == [
        (n, r[: len("its quant method _WorkingMethod runs")]) for n, r in err.value.layers
    ]


def test_safety_net_refuses_any_module_with_postload_work(vllm_cfg):
    """A quant method that is no QuantizeMethodBase but does post-load work, and a
    model-level hook, are refused by the safety net; a method whose post-load is the
    base no-op is not."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from wcache.vllm.model import UnplannedLayers

    worker = torch.nn.Module()
    worker.quant_method = _WorkingMethod()
    idle = torch.nn.Module()
    idle.quant_method = object()
    model = _HookedModel()
    model.add_module("worker", worker)
    model.add_module("idle", idle)
    with set_current_vllm_config(vllm_cfg), pytest.raises(UnplannedLayers) as err:
        _planned(model)
    reasons = dict(err.value.layers)
    assert ["<model>", "worker"] == sorted(reasons)
    assert "_WorkingMethod runs process_weights_after_loading" in reasons["worker"]
    assert "model-level process_weights_after_loading hook" in reasons["<model>"]
    from wcache.vllm import compat

    assert compat.quant_method_postload_is_noop(object())
    assert not compat.quant_method_postload_is_noop(_WorkingMethod())

    class Idle(QuantizeMethodBase):
        def create_weights(self, *a, **k):
            raise AssertionError

        def apply(self, *a, **k):
            raise AssertionError

    assert compat.quant_method_postload_is_noop(Idle())


@pytest.mark.parametrize("fallback", [True, False])
def test_mla_layer_is_refused_before_any_weight_is_read(vllm_cfg, monkeypatch, fallback):
    """The engine loader with an MLA layer in SmolLM2: plan-missing before the key
    (checkpoint digest) or the daemon; fallback=true loads from disk, false raises."""
    import wcache.vllm.loader as loader_mod

    def change(model):
        model.model.layers[2].self_attn.attn = _mla()

    if not fallback:
        with pytest.raises(
            loader_mod.RestoreFailed,
            match=r"\[plan-missing\].*"
            r"model\.layers\.2\.self_attn\.attn.*AMX_MLA",
        ) as err:
            load_with_changed_model(vllm_cfg, monkeypatch, fallback, change)
        assert "plan-missing" == err.value.code
        return
    model, warnings = load_with_changed_model(vllm_cfg, monkeypatch, fallback, change)
    assert [] == [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert 1 == len(warnings)
    assert "[plan-missing]" in warnings[0] and "model.layers.2.self_attn.attn" in warnings[0]


def test_smollm2_attention_layers_still_get_the_attention_plan(vllm_cfg):
    """Plain Attention layers keep wcache's attention plan (the refusals are only for
    the variants)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_cfg):
        planned = _planned(meta_model(vllm_cfg))
    attn = [p for p in planned if p.name.endswith("self_attn.attn")]
    assert 30 == len(attn)
    assert {"attention/default@1"} == {p.plan.id for p in attn}


# ------------------------------------------------------------------ item 5


def test_installed_vllm_is_a_supported_release():
    """The venv runs a release and build wcache supports (so the check below passes),
    and compat's row for it is that release's own."""
    from wcache.vllm import compat

    assert compat.vllm_version() in compat.SUPPORTED_VLLM
    assert compat.vllm_version() == compat.release().version
    assert compat.vllm_distribution() in compat.release().builds
    compat.check_vllm_version()


def test_supported_releases_table():
    """0.32.0 is supported on CUDA and CPU, 0.33.0 on CUDA only (issue 23)."""
    from wcache.vllm import compat

    assert {"0.32.0": ("vllm", "vllm-cpu"), "0.33.0": ("vllm",)} == {
        v: r.builds for v, r in compat.SUPPORTED_VLLM.items()
    }
    assert "0.32.0 (CUDA: vllm, CPU: vllm-cpu), 0.33.0 (CUDA: vllm)" == compat.supported_releases()


@pytest.mark.parametrize(
    "version,want",
    [
        ("0.32.0", "0.32.0"),
        ("0.33.0", "0.33.0"),
        ("0.33.1", "0.33.0"),
        ("0.34.0+cu130", "0.33.0"),
        ("0.32.5", "0.32.0"),
        ("0.31.0", "0.32.0"),
        ("0.40.0.dev1", "0.33.0"),
        ("0.33.0rc1", "0.32.0"),
        ("0.33.1rc1", "0.33.0"),
        ("v0.33.2", "0.33.0"),
    ],
)
def test_release_of_an_unsupported_version_is_the_newest_before_it(version, want):
    """Under the override, an unsupported version runs with the newest supported
    release's tables that is not newer than it (the oldest if none is)."""
    from wcache.vllm import compat

    assert want == compat.release(version).version


@pytest.mark.parametrize(
    "version,distribution,env,refused",
    [
        ("0.32.0", "vllm-cpu", {}, False),
        ("0.32.0", "vllm", {}, False),
        ("0.33.0", "vllm", {}, False),
        ("0.33.0", "vllm-cpu", {}, True),  # vLLM-CPU stays at 0.32.0
        ("0.32.1", "vllm-cpu", {}, True),
        ("0.34.0", "vllm", {}, True),
        ("0.34.0", "vllm", {"WCACHE_ALLOW_UNTESTED_VLLM": "1"}, False),
        ("0.33.0", "vllm-cpu", {"WCACHE_ALLOW_UNTESTED_VLLM": "1"}, False),
        ("0.34.0", "vllm", {"WCACHE_ALLOW_UNTESTED_VLLM": "yes"}, True),
    ],
)
def test_check_vllm_version(version, distribution, env, refused):
    """An unsupported version, or a supported one as another build, is refused naming
    this version and build, listing the supported releases and the override."""
    from wcache.vllm.compat import UntestedVllm, check_vllm_version

    if not refused:
        assert check_vllm_version(version, env, distribution) is None
        return
    with pytest.raises(UntestedVllm) as err:
        check_vllm_version(version, env, distribution)
    message = str(err.value)
    assert message.startswith(f"this is vLLM {version} ({distribution}")
    assert "wcache supports vLLM 0.32.0 (CUDA: vllm, CPU: vllm-cpu), 0.33.0 (CUDA: vllm)" in message
    assert "WCACHE_ALLOW_UNTESTED_VLLM=1" in message
    assert "untested-vllm" == err.value.code


@pytest.mark.parametrize(
    "cuda,version,refused",
    [
        ("13.0", "0.33.0", False),
        ("13.0", "0.32.0", False),
        (None, "0.32.0", False),
        (None, "0.33.0", True),
    ],
)
def test_source_tree_without_metadata_is_judged_by_its_torch(monkeypatch, cuda, version, refused):
    """A vLLM no distribution provides (a source tree) is a CUDA build on a CUDA torch and a
    CPU one on a CPU torch: 0.33.0's Python over a CPU torch is refused like vllm-cpu 0.33."""
    import torch

    from wcache.vllm.compat import UntestedVllm, check_vllm_version

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    if not refused:
        assert check_vllm_version(version, {}, "unknown") is None
        return
    with pytest.raises(
        UntestedVllm,
        match=r"\(unknown, a CPU build by its torch\): vLLM "
        r"0\.33\.0 is supported as its CUDA build",
    ):
        check_vllm_version(version, {}, "unknown")


def test_wrong_build_of_a_supported_version_is_named():
    """vLLM 0.33.0 as vllm-cpu is refused saying which build 0.33.0 is supported as."""
    from wcache.vllm.compat import UntestedVllm, check_vllm_version

    with pytest.raises(
        UntestedVllm,
        match=r"vLLM 0\.33\.0 is supported as its CUDA build "
        r"\(vllm\) only",
    ):
        check_vllm_version("0.33.0", {}, "vllm-cpu")


def test_plugin_on_untested_vllm_registers_refusing_loaders(monkeypatch):
    """On another vLLM the plugin leaves vLLM usable but load_format='wcache' raises
    UntestedVllm when vLLM builds the loader; with the override it is wcache's loader."""
    from vllm.config import LoadConfig
    from vllm.model_executor import model_loader as ml

    from wcache.vllm import compat, plugin

    monkeypatch.setattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", dict(ml._LOAD_FORMAT_TO_MODEL_LOADER))
    # the version check reads it in compat.releases
    monkeypatch.setattr(compat.releases, "vllm_version", lambda: "0.99.0")
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    plugin.register()
    for fmt in plugin.LOAD_FORMATS:
        with pytest.raises(compat.UntestedVllm, match="this is vLLM 0.99.0"):
            ml.get_model_loader(LoadConfig(load_format=fmt))
    assert (
        "DefaultModelLoader" == type(ml.get_model_loader(LoadConfig(load_format="auto"))).__name__
    )
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    import wcache.vllm.loader as loader_mod

    ml.register_model_loader("wcache")(loader_mod.WcacheModelLoader)  # the import is cached
    plugin.register()
    assert isinstance(
        ml.get_model_loader(LoadConfig(load_format="wcache")), loader_mod.WcacheModelLoader
    )


def test_daemon_refuses_untested_vllm(monkeypatch):
    """`wcache serve` stops before loading on another vLLM version."""
    import argparse

    from wcache.daemon import serve
    from wcache.vllm import compat

    # the version check reads it in compat.releases
    monkeypatch.setattr(compat.releases, "vllm_version", lambda: "0.99.0")
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UntestedVllm):
        serve.main(argparse.Namespace(), [])


#: vLLM internals that only compat/ may name (tests/vllm/test_one_door.py checks
#: every private name with ast; this also catches them in docstrings).
INTERNALS = (
    "_ROPE_DICT",
    "static_forward_context",
    "record_metadata_for_reloading",
    "_set_torch_accelerator_to_noop",
)
NOT_YET_MOVED: set[str] = set()


def test_vllm_internals_only_in_compat():
    """No module of wcache/vllm outside compat/ names a vLLM internal."""
    offenders = {}
    for path in sorted(WCACHE_VLLM.glob("*.py")):
        if path.name in NOT_YET_MOVED:
            continue
        found = [name for name in INTERNALS if name in path.read_text()]
        if found:
            offenders[path.name] = found
    assert {} == offenders


def test_adapter_names_only_classes_compat_imports():
    """Every vLLM class name in adapter.py is one compat imports (a renamed class
    fails at import instead of silently no longer matching)."""
    from wcache.vllm import compat

    tree = ast.parse((WCACHE_VLLM / "adapter.py").read_text())
    names = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.isidentifier()
        and node.value[:1].isupper()
        and node.value.endswith(("Method", "Kernel", "Attention", "Int8", "WNA16"))
    }
    assert names  # the adapter does name classes
    assert set() == names - set(compat.release().class_modules)


def test_every_mapped_vllm_class_exists_in_this_vllm():
    """Each class compat maps is found in its module once imported (a vLLM that moved
    or renamed one fails here); compat itself imports nothing: a module this process
    never imported has no instances, so its classes match nothing."""
    import importlib

    from wcache.vllm import compat

    for name, module in compat.release().class_modules.items():
        importlib.import_module(module)
        assert name == getattr(compat.classes(), name).__name__
    for module, _cls in compat.release().kernel_classes.values():
        importlib.import_module(module)
    assert {kid for _, kid in compat.kernel_classes()} == set(compat.release().kernel_classes)
    assert all(c is not compat._NotImported for c, _ in compat.kernel_classes())
    assert not compat.is_type(object(), "MLAAttention")


def test_kernel_ids_by_exact_class():
    """A subclass maps to its own id (zentorch is a CPUWNA16 subclass with another
    layout); an unknown kernel maps to its class name, which plan_for refuses."""
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.zentorch import (
        ZentorchWNA16LinearKernel,
    )

    from wcache.vllm import compat

    assert "cpu_wna16" == compat.kernel_id(CPUWNA16LinearKernel.__new__(CPUWNA16LinearKernel))
    assert "zentorch" == compat.kernel_id(
        ZentorchWNA16LinearKernel.__new__(ZentorchWNA16LinearKernel)
    )

    class NewKernel(CPUWNA16LinearKernel):
        pass

    assert "NewKernel" == compat.kernel_id(NewKernel.__new__(NewKernel))
    assert issubclass(NoPlan, Exception)
