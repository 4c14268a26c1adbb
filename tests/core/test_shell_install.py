"""wcache.shell.install_tensors_: a layer reachable under two names (vLLM 0.33's fused-MoE
router gate is both ``mlp.gate`` and ``mlp.experts.gate``) takes its plan's writes under
both, so a TRANSFORM that reshapes it is accepted whichever name the export used."""

from __future__ import annotations

import pytest
import torch

from wcache.errors import ModelMismatch
from wcache.shell import install_tensors_


def _model() -> torch.nn.Module:
    """``mlp.gate`` (a [6, 128] linear on meta) also registered as ``mlp.experts.gate``."""
    with torch.device("meta"):
        gate = torch.nn.Linear(128, 6, bias=False, dtype=torch.bfloat16)
    experts = torch.nn.Module()
    experts.gate = gate
    mlp = torch.nn.Module()
    mlp.experts = experts  # registered first: named_parameters() meets experts.gate first
    mlp.gate = gate
    model = torch.nn.Module()
    model.mlp = mlp
    return model


def _install(model: torch.nn.Module, transformed: dict[str, set[str]]) -> None:
    packed = torch.zeros(128, 16, dtype=torch.float8_e4m3fn)  # a transposed, padded FP8 weight
    install_tensors_(
        model,
        {"mlp.experts.gate.weight": packed},
        {"mlp.experts.gate.weight": "param"},
        {},
        {},
        writes=transformed,
        transformed=transformed,
    )


def test_a_transform_declared_under_one_name_covers_the_modules_other_name():
    """The plan resolved for ``mlp.gate`` declares the weight transformed; the export names
    it ``mlp.experts.gate.weight``: installed, and the same object under both names."""
    model = _model()
    _install(model, {"mlp.gate": {"weight"}})
    assert model.mlp.gate.weight.dtype == torch.float8_e4m3fn
    assert model.mlp.experts.gate.weight is model.mlp.gate.weight
    assert tuple(model.mlp.gate.weight.shape) == (128, 16)


def test_without_a_plan_writing_it_the_shape_still_has_to_match():
    """No plan transforms the gate: the reshaped export is a model mismatch, as before."""
    with pytest.raises(ModelMismatch, match="mlp.experts.gate.weight"):
        _install(_model(), {})


class _Impl:
    """Stands for a vLLM attention backend impl: a plain object keeping the sinks
    parameter it was given (``TritonAttentionImpl.sinks = sinks``)."""

    def __init__(self, sinks: torch.Tensor) -> None:
        self.sinks = sinks
        self.scale = 0.125


def _sink_model() -> torch.nn.Module:
    """GPT-OSS's attention on meta: ``attn.sinks`` a parameter, ``attn.attn.impl.sinks``
    the same object."""
    with torch.device("meta"):
        sinks = torch.nn.Parameter(torch.empty(4, dtype=torch.bfloat16), requires_grad=False)
    inner = torch.nn.Module()
    inner.impl = _Impl(sinks)
    attn = torch.nn.Module()
    attn.sinks = sinks
    attn.attn = inner
    model = torch.nn.Module()
    model.attn = attn
    return model


def test_a_captured_reference_follows_the_installed_tensor():
    """An object holding the meta-built parameter (an attention impl's sinks) holds the
    installed tensor after install, with its bytes, not the meta tensor."""
    model = _sink_model()
    mapped = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.bfloat16)
    install_tensors_(
        model, {"attn.sinks": mapped}, {"attn.sinks": "param"}, {}, {}, writes={}, transformed={}
    )
    assert model.attn.attn.impl.sinks is model.attn.sinks
    assert model.attn.attn.impl.sinks.device.type == "cpu"
    assert torch.equal(model.attn.attn.impl.sinks, mapped)
    assert model.attn.attn.impl.scale == 0.125


def test_meta_leftovers_names_an_impl_tensor_still_on_meta():
    """A tensor an attention impl keeps that is still on meta after restore is reported
    (restore-incomplete) instead of reaching a kernel."""
    from wcache.vllm.model import meta_leftovers

    model = _sink_model()
    model.attn._parameters["sinks"] = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    assert meta_leftovers(model) == ["attn.attn.impl.sinks"]


def test_rebind_touches_only_references_to_replaced_tensors():
    """rebind_captured_ repoints exactly the references to a replaced tensor and names
    them; an unrelated tensor attribute of the same object is left alone."""
    from wcache.shell import rebind_captured_

    model = _sink_model()
    impl = model.attn.attn.impl
    impl.other = torch.zeros(2)
    other = impl.other
    old = model.attn.sinks
    new = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16), requires_grad=False)
    rebound = rebind_captured_(model.modules(), {id(old): (old, new)})
    assert rebound == ["_Impl.sinks"]
    assert impl.sinks is new and impl.other is other
