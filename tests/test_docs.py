"""Generated docs stay current."""

from pathlib import Path

from wcache.plans.docs import render_plans

ROOT = Path(__file__).resolve().parents[1]


def test_plans_md_is_current():
    """docs/plans.md equals `wcache plans --markdown` (run `make docs` after changing a plan)."""
    assert (ROOT / "docs" / "plans.md").read_text() == render_plans(markdown=True)


def test_cli_help_lists_every_command(capsys):
    """`wcache --help` names every subcommand an operator needs."""
    import pytest

    from wcache.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("serve", "status", "stop", "plans", "bench", "verify"):
        assert f"wcache {cmd}" in out


def test_every_refusal_probe_is_refused():
    """Each case the issues say must be refused raises NoPlan with a reason (none resolves)."""
    from wcache.plans.docs import REFUSAL_PROBES, refusals

    rows = refusals()
    assert len(rows) == len(REFUSAL_PROBES)
    assert [case for case, reason in rows if reason.startswith("NOT REFUSED")] == []
    assert all(len(reason) > 40 for _, reason in rows)


def test_every_cpu_plan_states_where_it_was_proven():
    """docs/plans.md's proven-on table covers every CPU plan (and names no unknown plan)."""
    from wcache.plans import all_plans
    from wcache.plans.docs import PROVEN_ON

    cpu_kernels = ("onednn", "torch_linear", "sgl", "cpu_wna16", "scales", "default", "cpu_vec",
                   "cpu_amx")
    assert set(PROVEN_ON) == {p.id for p in all_plans() if p.kernel in cpu_kernels}


def test_every_cuda_plan_states_its_contract():
    """docs/plans.md's CUDA table covers every CUDA plan (and names no unknown plan)."""
    from wcache.plans import all_plans
    from wcache.plans.docs import CUDA_CONTRACTS

    cuda_kernels = ("marlin", "cutlass", "cutlass_block", "fp8_marlin", "cutlass_moe", "machete",
                    "cutlass_int8", "triton")
    assert set(CUDA_CONTRACTS) == {p.id for p in all_plans() if p.kernel in cuda_kernels}


def test_plans_host_shows_vllms_decisions_and_plans(capsys):
    """`wcache plans --host` prints this host's probed kernel library and the unquantized
    plan for the bf16 GEMM branch vLLM takes here."""
    import pytest

    pytest.importorskip("vllm")
    from wcache.cli import main
    from wcache.vllm.probe import host_target

    assert 0 == main(["plans", "--host"])
    out = capsys.readouterr().out
    target = host_target("cpu")
    assert "cpu.kernel_library" in out and target.kernel("cpu.kernel_library") in out
    assert f"unquantized/{target.kernel('unquantized_gemm[bfloat16]')}@1" in out


def _python_blocks(text: str) -> list[str]:
    """The bodies of the fenced ```python blocks of a markdown text, in order."""
    import re

    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_readme_example_runs(capsys):
    """README's library example runs as written (wcache.shell's load_/prepare_/restore_ on
    a bound plan) and its own asserts hold; it prints the plan's stage table."""
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert 1 == len(blocks)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_example"})
    assert "### `awq/marlin@1`" in capsys.readouterr().out
