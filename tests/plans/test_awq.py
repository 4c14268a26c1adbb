"""wcache/plans/awq.py: which AWQ plan (CPUWNA16 w4a16 or w4a8) each CPU target
selects, the refusals with their reasons, the restore's checks of what the daemon
recorded (``use_w4a8``, ``isa_hint``, a layout from another host), and the guard
against mis-tagged stages, shown on the AWQ plan's stages. The properties every CPU
plan shares are in tests/plans/test_cpu_plan_properties.py; the CUDA AWQ plans are in
test_marlin.py and test_machete.py."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve

from wcache.core import (
    LayerConfig,
    Plan,
    PlanInvalid,
    QuantSpec,
    RecordedMismatch,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
)
from wcache.plans import plan_for
from wcache.shell import snapshot
from wcache.stages import cpu_wna16
from wcache.testing.plans import UncheckedPlan, unregistered_stage

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import (
    AMX,
    AMX_W4A8_OFF,
    AVX2,
    AVX512,
    HOST,
    HOST_LIBRARY,
    HOST_W4A16,
    dict_diff,
)
from tests.helpers.cpu_plans import (
    assert_refused,
    assert_resolves,
    exported_layer,
    load_synced_,
    restore_synced_,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


def _awq_spec():
    return QuantSpec("awq", num_bits=4, group_size=64, zero_point=True)


@pytest.mark.parametrize(
    "spec,config_kw,target,plan_id",
    [
        (
            QuantSpec("awq", num_bits=4, group_size=128, zero_point=True),
            {},
            AVX512,
            "awq/cpu_wna16@1",
        ),
        (
            QuantSpec("awq", num_bits=4, group_size=128, zero_point=True),
            {},
            AMX_W4A8_OFF,
            "awq/cpu_wna16@1",
        ),
        # AMX with bf16 activations and VLLM_CPU_INT4_W4A8 on: the w4a8 layout
        (
            QuantSpec("awq", num_bits=4, group_size=64, zero_point=True),
            {},
            AMX,
            "awq/cpu_wna16_w4a8@1",
        ),
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for picks the AWQ layout for the kernel decisions the Target records."""
    assert_resolves(spec, config_kw, target, plan_id)


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
        # vLLM's convert_weight_packed_scale_zp blocks K by min(group, 128): it fails itself
        (
            QuantSpec("awq", num_bits=4, group_size=-1, zero_point=True),
            (192, 128),
            AMX,
            "convert_weight_packed_scale_zp cannot block size_k 192",
        ),
        (
            _awq_spec(),
            (256, 128),
            vl.synthetic_target(
                ("amx", "avx512", "avx512_bf16"), **{"op.int4_scaled_mm_cpu": "absent"}
            ),
            r"no torch.ops._C.int4_scaled_mm_cpu \(CPUWNA16LinearKernel \(w4a8\)",
        ),
        (
            QuantSpec("awq", num_bits=4, group_size=64, zero_point=False),
            (256, 128),
            AVX512,
            "without zero points",
        ),
        (_awq_spec(), (256, 100), AVX512, "size_n % 32"),
        (
            _awq_spec(),
            (256, 128),
            AVX2,
            r"_C_AVX2 on this host has no torch.ops._C.cpu_gemm_wna16 \(CPUWNA16LinearKernel",
        ),
        (_awq_spec(), (256, 128), Target("cpu"), "records no vLLM kernel decisions"),
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """Unsupported AWQ layouts, kernel decisions and targets raise NoPlan with the reason."""
    assert_refused(spec, size, target, message)


@pytest.mark.parametrize(
    "target,stage_name,key,value",
    [
        (AVX512, "cpu_wna16.set_use_w4a8", "use_w4a8", True),
        (AVX512, "cpu_wna16.set_isa_hint", "isa_hint", "vsx"),  # no x86 host records vsx
        (AMX, "cpu_wna16.set_use_w4a8", "use_w4a8", False),
    ],
    ids=["w4a16-use_w4a8", "w4a16-isa_hint", "w4a8-use_w4a8"],
)
def test_restore_recorded_mismatch(target, stage_name, key, value):
    """A daemon record of use_w4a8/isa_hint that differs from the target's raises
    (both CPUWNA16 layouts; the w4a8 prepare needs vLLM's ``_C`` op)."""
    if target is AMX and HOST.kernel("op.convert_weight_packed_scale_zp") != "present":
        pytest.skip(f"vLLM's {HOST_LIBRARY} has no torch.ops._C.convert_weight_packed_scale_zp")
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=target).plan
    engine, prepared = exported_layer(case, plan, target=target)
    recorded = {k: dict(v) for k, v in prepared.recorded.items()}
    assert recorded[stage_name][key] != value
    recorded[stage_name][key] = value
    with pytest.raises(RecordedMismatch, match=key):
        restore_synced_(
            engine, plan.bind(case.config, target), recorded, strict=True, drops=prepared.drops
        )


def test_restore_on_other_isa_raises_recorded_mismatch():
    """Bytes prepared on a non-AMX host restored on an AMX host (w4a8 off) raise
    RecordedMismatch on isa_hint ("vec" recorded, "amx" there)."""
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan
    engine, prepared = exported_layer(case, plan, target=AVX512)
    with pytest.raises(RecordedMismatch, match="isa_hint"):
        restore_synced_(
            engine, plan.bind(case.config, AMX_W4A8_OFF), prepared.recorded, drops=prepared.drops
        )


def test_w4a16_bytes_on_a_w4a8_host_raise_recorded_mismatch():
    """w4a16 bytes (prepared for a non-AMX host) restored with the plan an AMX host
    resolves (w4a8 layout) raise RecordedMismatch: the record names set_isa_hint,
    which the w4a8 plan lacks, so the engine never reads w4a16 bytes as w4a8."""
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan
    engine, prepared = exported_layer(case, plan, target=AVX512)
    amx_plan = plan_for(case.config, target=AMX).plan
    assert "awq/cpu_wna16_w4a8@1" == amx_plan.id
    with pytest.raises(RecordedMismatch, match="cpu_wna16.set_isa_hint"):
        restore_synced_(
            engine, amx_plan.bind(case.config, AMX), prepared.recorded, drops=prepared.drops
        )


def _awq_plan(*stages_, unchecked=False) -> Plan:
    cls = UncheckedPlan if unchecked else Plan
    return cls(
        method="awq",
        kernel="cpu_wna16_test",
        stages=stages_,
        checkpoint={"qweight", "qzeros", "scales", "bias"},
    )


def _awq_stages():
    """The AWQ plan's w4a16 stages (resolved for an AVX512 host: the guard tests below
    run them without vLLM's GEMM, so they hold on hosts whose vLLM lacks cpu_gemm_wna16;
    they bind HOST_W4A16, where the w4a16 layout is vLLM's choice on any host)."""
    return list(plan_for(LayerConfig(_awq_spec(), 128, 64), target=AVX512).stages)


def test_transform_mistagged_metadata_is_invalid():
    """A TRANSFORM re-tagged METADATA (so restore would replay it) is refused at build."""
    stages_ = _awq_stages()
    stages_[0] = evolve(stages_[0], tag=Tag.METADATA)
    with pytest.raises(PlanInvalid, match="awq.convert_to_standard"):
        _awq_plan(*stages_)


def test_allocate_writing_exported_tensor_is_invalid_and_guarded():
    """An ALLOCATE stage writing an exported tensor is refused at build; forced through,
    restore raises RestoreWroteSharedTensor."""

    @unregistered_stage(
        "cpu_wna16.alloc_scales", Tag.ALLOCATE, reads=("scales",), writes=("scales",)
    )
    def bad(tensors, config, target, recorded):
        return StageOut(tensors={"scales": torch.ones_like(tensors["scales"])})

    with pytest.raises(PlanInvalid, match="alloc_scales"):
        _awq_plan(*_awq_stages(), bad)
    case = vl.awq_linear(128, 64, 32)
    plan = _awq_plan(*_awq_stages(), bad, unchecked=True)
    engine, prepared = exported_layer(case, plan, target=HOST_W4A16)
    with pytest.raises(RestoreWroteSharedTensor, match="scales"):
        restore_synced_(
            engine,
            plan.bind(case.config, HOST_W4A16),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


@pytest.mark.parametrize("via_data", [False, True])
def test_metadata_writing_in_place_is_caught(via_data):
    """A METADATA stage that writes shared bytes in place fails the restore guard, by
    version counter or (through ``.data``, which hides it) by checksum."""

    @unregistered_stage("cpu_wna16.set_scales_in_place", Tag.METADATA, reads=("scales",))
    def sneaky(tensors, config, target, recorded):
        (tensors["scales"].data if via_data else tensors["scales"]).mul_(2)
        return StageOut()

    case = vl.awq_linear(128, 64, 32)
    plan = _awq_plan(*_awq_stages())
    engine, prepared = exported_layer(case, plan, target=HOST_W4A16)
    bad_plan = _awq_plan(*_awq_stages(), sneaky)
    with pytest.raises(RestoreWroteSharedTensor, match="scales"):
        restore_synced_(
            engine,
            bad_plan.bind(case.config, HOST_W4A16),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


def test_metadata_folded_into_transform_fails_invariant():
    """Folding set_isa_hint into the repack TRANSFORM passes load but the restored layer
    lacks isa_hint: the snapshots differ."""
    repack = cpu_wna16.repack("qweight")

    @unregistered_stage(
        "cpu_wna16.repack",
        Tag.TRANSFORM,
        reads=("qweight", "scales"),
        writes=("qweight",),
        attrs=("isa_hint",),
    )
    def folded(tensors, config, target, recorded):
        out = repack(tensors, config, target, recorded)
        return evolve(
            out, attrs={"isa_hint": cpu_wna16.isa_hint_for(tensors["scales"].dtype, target)}
        )

    stages_ = [
        s for s in _awq_stages() if s.name not in ("cpu_wna16.set_isa_hint", "cpu_wna16.repack")
    ] + [folded]
    plan = _awq_plan(*stages_)
    case = vl.awq_linear(128, 64, 32)
    loaded, expected = case.new_layer(), case.new_layer()
    load_synced_(loaded, plan.bind(case.config, HOST_W4A16))
    with pytest.MonkeyPatch.context() as mp:  # vLLM's w4a16 layout, as HOST_W4A16
        mp.setenv(cpu_wna16.W4A8_ENV, "0")
        case.vllm_process(expected)
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    engine, prepared = exported_layer(case, plan, target=HOST_W4A16)
    restore_synced_(
        engine,
        plan.bind(case.config, HOST_W4A16),
        prepared.recorded,
        strict=True,
        drops=prepared.drops,
    )
    diff = dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert {"@isa_hint": (loaded.isa_hint, "<missing>")} == diff
