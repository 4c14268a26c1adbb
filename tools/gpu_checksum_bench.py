"""How fast one pass of the restore guard's content check can read an 8B-sized
arena (13 GiB, 32 layer ranges) on this GPU, per reduction variant; and what
``import cuda.bindings.driver`` costs in a fresh process.
python tools/gpu_checksum_bench.py [GiB]"""
import subprocess, sys, time

import torch

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 13.0
LAYERS = 32


def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(sorted(out)[len(out) // 2], 3)


def main():
    from wcache.core import ByteRange, range_sums, RestoreGuard
    n = int(GIB * 2**30) // 4096 * 4096
    arena = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    per = n // LAYERS // 8 * 8
    views = [arena[i * per:(i + 1) * per] for i in range(LAYERS)]
    ranges = [ByteRange(v, (f"l{i}",), 0, per) for i, v in enumerate(views)]
    gbs = lambda ms: round(n / ms / 1e6, 1)
    res = {}
    res["range_sums int64"] = timed(lambda: range_sums(ranges))
    res["int64 sum, no sync"] = timed(lambda: [v.view(torch.int64).sum() for v in views])
    res["int32 sum(dtype=int64)"] = timed(lambda: [v.view(torch.int32).sum(dtype=torch.int64) for v in views])
    res["int64 2-D rows sum then sum"] = timed(lambda: [v.view(torch.int64).view(-1, 512).sum(1).sum() for v in views])
    res["float32 view nansum"] = timed(lambda: [v.view(torch.float32).nansum() for v in views])
    res["copy (read+write) d2d"] = timed(lambda: arena.clone())
    for k, ms in res.items():
        print(f"{k:32s} {ms:8.3f} ms  {gbs(ms):7.1f} GB/s read", flush=True)
    layers = {f"l{i}": {"w": views[i].view(torch.bfloat16)} for i in range(LAYERS)}
    t0 = time.perf_counter(); g = RestoreGuard(layers); torch.cuda.synchronize(); t1 = time.perf_counter()
    for i in range(LAYERS):
        g.check_layer(f"l{i}", ())
    t2 = time.perf_counter(); g.check_all(); t3 = time.perf_counter()
    print(f"RestoreGuard: init {1e3*(t1-t0):.2f} ms, 32 check_layer {1e3*(t2-t1):.2f} ms, check_all {1e3*(t3-t2):.2f} ms")
    r = subprocess.run([sys.executable, "-c", "import time, torch; torch.empty(1, device='cuda'); "
                        "t0 = time.perf_counter(); import cuda.bindings.driver; "
                        "print(f'import cuda.bindings.driver {1e3*(time.perf_counter()-t0):.1f} ms')"],
                       capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr[-500:])


if __name__ == "__main__":
    main()
