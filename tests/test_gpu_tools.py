"""The H200 harness scripts (tools/gpu) parse, and refuse bad use with a message,
on any machine (the GPU steps themselves run on the H200: docs/gpu.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"
SCRIPTS = sorted(TOOLS.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    """bash -n accepts every harness script."""
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_build_bundle_needs_a_version_and_its_pins(tmp_path):
    """build-bundle.sh without a version names the argument; with a version that has
    no pin list it says which file to write (before any download)."""
    script = str(TOOLS / "build-bundle.sh")
    none = subprocess.run(["bash", script], capture_output=True, text=True)
    assert none.returncode != 0 and "vLLM version" in none.stderr
    unknown = subprocess.run(["bash", script, "9.9.9", str(tmp_path)], capture_output=True,
                             text=True)
    assert unknown.returncode == 2 and "deps-vllm-9.9.9.txt" in unknown.stderr


def test_device_setup_names_missing_chunks(tmp_path):
    """device-setup.sh on a machine that received no chunks says so and exits 2."""
    sha = tmp_path / "bundle.sha"
    sha.write_text("0" * 64 + "\n")
    env = {"PATH": "/usr/bin:/bin", "WCACHE_GPU_SITE": str(tmp_path / "site"),
           "WCACHE_GPU_RECV": str(tmp_path / "recv")}
    out = subprocess.run(["bash", str(TOOLS / "device-setup.sh"), str(sha)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "no chunks" in out.stderr


def test_env_sets_what_the_bundle_needs():
    """env.sh turns off vLLM's FlashInfer sampler (the bundle has no FlashInfer: without
    it every engine failed at start on the H200) and keeps NVLink multicast off."""
    out = subprocess.run(["bash", "-c", f"source {TOOLS / 'env.sh'}; echo "
                          "$VLLM_USE_FLASHINFER_SAMPLER $NCCL_NVLS_ENABLE"],
                         capture_output=True, text=True)
    assert out.stdout.split() == ["0", "0"]
