"""Time each step of a cuda_vmm attach (and of cuda_ipc) for an 8B-sized arena
(13 GiB bf16 by default) in a fresh process: python tools/gpu_vmm_steps.py [GiB]."""
import json, os, subprocess, sys, tempfile, time

import torch

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 13.0


def main() -> None:
    from wcache.store import CacheKey, DaemonServer, Export, attach
    from wcache.store import transport_vmm
    n = int(GIB * 2**30) // 2
    key = CacheKey({"bench": "vmm-steps", "gib": GIB})
    for transport in ("cuda_vmm", "cuda_ipc"):
        d = tempfile.mkdtemp(prefix="wvs-"); os.chmod(d, 0o700)
        export = Export({"w": torch.zeros(n, dtype=torch.bfloat16, device="cuda:0")}, {"w": "param"}, {}, {}, {})
        server = DaemonServer(export, key, socket_dir=d, device="cuda:0", transport=transport).start()
        del export
        torch.cuda.empty_cache()
        child = subprocess.run([sys.executable, "-c", f"""
import time, torch, json
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
import cuda.bindings.driver  # imported before the timed region in one run, so both are seen
from wcache.store import CacheKey, attach
from wcache.store import transport_vmm
from wcache.store.paths import cuda_device_uuid
out = []
for i in range(3):
    t0 = time.perf_counter()
    att = attach(CacheKey({key.fields!r}), socket_dir={d!r}, device="cuda:0", device_id=cuda_device_uuid(0))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    s = float(att.tensors["w"][:1024].float().sum())
    out.append({{"attach_ms": round((t1 - t0) * 1e3, 2), "steps": dict(transport_vmm.last_open_ms)}})
    att.close(); del att
print(json.dumps(out))
"""], capture_output=True, text=True, timeout=300)
        print(transport, child.stdout.strip() or child.stderr[-2000:], flush=True)
        server.stop()


if __name__ == "__main__":
    main()
