"""wcache/plans/hosts.py: the reference host classes' kernel decisions build the CPU
Targets the plan docs and plan-match tests use: AVX512-BF16 first, AMX's differences
over them, explicit decisions last, and the tables name exactly the decisions vLLM's
probe reports on a real host."""

from __future__ import annotations

import pytest

from wcache.plans import hosts


def test_reference_target_is_the_avx512_bf16_host_by_default():
    """With no arguments: a CPU target with the AVX512-BF16 ISA and that table's decisions."""
    target = hosts.reference_target()
    assert ("cpu", frozenset({"avx512", "avx512_bf16"})) == (target.device_type, target.isa)
    assert hosts.AVX512_BF16 == dict(target.kernels)


def test_amx_in_the_isa_applies_amx_decisions_over_avx512():
    """An ISA naming amx takes AMX's SGL decisions and keeps every other AVX512-BF16 one."""
    target = hosts.reference_target(("avx512", "avx512_bf16", "amx"))
    assert {**hosts.AVX512_BF16, **hosts.AMX} == dict(target.kernels)
    assert "sgl" == target.kernel("unquantized_gemm[bfloat16,sgl_shape]")
    assert "onednn" == target.kernel("unquantized_gemm[bfloat16]")


def test_explicit_decisions_override_the_tables():
    """Decisions passed by name (the AVX2 table, one GEMM) win over the host class's."""
    avx2 = hosts.reference_target((), **hosts.AVX2)
    assert hosts.AVX2 == dict(avx2.kernels)
    assert frozenset() == avx2.isa
    zen = hosts.reference_target(**{"unquantized_gemm[bfloat16]": "zentorch"})
    assert "zentorch" == zen.kernel("unquantized_gemm[bfloat16]")
    assert "onednn" == zen.kernel("unquantized_gemm[float32]")


def test_env_is_carried_onto_the_target():
    """The env a reference target is built with is the target's (kernel-selection switches)."""
    target = hosts.reference_target(env={"VLLM_CPU_INT4_W4A8": "0"})
    assert {"VLLM_CPU_INT4_W4A8": "0"} == dict(target.env)


@pytest.mark.parametrize("table", ["AVX512_BF16", "AVX2"])
def test_the_tables_name_the_decisions_the_probe_reports(table):
    """Each full host table has exactly the keys vLLM's probe reports on this host (none
    missing, none stale); the AMX table only overrides keys of the others."""
    pytest.importorskip("vllm")
    from wcache.vllm.probe import host_target

    probed = set(dict(host_target("cpu", env={}).kernels))
    assert probed == set(getattr(hosts, table))
    assert set(hosts.AMX) <= probed
