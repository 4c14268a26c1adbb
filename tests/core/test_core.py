"""Core runner, plan rules and restore guard, on synthetic stages (no vLLM)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.core import (
    LayerConfig,
    LayerState,
    NoPlan,
    Plan,
    PlanInvalid,
    QuantSpec,
    RecordedMismatch,
    RestoreIncomplete,
    RestoreWroteSharedTensor,
    StageContractError,
    StageOut,
    Tag,
    Target,
    checks,
    stage,
)
from wcache.core.checks import Step
from wcache.plans.registry import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot
from wcache.testing.plans import unregistered_stage

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


TOY = Plan(
    "toy",
    "ref",
    (scale_weight, set_width, alloc_workspace, derive_handle, isa_from_target),
    frozenset({"weight"}),
)
CONFIG = LayerConfig(QuantSpec("toy"), size_k=8, size_n=6, name="layer0")
ATTRS = ["logical_width", "isa"]


def _layer(weight: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    return m


def _exported(plan: Plan, weight: torch.Tensor, target: Target = CPU):
    daemon = _layer(weight)
    prepared = prepare_(daemon, plan.bind(CONFIG, target))
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
    load_(loaded, TOY.bind(config, CPU))
    daemon = _layer(weight)
    prepared = prepare_(daemon, TOY.bind(config, CPU))
    engine = torch.nn.Module()
    engine.weight = torch.nn.Parameter(prepared.tensors["weight"].clone(), requires_grad=False)
    restore_(engine, TOY.bind(config, CPU), prepared.recorded, strict=True)
    assert snapshot(engine, ATTRS) == snapshot(loaded, ATTRS)
    x = torch.randn(3, k)
    assert torch.equal(engine.handle(x), loaded.handle(x))


def test_prepare_skips_allocate_and_derive():
    """The daemon's prepare runs no ALLOCATE/DERIVE stage: no workspace, no handle, weight kept."""
    prepared, _ = _exported(TOY, torch.ones(6, 8))
    assert set(prepared.tensors) == {"weight"}
    assert torch.equal(prepared.tensors["weight"], torch.full((6, 8), 2.0))
    assert prepared.recorded == {"toy.set_width": {"width": 6}, "toy.set_isa": {"isa": "vec"}}


def test_prepared_mappings_are_read_only():
    """Prepared's tensors, attrs and recorded values (inner mappings too) refuse writes."""
    prepared, _ = _exported(TOY, torch.ones(6, 8))
    for mapping in (
        prepared.tensors,
        prepared.attrs,
        prepared.recorded,
        prepared.recorded["toy.set_width"],
    ):
        with pytest.raises(TypeError):
            mapping["x"] = 1  # type: ignore[index]  # the write the proxy refuses
    assert {"width": 6} == dict(prepared.recorded["toy.set_width"])


def test_derive_release_keeps_shared_bytes_and_installs_placeholder():
    """A DERIVE release leaves an empty placeholder while the guard still checks the mapped bytes."""
    prepared, engine = _exported(TOY, torch.ones(6, 8))
    shared = engine.weight
    state = restore_(engine, TOY.bind(CONFIG, CPU), prepared.recorded, strict=True)
    assert engine.weight.shape == (0,)
    assert state.released["weight"] is shared
    assert torch.equal(shared, torch.full((6, 8), 2.0))


def test_replayed_inplace_write_is_caught():
    """A METADATA stage that writes in place into a shared tensor raises RestoreWroteSharedTensor."""
    bad = Plan("toy", "bad", (scale_weight, inplace_scale), frozenset({"weight"}))
    prepared, engine = _exported(bad, torch.ones(2, 2))
    with pytest.raises(RestoreWroteSharedTensor, match="toy.set_flag_in_place"):
        restore_(engine, bad.bind(CONFIG, CPU), prepared.recorded)


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
        Plan(
            "toy",
            "invalid",
            (
                scale_weight,
                scale_weight,
                alloc_over_export,
                reads_ghost,
                alloc_workspace,
                transform_needs_alloc,
            ),
            frozenset({"weight"}),
        )
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
        load_(_layer(torch.ones(1)), plan.bind(CONFIG, CPU))


def test_recorded_mismatch_names_the_stage():
    """A value recomputed on restore that differs from the daemon's raises RecordedMismatch."""
    prepared, engine = _exported(TOY, torch.ones(6, 8), target=Target("cpu", None, {"amx"}))
    with pytest.raises(RecordedMismatch, match="toy.set_isa"):
        restore_(engine, TOY.bind(CONFIG, CPU), prepared.recorded)


def test_missing_tensor_is_restore_incomplete():
    """Restoring without an exported tensor the plan reads raises RestoreIncomplete."""
    with pytest.raises(RestoreIncomplete, match="weight"):
        restore_(torch.nn.Module(), TOY.bind(CONFIG, CPU), {})


def test_forgotten_metadata_breaks_the_invariant():
    """Folding METADATA work into a TRANSFORM makes restore differ from load (what the
    invariant tests catch)."""

    @stage(
        "toy.fold_scale_set_width",
        Tag.TRANSFORM,
        reads=["weight"],
        writes=["weight"],
        attrs=["logical_width"],
    )
    def scale_and_width(t, c, tg, r):
        return StageOut(tensors={"weight": t["weight"] * 2}, attrs={"logical_width": c.size_n})

    plan = Plan("toy", "forgetful", (scale_and_width,), frozenset({"weight"}))
    loaded = _layer(torch.ones(6, 8))
    load_(loaded, plan.bind(CONFIG, CPU))
    prepared, engine = _exported(plan, torch.ones(6, 8))
    restore_(engine, plan.bind(CONFIG, CPU), prepared.recorded)
    assert snapshot(engine, ["logical_width"]) != snapshot(loaded, ["logical_width"])


def test_unknown_method_is_refused_with_reason():
    """plan_for refuses an unknown method, naming the known ones."""
    with pytest.raises(NoPlan, match="no plan for method 'bitsandbytes'"):
        plan_for(QuantSpec("bitsandbytes"), target=CPU)


def test_target_json_roundtrip():
    """Targets survive the manifest's JSON form unchanged."""
    t = Target("cuda", (9, 0), frozenset(), (("VLLM_CPU_INT4_W4A8", "0"),))
    assert Target.from_json(t.to_json()) == t


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"VLLM_CPU_INT4_W4A8": "1"}, ()),
        ({"VLLM_CPU_INT4_W4A8": "0"}, (("VLLM_CPU_INT4_W4A8", "0"),)),
        ({"VLLM_BATCH_INVARIANT": "00"}, ()),
        ({"VLLM_MARLIN_INPUT_DTYPE": ""}, ()),
        ({"VLLM_MARLIN_INPUT_DTYPE": "fp8"}, (("VLLM_MARLIN_INPUT_DTYPE", "fp8"),)),
    ],
)
def test_target_env_set_to_vllm_default_is_the_same_target(env, expected):
    """A kernel-selection variable set to vLLM's default (or empty) gives the same Target as
    leaving it unset, so the cache key does not change for nothing."""
    assert Target.detect("cpu", env=env).env == expected


# --------------------------------------------------------------------------- the fold's guard hook


class _RecordingGuard:
    """A :class:`~wcache.core.StepGuard` that records each call and checks nothing."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, str]] = []
        self.layers: list[tuple[str, tuple[str, ...]]] = []

    def check_stage(self, layer, stage_name, tensors):
        self.stages.append((layer, stage_name))

    def blame_write(self, layer, stage_name, names):
        raise AssertionError(f"blamed {stage_name} for {names}")

    def check_layer(self, layer, stage_names):
        self.layers.append((layer, tuple(stage_names)))


def test_restore_fold_calls_the_guard_hook_once_per_replayed_stage():
    """The restore fold runs the guard's check_stage once after each replayed stage, in
    plan order and never for a TRANSFORM; the shell adds one install check."""
    prepared, engine = _exported(TOY, torch.randn(6, 8))
    replayed = [s.name for s in TOY.stages if s.replayable]
    assert ["toy.set_width", "toy.alloc_workspace", "toy.bind_handle", "toy.set_isa"] == replayed

    bound = TOY.bind(CONFIG, CPU)
    pure = _RecordingGuard()
    from wcache.shell import state_from_module

    bound.restore_run(
        bound.restore_start(state_from_module(engine), prepared.recorded),
        prepared.recorded,
        guard=pure,
    )
    assert [("layer0", n) for n in replayed] == pure.stages

    prepared, engine = _exported(TOY, torch.randn(6, 8))
    shell_guard = _RecordingGuard()
    restore_(engine, bound, prepared.recorded, guard=shell_guard)
    assert [("layer0", n) for n in replayed] + [("layer0", "(install)")] == shell_guard.stages
    assert [("layer0", tuple(replayed))] == shell_guard.layers


def test_load_and_prepare_are_the_same_fold_without_a_guard():
    """Plan.run with LOAD_TAGS/PREPARE_TAGS folds exactly the stages of those tags and
    never calls a guard it was not given (the guard is the restore's hook only)."""
    from wcache.core import LOAD_TAGS, PREPARE_TAGS
    from wcache.shell import state_from_module

    state = state_from_module(_layer(torch.ones(6, 8)))
    loaded = TOY.run(state, CONFIG, CPU, LOAD_TAGS)
    prepared = TOY.run(state, CONFIG, CPU, PREPARE_TAGS)
    assert {"weight", "workspace"} == set(loaded.tensors)
    assert {"weight"} == set(prepared.tensors)
    assert {"toy.set_width", "toy.set_isa"} == set(prepared.recorded)
    guard = _RecordingGuard()
    TOY.run(state, CONFIG, CPU, PREPARE_TAGS, guard=guard)
    assert [
        ("layer0", "toy.fold_weight_scale"),
        ("layer0", "toy.set_width"),
        ("layer0", "toy.set_isa"),
    ] == guard.stages


# --------------------------------------------------------------------------- contract checks


def _st(tag=Tag.METADATA, **decl):
    return unregistered_stage("toy.set_x", tag, **decl)(lambda t, c, tg, r: StageOut())


_W = LayerState(tensors={"weight": torch.ones(2)})

#: (check, a step that breaks its rule, the violation it must report)
BAD_STEPS = [
    (
        checks.check_reads,
        Step(_st(reads=("weight",)), LayerState(), CONFIG),
        "stage 'toy.set_x' reads ['weight'] but the layer has only []",
    ),
    (
        checks.check_returns_stage_out,
        Step(_st(), _W, CONFIG, out=None),
        "stage 'toy.set_x' returned NoneType, not StageOut",
    ),
    (
        checks.check_shared_untouched,
        Step(_st(), _W, CONFIG, shared=frozenset({"weight"}), out=StageOut(), touched=("weight",)),
        "stage 'toy.set_x' wrote in place into shared tensors ['weight']",
    ),
    (
        checks.check_inputs_untouched,
        Step(_st(), _W, CONFIG, out=StageOut(), touched=("weight",)),
        "stage 'toy.set_x' mutated its input tensors ['weight'] in place",
    ),
    (
        checks.check_declared_writes,
        Step(_st(Tag.TRANSFORM), _W, CONFIG, out=StageOut(tensors={"x": torch.ones(1)})),
        "stage 'toy.set_x' wrote ['x'] without declaring them in writes",
    ),
    (
        checks.check_declared_attrs,
        Step(_st(), _W, CONFIG, out=StageOut(attrs={"a": 1})),
        "stage 'toy.set_x' set attributes ['a'] without declaring them in attrs",
    ),
    (
        checks.check_no_tensors_from_readonly_tags,
        Step(_st(), _W, CONFIG, out=StageOut(tensors={"x": torch.ones(1)})),
        "METADATA stage 'toy.set_x' returned tensors ['x']; only TRANSFORM and ALLOCATE",
    ),
    (
        checks.check_shared_not_replaced,
        Step(_st(), _W, CONFIG, shared=frozenset({"weight"}), out=StageOut(drop=("weight",))),
        "stage 'toy.set_x' replaces or drops shared tensors ['weight']",
    ),
    (
        checks.check_derive_drops_nothing,
        Step(_st(Tag.DERIVE), _W, CONFIG, out=StageOut(drop=("weight",))),
        "DERIVE stage 'toy.set_x' may not drop tensors (('weight',))",
    ),
    (
        checks.check_declared_drops,
        Step(_st(Tag.TRANSFORM, writes=("weight",)), _W, CONFIG, out=StageOut(drop=("weight",))),
        "stage 'toy.set_x' dropped ['weight'] without declaring them in drops",
    ),
    (
        checks.check_no_tensor_slots_in_attrs,
        Step(_st(attrs=("weight",)), _W, CONFIG, out=StageOut(attrs={"weight": None})),
        "METADATA stage 'toy.set_x' set tensors ['weight'] through attrs",
    ),
    (
        checks.check_release,
        Step(_st(reads=("weight",)), _W, CONFIG, out=StageOut(release=("weight",))),
        "stage 'toy.set_x' releases ['weight']; only DERIVE stages may release",
    ),
    (
        checks.check_memo,
        Step(_st(), _W, CONFIG, out=StageOut(memo={"k": 1})),
        "stage 'toy.set_x' returned memo entries but is not declared memoized",
    ),
    (
        checks.check_recorded,
        Step(_st(), _W, CONFIG, recorded={"width": 6}, out=StageOut(record={"width": 7})),
        "stage 'toy.set_x': values recomputed here differ from the daemon's (recorded, here): "
        "{'width': (6, 7)}",
    ),
]


@pytest.mark.parametrize(
    "check, bad, violation", BAD_STEPS, ids=[c.__name__ for c, _, _ in BAD_STEPS]
)
def test_each_contract_check_reports_its_violation(check, bad, violation):
    """Each named check returns exactly one violation for its bad input, naming it, and
    none for the same stage returning nothing (StageOut())."""
    problems = check(bad)
    assert 1 == len(problems) and violation in problems[0], problems
    good = (
        Step(bad.stage, bad.state, CONFIG, out=StageOut())
        if check is not checks.check_reads
        else Step(bad.stage, _W, CONFIG)
    )
    assert [] == check(good)


def test_the_table_covers_every_step_check():
    """Every check the fold runs (READ_CHECKS + STEP_CHECKS) has a row in BAD_STEPS."""
    run = {fn for _, fn in checks.READ_CHECKS + checks.STEP_CHECKS}
    assert run == {c for c, _, _ in BAD_STEPS}
