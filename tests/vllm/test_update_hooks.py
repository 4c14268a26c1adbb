"""The private-write hooks a CUDA ``zero_copy`` restore puts on the model, one policy
per transport (``wcache.vllm.loader._install_update_hooks_``), driven through vLLM's
own reload functions on a small torch model, with fakes standing in for the mapping:

* ``cuda_vmm``: the whole arena privatized in place, once, before the first write;
  addresses never change;
* ``cuda_ipc`` with CUDA graphs or torch.compile: ``update-unsupported`` before any
  tensor is touched (values, objects, devices and addresses as before);
* ``cuda_ipc`` eager: the written tensors get private copies (new addresses).

The real driver and engine run in tests/gpu_engine/test_weight_updates_graphs.py (H200).
"""

from __future__ import annotations

import types

import pytest
import torch

from wcache.errors import UpdateUnsupported, WcacheError
from wcache.vllm.loader import _address_bound, _install_update_hooks_
from wcache.vllm.verify import module_state

#: Bytes the fake cuda_vmm mapping reports copied on its first privatization.
ARENA_BYTES = 4096


class _Model(torch.nn.Module):
    """Two layers whose parameters do not require grad (as restored ones), loaded the
    way vLLM's models load: each parameter's ``weight_loader``, else the default."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.LayerNorm(4, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, w in weights:
            getattr(params[name], "weight_loader", default_weight_loader)(params[name], w)
        return {name for name, _ in weights}


class _FakeVmm:
    """A cuda_vmm attachment: privatize_in_place_ copies once, then nothing."""

    keeps_addresses_on_write = True

    def __init__(self, model: torch.nn.Module, events: list[str]):
        self.arena_range = _range(model)
        self.events = events
        self.copied = False

    def privatize_in_place_(self) -> int:
        self.events.append("privatize")
        copied, self.copied = (0 if self.copied else ARENA_BYTES), True
        return copied


class _FakeIpc:
    keeps_addresses_on_write = False

    def __init__(self, model: torch.nn.Module):
        self.arena_range = _range(model)


def _range(model: torch.nn.Module) -> tuple[int, int]:
    """An "arena" covering every parameter of the model."""
    ptrs = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters()]
    return min(lo for lo, _ in ptrs), max(hi for _, hi in ptrs)


def _config():
    """What vLLM's in-place ``reload_weights`` reads of the engine's config."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(quantization=None, dtype=torch.float32),
        load_config=None,
        lora_config=None,
    )


def _model() -> _Model:
    from vllm.model_executor.model_loader.reload import layerwise

    model = _Model()
    layerwise.record_metadata_for_reloading(model)  # as the loader's compat.record_reload_metadata_
    return model


def _reload(model, weights, checkpoint_format: bool) -> None:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    reload_weights(_config(), model, weights, None, checkpoint_format)


def _picture(model) -> dict[str, tuple]:
    return {
        n: (id(p), p.device.type, p.data_ptr(), p.detach().clone())
        for n, p in model.named_parameters()
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x[:3] == y[:3] and torch.equal(x[3], y[3]) for x, y in zip(a.values(), b.values())
    )


# ----------------------------------------------------------------- the decision


def test_hooks_are_invisible_to_verify():
    """After the hooks are installed, ``wcache verify``'s model state is unchanged (the
    H200 tier failed verify on ``~get_submodule`` before the hooks were marked)."""
    model = _model()
    before = module_state(model)
    _install_update_hooks_(model, _FakeVmm(model, []), address_bound=True)
    assert "get_submodule" in vars(model) and "load_weights" in vars(model)
    assert module_state(model) == before


@pytest.mark.parametrize(
    ("attachment", "address_bound", "policy"),
    [
        (_FakeVmm, True, "in_place"),
        (_FakeVmm, False, "in_place"),
        (_FakeIpc, True, "refuse"),
        (_FakeIpc, False, "clone"),
    ],
)
def test_policy_per_transport_and_graphs(attachment, address_bound, policy):
    """cuda_vmm always privatizes in place; cuda_ipc refuses with graphs/compile and
    clones when eager."""
    model = _model()
    att = _FakeVmm(model, []) if attachment is _FakeVmm else _FakeIpc(model)
    assert _install_update_hooks_(model, att, address_bound) == policy


def _vllm_config(enforce_eager: bool, mode: str, cudagraph: str):
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=types.SimpleNamespace(
            mode=CompilationMode[mode], cudagraph_mode=CUDAGraphMode[cudagraph]
        ),
    )


@pytest.mark.parametrize(
    ("eager", "mode", "cudagraph", "bound"),
    [
        (True, "NONE", "NONE", False),
        (False, "VLLM_COMPILE", "FULL_AND_PIECEWISE", True),  # vLLM's CUDA default
        (False, "VLLM_COMPILE", "NONE", True),  # compiled, no graphs
        (False, "NONE", "FULL", True),  # graphs, no compile
        (False, "NONE", "NONE", False),
    ],
)
def test_address_bound_follows_compile_and_cudagraph_mode(eager, mode, cudagraph, bound):
    """An engine holds weight addresses when it compiles or captures CUDA graphs."""
    assert _address_bound(_vllm_config(eager, mode, cudagraph)) is bound


# ----------------------------------------------------------------- cuda_vmm: in place


def test_vmm_privatizes_once_before_the_first_write_and_keeps_addresses():
    """load_weights, both reload formats: the arena is privatized before the first
    write only, every parameter keeps its object and address, and the writes land."""
    model = _model()
    events: list[str] = []
    _install_update_hooks_(model, _FakeVmm(model, events), address_bound=True)
    ptrs = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
    loader = model.norm.weight.__dict__.setdefault  # a write records itself after privatize
    loader("weight_loader", lambda p, w: (events.append("write"), p.data.copy_(w)))

    model.load_weights([("norm.weight", torch.full((4,), 2.0))])
    assert events == ["privatize", "write"]
    _reload(model, [("proj.weight", torch.ones(4, 4))], checkpoint_format=True)
    _reload(model, [("norm.weight", torch.full((4,), 3.0))], checkpoint_format=False)
    assert events[0] == "privatize" and events.count("privatize") >= 2  # later calls: no copy
    assert {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()} == ptrs
    assert torch.equal(model.proj.weight, torch.ones(4, 4))
    assert torch.equal(model.norm.weight, torch.full((4,), 3.0))


def test_vmm_checkpoint_reload_privatizes_before_vllm_sets_layers_aside():
    """A checkpoint-format reload privatizes at its start, while every parameter is
    still the live one (vLLM has not yet moved the layers to meta)."""
    model = _model()
    seen = []
    att = _FakeVmm(model, [])
    real = att.privatize_in_place_

    def privatize() -> int:
        seen.append({p.device.type for p in model.parameters()})
        return real()

    att.privatize_in_place_ = privatize
    _install_update_hooks_(model, att, address_bound=True)
    _reload(model, [("proj.weight", torch.ones(4, 4))], checkpoint_format=True)
    assert seen[0] == {"cpu"}


def test_vmm_ignores_get_submodule_outside_a_reload():
    """LoRA's module replacement and weight tying resolve modules through
    get_submodule: no privatization (the arena stays shared)."""
    model = _model()
    events: list[str] = []
    _install_update_hooks_(model, _FakeVmm(model, events), address_bound=True)
    assert model.get_submodule("proj") is model.proj
    assert events == []


# ----------------------------------------------------------------- cuda_ipc + graphs: refused


@pytest.mark.parametrize("path", ["load_weights", "reload_checkpoint", "reload_kernel"])
def test_ipc_with_graphs_refuses_before_any_tensor_is_touched(path):
    """update-unsupported naming the fixes, and every parameter is the same object, on
    the same device, at the same address, with the same values: the engine serves on."""
    model = _model()
    _install_update_hooks_(model, _FakeIpc(model), address_bound=True)
    before = _picture(model)
    new = [("proj.weight", torch.ones(4, 4))]
    with pytest.raises(UpdateUnsupported) as info:
        if path == "load_weights":
            model.load_weights(new)
        else:
            _reload(model, new, checkpoint_format=path == "reload_checkpoint")
    assert isinstance(info.value, (WcacheError, RuntimeError))
    assert info.value.code == "update-unsupported"
    for fix in ("cuda_vmm", "mode='copy'", "enforce_eager=True"):
        assert fix in str(info.value)
    assert _same(_picture(model), before)
    assert "_original_do_torchao_reload" not in vars(model)
    # and the model still reloads normally once the hook is gone (nothing half-done)
    from vllm.model_executor.model_loader.reload import layerwise

    assert all(
        i.kernel_tensors is None for i in (layerwise.LAYERWISE_INFO[m] for m in model.modules())
    )


# ----------------------------------------------------------------- cuda_ipc eager: clone


def test_ipc_eager_clones_what_an_update_writes():
    """load_weights writes a private copy (a new address), never the arena; a
    kernel-format reload clones that module only."""
    model = _model()
    arena = model.proj.weight.data
    lo = arena.data_ptr()
    _install_update_hooks_(model, _FakeIpc(model), address_bound=False)
    snapshot = arena.clone()
    model.load_weights([("proj.weight", torch.ones(4, 4))])
    assert torch.equal(arena, snapshot)  # the "arena" bytes are untouched
    assert torch.equal(model.proj.weight, torch.ones(4, 4))
    assert model.proj.weight.data_ptr() != lo

    model = _model()
    proj_ptr, norm = model.proj.weight.data_ptr(), model.norm.weight.data
    _install_update_hooks_(model, _FakeIpc(model), address_bound=False)
    _reload(model, [("norm.weight", torch.full((4,), 5.0))], checkpoint_format=False)
    assert torch.equal(model.norm.weight, torch.full((4,), 5.0))
    assert torch.equal(norm, torch.ones(4))  # the "arena" kept LayerNorm's initial ones
    assert model.proj.weight.data_ptr() == proj_ptr  # another module: not copied
