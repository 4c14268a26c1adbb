"""vLLM's Transformers modeling backend under wcache's meta build re-creates only the
parameters a disk build has on meta (issue 47: ``%weight: (..., (('dummy_weight_value',
1.0),)) != (..., ())`` from ``wcache verify`` on OLMo2, Starcoder2, GPT-NeoX, GLM and
Phi with vLLM 0.33 on the H100): vLLM's own swapped-in modules keep their parameter
objects and attributes; transformers' own parameters are materialized as before.

Runs vLLM's real ``Base.init_parameters`` (the installed release) on a small tree.
"""

from __future__ import annotations

import types

import pytest
import torch

from wcache.vllm import compat


class _HfBlock(torch.nn.Module):
    """A transformers-side module (neither vLLM's nor wcache's class)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))


class _VllmNorm(torch.nn.Module):
    """Stands for a vLLM module the backend swaps in (RMSNorm, LayerNorm): parameters
    without a weight loader, one attribute set by its constructor, and one parameter
    that has a loader (which the pass leaves alone on both sides)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, device="meta"))
        self.weight.dummy_weight_value = 1.0
        self.loaded = torch.nn.Parameter(torch.empty(4, device="meta"))
        self.loaded.weight_loader = print
        self.bias = torch.nn.Parameter(torch.empty(4, device="meta"))
        self.bias.dummy_weight_value = 0.0


_VllmNorm.__module__ = "vllm.model_executor.layers.layernorm"


class _Tree(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _HfBlock()
        self.norm = _VllmNorm()


def _backend_self() -> types.SimpleNamespace:
    """What ``Base.init_parameters`` reads of its model: the dtype and the device."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(dtype=torch.float32),
        device_config=types.SimpleNamespace(device=torch.device("cpu")),
    )


@pytest.fixture(scope="module")
def base():
    return pytest.importorskip("vllm.model_executor.models.transformers.base")


def test_vllm_module_parameters_keep_object_and_attributes(base):
    tree = _Tree()
    weight, loaded, bias = tree.norm.weight, tree.norm.loaded, tree.norm.bias
    with compat.transformers_parameters_as_disk():
        base.Base.init_parameters(_backend_self(), tree)
    assert tree.norm.weight is weight and tree.norm.bias is bias and tree.norm.loaded is loaded
    assert (weight.dummy_weight_value, bias.dummy_weight_value) == (1.0, 0.0)
    assert weight.device.type == "meta"  # filled by the restore, as any meta parameter
    assert list(tree.norm._parameters) == ["weight", "loaded", "bias"]
    # transformers' own parameter is materialized on the engine's device, as on disk
    assert tree.block.weight.device.type == "cpu"
    assert vars(tree.block.weight) == {}


def test_without_the_patch_the_pass_drops_the_attributes(base):
    """The upstream pass on an all-meta tree: what the patch prevents (so the test
    above can fail), and the patch is gone after its block."""
    with compat.transformers_parameters_as_disk():
        pass
    tree = _Tree()
    weight = tree.norm.weight
    base.Base.init_parameters(_backend_self(), tree)
    assert tree.norm.weight is not weight
    assert not hasattr(tree.norm.weight, "dummy_weight_value")
    assert tree.norm.weight.device.type == "cpu"


def test_parameters_come_back_when_the_pass_raises(base, monkeypatch):
    """An error inside vLLM's pass leaves the hidden parameters in their module."""

    def boom(self, module, dtype=None):
        raise RuntimeError("pass failed")

    monkeypatch.setattr(base.Base, "init_parameters", boom)
    tree = _Tree()
    weight = tree.norm.weight
    with compat.transformers_parameters_as_disk(), pytest.raises(RuntimeError, match="pass failed"):
        base.Base.init_parameters(_backend_self(), tree)
    assert tree.norm.weight is weight
    assert list(tree.norm._parameters) == ["weight", "loaded", "bias"]
