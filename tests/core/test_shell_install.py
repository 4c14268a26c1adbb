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
