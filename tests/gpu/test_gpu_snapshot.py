"""Snapshots of CUDA arenas and seeding between two GPU daemons over NCCL.

The snapshot tests need one GPU; the NCCL test needs two (a daemon subprocess on
cuda:0 seeds a daemon on cuda:1 in this process).
"""

from __future__ import annotations

import os

import pytest
import torch

from wcache.store import CacheKey, DaemonServer, Export, socket_path
from wcache.store.arena import tensor_views
from wcache.store.prebuilt import served_arena
from wcache.store.snapshot import (
    ARENA_FILE,
    SnapshotCorrupt,
    open_snapshot,
    snapshot_arena,
    write_snapshot,
)
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon, synthetic_export

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_export(device: str = "cuda:0") -> Export:
    e = synthetic_export()
    return Export(
        {k: v.to(device) for k, v in e.tensors.items()},
        e.kinds,
        e.aliases,
        e.layers,
        e.extra,
        e.nonpersistent,
    )


def _arena(server) -> torch.Tensor:
    view = served_arena(server)
    try:
        return view.tensor.clone()
    finally:
        view.close()


@pytest.mark.parametrize("transport", ["cuda_vmm", "cuda_ipc"])
def test_cuda_snapshot_round_trip(sock_dir, tmp_path, transport):
    """A CUDA arena written to a snapshot and read back (pinned staging) is byte-identical."""
    from wcache.store import transport_vmm

    if transport == "cuda_vmm" and not transport_vmm.available(0)[0]:
        pytest.skip(transport_vmm.available(0)[1])
    key = CacheKey(BASE_KEY)
    src = DaemonServer(
        _cuda_export(),
        key,
        socket_dir=sock_dir,
        device="cuda:0",
        device_id="gpu-src",
        transport=transport,
    )
    try:
        ref = _arena(src)
        write_snapshot(str(tmp_path), "rank0", ref, src.manifest, key)
        snap = open_snapshot(str(tmp_path), "rank0")
        dst = DaemonServer(
            snapshot_arena(snap),
            key,
            socket_dir=sock_dir,
            device="cuda:0",
            device_id="gpu-dst",
            transport=transport,
        )
        try:
            assert transport == dst.transport and src.manifest == dst.manifest
            got = _arena(dst)
            assert torch.equal(ref[: src.nbytes], got[: src.nbytes])
            views = tensor_views(got, dst.manifest)
            for name, t in synthetic_export().tensors.items():
                assert torch.equal(t, views[name].cpu()), name
        finally:
            dst.stop()
        apath = os.path.join(snap.path, ARENA_FILE)
        with open(apath, "r+b") as f:
            f.seek(snap.data_offset + 7)
            b = f.read(1)
            f.seek(snap.data_offset + 7)
            f.write(bytes([b[0] ^ 0x80]))
        with pytest.raises(SnapshotCorrupt, match="does not match its digest"):
            DaemonServer(
                snapshot_arena(open_snapshot(str(tmp_path), "rank0")),
                key,
                socket_dir=sock_dir,
                device="cuda:0",
                device_id="gpu-bad",
                transport=transport,
            )
    finally:
        src.stop()


def test_gloo_seeding_of_cuda_arenas_on_one_gpu(sock_dir):
    """Two CUDA daemons on one GPU: the receiver, seeded over gloo, serves the same bytes
    (the device-side digest and the CUDA arenas on both ends; NCCL needs two GPUs)."""
    from wcache.store.seed import seed_arena

    key = CacheKey(BASE_KEY)
    src = start_daemon(sock_dir, "gpu0", extra_args=("--device", "cuda:0", "--seed-source"))
    try:
        dst = DaemonServer(
            seed_arena(socket_path(sock_dir, "gpu0"), key, backend="gloo"),
            key,
            socket_dir=sock_dir,
            device="cuda:0",
            device_id="gpu0b",
        )
        try:
            views = tensor_views(_arena(dst), dst.manifest)
            for name, t in synthetic_export().tensors.items():
                assert torch.equal(t, views[name].cpu()), name
        finally:
            dst.stop()
    finally:
        stop_daemon(src)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_seeding_between_two_gpu_daemons(sock_dir):
    """A daemon on cuda:1 seeded over NCCL from a daemon process on cuda:0 holds the same bytes."""
    from wcache.store.seed import seed_arena

    key = CacheKey(BASE_KEY)
    src = start_daemon(sock_dir, "gpu0", extra_args=("--device", "cuda:0", "--seed-source"))
    try:
        dst = DaemonServer(
            seed_arena(socket_path(sock_dir, "gpu0"), key),
            key,
            socket_dir=sock_dir,
            device="cuda:1",
            device_id="gpu1",
        )
        try:
            got = _arena(dst)
            assert got.device == torch.device("cuda", 1)
            views = tensor_views(got, dst.manifest)
            for name, t in synthetic_export().tensors.items():
                assert torch.equal(t, views[name].cpu()), name
        finally:
            dst.stop()
    finally:
        stop_daemon(src)
