"""wcache.shell's parameter flags (issue 44, item 6): a restored parameter gets the
class, attributes and ``requires_grad`` vLLM's load leaves on a disk engine.

:func:`param_flags` (the daemon) records per parameter whether the built object is
kept; :func:`install_tensors_` (the engine) rebuilds kept ones from the meta build
(:func:`parameter_like`) and makes the others plain parameters."""

from __future__ import annotations

import weakref

import pytest
import torch

from wcache.core import ParamOutcome
from wcache.errors import ModelMismatch
from wcache.shell import carried_attrs, install_tensors_, param_flags, parameter_like


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


def test_param_flags_follow_each_written_parameters_outcome():
    """Unwritten: kept while it is the built object; written: what its outcome says
    (kept with the build's requires_grad, or plain carrying the named attributes)."""
    model = _model("cpu")
    built = {n: weakref.ref(p) for n, p in model.named_parameters()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    model.lin.qweight = torch.nn.Parameter(
        torch.zeros(2, 16, dtype=torch.int32), requires_grad=False
    )
    outcomes = {
        "lin": {
            "qweight": ParamOutcome(kept=True),
            "scales": ParamOutcome(kept=False, carried=("weight_loader",), attrs={"a": 1}),
        }
    }
    flags = param_flags(model, built, outcomes, grads)
    assert flags == {
        "lin.qweight": [True, False, [], {}],  # replaced, but vLLM keeps the built one
        "lin.scales": [False, False, ["weight_loader"], {"a": 1}],  # re-registered plain
        "norm.weight": [True, True, [], {}],  # untouched: the built parameter, requires grad
    }
    assert param_flags(model, built, {})["lin.qweight"] == [False, False, [], {}]


def _install_qweight(**record) -> torch.nn.Module:
    """A meta-built model whose ``lin.qweight`` install_tensors_ fills from a daemon
    tensor with ``record`` (its param_flags / param_attrs)."""
    model = _model("meta")
    tensors = {"lin.qweight": torch.ones(4, 8, dtype=torch.int32)}
    install_tensors_(
        model, tensors, {"lin.qweight": "param"}, {}, {}, writes={}, transformed={}, **record
    )
    return model


def test_install_gives_a_reregistered_parameter_the_carried_attributes():
    """A plain re-registered parameter carries the build's attributes the record names
    (``*``: all but the loader's backing field) and the record's attributes."""
    model = _install_qweight(
        param_flags={"lin.qweight": [False, False, ["weight_loader"], {"input_dim": 0}]}
    )
    q = model.lin.qweight
    assert type(q) is torch.nn.Parameter
    assert vars(q) == {"weight_loader": _loader, "input_dim": 0}
    assert carried_attrs(_model("meta").lin.qweight, ["*"]) == {
        "packed_dim": 0,
        "output_dim": 1,
        "weight_loader": _loader,
    }


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
    model = _install_qweight(
        param_flags={"lin.qweight": [True, False]},
        param_attrs={"lin.qweight": {"packed_dim": 1}},
    )
    assert (model.lin.qweight.packed_dim, model.lin.qweight.output_dim) == (1, 1)
    assert model.lin.qweight.weight_loader is _loader


class _Head(torch.nn.Module):
    """Stands for vLLM's ParallelLMHead: a ``bias`` slot left ``None`` at build, which
    the transformers backend's load registers (``_register_bias``) with vLLM's
    attributes, one of them a method of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("bias", None)

    def weight_loader(self, param, loaded):
        param.data.copy_(loaded)

    def register_bias_(self) -> None:
        self.bias = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        self.bias.output_dim, self.bias.weight_loader = 0, self.weight_loader
        self.bias.handle = object()  # a process-local object: not carried


def _head_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.lm_head = _Head()
    return model


def test_param_flags_record_a_parameter_the_load_created_with_its_attributes():
    """A parameter the build lacked records its plain attributes by value and its
    module-bound methods by module and method name; other objects are left out."""
    model = _head_model()
    built = {n: weakref.ref(p) for n, p in model.named_parameters()}
    model.lm_head.register_bias_()
    flags = param_flags(model, built, {})
    assert flags == {
        "lm_head.bias": [
            False,
            False,
            [],
            {"output_dim": 0},
            {"weight_loader": ["lm_head", "weight_loader"]},
        ]
    }


def test_install_binds_a_created_parameters_method_to_the_engines_module():
    """The engine's parameter gets the recorded values and the method bound to its own module (not the daemon's)."""
    model = _head_model()
    record = [False, False, [], {"output_dim": 0}, {"weight_loader": ["lm_head", "weight_loader"]}]
    tensors = {"lm_head.bias": torch.ones(8)}
    install_tensors_(
        model,
        tensors,
        {"lm_head.bias": "param"},
        {},
        {},
        writes={},
        transformed={},
        param_flags={"lm_head.bias": record},
    )
    bias = model.lm_head.bias
    assert bias.output_dim == 0
    assert bias.weight_loader == model.lm_head.weight_loader  # bound to this model's head
    assert bias.weight_loader.__self__ is model.lm_head


def test_install_refuses_a_recorded_method_the_engines_module_lacks():
    """A record naming a method the engine's module does not have is a ModelMismatch, before anything is bound."""
    model = _head_model()
    record = [False, False, [], {}, {"weight_loader": ["lm_head", "no_such_loader"]}]
    with pytest.raises(ModelMismatch) as err:
        install_tensors_(
            model,
            {"lm_head.bias": torch.ones(8)},
            {"lm_head.bias": "param"},
            {},
            {},
            writes={},
            transformed={},
            param_flags={"lm_head.bias": record},
        )
    assert err.value.code == "model-mismatch" and "no_such_loader" in str(err.value)
