"""The GPU measurement modules of the benchmark suite (once tools/ scripts) start and
explain themselves on any machine; their measurements run on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wcache.benchmarks import gpu_costs


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


def test_gpu_costs_help_names_its_three_measurements():
    """`python -m wcache.benchmarks.gpu_costs --help` exits 0 and lists checksum, guard-cold, vmm-steps."""
    out = _run("wcache.benchmarks.gpu_costs", "--help")
    assert 0 == out.returncode and all(
        w in out.stdout for w in ("checksum", "guard-cold", "vmm-steps")
    )


@pytest.mark.parametrize("argv", [[], ["no-such-measurement"], ["checksum", "not-a-size"]])
def test_gpu_costs_refuses_bad_use(argv, capsys):
    """A missing or unknown measurement, or a size that is not a number, is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        gpu_costs.main(argv)
    assert 2 == info.value.code and "usage:" in capsys.readouterr().err


def test_daemon_memory_without_arguments_prints_its_usage():
    """`python -m wcache.benchmarks.daemon_memory` alone prints its usage and exits 2."""
    out = _run("wcache.benchmarks.daemon_memory")
    assert (
        2 == out.returncode and "python3 -m wcache.benchmarks.daemon_memory OUT_DIR" in out.stdout
    )
