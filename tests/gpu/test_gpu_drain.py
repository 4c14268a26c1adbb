"""Device copies drain before their buffers are freed when a snapshot fill fails
midway (cuda_ipc and cuda_vmm), the LMCache#4830 kind of bug: the copy stream is
held back by a spin kernel, the second wave's read fails while the first wave's
copies are still queued, and the error must not return (nor the arena be freed)
before those copies have landed.

Needs one GPU: ``python -m pytest tests/gpu/test_gpu_drain.py -q -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from wcache.store import CacheKey, DaemonServer, Export
from wcache.store import snapshot as snapshot_mod
from wcache.store.prebuilt import served_arena
from wcache.store.snapshot import (
    SnapshotCorrupt,
    open_snapshot,
    snapshot_arena,
    write_snapshot,
)
from wcache.testing.store import BASE_KEY, synthetic_export

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

#: Spin-kernel length that holds the copy stream back (GPU clock cycles): ~1 s at
#: the H200's ~2 GHz, far longer than the failing read takes to raise.
DELAY_CYCLES = 2_000_000_000
#: Chunks per wave in the test; the chunk size is chosen so that the arena makes
#: exactly DEPTH + 1 chunks, i.e. two waves (the last wave is the one the fill
#: loop does not drain itself).
DEPTH = 2
#: The byte every probe allocation is filled with; a landed stale copy changes it.
SENTINEL = 0xAB


def _cuda_export() -> Export:
    e = synthetic_export()
    return Export(
        {k: v.to("cuda:0") for k, v in e.tensors.items()},
        e.kinds,
        e.aliases,
        e.layers,
        e.extra,
        e.nonpersistent,
    )


@pytest.fixture
def snap(tmp_path, sock_dir):
    """A snapshot of a small CUDA arena."""
    key = CacheKey(BASE_KEY)
    src = DaemonServer(
        _cuda_export(),
        key,
        socket_dir=sock_dir,
        device="cuda:0",
        device_id="gpu-src",
        transport="cuda_ipc",
    )
    try:
        view = served_arena(src)
        try:
            write_snapshot(str(tmp_path), "rank0", view.tensor.clone(), src.manifest, key)
        finally:
            view.close()
    finally:
        src.stop()
    return open_snapshot(str(tmp_path), "rank0")


@pytest.fixture
def delayed_failing_fill(snap, monkeypatch):
    """The snapshot fill's copy stream starts behind a spin kernel, the arena is read
    in two waves and every read of the second wave fails. Yields
    ``{"streams": [...], "dst_ptr": [...]}``: the streams the fill created and the
    address of the arena it filled."""
    real_stream, real_read, real_fill = (
        torch.cuda.Stream,
        snapshot_mod._read_range,
        snapshot_mod._fill_cuda,
    )
    seen: dict[str, list] = {"streams": [], "dst_ptr": []}
    calls = {"n": 0}

    busy = {"now": False}

    def delayed_stream(*args, **kwargs):
        s = real_stream(*args, **kwargs)
        if busy["now"] or "stream_id" in kwargs:
            # current_stream() (inside torch.cuda.stream()) wraps an existing stream
            return s
        busy["now"] = True
        try:
            with torch.cuda.stream(s):
                torch.cuda._sleep(DELAY_CYCLES)
        finally:
            busy["now"] = False
        seen["streams"].append(s)
        return s

    def failing_read(fd, path, dst, file_offset):
        calls["n"] += 1
        if calls["n"] > DEPTH:  # the second wave
            raise OSError(5, "Input/output error (injected)")
        return real_read(fd, path, dst, file_offset)

    def recording_fill(s, dst, *args, **kwargs):
        seen["dst_ptr"].append(dst.data_ptr())
        return real_fill(s, dst, *args, **kwargs)

    chunk = -(-snap.manifest.arena_nbytes // (DEPTH + 1))
    monkeypatch.setattr(snapshot_mod, "READ_CHUNK_BYTES", chunk)
    monkeypatch.setattr(snapshot_mod, "CUDA_STAGING_CHUNKS", DEPTH)
    monkeypatch.setattr(snapshot_mod, "_read_range", failing_read)
    monkeypatch.setattr(snapshot_mod, "_fill_cuda", recording_fill)
    monkeypatch.setattr(torch.cuda, "Stream", delayed_stream)
    yield seen


@pytest.mark.parametrize("transport", ["cuda_ipc", "cuda_vmm"])
def test_failed_snapshot_fill_drains_its_copies_before_freeing(
    snap, delayed_failing_fill, sock_dir, transport
):
    """The fill fails with copies queued behind a ~1 s spin kernel: when the error reaches the
    caller the copy stream is idle (drained), and on cuda_ipc the freed block, reused by the next
    allocation, is not overwritten by a late copy."""
    from wcache.store import transport_vmm

    if transport == "cuda_vmm" and not transport_vmm.available(0)[0]:
        pytest.skip(transport_vmm.available(0)[1])
    torch.cuda.synchronize()
    with pytest.raises(SnapshotCorrupt, match="injected"):
        DaemonServer(
            snapshot_arena(snap),
            CacheKey(BASE_KEY),
            socket_dir=sock_dir,
            device="cuda:0",
            device_id="gpu-dst",
            transport=transport,
        )
    streams = delayed_failing_fill["streams"]
    assert streams and all(s.query() for s in streams), (
        "the error returned with copies still queued on the fill's stream"
    )
    if transport == "cuda_ipc":
        n = snap.manifest.arena_nbytes
        probe = torch.full((n,), SENTINEL, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()  # every stream, late copies included, has finished now
        if probe.data_ptr() in delayed_failing_fill["dst_ptr"]:  # the freed block, reused
            assert bool((probe == SENTINEL).all()), "a queued copy landed in a freed, reused block"
