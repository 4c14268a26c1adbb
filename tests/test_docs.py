"""The CLI help, `wcache plans --host` and README's example stay current (docs/plans.md,
generated from wcache/plans/docs.py, is checked by tests/plans/test_docs.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_help_lists_every_command(capsys):
    """`wcache --help` names every subcommand an operator needs."""
    import pytest

    from wcache.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("serve", "status", "stop", "plans", "bench", "verify"):
        assert f"wcache {cmd}" in out


def test_every_registered_plan_names_its_devices():
    """Each registered plan runs on CPU or CUDA or both, and its device is in its docs."""
    from wcache.core import DEVICE_TYPES
    from wcache.plans import all_plans

    plans = all_plans()
    assert {"cpu", "cuda"} == {d for p in plans for d in p.devices}
    assert [] == [p.id for p in plans if not set(p.devices) <= set(DEVICE_TYPES)]
    assert [] == [p.id for p in plans if f"Runs on: {', '.join(p.devices)}." not in p.describe()]


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
