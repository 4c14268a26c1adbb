"""wcache/plans/machete.py: wcache follows vLLM's kernel choice (VLLM_DISABLED_KERNELS
gives Marlin; a plain spec gets Marlin, Machete only when named), and the refusals
(a CPU target, asymmetric GPTQ) name their reasons. The contracts are rows of
tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest
from attrs import evolve

from tests.helpers.cuda_cases import H200, MACHETE_EXTRA, cuda_config
from wcache.core import NoPlan, QuantSpec, Target
from wcache.plans import machete as machete_plans
from wcache.plans import marlin as marlin_plans
from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers.cpu_cases import AVX512
from tests.helpers.cpu_plans import assert_refused
from tests.helpers.cuda_contracts import adapter_plan, marlin_case


def test_machete_disabled_by_vllms_switch_gives_marlin(simulated_cuda, monkeypatch):
    """With vLLM's own VLLM_DISABLED_KERNELS=MacheteLinearKernel a Machete shape gets
    MarlinLinearKernel from vLLM, and the adapter the Marlin plan (wcache follows the
    layer, it does not re-derive the choice)."""
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import (
        MarlinLinearKernel,
    )

    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "MacheteLinearKernel")
    case = marlin_case("awq", 256, 256, 128)
    layer = case.new_layer("cpu", seed=0)
    assert type(layer.quant_method.kernel) is MarlinLinearKernel
    adapter_plan(layer, "awq/marlin@1")


def test_plain_spec_without_kernel_gets_marlin_and_machete_only_when_named():
    """wcache does not re-derive vLLM's kernel choice: a plain spec without a kernel
    resolves Marlin on sm90 (the Machete plan names its reason), and kernel='machete'
    (what the adapter records when vLLM picked Machete) resolves the Machete plan."""
    cfg = evolve(cuda_config("gptq", 128, 128, bits=4, g=64), quant=QuantSpec("gptq", 4, 64))
    assert plan_for(cfg, target=H200).plan is marlin_plans.GPTQ
    named = evolve(cfg, quant=evolve(cfg.quant, kernel="machete"), extra=MACHETE_EXTRA)
    assert plan_for(named, target=H200).plan is machete_plans.GPTQ
    with pytest.raises(NoPlan, match="MacheteLinearKernel"):
        plan_for(evolve(named, extra=()), target=H200).plan
    with pytest.raises(NoPlan, match="sm90"):
        plan_for(named, target=Target("cuda", (10, 0))).plan


@pytest.mark.parametrize(
    "cfg,target,reason",
    [
        (
            cuda_config(
                "gptq", 128, 128, bits=4, g=64, zp=True, kernel="machete", extra=MACHETE_EXTRA
            ),
            H200,
            "asymmetric GPTQ",
        ),
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Asymmetric GPTQ on Machete raises NoPlan naming the reason (vLLM's GPTQ is symmetric)."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
        (
            QuantSpec("awq", num_bits=4, zero_point=True, kernel="machete"),
            (256, 128),
            AVX512,
            "Machete is a CUDA kernel; the target is cpu",
        ),
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """A Machete layer on a CPU target raises NoPlan naming the device."""
    assert_refused(spec, size, target, message)
