"""Marlin MoE stages (issue 46): the per-expert helpers equal vLLM's pure functions bit for
bit (vLLM's ``marlin_utils`` helpers run on CPU; the repack against vLLM's
``marlin_weights`` reference), the stages are pure and accept meta tensors, the repack
must never be replayed, and bad inputs raise the layout error."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve

from tests.helpers import moe_cases as mc
from wcache.core import LayerState
from wcache.stages import marlin_moe as mm
from wcache.stages.marlin import MarlinLayoutError
from wcache.stages.packing import pack_awq, unpack_int32

#: (E, groups, N): w13-like (N = 2 * 128) and w2-like zero-point / scale shapes.
SHAPES = ((3, 4, 256), (2, 1, 128))


def _rand_int32(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("e,groups,n", SHAPES)
def test_zero_points_equal_vllms(e, groups, n):
    """moe_packed_to_marlin_zero_points / moe_awq_to_marlin_zero_points equal vLLM's
    functions of the same names on random packed words."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils as vmu

    zp = _rand_int32(e, groups, n // 8, seed=n)
    assert torch.equal(
        vmu.moe_packed_to_marlin_zero_points(zp, groups, n, 4),
        mm.moe_packed_to_marlin_zero_points(zp, 4),
    )
    assert torch.equal(
        vmu.moe_awq_to_marlin_zero_points(zp, groups, n, 4), mm.moe_awq_to_marlin_zero_points(zp, 4)
    )


@pytest.mark.parametrize("size_k,group", [(96, 32), (128, 128), (8, -1)])
def test_scales_equal_vllms(size_k, group):
    """moe_permute_scales equals vLLM's marlin_moe_permute_scales, including vLLM's choice
    of the single permutation when G == size_k (a single group)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_moe_permute_scales,
    )

    g = torch.Generator().manual_seed(size_k)
    s = torch.rand(3, 2, 256, generator=g).to(torch.bfloat16)
    expected = marlin_moe_permute_scales(s, size_k, 256, group)
    assert torch.equal(expected, mm.moe_permute_scales(s, size_k, group))


@pytest.mark.parametrize("inter,group", [(96, 32), (96, -1), (128, 128), (64, 64), (80, 16)])
def test_padded_intermediate_equals_vllms(inter, group):
    """The padded intermediate size is vLLM's marlin_moe_padded_intermediate."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_moe_padded_intermediate,
    )

    assert marlin_moe_padded_intermediate(inter, group) == mm.marlin_moe_padded_intermediate(
        inter, group
    )


def test_awq_repack_equals_the_gptq_repack_of_the_same_values():
    """awq_marlin_repack of AWQ-packed values == gptq_marlin_repack of the same values packed
    along K (the identity vLLM's test_awq_marlin_repack relies on), against vLLM's
    marlin_weights reference."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_test as mut

    k, n = 128, 128
    g = torch.Generator().manual_seed(3)
    values = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    expected = mut.marlin_weights(values, k, n, 4, mut.get_weight_perm(4))
    awq = pack_awq(values).unsqueeze(0)
    assert torch.equal(expected, mm.moe_awq_marlin_repack(awq, k, n, 4)[0])
    gptq = mc.marlin_int_experts("gptq", 1, k, n // 2, 32, 4, 0)["w13_qweight"]
    ref = mut.marlin_weights(unpack_int32(gptq[0], 4, 0), k, n, 4, mut.get_weight_perm(4))
    assert torch.equal(ref, mm.moe_marlin_repack(gptq, k, n, 4)[0])


def _gptq_layer(bias: str = "zero"):
    cfg = mc.moe_config(
        "gptq_moe", "marlin", experts=2, hidden=128, inter=96, backend="MARLIN", experts_cls="X"
    )
    cfg = evolve(cfg, quant=evolve(cfg.quant, num_bits=4, group_size=32))
    return cfg, mc.marlin_int_experts("gptq", 2, 128, 96, 32, 4, 7, bias=bias)


def test_repack_is_pure_and_replaying_it_corrupts_the_weights():
    """The repack returns new tensors (inputs unchanged) and, run again on its own output,
    gives other bytes: why it is a TRANSFORM a restore never replays."""
    from wcache.plans.marlin_moe import GPTQ_MOE

    cfg, t = _gptq_layer()
    before = {k: v.clone() for k, v in t.items()}
    st = GPTQ_MOE.stages[1]
    assert st.name == "marlin_moe.repack_weights"
    once = st(t, cfg, mc.H200, {}).tensors
    assert all(torch.equal(before[k], t[k]) for k in t)
    assert tuple(once["w13_qweight"].shape) == (2, 128 // 16, 2 * 128 * 2)
    # the same shape again only where the layout is square in packed words: re-pack w2
    w2 = once["w2_qweight"]  # [2, 128/16, 256]: not a checkpoint shape, so re-view it
    again = mm.moe_marlin_repack(w2.reshape(2, 16, 128), 128, 128, 4)
    assert not torch.equal(again.reshape(w2.shape), w2)


def test_unloaded_bias_becomes_a_none_slot_and_a_loaded_one_is_kept():
    """An all-zero expert bias (vLLM: not loaded) is dropped and its slot set to None; a
    loaded bias is padded per shard and permuted."""
    from wcache.core import LOAD_TAGS
    from wcache.plans.marlin_moe import GPTQ_MOE

    for bias, kept in (("zero", False), ("random", True)):
        cfg, t = _gptq_layer(bias)
        state = GPTQ_MOE.bind(cfg, mc.H200).run(LayerState(tensors=t), LOAD_TAGS)
        assert ("w13_bias" in state.tensors) is kept
        if kept:
            assert tuple(state.tensors["w13_bias"].shape) == (2, 2 * 128)
        else:
            assert state.attrs["w13_bias"] is None and state.attrs["w2_bias"] is None


@pytest.mark.parametrize(
    "change,match",
    [
        ({"num_bits": 3}, "4/8-bit"),
        ({"group_size": 16}, "group sizes"),
    ],
)
def test_bad_geometry_raises(change, match):
    """Bits or group sizes Marlin MoE does not take raise MarlinLayoutError naming them."""
    cfg, t = _gptq_layer()
    cfg = evolve(cfg, quant=evolve(cfg.quant, **change))
    with pytest.raises(MarlinLayoutError, match=match):
        mm.repack_weights("gptq", "w13_qweight", "w2_qweight")(t, cfg, mc.H200, {})


def test_unknown_layout_raises():
    """A layout other than gptq/ct/awq raises MarlinLayoutError naming the known ones."""
    cfg, t = _gptq_layer()
    with pytest.raises(MarlinLayoutError, match="gptq"):
        mm.repack_weights("exl2", "w13_qweight", "w2_qweight")(t, cfg, mc.H200, {})


def test_repacked_shapes_of_another_layer_are_refused():
    """Experts repacked for another intermediate size fail the replayed shape check,
    naming the tensor and both shapes."""
    from wcache.core import LOAD_TAGS
    from wcache.plans.marlin_moe import GPTQ_MOE
    from wcache.stages.moe import MoeLayoutError

    cfg, t = _gptq_layer()
    state = GPTQ_MOE.bind(cfg, mc.H200).run(LayerState(tensors=t), LOAD_TAGS)
    other = evolve(cfg, moe=evolve(cfg.moe, intermediate_size_per_partition=192))
    check = mm.validate_repacked_shapes("w13_qweight", "w2_qweight", "w13_scales", "w2_scales")
    assert check(state.tensors, cfg, mc.H200, {}).tensors == {}
    with pytest.raises(MoeLayoutError, match="w13_qweight is \\[2, 8, 512\\], expected"):
        check(state.tensors, other, mc.H200, {})
