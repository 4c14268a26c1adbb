"""Restore between two processes on one GPU over ``cuda_vmm`` and ``cuda_ipc`` (the H200 tier).

A spawned daemon process prepares three layers on ``cuda:0`` (bf16 on kernel
``none``, AWQ int4 on Marlin, online FP8 per-tensor on CUTLASS with N not a
multiple of 16), exports them with the store's cuda transport and serves them;
this process attaches, installs the zero-copy views, replays each plan's restore
under the strict guard and compares every layer's output with an ordinary load
done here from the same checkpoint bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import uuid

import pytest
import torch
from attrs import evolve

from wcache.core import LayerState, Target
from wcache.shell import apply_state_, load_, prepare_, restore_

#: Seconds to wait for the daemon process to prepare and serve (CUDA init plus a
#: few small layers take a few seconds; 300 covers a busy machine).
DAEMON_READY_TIMEOUT_S = 300.0
#: Layers served: (name, method, kernel, N, K).
LAYERS = (
    ("layers.0.bf16", "unquantized", "none", 192, 256),
    ("layers.1.awq", "awq", "marlin", 192, 256),
    ("layers.2.fp8", "fp8_per_tensor", "cutlass", 200, 248),
)
TOKENS = 33


def _daemon_main(
    conn,
    socket_dir: str,
    device_id: str,
    key_fields: dict,
    layers: list,
    device_name: str,
    target: Target,
    transport: str | None,
) -> None:
    """The daemon process: prepare on the device, export over ``transport`` (None: the
    store's default), serve until told."""
    try:
        from wcache.plans import plan_for
        from wcache.store import CacheKey, DaemonServer, Export

        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tensors, kinds, entries = {}, {}, {}
        with torch.no_grad():
            for name, config, ckpt in layers:
                plan = plan_for(config, target=target).plan
                module = torch.nn.Module()
                apply_state_(module, LayerState(tensors={k: v.to(device) for k, v in ckpt.items()}))
                prep = prepare_(module, plan.bind(config, target))
                for local, t in prep.tensors.items():
                    tensors[f"{name}.{local}"] = t
                    kinds[f"{name}.{local}"] = "buffer" if local in prep.buffers else "param"
                entries[name] = {
                    "plan": plan.id,
                    "drops": list(prep.drops),
                    "recorded": {k: dict(v) for k, v in prep.recorded.items()},
                }
        server = DaemonServer(
            Export(tensors=tensors, kinds=kinds, layers=entries),
            CacheKey(key_fields),
            socket_dir=socket_dir,
            device=device_name,
            device_id=device_id,
            transport=transport,
        )
        server.start()
        conn.send(("ready", os.getpid(), server.transport))
        conn.recv()
        server.stop()
    except BaseException as e:  # noqa: BLE001 (the test reports it)
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


def _bf16_forward(layer, config, x):
    return torch.nn.functional.linear(x, layer.weight)


#: The H200's target, for dry runs of this tier on CPU (conftest DRY_RUN; shm transport).
H200_DRY_RUN_TARGET = Target("cuda", (9, 0))


@pytest.mark.parametrize("transport", ["cuda_vmm", "cuda_ipc"])
def test_restore_in_a_second_process_equals_ordinary_load(
    checkpoints, fp8_forward, cuda, transport
):
    """A client process restores bf16, AWQ-Marlin and FP8-CUTLASS layers from a daemon
    process through ``transport`` (zero-copy views of the daemon's arena) and every
    layer's output equals the ordinarily loaded layer's, bit for bit. On the CPU dry
    run both cases use shm."""
    from wcache.plans import plan_for
    from wcache.store import CacheKey, attach

    R = pytest.importorskip("tests.helpers.reference_kernels")
    make, module_with = checkpoints
    device = cuda
    target = Target.detect(device) if device.type == "cuda" else H200_DRY_RUN_TARGET
    if device.type == "cuda" and transport == "cuda_vmm":
        from wcache.store import transport_vmm

        ok, why = transport_vmm.available(device.index or 0)
        if not ok:
            pytest.skip(f"cuda_vmm unavailable here: {why}")
    expected_transport = transport if device.type == "cuda" else "shm"
    forwards = {
        "unquantized": _bf16_forward,
        "awq": R.marlin_int_forward,
        "fp8_per_tensor": lambda layer, config, x: fp8_forward(layer, x),
    }
    layers = []
    for i, (name, method, kernel, n, k) in enumerate(LAYERS):
        config, ckpt = make(method, n, k, seed=i)
        layers.append((name, evolve(config, quant=evolve(config.quant, kernel=kernel)), ckpt))
    key_fields = {"test": "gpu-cuda-ipc", "nonce": uuid.uuid4().hex}
    device_id = f"gputest-{os.getpid()}"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="wcg-") as socket_dir:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_daemon_main,
            args=(
                child,
                socket_dir,
                device_id,
                key_fields,
                layers,
                str(device),
                target,
                transport if device.type == "cuda" else None,
            ),
            daemon=True,
        )
        proc.start()
        try:
            assert parent.poll(DAEMON_READY_TIMEOUT_S), "daemon process did not report"
            status, daemon_pid, served = parent.recv()
            assert "ready" == status, daemon_pid
            assert expected_transport == served
            assert daemon_pid != os.getpid()
            with torch.no_grad():
                att = attach(
                    CacheKey(key_fields),
                    socket_dir=socket_dir,
                    device=str(device),
                    device_id=device_id,
                )
                lo, hi = att.arena_range
                x_gen = torch.Generator(device).manual_seed(7)
                for name, config, ckpt in layers:
                    plan = plan_for(config, target=target).plan
                    restored = torch.nn.Module()
                    local = {
                        t.rpartition(".")[2]: v
                        for t, v in att.tensors.items()
                        if t.rpartition(".")[0] == name
                    }
                    apply_state_(restored, LayerState(tensors=local))
                    entry = att.layers[name]
                    assert plan.id == entry["plan"]
                    restore_(
                        restored,
                        plan.bind(config, target),
                        entry["recorded"],
                        strict=True,
                        drops=entry["drops"],
                    )
                    for tname, t in {**restored._parameters, **restored._buffers}.items():
                        if t is not None and t.numel():
                            assert lo <= t.data_ptr() < hi, (
                                f"{name}.{tname} is not a view of the arena"
                            )
                    loaded = module_with(ckpt, device)
                    load_(loaded, plan.bind(config, target))
                    x = torch.randn(TOKENS, config.size_k, generator=x_gen, device=device).to(
                        config.dtype
                    )
                    y_restored = forwards[config.quant.method](restored, config, x)
                    y_loaded = forwards[config.quant.method](loaded, config, x)
                    assert (TOKENS, config.size_n) == tuple(y_restored.shape), name
                    assert torch.equal(y_loaded, y_restored), name
                    del restored
                att.close()
        finally:
            try:
                parent.send("stop")
            except OSError:
                pass
            proc.join(DAEMON_READY_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    assert 0 == proc.exitcode
