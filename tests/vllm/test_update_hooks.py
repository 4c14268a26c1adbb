"""The copy-on-write hooks a CUDA ``zero_copy`` restore puts on the model."""

from __future__ import annotations

import types

import torch

from wcache.vllm.loader import _install_update_hooks_
from wcache.vllm.verify import module_state


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)
        return {name for name, _ in weights}


def test_update_hooks_are_invisible_to_verify_and_privatize_before_a_write():
    """After the hooks are installed, ``wcache verify``'s model state is unchanged (the
    H200 tier failed verify on ``~get_submodule`` before the hooks were marked), and a
    weight update through ``load_weights`` writes a private copy, never the arena."""
    model = _Model()
    before = module_state(model)
    arena = model.proj.weight.data
    lo = arena.data_ptr()
    attachment = types.SimpleNamespace(arena_range=(lo, lo + arena.numel() * arena.element_size()))
    _install_update_hooks_(model, attachment)
    assert "get_submodule" in vars(model) and "load_weights" in vars(model)
    assert module_state(model) == before

    snapshot = arena.clone()
    model.load_weights([("proj.weight", torch.ones(4, 4))])
    assert torch.equal(arena, snapshot)  # the "arena" bytes are untouched
    assert torch.equal(model.proj.weight, torch.ones(4, 4))
    assert model.proj.weight.data_ptr() != lo
