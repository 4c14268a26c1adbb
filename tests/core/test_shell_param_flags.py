"""wcache.shell's parameter flags (issue 44, item 6): a restored parameter gets the
class, attributes and ``requires_grad`` vLLM's load leaves on a disk engine.

:func:`param_flags` (the daemon) records per parameter whether the built object is
kept; :func:`install_tensors_` (the engine) rebuilds kept ones from the meta build
(:func:`parameter_like`) and makes the others plain parameters."""

from __future__ import annotations

import weakref

import torch

from wcache.shell import install_tensors_, param_flags, parameter_like


class PackedParam(torch.nn.Parameter):
    """Stands for vLLM's ``PackedvLLMParameter`` (a Parameter subclass with attributes)."""


def _loader(param, loaded):  # stands for a vLLM weight_loader
    param.data.copy_(loaded)


def _model(device: str) -> torch.nn.Module:
    """``lin.qweight`` (a PackedParam with vLLM-style attributes), ``lin.scales`` and
    ``norm.weight`` (a plain parameter that requires grad, like vLLM's RMSNorm)."""
    lin, norm = torch.nn.Module(), torch.nn.Module()
    with torch.device(device):
        q = PackedParam(torch.zeros(4, 8, dtype=torch.int32), requires_grad=False)
        q.packed_dim, q.output_dim, q.weight_loader = 0, 1, _loader
        lin.qweight = q
        lin.scales = torch.nn.Parameter(torch.ones(8), requires_grad=False)
        norm.weight = torch.nn.Parameter(torch.ones(8))
    model = torch.nn.Module()
    model.lin, model.norm = lin, norm
    return model


def test_parameter_like_keeps_class_attributes_and_data():
    """The new parameter has the built one's class and attributes and holds ``data`` itself (no copy)."""
    built = _model("meta").lin.qweight
    data = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    out = parameter_like(built, data, requires_grad=False)
    assert type(out) is PackedParam
    assert (out.packed_dim, out.output_dim, out.weight_loader) == (0, 1, _loader)
    assert out.requires_grad is False
    assert out.data_ptr() == data.data_ptr()


def test_param_flags_kept_replaced_written_and_declared():
    """Kept: same object and unwritten, or declared by the plan; a replaced or written one is not."""
    model = _model("cpu")
    built = {n: weakref.ref(p) for n, p in model.named_parameters()}
    model.lin.qweight = torch.nn.Parameter(
        torch.zeros(2, 16, dtype=torch.int32), requires_grad=False
    )
    flags = param_flags(model, built, {"lin": {"qweight", "scales"}}, {"lin": {"qweight"}})
    assert flags == {
        "lin.qweight": [True, False],  # replaced, but the plan declares vLLM keeps it
        "lin.scales": [False, False],  # the same object, but a stage writes it
        "norm.weight": [True, True],  # untouched: the built parameter, requires grad
    }
    assert param_flags(model, built, {}, {})["lin.qweight"] == [False, False]


def test_install_gives_kept_parameters_the_build_and_others_plain():
    """Installed: kept parameters as the meta build's class with its attributes and the recorded requires_grad; others plain."""
    model = _model("meta")
    tensors = {
        "lin.qweight": torch.ones(4, 8, dtype=torch.int32),
        "lin.scales": torch.full((8,), 2.0),
        "norm.weight": torch.full((8,), 3.0),
    }
    flags = {
        "lin.qweight": [True, False],
        "lin.scales": [False, False],
        "norm.weight": [True, True],
    }
    install_tensors_(
        model,
        tensors,
        dict.fromkeys(tensors, "param"),
        {},
        {},
        writes={},
        transformed={},
        param_flags=flags,
    )
    q = model.lin.qweight
    assert type(q) is PackedParam and (q.packed_dim, q.weight_loader) == (0, _loader)
    assert q.data_ptr() == tensors["lin.qweight"].data_ptr()
    assert type(model.lin.scales) is torch.nn.Parameter and vars(model.lin.scales) == {}
    assert model.norm.weight.requires_grad is True
    assert model.lin.qweight.requires_grad is False


def test_install_without_flags_gives_plain_parameters():
    """An export without the record (an older daemon): plain parameters without grad, as before."""
    model = _model("meta")
    tensors = {"norm.weight": torch.full((8,), 3.0)}
    install_tensors_(model, tensors, {"norm.weight": "param"}, {}, {}, writes={}, transformed={})
    assert type(model.norm.weight) is torch.nn.Parameter
    assert model.norm.weight.requires_grad is False


def test_install_sets_a_plans_attribute_overrides_on_kept_parameters():
    """A kept parameter gets the attributes vLLM's post-load changes (Plan.param_attrs) over the build's."""
    model = _model("meta")
    tensors = {"lin.qweight": torch.ones(4, 8, dtype=torch.int32)}
    install_tensors_(
        model,
        tensors,
        {"lin.qweight": "param"},
        {},
        {},
        writes={},
        transformed={},
        param_flags={"lin.qweight": [True, False]},
        param_attrs={"lin.qweight": {"packed_dim": 1}},
    )
    assert (model.lin.qweight.packed_dim, model.lin.qweight.output_dim) == (1, 1)
    assert model.lin.qweight.weight_loader is _loader
