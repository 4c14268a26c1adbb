"""Sleep mode on restored CUDA engines (H200, vLLM 0.33.0): issue 44, item 4.

A ``zero_copy`` engine (``cuda_vmm``, the default) with ``enable_sleep_mode`` is
refused at load with ``update-unsupported`` naming the fix (``mode='copy'``): the
daemon's memory is outside vLLM's CuMem pool, so sleep could neither offload nor
free it. A ``mode='copy'`` engine restored from the same daemon sleeps and wakes 20
times at level 1 and 20 times at level 2 (tests/gpu_engine/_sleep_engine.py, CUDA
graphs on): after every wake its greedy tokens equal its first ones, which equal a
disk engine's; the device memory the engine process uses after each wake (NVML where it
lists the process, else what its allocators hold: either way other work on the GPU does
not move it; the gVisor one-GPU kind hides the process from NVML) and the host RSS stay within
:data:`DEVICE_SLACK_BYTES` / :data:`HOST_SLACK_BYTES` of the first wake's.

Run on the H200: ``bash tools/gpu/run-tier.sh -k sleep_engines`` or, after
``source tools/gpu/env.sh``, ``python -m pytest tests/gpu_engine/test_sleep_engines.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.engine_script import run_engine_script
from wcache.daemon.process import DaemonProcess

SCRIPT = Path(__file__).with_name("_sleep_engine.py")
SERVE_ARGS = ("--attention-backend", "TRITON_ATTN")
CYCLES = 20
LEVELS = (1, 2)
#: Allowed growth of device memory in use after a wake over the first wake's (bytes):
#: allocator rounding and graph pools, far below one copy of SmolLM2's weights
#: (~270 MiB), so a leaked copy per cycle fails within two cycles.
DEVICE_SLACK_BYTES = 128 << 20
#: Allowed growth of host RSS over the first wake's (bytes): level 1's pinned
#: weight copy is freed on wake; a leaked one per cycle would exceed this in 3 cycles.
HOST_SLACK_BYTES = 512 << 20


def _engine(model: str, load_format: str, extra: dict, level: int, cycles: int) -> dict:
    args = ["--model", model, "--load-format", load_format, "--extra", json.dumps(extra)]
    args += ["--level", str(level), "--cycles", str(cycles)]
    return run_engine_script(SCRIPT, args, load_format).result


@pytest.fixture(scope="module")
def runs() -> dict:
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    out = {"disk": _engine(model, "auto", {}, 1, 0)}
    with tempfile.TemporaryDirectory(prefix="wc-sleep-gpu-") as sock:
        with DaemonProcess(model, sock, extra_args=SERVE_ARGS):
            zero_copy = {"socket_dir": sock, "fallback": False}
            out["zero_copy"] = _engine(model, "wcache", zero_copy, 1, 0)
            copy = {**zero_copy, "mode": "copy"}
            for level in LEVELS:
                out[level] = _engine(model, "wcache", copy, level, CYCLES)
    return out


def test_zero_copy_sleep_is_refused_at_load_naming_copy(runs):
    """A zero_copy engine with sleep mode is refused at load (update-unsupported), naming mode='copy'."""
    assert runs["zero_copy"]["refused"] in ("update-unsupported", "RestoreFailed")
    assert "update-unsupported" in runs["zero_copy"]["message"]
    assert "mode='copy'" in runs["zero_copy"]["message"]


@pytest.mark.parametrize("level", LEVELS)
def test_copy_engine_wakes_with_its_first_tokens(runs, level):
    """Every wake of a mode='copy' engine gives its first tokens, which are the disk engine's."""
    run = runs[level]
    assert run["first"] == runs["disk"]["first"]
    assert len(run["cycles"]) == CYCLES
    assert [c["tokens"] for c in run["cycles"]] == [run["first"]] * CYCLES


@pytest.mark.parametrize("level", LEVELS)
def test_copy_engine_memory_stays_bounded_per_cycle(runs, level):
    """Device memory in use and host RSS after each wake stay within a fixed slack of the first wake's."""
    awake = [c["awake"] for c in runs[level]["cycles"]]
    print(json.dumps({"level": level, "per_cycle": awake}))  # the figures, in the tier log
    first = awake[0]
    assert max(a["device_used"] for a in awake) - first["device_used"] <= DEVICE_SLACK_BYTES
    assert max(a["host_rss"] for a in awake) - first["host_rss"] <= HOST_SLACK_BYTES
    # asleep, the engine's weights and KV cache are off the device
    assert all(
        c["asleep"]["device_used"] < c["awake"]["device_used"] for c in runs[level]["cycles"]
    )
