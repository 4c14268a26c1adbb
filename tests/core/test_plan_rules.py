"""Every plan rule rejects its invalid plan at construction (one failing plan per rule),
plus the run-time checks that back the static ones, the frozen values, the stage
registry and ``plan_for``'s arguments. Synthetic stages, no vLLM."""

from __future__ import annotations

import types

import pytest
import torch
from attrs import evolve

from wcache.core import (
    STAGE_VERBS,
    LayerConfig,
    Plan,
    PlanInvalid,
    QuantSpec,
    RecordedMismatch,
    StageContractError,
    StageOut,
    Tag,
    Target,
    registered_stages,
    stage,
    stage_name_problem,
)
from wcache.plans import PlanArgumentError, plan_for
from wcache.shell import load_, restore_
from wcache.testing.plans import UncheckedPlan, unregistered_stage

CPU = Target("cpu", None, frozenset({"avx512"}))
CONFIG = LayerConfig(QuantSpec("toy"), size_k=8, size_n=6, name="layer0")
CHECKPOINT = frozenset({"weight", "scales"})


def _out(**kw):
    """A stage function returning ``StageOut(**kw)``."""
    return lambda t, c, tg, r: StageOut(**kw)


def _layer(**tensors: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def _invalid(*stages_, checkpoint=CHECKPOINT) -> str:
    """The PlanInvalid message for a plan of ``stages_``."""
    with pytest.raises(PlanInvalid) as info:
        Plan("toy", "bad", stages_, checkpoint)
    return str(info.value)


# --------------------------------------------------------------------------- rules


def test_a_tag_given_as_a_string_is_invalid():
    """A tag 'metadata' (a str, which would run in no mode) is refused at build and by
    @stage."""
    st_ = unregistered_stage("toy.set_width", "metadata", attrs=("width",))(_out())
    assert "not a Tag" in _invalid(st_)
    with pytest.raises(PlanInvalid, match="not a Tag"):
        stage("toy.set_width_str", "metadata")


@pytest.mark.parametrize("devices", ["rocm", (), ("cpu", "tpu")])
def test_a_device_not_cpu_or_cuda_is_invalid(devices):
    """A plan's devices are a non-empty subset of DEVICE_TYPES; one string is one device."""
    with pytest.raises(PlanInvalid, match="devices"):
        Plan("toy", "bad", (), CHECKPOINT, devices=devices)
    assert ("cuda",) == Plan("toy", "ok", (), CHECKPOINT, devices="cuda").devices
    assert ("cpu", "cuda") == Plan("toy", "ok", (), CHECKPOINT).devices


@pytest.mark.parametrize(
    "name",
    [
        "setwidth",
        "Toy.set_width",
        "toy.SetWidth",
        "toy.set-width",
        "toy.set_width.extra",
        "toy._set",
    ],
)
def test_a_name_not_family_verb_object_is_invalid(name):
    """Stage names are lower snake ``family.verb_object``, at build and at @stage."""
    st_ = unregistered_stage(name, Tag.METADATA, attrs=("width",))(_out())
    assert "family.verb_object" in _invalid(st_)
    with pytest.raises(PlanInvalid, match="family.verb_object"):
        stage(name, Tag.METADATA)


@pytest.mark.parametrize(
    "name, verb",
    [
        ("toy.width", "width"),
        ("toy.scale_weight", "scale"),
        ("nvfp4.alpha", "alpha"),
        ("marlin.fp8_repack", "fp8"),
        ("toy.input_scale_none", "input"),
    ],
)
def test_a_name_not_starting_with_a_stage_verb_is_invalid(name, verb):
    """Well-formed lower snake names whose first word after the dot is not in STAGE_VERBS
    are refused, at build and at @stage, with the rule and the allowed verbs named."""
    assert verb not in STAGE_VERBS
    st_ = unregistered_stage(name, Tag.METADATA, attrs=("width",))(_out())
    msg = _invalid(st_)
    assert f"stage name {name!r} is not family.verb_object: {verb!r} is not a stage verb" in msg
    assert ", ".join(STAGE_VERBS) in msg and "wcache.core.STAGE_VERBS" in msg
    with pytest.raises(PlanInvalid, match=f"{verb!r} is not a stage verb"):
        stage(name, Tag.METADATA)
    assert name not in registered_stages()


@pytest.mark.parametrize(
    "name", ["toy.set", "toy.set_width", "cpu_wna16.repack", "marlin.permute_zero_points"]
)
def test_a_verb_alone_or_followed_by_an_object_is_valid(name):
    """``family.<verb>`` and ``family.<verb>_<object>`` both pass the name rule."""
    assert stage_name_problem(name) is None
    Plan(
        "toy",
        "good",
        (unregistered_stage(name, Tag.METADATA, attrs=("width",))(_out()),),
        CHECKPOINT,
    )


def test_metadata_emptying_a_checkpoint_tensor_through_attrs_is_invalid():
    """A METADATA stage setting ``scales = None`` (dropping a checkpoint tensor through
    attrs) is a tensor write, refused at build."""
    st_ = unregistered_stage("toy.clear_scales", Tag.METADATA, attrs=("scales",))(
        _out(attrs={"scales": None})
    )
    assert "sets tensors ['scales'] through attrs" in _invalid(st_)


def test_metadata_declaring_drops_is_invalid():
    """METADATA may not declare drops (and drops must be declared writes)."""
    st_ = unregistered_stage("toy.drop_scales", Tag.METADATA, drops=("scales",))(_out())
    msg = _invalid(st_)
    assert "declares tensor writes ['scales']" in msg
    assert "drops ['scales'] without declaring them in writes" in msg


def test_replayed_read_of_a_dropped_intermediate_is_unreachable():
    """A METADATA stage reading ``packed``, which a later TRANSFORM drops, would fail
    only at restore; the reachability check refuses it at build."""
    pack = unregistered_stage(
        "toy.pack_weight", Tag.TRANSFORM, reads=("weight",), writes=("packed",)
    )(_out())
    width = unregistered_stage("toy.set_width", Tag.METADATA, reads=("packed",), attrs=("width",))(
        _out()
    )
    drop = unregistered_stage(
        "toy.drop_packed", Tag.TRANSFORM, writes=("packed",), drops=("packed",)
    )(_out(drop=("packed",)))
    msg = _invalid(pack, width, drop)
    assert "'toy.set_width' replays at restore and reads ['packed']" in msg
    Plan("toy", "good", (pack, width), CHECKPOINT)  # without the drop it is reachable


def test_replayed_read_of_an_allocate_output_is_reachable():
    """ALLOCATE outputs are in what a restore has (the rule adds them)."""
    alloc = unregistered_stage("toy.alloc_workspace", Tag.ALLOCATE, writes=("workspace",))(
        _out(tensors={"workspace": torch.zeros(1)})
    )
    derive = unregistered_stage(
        "toy.bind_handle", Tag.DERIVE, reads=("workspace",), attrs=("handle",)
    )(_out())
    Plan("toy", "good", (alloc, derive), CHECKPOINT)
    assert "reads 'workspace'" in _invalid(derive, alloc)


def test_every_violation_is_listed_once_in_one_error():
    """Two broken stages give one PlanInvalid naming both."""
    a = unregistered_stage("toy.clear_scales", Tag.METADATA, attrs=("scales",))(_out())
    b = unregistered_stage("toy.validate_ghost", Tag.VALIDATE, reads=("ghost",))(_out())
    msg = _invalid(a, b)
    assert "toy.clear_scales" in msg and "'ghost'" in msg


# --------------------------------------------------------------------------- run time


def test_records_are_checked_before_the_replay():
    """Values recorded for a stage the plan lacks raise before any stage runs."""
    calls = []

    def fn(t, c, tg, r):
        calls.append(1)
        return StageOut(attrs={"width": 6})

    width = unregistered_stage("toy.set_width", Tag.METADATA, attrs=("width",))(fn)
    plan = Plan("toy", "ok", (width,), CHECKPOINT)
    with pytest.raises(RecordedMismatch, match="toy.other"):
        restore_(_layer(weight=torch.ones(2)), plan.bind(CONFIG, CPU), {"toy.other": {"x": 1}})
    assert [] == calls


def test_an_undeclared_drop_is_a_contract_error():
    """A TRANSFORM dropping a name it declared as a write but not in drops fails at run
    time (the reachability check trusts the declaration)."""
    st_ = unregistered_stage("toy.drop_scales", Tag.TRANSFORM, writes=("scales",))(
        _out(drop=("scales",))
    )
    plan = Plan("toy", "bad", (st_,), CHECKPOINT)
    with pytest.raises(StageContractError, match="without declaring them in drops"):
        load_(_layer(weight=torch.ones(2), scales=torch.ones(2)), plan.bind(CONFIG, CPU))


def test_optional_slot_set_while_the_tensor_exists_is_a_contract_error():
    """A METADATA stage may set an optional tensor slot only when the layer lacks it."""
    st_ = unregistered_stage(
        "toy.clear_scales", Tag.METADATA, attrs=("scales",), optional=("scales",)
    )(_out(attrs={"scales": None}))
    plan = Plan("toy", "ok", (st_,), CHECKPOINT)
    load_(_layer(weight=torch.ones(2)), plan.bind(CONFIG, CPU))  # absent: fine
    with pytest.raises(StageContractError, match="through attrs"):
        load_(_layer(weight=torch.ones(2), scales=torch.ones(2)), plan.bind(CONFIG, CPU))


# --------------------------------------------------------------------------- values


def test_stage_outputs_and_states_hold_frozen_mappings():
    """StageOut and LayerState mappings are read-only (MappingProxyType)."""
    out = StageOut(tensors={"w": torch.ones(1)}, attrs={"a": 1}, record={"r": 2})
    for mapping in (out.tensors, out.attrs, out.record):
        assert isinstance(mapping, types.MappingProxyType)
        with pytest.raises(TypeError):
            mapping["x"] = 0
    state = load_(
        _layer(weight=torch.ones(2)), UncheckedPlan("toy", "ok", (), CHECKPOINT).bind(CONFIG, CPU)
    )
    with pytest.raises(TypeError):
        state.tensors["x"] = torch.ones(1)


def test_stage_equality_includes_the_function():
    """Two stages equal in every declaration but the function differ."""
    a = unregistered_stage("toy.set_width", Tag.METADATA)(_out())
    b = unregistered_stage("toy.set_width", Tag.METADATA)(_out())
    assert a != b
    assert a == evolve(a)


def test_binding_a_second_function_to_a_stage_name_is_an_error():
    """@stage registers one value per name; a second definition under a registered name
    is refused, while a parameterized stage's values (one definition) share the name and
    compare by their parameters."""
    from wcache.stages import cpu_wna16

    @stage("toy.set_registered_once", Tag.METADATA)
    def first(t, c, tg, r):
        return StageOut()

    with pytest.raises(PlanInvalid, match="already bound"):

        @stage("toy.set_registered_once", Tag.METADATA)
        def second(t, c, tg, r):
            return StageOut()

    assert first is registered_stages()["toy.set_registered_once"]
    assert cpu_wna16.repack is registered_stages()["cpu_wna16.repack"]
    assert cpu_wna16.repack("qweight") == cpu_wna16.repack(w_q="qweight")
    assert cpu_wna16.repack("qweight") != cpu_wna16.repack("weight_packed")
    assert (("w_q", "weight_packed"),) == cpu_wna16.repack("weight_packed").params
    assert "params=(('w_q', 'weight_packed'),)" in repr(cpu_wna16.repack("weight_packed"))


# --------------------------------------------------------------------------- plan_for


def test_plan_for_needs_an_explicit_target():
    """No silent CPU default: plan_for without a Target is refused."""
    with pytest.raises(TypeError):
        plan_for(LayerConfig(QuantSpec("awq", num_bits=4, group_size=128), 256, 128))
    with pytest.raises(PlanArgumentError, match="target=Target"):
        plan_for(LayerConfig(QuantSpec("awq", num_bits=4, group_size=128), 256, 128), target="cuda")


def test_plan_for_needs_the_layer_sizes_and_sends_vllm_objects_to_wcache_vllm():
    """A bare QuantSpec needs its LayerConfig; an unknown object is pointed to
    wcache.vllm.plan_for."""
    spec = QuantSpec("awq", num_bits=4, group_size=128, zero_point=True)
    with pytest.raises(PlanArgumentError, match="needs the layer's sizes"):
        plan_for(spec, target=Target("cuda", (8, 9)))
    with pytest.raises(PlanArgumentError, match="wcache.vllm.plan_for"):
        plan_for(object(), target=Target("cuda", (8, 9)))


def test_plan_for_returns_a_plan_bound_to_its_config():
    """The bound plan carries the config and target it was resolved for; a QuantSpec
    with a LayerConfig binds the spec's method."""
    spec = QuantSpec("awq", num_bits=4, group_size=128, zero_point=True)
    target = Target("cuda", (8, 9))
    bound = plan_for(spec, LayerConfig(QuantSpec("other"), 256, 128), target=target)
    assert ("awq/marlin@1", spec, 256, target) == (
        bound.id,
        bound.config.quant,
        bound.config.size_k,
        bound.target,
    )
    assert bound.plan.stages == bound.stages
