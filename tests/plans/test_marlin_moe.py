"""Issue 46 item 2: int4 fused MoE on Marlin (AWQ, GPTQ, compressed-tensors W4A16) against
vLLM's own RoutedExperts layers, on CUDA sm90 simulated as in
tests/plans/test_cuda_contracts.py
(tests.helpers.cuda_contracts).

vLLM's MoE oracle resolves ``MARLIN`` / ``MarlinExperts`` for the three methods; vLLM's
post-load (``convert_to_wna16_moe_kernel_format``) runs with its repack ops replaced by
the references vLLM ships in Python (``marlin_utils_test.marlin_weights`` on the
weights unpacked by vLLM's own ``unpack_cols`` / ``unpack_quantized_values_into_int32``,
what vLLM's ``test_marlin_gemm.py`` checks the CUDA ops against); every other step
(padding, scale and zero-point permutations, biases, aliases, the MarlinExperts kernel
objects) is vLLM's own code. wcache's load and ``restore(export(prepare))`` must give the
same tensors (bytes, shapes, strides, None slots) and kernel objects. No CUDA kernel runs.
"""

from __future__ import annotations

import copy

import numpy
import pytest
import torch

from tests.helpers import vllm_layers as VL
from tests.helpers.cuda_contracts import unpack_rows
from tests.helpers.moe_contracts import H200, moe_contract, moe_layer
from wcache.core import NoPlan, Tag
from wcache.plans.marlin_moe import AWQ_MOE, CT_W4A16_MOE, GPTQ_MOE
from wcache.plans.registry import plan_for
from wcache.testing import moe_fixtures as mf

pytest.importorskip("vllm")

#: AWQ's nibble interleave inside an int32 word (vLLM's ``awq_marlin_repack`` undoes it).
AWQ_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)


def _reference_ops(monkeypatch) -> None:
    """``ops.gptq_marlin_moe_repack`` / ``ops.awq_marlin_moe_repack`` (CUDA ops) as vLLM's
    Python references, per expert."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test as mut
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_cols

    def marlin(q_w, size_k, size_n, num_bits):
        return mut.marlin_weights(q_w, size_k, size_n, num_bits, mut.get_weight_perm(num_bits))

    def gptq_moe(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit
        return torch.stack(
            [marlin(unpack_rows(w, num_bits), size_k, size_n, num_bits) for w in b_q_weight]
        )

    def awq_moe(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        assert not is_a_8bit
        undo = numpy.argsort(numpy.array(AWQ_INTERLEAVE))
        out = []
        for w in b_q_weight:
            q_w = unpack_cols(w, num_bits, size_k, size_n)
            q_w = q_w.reshape(-1, len(undo))[:, undo].reshape(size_k, size_n).contiguous()
            out.append(marlin(q_w, size_k, size_n, num_bits))
        return torch.stack(out)

    monkeypatch.setattr(ops, "gptq_marlin_moe_repack", gptq_moe)
    monkeypatch.setattr(ops, "awq_marlin_moe_repack", awq_moe)


@pytest.fixture
def marlin_moe(simulated_cuda_moe, monkeypatch):
    """Simulated sm90 with vLLM's reference Marlin MoE repacks."""
    _reference_ops(monkeypatch)


def _quant_config(fmt: str, group: int):
    """vLLM's config object for the fixture format's ``quantization_config``."""
    asym = fmt.endswith("_asym")  # compressed-tensors with zero points (no fixture of its own)
    qc = mf.moe_quantization_config(fmt.removesuffix("_asym"), [], group, "qwen3_moe")
    if asym:
        qc = copy.deepcopy(qc)
        for scheme in qc["config_groups"].values():
            scheme["weights"]["symmetric"] = False
    if fmt == "awq":
        from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

        return AutoAWQConfig.from_config(qc)
    if fmt.startswith("gptq"):
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

        return AutoGPTQConfig.from_config(qc)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return CompressedTensorsConfig.from_config(qc)


def _fill_int(layer, seed: int, loaded_biases: bool = False) -> None:
    """Random checkpoint values: every int32 word random bits, scales positive; expert
    biases zero (the checkpoint has none) unless ``loaded_biases`` (random, and marked
    loaded as vLLM's weight loader does)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(layer.named_parameters())):
            g = torch.Generator().manual_seed(seed + i)
            if p.dtype == torch.int32:
                value = VL.rand_int32(g, tuple(p.shape))
            elif name.endswith("_bias"):
                value = (
                    torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
                    if loaded_biases
                    else torch.zeros(p.shape, dtype=torch.float32)
                )
                if loaded_biases:
                    layer._loaded_expert_biases.add(name)
            else:
                # float32 draws: the layers are filled in and out of vLLM's context,
                # whose default dtype is bf16
                value = torch.rand(tuple(p.shape), generator=g, dtype=torch.float32) * 0.01 + 1e-3
            p.data.copy_(value.to(p.dtype))


def _case(fmt, hidden, inter, group, plan, *, loaded_biases=False):
    qc = _quant_config(fmt, group)
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, qc, meta=meta),
        lambda layer: _fill_int(layer, hidden + inter, loaded_biases),
        H200,
        plan,
    )
    assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
    assert type(restored.quant_method.moe_kernel.fused_experts).__name__ == "MarlinExperts"
    return config, vllm_layer, restored


#: (hidden, intermediate, group): the tier's qwen3_moe (experts of 96, G=32: padded to
#: 128), an aligned layer with G = 128 (a single w2 group), and G = 64.
SHAPES = [(128, 96, 32), (256, 128, 128), (128, 64, 64)]


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
def test_awq_moe_marlin_sm90(marlin_moe, hidden, inter, group):
    """AutoAWQMoEMethod on sm90 resolves MARLIN; vLLM's post-load (pad, awq_marlin_moe_repack,
    scales, AWQ zero points, aliases) equals wcache's ``awq_moe/marlin`` load and restore."""
    config, vllm_layer, restored = _case("awq", hidden, inter, group, "awq_moe/marlin@1")
    padded = mf_padded(inter, group)
    assert tuple(restored.w13_qweight.shape) == (4, hidden // 16, 2 * padded * 2)
    assert tuple(restored.w13_weight.shape) == tuple(restored.w13_qweight.shape)
    assert vllm_layer.w13_weight is vllm_layer.w13_qweight  # vLLM's alias, exported once


def mf_padded(inter: int, group: int) -> int:
    """vLLM's padded intermediate size (the expected shapes)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_moe_padded_intermediate,
    )

    return marlin_moe_padded_intermediate(inter, group)


@pytest.mark.parametrize("hidden,inter,group", SHAPES)
def test_gptq_moe_marlin_sm90(marlin_moe, hidden, inter, group):
    """AutoGPTQMoEMethod (symmetric int4) on sm90 resolves MARLIN; vLLM's post-load (pad,
    gptq_marlin_moe_repack, scales, zero points, unloaded bias slots None, aliases)
    equals wcache's ``gptq_moe/marlin`` load and restore."""
    config, vllm_layer, restored = _case("gptq", hidden, inter, group, "gptq_moe/marlin@1")
    assert restored._parameters["w13_bias"] is None
    assert restored._parameters["w2_bias"] is None
    assert tuple(restored.w2_qweight.shape) == (4, mf_padded(inter, group) // 16, hidden * 2)


def test_gptq_moe_marlin_loaded_biases(marlin_moe):
    """A GPTQ MoE checkpoint that holds expert biases: vLLM pads and permutes them; so
    does wcache (the all-zero test decides only where none was loaded)."""
    config, vllm_layer, restored = _case(
        "gptq", 128, 96, 32, "gptq_moe/marlin@1", loaded_biases=True
    )
    assert tuple(restored.w13_bias.shape) == (4, 2 * mf_padded(96, 32))


@pytest.mark.parametrize(
    "fmt,hidden,inter,group",
    [("ct_w4a16", *s) for s in SHAPES]
    + [("ct_w4a16_channel", 256, 128, -1), ("ct_w4a16_channel", 128, 96, -1)]
    + [("ct_w4a16_asym", 128, 96, 32), ("ct_w4a16_asym", 256, 128, 128)],
)
def test_ct_w4a16_moe_marlin_sm90(marlin_moe, fmt, hidden, inter, group):
    """CompressedTensorsWNA16MoEMethod (group, channel, asymmetric) on sm90 resolves MARLIN;
    vLLM's post-load (N-first -> K-first, pad, repack, scales, zero points, aliases) equals
    wcache's ``ct_w4a16_moe/marlin`` load and restore."""
    config, vllm_layer, restored = _case(fmt, hidden, inter, group, "ct_w4a16_moe/marlin@1")
    assert config.quant.group_size == group
    assert config.quant.strategy == ("channel" if group == -1 else "group")
    assert config.quant.zero_point == fmt.endswith("_asym")
    assert ("w13_weight_zero_point" in restored._parameters) == fmt.endswith("_asym")


# --------------------------------------------------------------------------- plan rules


@pytest.mark.parametrize("plan", [AWQ_MOE, GPTQ_MOE, CT_W4A16_MOE], ids=lambda p: p.id)
def test_marlin_moe_plans_replay_only_metadata(plan):
    """Every byte-writing step is a TRANSFORM the daemon runs once; restore replays only
    METADATA and VALIDATE (shapes, the resolved backend, GPTQ's None bias slots); nothing
    is allocated."""
    tags = {s.name: s.tag for s in plan.stages}
    replayed = sorted(n for n, t in tags.items() if t is not Tag.TRANSFORM)
    assert {tags[n] for n in replayed} == {Tag.METADATA, Tag.VALIDATE}
    expected = ["marlin_moe.validate_repacked_shapes", "moe.set_experts_kernel"] + (
        ["marlin_moe.clear_unloaded_bias"] if plan is GPTQ_MOE else []
    )
    assert sorted(expected) == replayed
    assert (
        "marlin_moe.repack_weights" in tags and tags["marlin_moe.repack_weights"] is Tag.TRANSFORM
    )


def _moe_cfg(method: str, **quant):
    from attrs import evolve

    from tests.helpers import moe_cases as mc

    cfg = mc.moe_config(
        method,
        "marlin",
        experts=2,
        hidden=128,
        inter=96,
        backend="MARLIN",
        experts_cls="MarlinExperts",
    )
    return evolve(cfg, quant=evolve(cfg.quant, **quant))


@pytest.mark.parametrize(
    "method,quant,match",
    [
        ("gptq_moe", {"num_bits": 4, "group_size": 32, "zero_point": True}, "asymmetric GPTQ"),
        ("awq_moe", {"num_bits": 4, "group_size": 32, "zero_point": False}, "zero points"),
        ("awq_moe", {"num_bits": 8, "group_size": 32, "zero_point": True}, "4,\\)-bit"),
        ("ct_w4a16_moe", {"num_bits": 4, "group_size": 16}, "group sizes"),
        (
            "ct_w4a16_moe",
            {"num_bits": 4, "group_size": 32, "options": (("marlin_input_dtype", "fp8"),)},
            "VLLM_MARLIN_INPUT_DTYPE",
        ),
    ],
)
def test_marlin_moe_refusals(method, quant, match):
    """What Marlin MoE does not take is refused by plan_for before any weight is read,
    with the reason."""
    with pytest.raises(NoPlan, match=match):
        plan_for(_moe_cfg(method, **quant), target=H200)


def test_other_wna16_backends_are_refused_by_name():
    """A WNA16 MoE layer on another backend (BATCHED_MARLIN under EP all-to-all, Triton)
    has no plan: refused naming the backend."""
    from attrs import evolve

    cfg = _moe_cfg("gptq_moe", num_bits=4, group_size=32)
    for backend in ("BATCHED_MARLIN", "TRITON"):
        other = evolve(cfg, moe=evolve(cfg.moe, backend=backend))
        with pytest.raises(NoPlan, match=backend):
            plan_for(other, target=H200)
