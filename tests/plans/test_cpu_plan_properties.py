"""Properties of every CPU plan (unquantized, AWQ, GPTQ, compressed-tensors W4A16 /
W8A8 INT8, KV-cache scales) on real vLLM 0.32 layers: ``plan.load`` equals vLLM's own
post-load (tensors, attributes, ``apply`` output bit for bit), ``restore(export(prepare(x)))``
equals ``load(x)``, stages are pure, restore replays idempotently, plans resolve as
vLLM decides on this host, and every CPU plan is registered and described. What is
particular to one plan module is in tests/plans/test_<module>.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.core import PREPARE_TAGS, LayerConfig, NoPlan, QuantSpec, Tag
from wcache.core.decisions import gemm_decision
from wcache.plans import all_plans, plan_for
from wcache.shell import snapshot, state_from_module
from wcache.stages import cpu_gemm, cpu_wna16

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import (
    AVX512,
    BF16,
    CPU_PLAN_IDS,
    FAMILIES,
    HOST,
    HOST_LIBRARY,
    dict_diff,
)
from tests.helpers.cpu_plans import (
    exported_layer,
    forward,
    host_plan,
    load_synced_,
    restore_synced_,
)
from wcache.vllm import probe

pytestmark = pytest.mark.usefixtures("vllm_world")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8)
@given(data=st.data())
def test_load_matches_vllm(family, data):
    """plan.load gives vLLM's tensors, attributes and bit-identical apply output."""
    case = data.draw(FAMILIES[family])
    plan = host_plan(case)
    expected, actual = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    load_synced_(actual, plan.bind(case.config, HOST))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(actual, case.attr_paths))
    if case.apply is not None:
        assert torch.equal(forward(case, expected), forward(case, actual))


@pytest.mark.parametrize("family", ["awq", "gptq", "ct_w4a16"])
@settings(max_examples=8)
@given(data=st.data())
def test_load_matches_vllm_tensors_where_the_host_cannot_apply(family, data):
    """Where this host's vLLM kernel library lacks ``cpu_gemm_wna16`` (an AVX2-only host,
    where the test above skips these families), plan.load for an AVX512 target still
    gives vLLM's post-load tensors and attributes (values, shapes, strides): vLLM's
    post-load is plain torch here; only ``apply`` needs the kernel. (A host with the op
    is left to the test above: there vLLM's post-load asks the host for AMX itself.)"""
    case = data.draw(FAMILIES[family])
    if cpu_gemm.missing_op_reason(HOST, ("cpu_gemm_wna16",), "CPUWNA16LinearKernel") is None:
        pytest.skip(f"{HOST_LIBRARY} has cpu_gemm_wna16: test_load_matches_vllm covers it")
    plan = plan_for(case.config, target=AVX512).plan
    expected, actual = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    load_synced_(actual, plan.bind(case.config, AVX512))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(actual, case.attr_paths))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8)
@given(data=st.data())
def test_restore_of_export_equals_load(family, data):
    """restore(export(prepare(x))) == load(x): tensors, attributes, apply output."""
    case = data.draw(FAMILIES[family])
    plan = host_plan(case)
    loaded = case.new_layer()
    load_synced_(loaded, plan.bind(case.config, HOST))
    engine, prepared = exported_layer(case, plan)
    restore_synced_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    meta_left = [k for k, v in state_from_module(engine).tensors.items() if v.device.type == "meta"]
    assert [] == meta_left
    if case.apply is not None:
        assert torch.equal(forward(case, loaded), forward(case, engine))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=5)
@given(data=st.data())
def test_prepare_and_load_are_pure(family, data):
    """Running a plan's stages never writes the layer's checkpoint tensors in place."""
    case = data.draw(FAMILIES[family])
    plan = host_plan(case)
    layer = case.new_layer()
    state = state_from_module(layer)
    before = {k: (v.detach().clone(), v._version) for k, v in state.tensors.items()}
    for tags in (PREPARE_TAGS, frozenset(Tag)):
        plan.run(state, case.config, HOST, tags, check_purity=True)
        for k, (copy, version) in before.items():
            assert torch.equal(copy, state.tensors[k]) and version == state.tensors[k]._version


@pytest.mark.parametrize("family", ["awq", "ct_w4a16", "embedding", "kv_cache"])
def test_restore_twice_equals_once(family):
    """Replaying the restore stages a second time changes nothing observable (plans
    whose DERIVE releases the source weight can only be restored once, as in vLLM)."""
    case = {
        "awq": vl.awq_linear(128, 64, 32),
        "ct_w4a16": vl.ct_w4a16_linear(128, 64, 32, False),
        "embedding": vl.unquantized_embedding(100, 64),
        "kv_cache": vl.kv_cache_layer("fp8", 0.5, 0.25, -1.0, 2.0),
    }[family]
    plan = host_plan(case)
    engine, prepared = exported_layer(case, plan)
    restore_synced_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    once = snapshot(engine, case.attr_paths)
    out_once = forward(case, engine)
    restore_synced_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(once, snapshot(engine, case.attr_paths))
    if out_once is not None:
        assert torch.equal(out_once, forward(case, engine))


def test_plan_for_on_this_host_follows_vllms_decisions():
    """On this host, the unquantized plan is the branch vLLM's dispatch took, and the
    CPUWNA16 plans resolve exactly when vLLM's kernel library has cpu_gemm_wna16."""
    for dtype in ("bfloat16", "float16", "float32"):
        config = LayerConfig(QuantSpec("unquantized"), 256, 128, dtype)
        shaped = cpu_gemm.sgl_shape(128, 256, getattr(torch, dtype))
        assert (
            HOST.kernel(gemm_decision(getattr(torch, dtype), shaped))
            == plan_for(config, target=HOST).kernel
        )
    for n, k in ((128, 256), (64, 96), (8, 32)):  # general, SGL-shaped, N < 16
        config = LayerConfig(QuantSpec("unquantized"), k, n, "bfloat16")
        assert (
            probe.unquantized_gemm_kernel(n, k, torch.bfloat16)
            == plan_for(config, target=HOST).kernel
        )
    awq = LayerConfig(QuantSpec("awq", num_bits=4, group_size=64, zero_point=True), 256, 128)
    if HOST.kernel("op.cpu_gemm_wna16") == "present":
        layout = "cpu_wna16_w4a8" if cpu_wna16.use_w4a8_for(BF16, HOST) else "cpu_wna16"
        assert f"awq/{layout}@1" == plan_for(awq, target=HOST).id
    else:
        with pytest.raises(
            NoPlan, match=f"{HOST_LIBRARY} on this host has no torch.ops._C.cpu_gemm_wna16"
        ):
            plan_for(awq, target=HOST)


def test_cpu_plans_registered_with_descriptions_and_sources():
    """Every CPU plan is registered, described, and each stage names its upstream source."""
    plans = {p.id: p for p in all_plans()}
    for plan_id in CPU_PLAN_IDS:
        plan = plans[plan_id]
        assert len(plan.description) > 40, plan_id
        assert all(s.source for s in plan.stages), plan_id
        assert f"`{plan_id}`" in plan.describe()
