"""The kernel-object audit of ``wcache verify`` (issue 44 item 5): every tensor a
layer's kernel objects hold is traced by data pointer to the layer's own parameter or
buffer, so a kernel that kept a tensor the restore replaced is a named difference."""

from __future__ import annotations

import dataclasses

import torch

from wcache.vllm import verify as V


@dataclasses.dataclass
class _Desc:
    scale: torch.Tensor | None


class _QuantConfig:
    def __init__(self, w1_scale: torch.Tensor, workspace: torch.Tensor):
        self._w1 = _Desc(w1_scale)
        self.workspaces = [workspace]


class _Kernel:
    def __init__(self, quant_config: _QuantConfig):
        self.fused_experts = {"experts": quant_config}


class _Method:
    def __init__(self, quant_config: _QuantConfig, kernel_config: _QuantConfig):
        self.moe_quant_config = quant_config
        self.moe_kernel = _Kernel(kernel_config)


# the audit opens only vLLM's and wcache's objects, as vLLM's kernels are
for _cls in (_Desc, _QuantConfig, _Kernel, _Method):
    _cls.__module__ = "vllm.model_executor.fake_moe"


def _layer(stale: bool) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.arange(32.0).reshape(4, 8), requires_grad=False)
    layer.w13_weight_scale = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    scale = layer.w13_weight_scale.data
    held = scale.clone() if stale else scale[1:]  # a stale copy, or a view of the param
    kernel_config = _QuantConfig(layer.w13_weight.data.view(-1)[8:], torch.zeros(8))
    layer.quant_method = _Method(_QuantConfig(held, torch.zeros(16)), kernel_config)
    return layer


def test_audit_names_the_parameter_a_deep_kernel_tensor_lies_in():
    """A view of a parameter is owned by it, also five levels down (through a dict);
    a workspace is private."""
    owners = V.kernel_tensor_owners(_layer(stale=False))
    assert owners["&quant_method.moe_quant_config._w1.scale"] == "w13_weight_scale"
    assert owners["&quant_method.moe_kernel.fused_experts['experts']._w1.scale"] == "w13_weight"
    assert owners["&quant_method.moe_quant_config.workspaces[0]"] == V.PRIVATE
    assert owners["&quant_method.moe_kernel.fused_experts['experts'].workspaces[0]"] == V.PRIVATE


def test_a_kernel_holding_a_replaced_tensor_is_a_difference_even_with_equal_bytes():
    """The stale copy has the same bytes (checksums agree) but lies in no parameter:
    verify's comparison names the path and both owners."""
    loaded, restored = V.module_state(_layer(False)), V.module_state(_layer(True))
    diff = V.first_difference(loaded, restored)
    assert diff is not None and diff.startswith("&quant_method.moe_quant_config._w1.scale")
    assert "'w13_weight_scale' != '<private>'" in diff


def test_equal_layers_audit_equal():
    """Two layers built the same way (different allocations) compare equal."""
    assert V.first_difference(V.module_state(_layer(False)), V.module_state(_layer(False))) is None


def test_audit_ignores_objects_of_other_libraries_and_submodules():
    """Only vLLM/wcache objects are opened; a submodule is audited on its own."""

    class Foreign:
        def __init__(self):
            self.t = torch.zeros(2)

    layer = _layer(False)
    layer.foreign = Foreign()
    layer.child = torch.nn.Linear(2, 2)
    owners = V.kernel_tensor_owners(layer)
    assert not any(k.startswith(("&foreign", "&child")) for k in owners)


def test_declared_attribute_paths_are_left_to_the_snapshot():
    """A path the plan declares (compared by the snapshot, where vLLM's closure and
    wcache's callable object are both "<callable>") is not opened by the audit."""
    layer = _layer(False)
    owners = V.kernel_tensor_owners(layer, skip=["quant_method.moe_quant_config"])
    assert not any(k.startswith("&quant_method.moe_quant_config") for k in owners)
    assert "&quant_method.moe_kernel.fused_experts['experts']._w1.scale" in owners


def test_every_parameter_is_compared_by_class_attributes_and_requires_grad():
    """Every parameter, one a post-load re-registered included, compares by class,
    attributes and requires_grad (issue 44 item 6: no exception for rewritten ones)."""
    built = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    built.weight_loader = print
    layer_a, layer_b = torch.nn.Module(), torch.nn.Module()
    layer_a.w = built
    layer_b.w = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    assert V.parameter_flags(layer_a) != V.parameter_flags(layer_b)
    layer_b.w.weight_loader = print
    assert V.parameter_flags(layer_a) == V.parameter_flags(layer_b)
    layer_b.w.requires_grad_(True)
    assert V.parameter_flags(layer_a) != V.parameter_flags(layer_b)
