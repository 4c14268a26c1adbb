"""Cold-start cost of the guard's content check in a fresh process (first use of
torch's int64 sum kernel), then the whole RestoreGuard over 128 layer ranges of a
13 GiB arena, cold and warm. python tools/gpu_guard_cold.py"""
import time

import torch

torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
from wcache.core import RestoreGuard, range_sums, layer_ranges  # noqa: E402

small = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
t0 = time.perf_counter(); range_sums(layer_ranges({"w": small})); t1 = time.perf_counter()
range_sums(layer_ranges({"w": small})); t2 = time.perf_counter()
print(f"first range_sums (cold kernels) {1e3*(t1-t0):.2f} ms, second {1e3*(t2-t1):.2f} ms")
n = 13 * 2**30
arena = torch.empty(n, dtype=torch.uint8, device="cuda:0")
per = n // 128 // 256 * 256
layers = {f"l{i}": {"weight": arena[i*per:(i+1)*per].view(torch.bfloat16)} for i in range(128)}
for rep in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    g = RestoreGuard(layers); t1 = time.perf_counter()
    for i in range(128):
        g.check_stage(f"l{i}", "s", layers[f"l{i}"]); g.check_layer(f"l{i}", ())
    t2 = time.perf_counter(); g.check_all(); t3 = time.perf_counter()
    print(f"rep {rep}: init {1e3*(t1-t0):.2f} ms, 128x(check_stage+check_layer) {1e3*(t2-t1):.2f} ms, "
          f"check_all {1e3*(t3-t2):.2f} ms")
