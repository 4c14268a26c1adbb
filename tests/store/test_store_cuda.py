"""cuda_ipc transport between processes (needs a CUDA device; run on the H200)."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from wcache.store import CacheKey, attach, daemon_status, socket_path
from wcache.store.paths import cuda_device_uuid
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon, synthetic_export

# The daemon notices a client process's exit through EOF on its connection.
RELEASE_WAIT_S = 10.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def cuda_daemon(sock_dir):
    device_id = cuda_device_uuid(0)
    proc = start_daemon(sock_dir, device_id, extra_args=("--device", "cuda:0"))
    yield device_id
    stop_daemon(proc)


def test_cuda_ipc_attach_is_zero_copy_and_bit_exact(sock_dir, cuda_daemon):
    """Every tensor from another process's arena equals the export and is a view of one IPC allocation."""
    # What the daemon exported: the synthetic tensors moved to the GPU (``.to``
    # makes a strided slice contiguous, so strides are compared with these).
    export = {k: t.to("cuda:0") for k, t in synthetic_export().tensors.items()}
    with attach(
        CacheKey(BASE_KEY), socket_dir=sock_dir, device="cuda:0", device_id=cuda_daemon
    ) as att:
        lo, hi = att.arena_range
        for name, t in export.items():
            v = att.tensors[name]
            assert "cuda" == v.device.type, name
            assert (t.shape, t.stride(), t.dtype) == (v.shape, v.stride(), v.dtype), name
            assert torch.equal(t, v), name
            if v.numel():
                assert lo <= v.data_ptr() < hi, name
        assert att.tensors["lm_head.weight"] is att.tensors["w0"]


def test_cuda_two_processes_and_copy_mode(sock_dir, cuda_daemon):
    """A second client process reads the same bytes while a copy-mode client here closes; our mapping stays valid."""
    key = CacheKey(BASE_KEY)
    with attach(key, socket_dir=sock_dir, device="cuda:0", device_id=cuda_daemon) as shared:
        with attach(
            key, socket_dir=sock_dir, device="cuda:0", device_id=cuda_daemon, mode="copy"
        ) as private:
            assert not (
                shared.arena_range[0] <= private.tensors["w0"].data_ptr() < shared.arena_range[1]
            )
            private.tensors["w0"].add_(1)
        script = textwrap.dedent(f"""
            import sys, torch
            from wcache.testing.store import BASE_KEY, synthetic_export
            from wcache.store import CacheKey, attach
            with attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r}, device="cuda:0",
                        device_id={cuda_daemon!r}) as att:
                ok = all(torch.equal(t, att.tensors[n].cpu()) for n, t in synthetic_export().tensors.items())
            print("equal" if ok else "DIFFERENT")
        """)
        child = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=180
        )
        assert "equal" == child.stdout.strip(), child.stderr[-3000:]
        for name, t in synthetic_export().tensors.items():
            assert torch.equal(t, shared.tensors[name].cpu()), name
        deadline = (
            time.monotonic() + RELEASE_WAIT_S
        )  # the daemon sees the child's EOF asynchronously
        while daemon_status(socket_path(sock_dir, cuda_daemon))["attachments_active"] > 1:
            assert time.monotonic() < deadline, "the child's attachment was never released"
            time.sleep(0.05)
        assert 1 == daemon_status(socket_path(sock_dir, cuda_daemon))["attachments_active"]
