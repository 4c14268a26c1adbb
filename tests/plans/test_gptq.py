"""wcache/plans/gptq.py: which GPTQ plan (CPUWNA16 w4a16 or w4a8) each CPU target
selects, the refusals with their reasons, and restores the export or the record does
not match (a missing tensor, a record of a stage the plan lacks). The properties every
CPU plan shares are in tests/plans/test_cpu_plan_properties.py; the CUDA GPTQ plans are
in test_marlin.py and test_machete.py."""

from __future__ import annotations

import pytest

from wcache.core import QuantSpec, RecordedMismatch, RestoreIncomplete
from wcache.plans import plan_for

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import AVX2, AVX512, HOST
from tests.helpers.cpu_plans import (
    assert_refused,
    assert_resolves,
    exported_layer,
    host_plan,
    restore_synced_,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


@pytest.mark.parametrize(
    "spec,config_kw,target,plan_id",
    [
        (QuantSpec("gptq", num_bits=4, group_size=128), {}, AVX512, "gptq/cpu_wna16@1"),
        # RISC-V with bf16 activations: the w4a8 layout
        (
            QuantSpec("gptq", num_bits=4),
            {},
            vl.synthetic_target(("riscv",)),
            "gptq/cpu_wna16_w4a8@1",
        ),
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for picks the GPTQ layout for the kernel decisions the Target records."""
    assert_resolves(spec, config_kw, target, plan_id)


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
        (QuantSpec("gptq", num_bits=8, group_size=128), (256, 128), AVX512, "GPTQ int8 on CPU"),
        (QuantSpec("gptq", num_bits=4, group_size=64), (256, 128), AVX2, "cpu_gemm_wna16"),
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """GPTQ int8 on CPU and a host without vLLM's CPUWNA16 op raise NoPlan with the reason."""
    assert_refused(spec, size, target, message)


def test_restore_missing_tensor_raises_incomplete():
    """A restore whose export lacks a tensor the plan reads raises RestoreIncomplete
    (the w4a16 layout: its restore reads the scales for isa_hint)."""
    case = vl.gptq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan  # plain torch: runs on any host
    engine, prepared = exported_layer(case, plan, target=AVX512)
    del engine._parameters["scales"]
    with pytest.raises(RestoreIncomplete, match="scales"):
        restore_synced_(
            engine,
            plan.bind(case.config, AVX512),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


def test_recorded_values_for_unknown_stage_raise():
    """Records naming a stage the plan lacks mean daemon and engine differ: raise."""
    case = vl.gptq_linear(128, 64, 32)
    plan = host_plan(case)
    engine, prepared = exported_layer(case, plan)
    recorded = {**prepared.recorded, "marlin.repack": {"x": 1}}
    with pytest.raises(RecordedMismatch, match="marlin.repack"):
        restore_synced_(engine, plan.bind(case.config, HOST), recorded, drops=prepared.drops)
