"""Core runner, plan rules and restore guard, on synthetic stages (no vLLM)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.core import (
    LayerConfig, NoPlan, Plan, PlanInvalid, QuantSpec, RecordedMismatch, RestoreIncomplete,
    RestoreWroteSharedTensor, StageContractError, StageOut, Tag, Target, snapshot, stage,
)
from wcache.plans.registry import plan_for

CPU = Target("cpu", None, frozenset({"avx512"}))


@stage("toy.fold_weight_scale", Tag.TRANSFORM, reads=["weight"], writes=["weight"], source="test")
def scale_weight(t, c, tg, r):
    return StageOut(tensors={"weight": t["weight"] * 2})


@stage("toy.set_width", Tag.METADATA, reads=["weight"], attrs=["logical_width"], source="test")
def set_width(t, c, tg, r):
    return StageOut(attrs={"logical_width": c.size_n}, record={"width": c.size_n})


@stage("toy.alloc_workspace", Tag.ALLOCATE, writes=["workspace"], source="test")
def alloc_workspace(t, c, tg, r):
    return StageOut(tensors={"workspace": torch.zeros(4, dtype=torch.int32)})


@stage("toy.bind_handle", Tag.DERIVE, reads=["weight"], attrs=["handle"], source="test")
def derive_handle(t, c, tg, r):
    w = t["weight"].clone()
    return StageOut(attrs={"handle": lambda x: x @ w.t()}, release=("weight",))


@stage("toy.set_flag_in_place", Tag.METADATA, reads=["weight"], attrs=["flag"], source="test")
def inplace_scale(t, c, tg, r):
    t["weight"].mul_(2)  # the bug class: an in-place write during replay
    return StageOut(attrs={"flag": True})


@stage("toy.set_isa", Tag.METADATA, attrs=["isa"], source="test")
def isa_from_target(t, c, tg, r):
    value = "amx" if tg.has("amx") else "vec"
    return StageOut(attrs={"isa": value}, record={"isa": value})


TOY = Plan("toy", "ref", (scale_weight, set_width, alloc_workspace, derive_handle,
                          isa_from_target), frozenset({"weight"}))
CONFIG = LayerConfig(QuantSpec("toy"), size_k=8, size_n=6, name="layer0")
ATTRS = ["logical_width", "isa"]


def _layer(weight: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return m


def _exported(plan: Plan, weight: torch.Tensor, target: Target = CPU):
    daemon = _layer(weight)
    prepared = plan.prepare(daemon, CONFIG, target)
    engine = torch.nn.Module()
    for name, t in prepared.tensors.items():
        engine.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return prepared, engine


@given(st.integers(1, 6), st.integers(1, 8))
def test_restore_equals_load(n, k):
    """restore(export(prepare(x))) has the same tensors, attributes and output as load(x)."""
    weight = torch.randn(n, k)
    config = LayerConfig(QuantSpec("toy"), size_k=k, size_n=n, name="l")
    loaded = _layer(weight)
    TOY.load(loaded, config, CPU)
    daemon = _layer(weight)
    prepared = TOY.prepare(daemon, config, CPU)
    engine = torch.nn.Module()
    engine.weight = torch.nn.Parameter(prepared.tensors["weight"].clone(), requires_grad=False)
    TOY.restore(engine, config, CPU, prepared.recorded, strict=True)
    assert snapshot(engine, ATTRS) == snapshot(loaded, ATTRS)
    x = torch.randn(3, k)
    assert torch.equal(engine.handle(x), loaded.handle(x))


def test_prepare_skips_allocate_and_derive():
    """The daemon's prepare runs no ALLOCATE/DERIVE stage: no workspace, no handle, weight kept."""
    prepared, _ = _exported(TOY, torch.ones(6, 8))
    assert set(prepared.tensors) == {"weight"}
    assert torch.equal(prepared.tensors["weight"], torch.full((6, 8), 2.0))
    assert prepared.recorded == {"toy.set_width": {"width": 6}, "toy.set_isa": {"isa": "vec"}}


def test_derive_release_keeps_shared_bytes_and_installs_placeholder():
    """A DERIVE release leaves an empty placeholder while the guard still checks the mapped bytes."""
    prepared, engine = _exported(TOY, torch.ones(6, 8))
    shared = engine.weight
    state = TOY.restore(engine, CONFIG, CPU, prepared.recorded, strict=True)
    assert engine.weight.shape == (0,)
    assert state.released["weight"] is shared
    assert torch.equal(shared, torch.full((6, 8), 2.0))


def test_replayed_inplace_write_is_caught():
    """A METADATA stage that writes in place into a shared tensor raises RestoreWroteSharedTensor."""
    bad = Plan("toy", "bad", (scale_weight, inplace_scale), frozenset({"weight"}))
    prepared, engine = _exported(bad, torch.ones(2, 2))
    with pytest.raises(RestoreWroteSharedTensor, match="toy.set_flag_in_place"):
        bad.restore(engine, CONFIG, CPU, prepared.recorded)


def test_stage_mutating_input_during_load_is_a_contract_error():
    """Purity is checked even outside restore when check_purity is on."""
    bad = Plan("toy", "bad2", (inplace_scale,), frozenset({"weight"}))
    from wcache.core import LayerState
    state = LayerState(tensors={"weight": torch.ones(2)})
    with pytest.raises(StageContractError, match="mutated"):
        bad.run(state, CONFIG, CPU, frozenset(Tag), check_purity=True)


def test_plan_rules_list_every_violation():
    """Plan validation reports all rule violations at build time, in one error."""
    @stage("toy.alloc_over_export", Tag.ALLOCATE, writes=["weight"])
    def alloc_over_export(t, c, tg, r):
        return StageOut()

    @stage("toy.convert_ghost", Tag.TRANSFORM, reads=["ghost"], writes=["x"])
    def reads_ghost(t, c, tg, r):
        return StageOut()

    @stage("toy.pack_workspace", Tag.TRANSFORM, reads=["workspace"], writes=["y"])
    def transform_needs_alloc(t, c, tg, r):
        return StageOut()

    with pytest.raises(PlanInvalid) as info:
        Plan("toy", "invalid", (scale_weight, scale_weight, alloc_over_export, reads_ghost,
                                alloc_workspace, transform_needs_alloc), frozenset({"weight"}))
    msg = str(info.value)
    assert "used more than once" in msg
    assert "writes exported tensors ['weight']" in msg
    assert "reads 'ghost'" in msg
    assert "depends on ALLOCATE output 'workspace'" in msg


def test_undeclared_write_is_rejected():
    """A stage returning a tensor it did not declare in writes is a contract error."""
    @stage("toy.repack_weight", Tag.TRANSFORM, reads=["weight"], writes=["weight"])
    def sneaky(t, c, tg, r):
        return StageOut(tensors={"other": torch.zeros(1)})

    plan = Plan("toy", "sneaky", (sneaky,), frozenset({"weight"}))
    with pytest.raises(StageContractError, match="other"):
        plan.load(_layer(torch.ones(1)), CONFIG, CPU)


def test_recorded_mismatch_names_the_stage():
    """A value recomputed on restore that differs from the daemon's raises RecordedMismatch."""
    prepared, engine = _exported(TOY, torch.ones(6, 8), target=Target("cpu", None, {"amx"}))
    with pytest.raises(RecordedMismatch, match="toy.set_isa"):
        TOY.restore(engine, CONFIG, CPU, prepared.recorded)


def test_missing_tensor_is_restore_incomplete():
    """Restoring without an exported tensor the plan reads raises RestoreIncomplete."""
    with pytest.raises(RestoreIncomplete, match="weight"):
        TOY.restore(torch.nn.Module(), CONFIG, CPU, {})


def test_forgotten_metadata_breaks_the_invariant():
    """Folding METADATA work into a TRANSFORM makes restore differ from load (what the
    invariant tests catch)."""
    @stage("toy.fold_scale_set_width", Tag.TRANSFORM, reads=["weight"], writes=["weight"],
           attrs=["logical_width"])
    def scale_and_width(t, c, tg, r):
        return StageOut(tensors={"weight": t["weight"] * 2}, attrs={"logical_width": c.size_n})

    plan = Plan("toy", "forgetful", (scale_and_width,), frozenset({"weight"}))
    loaded = _layer(torch.ones(6, 8))
    plan.load(loaded, CONFIG, CPU)
    prepared, engine = _exported(plan, torch.ones(6, 8))
    plan.restore(engine, CONFIG, CPU, prepared.recorded)
    assert snapshot(engine, ["logical_width"]) != snapshot(loaded, ["logical_width"])


def test_unknown_method_is_refused_with_reason():
    """plan_for refuses an unknown method, naming the known ones."""
    with pytest.raises(NoPlan, match="no plan for method 'bitsandbytes'"):
        plan_for(QuantSpec("bitsandbytes"), target=CPU)


def test_target_json_roundtrip():
    """Targets survive the manifest's JSON form unchanged."""
    t = Target("cuda", (9, 0), frozenset(), (("VLLM_CPU_INT4_W4A8", "0"),))
    assert Target.from_json(t.to_json()) == t


@pytest.mark.parametrize("env, expected", [
    ({"VLLM_CPU_INT4_W4A8": "1"}, ()),
    ({"VLLM_CPU_INT4_W4A8": "0"}, (("VLLM_CPU_INT4_W4A8", "0"),)),
    ({"VLLM_BATCH_INVARIANT": "00"}, ()),
    ({"VLLM_MARLIN_INPUT_DTYPE": ""}, ()),
    ({"VLLM_MARLIN_INPUT_DTYPE": "fp8"}, (("VLLM_MARLIN_INPUT_DTYPE", "fp8"),)),
])
def test_target_env_set_to_vllm_default_is_the_same_target(env, expected):
    """A kernel-selection variable set to vLLM's default (or empty) gives the same Target as
    leaving it unset, so the cache key does not change for nothing."""
    assert Target.detect("cpu", env=env).env == expected
