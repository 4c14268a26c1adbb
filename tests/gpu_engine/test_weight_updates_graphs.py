"""Weight updates on a restored CUDA engine with CUDA graphs and torch.compile (H200):
issue 44, item 1.

Every engine runs tests/e2e/_update_engine.py (SmolLM2 bf16, vLLM's update paths:
``model.load_weights`` through ``collective_rpc``, ``reload_weights`` with an
iterator in checkpoint and in kernel format, and from disk), recording the greedy
tokens after each step and every parameter whose ``data_ptr()`` a step changed:

* a disk engine with CUDA graphs (``graphs``: cudagraph_mode FULL, no compile) and
  one compiled (``compiled``: vLLM's defaults, torch.compile + graphs): the reference;
* a ``cuda_vmm`` daemon (the default transport): restored engines in both modes must
  give the disk engine's tokens after every step, with no parameter's address
  changed (the arena is privatized in place); then a second engine attached to the
  same daemon gives the original tokens, and the daemon's bytes are unchanged;
* a ``cuda_ipc`` daemon (forced: tests/gpu_engine/_serve_cuda_ipc.py): a restored
  engine with graphs refuses every update with ``update-unsupported`` before any
  write, keeps serving its original tokens, no address changes; a second engine and
  the daemon's bytes are unchanged too.

On main before issue 44 this fails: there the loader privatized by
``t.data = t.data.clone()``, so every updated parameter's ``data_ptr()`` changed
(``ptrs_changed`` non-empty), the captured graphs kept reading the daemon's bytes and
the restored engine's tokens after an update stayed the baseline's (not the disk
engine's); and the ``cuda_ipc`` engine raised nothing (no ``errors``).

Run on the H200: ``bash tools/gpu/run-tier.sh -k weight_updates_graphs`` or, after
``source tools/gpu/env.sh``, ``python -m pytest tests/gpu_engine/test_weight_updates_graphs.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers.engine_script import run_engine_script
from wcache.core import tensor_checksum
from wcache.daemon.process import DaemonProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "_update_engine.py"
IPC_SERVE = Path(__file__).with_name("_serve_cuda_ipc.py")
UPDATES = ("load_weights", "reload_iterator", "reload_kernel_format", "reload_disk")
#: Updates that change the tokens (reload_disk gives the checkpoint's weights back).
CHANGING = ("load_weights", "reload_iterator", "reload_kernel_format")
#: The daemon builds the model's attention layers too (wcache.testing.engine_acceptance).
SERVE_ARGS = ("--attention-backend", "TRITON_ATTN")
MODES = ("graphs", "compiled")


def _engine(
    model: Path,
    load_format: str,
    extra: dict,
    mode: str,
    steps: tuple[str, ...] = ("baseline", *UPDATES),
) -> dict:
    args = ["--model", str(model), "--load-format", load_format, "--extra", json.dumps(extra)]
    args += ["--device", "cuda", "--mode", mode, "--steps", ",".join(steps)]
    return run_engine_script(SCRIPT, args, f"{load_format} {mode}").result


def _daemon_checksums(socket_dir: str) -> tuple[str, dict[str, str]]:
    """The daemon's transport and every tensor's checksum, attached from this process."""
    from wcache.store import CacheKey, attach, daemon_status
    from wcache.store.paths import list_sockets

    (sock,) = list_sockets(socket_dir)
    status = daemon_status(sock)
    with attach(
        CacheKey(status["key_fields"]),
        socket_dir=socket_dir,
        device="cuda",
        device_id=status["device_id"],
    ) as att:
        return status["transport"], {n: tensor_checksum(t) for n, t in att.tensors.items()}


def _serve(model: Path, sock: str, *, ipc: bool) -> DaemonProcess:
    daemon = DaemonProcess(model, sock, extra_args=SERVE_ARGS)
    if ipc:  # [python, -m, wcache.cli, serve, ...] -> [python, _serve_cuda_ipc.py, serve, ...]
        daemon.args[1:3] = [str(IPC_SERVE)]
    return daemon


def _restored(model: Path, *, ipc: bool, modes: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory(prefix="wc-upd-gpu-") as sock:
        with _serve(model, sock, ipc=ipc):
            transport, before = _daemon_checksums(sock)
            extra = {"socket_dir": sock, "fallback": False}
            runs = {mode: _engine(model, "wcache", extra, mode) for mode in modes}
            second = _engine(model, "wcache", extra, "graphs", steps=("baseline",))
            _, after = _daemon_checksums(sock)
    return {
        "transport": transport,
        "runs": runs,
        "second": second,
        "before": before,
        "after": after,
    }


@pytest.fixture(scope="module")
def model() -> Path:
    from wcache.testing.fixtures import build

    return build("bf16")


@pytest.fixture(scope="module")
def disk(model) -> dict:
    return {mode: _engine(model, "auto", {}, mode) for mode in MODES}


@pytest.fixture(scope="module")
def vmm(model) -> dict:
    return _restored(model, ipc=False, modes=MODES)


@pytest.fixture(scope="module")
def ipc(model) -> dict:
    return _restored(model, ipc=True, modes=("graphs",))


def test_disk_reference_runs_with_graphs_and_each_update_takes_effect(disk):
    """The disk engines capture graphs (and one compiles), every update changes the
    tokens, reloading from disk gives the baseline back, no address changes."""
    assert disk["graphs"]["engine"]["cudagraph_mode"] != "NONE"
    assert disk["compiled"]["engine"]["compilation_mode"] != "NONE"
    for mode, run in disk.items():
        steps = run["steps"]
        assert run["errors"] == {}, mode
        for step in CHANGING:
            assert steps[step] != steps["baseline"], (mode, step)
        assert steps["reload_disk"] == steps["baseline"], mode
        assert not any(run["ptrs_changed"].values()), (mode, run["ptrs_changed"])


@pytest.mark.parametrize("mode", MODES)
def test_cuda_vmm_updates_equal_the_disk_engine_at_the_same_addresses(disk, vmm, mode):
    """cuda_vmm with graphs (and compiled): the tokens after every step equal the disk
    engine's and no parameter's data_ptr() changed."""
    run = vmm["runs"][mode]
    assert (vmm["transport"], run["engine"]["transport"]) == ("cuda_vmm", "cuda_vmm")
    assert run["engine"]["cudagraph_mode"] == disk[mode]["engine"]["cudagraph_mode"] != "NONE"
    assert run["errors"] == {}
    assert run["ptrs_changed"] == {step: [] for step in ("baseline", *UPDATES)}
    for step, tokens in disk[mode]["steps"].items():
        assert run["steps"][step] == tokens, step


def test_cuda_vmm_daemon_bytes_and_a_second_engine_unchanged(disk, vmm):
    """After the updates the daemon's bytes are what they were, and a second engine
    attached to it gives the original tokens."""
    assert vmm["after"] == vmm["before"]
    assert vmm["second"]["steps"]["baseline"] == disk["graphs"]["steps"]["baseline"]


def test_cuda_ipc_with_graphs_refuses_every_update_and_serves_on(disk, ipc):
    """cuda_ipc with graphs: each update is update-unsupported before any write; the
    tokens stay the baseline (the disk engine's), no address changed, the daemon's
    bytes and a second engine unchanged."""
    run = ipc["runs"]["graphs"]
    assert (ipc["transport"], run["engine"]["transport"]) == ("cuda_ipc", "cuda_ipc")
    assert run["engine"]["cudagraph_mode"] != "NONE"
    assert run["errors"] == {step: "update-unsupported" for step in UPDATES}
    assert not any(run["ptrs_changed"].values()), run["ptrs_changed"]
    baseline = disk["graphs"]["steps"]["baseline"]
    assert {step: baseline for step in ("baseline", *UPDATES)} == run["steps"]
    assert ipc["after"] == ipc["before"]
    assert ipc["second"]["steps"]["baseline"] == baseline
