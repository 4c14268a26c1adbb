"""The CUDA contract tests' machinery (tests/plans/test_cuda_contracts.py and the
plan modules' own tests): vLLM's platform simulated as CUDA at a capability with its
CUDA ops swapped for vLLM's pure-torch references (:func:`simulate_cuda`), the vLLM
layer builders and checkpoint fillers per format, and the comparison of vLLM's
processed layer with wcache's load and ``restore(export(prepare))``
(:func:`load_restore`, :func:`assert_equal`). vLLM is imported inside the functions:
importing this module does not import vLLM."""

from __future__ import annotations

import importlib
import itertools
import types

import pytest
import torch

from tests.helpers import vllm_layers as VL
from wcache.core import Target, tensor_checksum
from wcache.plans.registry import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot

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


def unpack_rows(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
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
IMPORT_BEFORE_PATCH = (
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


def simulate_cuda(monkeypatch, capability: tuple[int, int]) -> None:
    """vLLM's platform as CUDA at ``capability`` with reference ops (undone by
    ``monkeypatch`` after the test)."""
    VL.ensure_vllm()
    # import first: these modules (or their imports) check the platform at import
    for module in IMPORT_BEFORE_PATCH:
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
        q = unpack_rows(b_q_weight, num_bits)
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


class QuantConfig:
    """The smallest quant config ``LinearBase`` accepts: one method class."""

    online_quantization_config = None

    def __init__(self, method_cls):
        self.method_cls = method_cls

    def get_quant_method(self, layer, prefix=""):
        return self.method_cls()


def diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def assert_equal(expected: torch.nn.Module, actual: torch.nn.Module, attrs: tuple[str, ...]):
    """Tensors (kind, shape, dtype, strides, bytes) and ``attrs`` equal."""
    assert {} == diff(snapshot(expected, attrs), snapshot(actual, attrs))


def module_attrs(module: torch.nn.Module) -> dict:
    """The module's own attributes as ``wcache verify`` reads them (``~name`` entries of
    its module state; tensors are compared by :func:`assert_equal`)."""
    from wcache.vllm.verify import module_state

    return {
        k: v
        for k, v in module_state(module).items()
        if k.startswith("~") and not k.startswith(("~scheme", "~quant_method"))
    }


def assert_module_attrs_equal(expected: torch.nn.Module, actual: torch.nn.Module):
    """Every layer attribute vLLM's post-load leaves (e.g. 0.33's
    ``processed_weight_dims``) reads the same on ``actual``."""
    assert {} == diff(module_attrs(expected), module_attrs(actual))


def adapter_plan(
    layer: torch.nn.Module, expected_plan: str, target: Target = H200, name: str = "layer"
):
    """(the adapter's LayerConfig, the plan it resolves) for vLLM's ``layer`` on
    ``target``; the plan's id must be ``expected_plan``."""
    from wcache.vllm.adapter import layer_config

    config = layer_config(layer.quant_method, layer, target, name=name)
    plan = plan_for(config, target=target).plan
    assert plan.id == expected_plan
    return config, plan


def load_restore(plan, config, build, fill, target: Target = H200):
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


def online_fp8_layer(method_cls, size_k: int, size_n: int, meta: bool = False):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return ReplicatedLinear(
            size_k,
            size_n,
            bias=False,
            params_dtype=torch.bfloat16,
            quant_config=QuantConfig(method_cls),
        )


#: online FP8 method -> the wcache plan the adapter must pick on sm90.
ONLINE_FP8_PLANS = {
    "Fp8PerTensorOnlineLinearMethod": "fp8_per_tensor/cutlass@1",
    "Fp8PtpcOnlineLinearMethod": "fp8_per_channel/cutlass@1",
    "Fp8PerBlockOnlineLinearMethod": "fp8_per_block/cutlass_block@1",
}

#: online FP8 method -> the kernel class vLLM picks for it on sm90.
ONLINE_FP8_KERNELS = {
    "Fp8PerTensorOnlineLinearMethod": "CutlassFP8ScaledMMLinearKernel",
    "Fp8PtpcOnlineLinearMethod": "CutlassFP8ScaledMMLinearKernel",
    "Fp8PerBlockOnlineLinearMethod": "CutlassFp8BlockScaledMMKernel",
}
#: Attributes vLLM's CUTLASS block ``apply`` reads besides the weight tensors
#: (``FP8BlockParams.from_layer``; the block shape from the method).
FP8_BLOCK_ATTRS = ("input_scale", "input_scale_ub", "weight_block_size")


def online_fp8_contract(name: str, size_k: int, size_n: int, attrs: tuple[str, ...]):
    """vLLM's layerwise online load (its weight loader materializes and processes the
    layer) vs wcache load and restore, for one online FP8 method."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    cls = getattr(online, name)
    weight = (
        torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(size_n)) * 0.05
    ).to(torch.bfloat16)

    vllm_layer = online_fp8_layer(cls, size_k, size_n)
    config, plan = adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    assert dict(config.extra)["tp_size"] == 1
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())
    assert vllm_layer._already_called_process_weights_after_loading

    def build(meta=False):
        return online_fp8_layer(cls, size_k, size_n, meta)

    def fill(layer):  # the daemon's checkpoint tensor, as a plain Parameter
        layer._parameters["weight"] = torch.nn.Parameter(weight.clone(), requires_grad=False)

    loaded, restored = load_restore(plan, config, build, fill)
    assert_equal(vllm_layer, loaded, attrs)
    assert_equal(loaded, restored, attrs)
    assert tensor_checksum(restored.weight) == tensor_checksum(vllm_layer.weight)
    return vllm_layer


def online_fp8_vllm_and_restored(name: str, size_k: int, size_n: int, seed: int):
    """(vLLM's online-loaded layer, the adapter's plan, wcache's restored layer) for
    one online FP8 method on a random ``[size_n, size_k]`` bf16 weight."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    cls = getattr(online, name)
    weight = (torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(
        torch.bfloat16
    )
    vllm_layer = online_fp8_layer(cls, size_k, size_n)
    config, plan = adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())

    def fill(layer):
        layer._parameters["weight"] = torch.nn.Parameter(weight.clone(), requires_grad=False)

    _, restored = load_restore(
        plan, config, lambda meta=False: online_fp8_layer(cls, size_k, size_n, meta), fill
    )
    return vllm_layer, plan, restored


#: FP8 e4m3 values drawn for checkpoint weights stay well inside +-448 (no NaN bytes).
FP8_DRAW_STD = 64.0


def rand_fp8(gen: torch.Generator, shape) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen) * FP8_DRAW_STD).to(torch.float8_e4m3fn)


def fp8_serialized_layer(
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


def fill_fp8_serialized(layer, seed: int, fused_scale: bool = False) -> None:
    """Checkpoint tensors: fp8 weight, per-shard (or block) scales, input scales, bias.
    ``fused_scale``: one scale on disk, the other shards keep vLLM's fp8-min sentinel."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.data.copy_(rand_fp8(gen, layer.weight.shape))
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


#: An Ampere capability: below CUTLASS FP8's sm89 floor, so vLLM picks weight-only FP8
#: Marlin for FP8 checkpoints.
SM80_CAPABILITY = (8, 0)
SM80 = Target("cuda", SM80_CAPABILITY)


def marlin_case(method: str, size_k: int, size_n: int, group_size: int, bits: int = 4):
    case = (
        VL.awq_linear(size_k, size_n, group_size)
        if method == "awq"
        else VL.gptq_linear(size_k, size_n, group_size, num_bits=bits)
    )
    return case


class SchemeQuantConfig(QuantConfig):
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


def ct_layer(scheme_factory, widths: tuple[int, ...], size_k: int, bias: bool, meta: bool = False):
    """A MergedColumnParallelLinear (TP 1) with a compressed-tensors scheme."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        return MergedColumnParallelLinear(
            size_k,
            list(widths),
            bias=bias,
            params_dtype=torch.bfloat16,
            quant_config=SchemeQuantConfig(scheme_factory),
        )


def _fp8_weight_args(strategy: str, block=None):
    """compressed-tensors' symmetric FP8 weight QuantizationArgs of ``strategy``."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=list(block) if block else None,
    )


def ct_fp8_scheme(strategy: str, static: bool, block=None):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Fp8,
    )

    args = _fp8_weight_args(strategy, block)
    return lambda: CompressedTensorsW8A8Fp8(weight_quant=args, is_static_input_scheme=static)


def ct_w8a16_fp8_scheme(strategy: str, static: bool, block=None):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A16Fp8,
    )

    args = _fp8_weight_args(strategy, block)
    return lambda: CompressedTensorsW8A16Fp8(weight_quant=args, is_static_input_scheme=static)


def modelopt_mxfp8_layer(widths: tuple[int, ...], size_k: int, bias: bool, meta: bool = False):
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


def fill_modelopt_mxfp8(layer, seed: int) -> None:
    """Checkpoint tensors: fp8 values, E8M0 codes around 2**0 (uint8), a bf16 bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.data.copy_(rand_fp8(gen, tuple(layer.weight.shape)))
        codes = torch.randint(120, 134, tuple(layer.weight_scale.shape), generator=gen)
        layer.weight_scale.data.copy_(codes.to(torch.uint8))
        if getattr(layer, "bias", None) is not None:
            layer.bias.data.copy_(torch.randn(tuple(layer.bias.shape), generator=gen))


#: What vLLM's Marlin MXFP8 ``apply`` reads besides the tensors, and the flag ModelOpt's
#: linear method sets for every format.
MODELOPT_MXFP8_ATTRS = ("output_size_per_partition", "input_size_per_partition", "is_w4a16_nvfp4")


def nvfp4_layer(
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


def fill_nvfp4(layer, seed: int) -> None:
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

#: Attributes vLLM's Marlin NVFP4 ``apply`` reads besides the layer's tensors (the
#: logical N and K; the padded extents come from the repacked weight's shape).
NVFP4_MARLIN_ATTRS = ("output_size_per_partition", "input_size_per_partition", "is_w4a16_nvfp4")

#: Distinct MoE layer names (vLLM registers each MoE layer by name in the forward context).
MOE_LAYER_IDS = itertools.count()


def nvfp4_moe_layer(num_experts: int, hidden: int, intermediate: int, meta: bool = False):
    """vLLM's RoutedExperts (built by FusedMoEFactory, TP 1) with ModelOptNvFp4FusedMoE."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    qc = ModelOptNvFp4Config("NVFP4", True, None, [], 16)
    prefix = f"model.layers.{next(MOE_LAYER_IDS)}.mlp.experts"
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


def fill_nvfp4_moe(layer, seed: int) -> None:
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

#: What CutlassInt8ScaledMMLinearKernel.apply_weights reads besides the weight tensors.
CUTLASS_INT8_ATTRS = ("input_scale", "input_zero_point", "azp_adj")

#: The layer name differs between the layers a test builds (vLLM registers each MoE
#: layer by name in the forward context).
LAYER_NAME_KEYS = ("~layer_name",)


def verify_state(module: torch.nn.Module) -> dict:
    """Everything ``wcache verify`` reads of ``module`` (kernel objects opened up, their
    tensors traced to the layer's parameters) but the layer's name."""
    from wcache.vllm.verify import module_state

    return {k: v for k, v in module_state(module).items() if k not in LAYER_NAME_KEYS}
