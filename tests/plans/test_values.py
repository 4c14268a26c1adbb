"""Stages and plans are values (issue 25): every registered stage and plan pickles and
round-trips equal, with an equal hash, and a parameterized stage's parameters are part
of its value and its repr."""

from __future__ import annotations

import pickle

import pytest

from wcache.core import (
    BoundPlan,
    LayerConfig,
    Plan,
    QuantSpec,
    Stage,
    StageDef,
    Target,
    registered_stages,
)
from wcache.plans import all_plans
from wcache.stages import cpu_wna16, marlin


def _round_trip(value):
    return pickle.loads(pickle.dumps(value))


def _wcache_registered() -> dict:
    return {
        n: v for n, v in registered_stages().items() if v.fn.__module__.startswith("wcache.stages.")
    }


@pytest.mark.parametrize("name", sorted(_wcache_registered()))
def test_every_registered_stage_pickles_and_round_trips_equal(name):
    """Each registered stage definition (a Stage, or a parameterized StageDef) survives
    pickle equal, with an equal hash; a StageDef comes back as the registered object."""
    value = _wcache_registered()[name]
    back = _round_trip(value)
    assert back == value and hash(back) == hash(value)
    if isinstance(value, StageDef):
        assert back is value


@pytest.mark.parametrize(
    "stage_",
    sorted({s for p in all_plans() for s in p.stages}, key=lambda s: (s.name, repr(s.params))),
    ids=lambda s: f"{s.name}{dict(s.params) or ''}",
)
def test_every_stage_a_plan_runs_pickles_and_round_trips_equal(stage_):
    """Every stage value in a registered plan (parameterized ones included) pickles by
    reference to its registered definition and comes back equal, with an equal hash."""
    back = _round_trip(stage_)
    assert isinstance(back, Stage)
    assert back == stage_ and hash(back) == hash(stage_)


@pytest.mark.parametrize("plan", all_plans(), ids=lambda p: p.id)
def test_every_registered_plan_pickles_and_round_trips_equal(plan):
    """Every registered plan survives pickle equal, with an equal hash and the same
    match decision on a sample layer."""
    back = _round_trip(plan)
    assert isinstance(back, Plan)
    assert back == plan and hash(back) == hash(plan)
    config = LayerConfig(QuantSpec(plan.method, num_bits=4, group_size=128), 256, 128)
    for target in (Target("cpu"), Target("cuda", (9, 0))):
        assert plan.match(config, target) == back.match(config, target)


def test_a_bound_plan_pickles_and_round_trips_equal():
    """A BoundPlan (what plan_for returns) is a value too."""
    plan = all_plans()[0]
    bound = plan.bind(LayerConfig(QuantSpec(plan.method), 64, 32, name="l"), Target("cpu"))
    assert isinstance(bound, BoundPlan)
    back = _round_trip(bound)
    assert back == bound and hash(back) == hash(bound)


def test_a_parameterized_stage_is_one_definition_whose_parameters_are_its_value():
    """One registered name, one definition: values differ only by their parameters,
    which show in the repr; equal parameters (positional, keyword or by default) give
    equal stages."""
    assert isinstance(marlin.repack_stage, StageDef)
    assert registered_stages()["marlin.repack"] is marlin.repack_stage
    a = marlin.repack_stage("qweight")
    assert a == marlin.repack_stage(w_q="qweight", n_major=False)
    assert hash(a) == hash(marlin.repack_stage("qweight", n_major=False))
    assert a != marlin.repack_stage("qweight", n_major=True)
    assert (("w_q", "qweight"), ("n_major", False)) == a.params
    assert "params=(('w_q', 'qweight'), ('n_major', False))" in repr(a)
    assert ("qweight",) == a.reads == a.writes
    assert (
        frozenset({"weight_zero_point"})
        == cpu_wna16.transpose_zero_points("weight_zero_point", asymmetric_only=True).optional
    )
    assert frozenset() == cpu_wna16.transpose_zero_points("qzeros").optional
    with pytest.raises(TypeError):
        marlin.repack_stage("qweight", bogus=True)
