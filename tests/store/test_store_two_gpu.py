"""Two CUDA daemons (one per GPU) and a 2-rank client; run on a host with two GPUs.

Each rank's daemon serves its own shard (a different synthetic export) keyed by
its GPU's UUID; each client rank attaches only to the daemon of the GPU it runs
on; a client asking on the wrong GPU is refused.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from wcache.store.paths import cuda_device_uuid
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

#: One client rank: attach to this GPU's daemon, check shard, device and zero-copy.
RANK_SCRIPT = """
import sys, json, torch
from wcache.testing.store import BASE_KEY, synthetic_export
from wcache.store import CacheKey, attach
from wcache.store.paths import cuda_device_uuid
rank = {rank}
torch.cuda.set_device(rank)
key = dict(BASE_KEY, tp=[2, rank])
with attach(CacheKey(key), socket_dir={sock!r}, device=f"cuda:{{rank}}",
            device_id=cuda_device_uuid(rank)) as att:
    lo, hi = att.arena_range
    ok = all(torch.equal(t, att.tensors[n].cpu()) and att.tensors[n].device.index == rank
             and (not t.numel() or lo <= att.tensors[n].data_ptr() < hi)
             for n, t in synthetic_export(seed=rank).tensors.items())
print(json.dumps({{"rank": rank, "ok": ok}}))
"""


@pytest.fixture
def two_daemons(sock_dir):
    procs = []
    try:
        for rank in (0, 1):
            procs.append(
                start_daemon(
                    sock_dir,
                    cuda_device_uuid(rank),
                    seed=rank,
                    key=dict(BASE_KEY, tp=[2, rank]),
                    extra_args=("--device", f"cuda:{rank}"),
                )
            )
        yield sock_dir
    finally:
        for p in procs:
            stop_daemon(p)


def test_each_rank_attaches_to_its_own_gpu_daemon(two_daemons):
    """Rank r (on cuda:r) gets shard r, on cuda:r, as a view of that daemon's arena."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT.format(rank=rank, sock=two_daemons)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [c.communicate(timeout=300) for c in children]
    results = [o[0].strip().splitlines()[-1] if o[0].strip() else o[1][-2000:] for o in outs]
    assert results == ['{"rank": 0, "ok": true}', '{"rank": 1, "ok": true}']


def test_client_on_the_wrong_gpu_is_refused(two_daemons):
    """A client on cuda:0 asking GPU 1's daemon is refused with transport-failed."""
    script = textwrap.dedent(f"""
        import sys, torch
        from wcache.testing.store import BASE_KEY
        from wcache.store import CacheKey, TransportFailed, attach
        from wcache.store.paths import cuda_device_uuid
        try:
            attach(CacheKey(dict(BASE_KEY, tp=[2, 1])), socket_dir={two_daemons!r},
                   device="cuda:0", device_id=cuda_device_uuid(1))
            print("ATTACHED")
        except TransportFailed as e:
            print("refused", e.code, str(e))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.stdout.startswith("refused transport-failed"), out.stdout + out.stderr[-2000:]
    assert "asked for cuda:0" in out.stdout
