"""LoRA on restored CUDA engines (H200, vLLM 0.33.0): issue 44, item 2.

Per checkpoint (SmolLM2 bf16, vLLM's serialized FP8, AWQ int4 on Marlin) one daemon,
started without LoRA arguments, serves a LoRA engine (``enable_lora=True``, CUDA graphs
on: cudagraph_mode FULL, no compile) restored with fallback off; a disk-loaded LoRA
engine with the same graphs mode gets the same random rank-8 adapter on
q/v/down_proj (:mod:`wcache.testing.lora`). Both run tests/e2e/_lora_engine.py:
greedy tokens without an adapter, with a ``LoRARequest`` and without again, and what
LoRA reads from each base layer it wraps (``_get_lora_device``, the base layer's
tensors or None, partition sizes, the stacked LoRA buffers). For bf16 a plain engine
restores from the same daemon too (the key holds no LoRA setting), and, one engine
each, a LoRA engine restored with ``mode=copy`` from that daemon and one restored from
a second daemon forced onto the ``cuda_ipc`` transport
(tests/gpu_engine/_serve_cuda_ipc.py): the quickstart table's ``copy`` and
``cuda_ipc`` cells.

Run on the H200: ``bash tools/gpu/run-tier.sh -k lora_engines`` or, after
``source tools/gpu/env.sh``, ``python -m pytest tests/gpu_engine/test_lora_engines.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.engine_script import run_engine_script
from wcache.daemon.process import DaemonProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "_lora_engine.py"
#: The daemon builds the model's attention layers too (wcache.testing.engine_acceptance).
SERVE_ARGS = ("--attention-backend", "TRITON_ATTN")
#: bf16; vLLM's serialized FP8 (CUTLASS on sm90); AWQ int4 (vLLM picks awq_marlin).
FORMATS = ("bf16", "fp8", "awq")
MODE = "graphs"
#: ``wcache serve`` with cuda_vmm reported missing: the daemon serves over cuda_ipc.
IPC_SERVE = Path(__file__).with_name("_serve_cuda_ipc.py")
#: One results row per test (tests/gpu_engine/conftest.py), as lora/<test name>.
RESULT_PREFIX = "lora"
#: The restored variants beyond the default (cuda_vmm, zero_copy), bf16 only.
VARIANTS = ("copy", "cuda_ipc")
#: SmolLM2-135M's decoder layers; LoRA wraps qkv_proj (q/v slices) and down_proj in each.
NUM_LAYERS = 30
WRAPPED = ("qkv_proj", "down_proj")


def _engine(model: str, adapter: str, load_format: str, extra: dict, *flags: str) -> dict:
    args = ["--model", model, "--adapter", adapter, "--load-format", load_format]
    args += ["--extra", json.dumps(extra), "--device", "cuda", "--mode", MODE, *flags]
    return run_engine_script(SCRIPT, args, load_format).result


@pytest.fixture(scope="module", params=FORMATS)
def runs(request, lora_adapter) -> dict:
    from wcache.testing.fixtures import build

    model = str(build(request.param))
    out = {"format": request.param}
    with tempfile.TemporaryDirectory(prefix="wc-lora-gpu-") as sock:
        with DaemonProcess(model, sock, extra_args=SERVE_ARGS):
            extra = {"socket_dir": sock, "fallback": False}
            out["disk"] = _engine(model, lora_adapter, "auto", {})
            out["restored"] = _engine(model, lora_adapter, "wcache", extra)
            if request.param == "bf16":
                out["plain"] = _engine(model, lora_adapter, "wcache", extra, "--no-lora")
                out["copy"] = _engine(model, lora_adapter, "wcache", {**extra, "mode": "copy"})
    if request.param == "bf16":
        with tempfile.TemporaryDirectory(prefix="wc-lora-ipc-") as sock:
            daemon = DaemonProcess(model, sock, extra_args=SERVE_ARGS)
            daemon.args[1:3] = [str(IPC_SERVE)]  # [python, -m, wcache.cli, ...] -> the wrapper
            with daemon:
                extra = {"socket_dir": sock, "fallback": False}
                out["cuda_ipc"] = _engine(model, lora_adapter, "wcache", extra)
    return out


def test_lora_outputs_equal_disk_engine(runs):
    """With and without the LoRARequest, the restored LoRA engine's tokens equal the disk engine's (graphs on)."""
    for key in ("base", "lora", "base_after"):
        assert runs["restored"][key] == runs["disk"][key], key


def test_adapter_takes_effect_and_leaves_base(runs):
    """The adapter changes the tokens, and requests without it get the base tokens back."""
    restored = runs["restored"]
    assert restored["lora"] != restored["base"]
    assert restored["base_after"] == restored["base"]


def test_lora_reads_disk_engine_base_layers(runs):
    """Every LoRA-wrapped layer's base state (tensors or None, sizes, device, stacked buffers) equals the disk engine's."""
    disk, restored = runs["disk"]["layers"], runs["restored"]["layers"]
    assert len([n for n in disk if n.endswith(WRAPPED)]) == NUM_LAYERS * len(WRAPPED)
    assert sorted(disk) == sorted(restored)
    assert {n: r for n, r in restored.items() if r != disk[n]} == {}
    assert {r["lora_device"] for n, r in restored.items() if n.endswith(WRAPPED)} == {"cuda:0"}


def test_one_daemon_serves_lora_and_plain_engines(runs):
    """The daemon that serves the LoRA engine restores a plain engine too, with the same base tokens."""
    if runs["format"] != "bf16":
        pytest.skip("the plain engine runs for bf16 only (one engine start less)")
    assert runs["plain"]["base"] == runs["disk"]["base"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_on_copy_and_cuda_ipc_equals_disk_engine(runs, variant):
    """A LoRA engine restored with mode=copy, and one from a cuda_ipc daemon, give the
    disk engine's tokens with and without the adapter and its base layers' state."""
    if runs["format"] != "bf16":
        pytest.skip("copy and cuda_ipc run for bf16 only (one engine each)")
    disk, restored = runs["disk"], runs[variant]
    for key in ("base", "lora", "base_after"):
        assert restored[key] == disk[key], key
    assert restored["lora"] != restored["base"]
    assert {n: r for n, r in restored["layers"].items() if r != disk["layers"].get(n)} == {}
    assert sorted(restored["layers"]) == sorted(disk["layers"])
