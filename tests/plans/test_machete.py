"""wcache/plans/machete.py: wcache follows vLLM's kernel choice (VLLM_DISABLED_KERNELS
gives Marlin). The contracts are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

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
