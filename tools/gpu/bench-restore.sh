#!/usr/bin/env bash
# The restore guard and CUDA transports on the H200, one command (measured for
# issue 13): the guard/transport GPU tests, the cuda_ipc store tests, then the 8B
# restore benchmark with the default guard and transport, and the comparison runs.
# Needs blake3 as a cp312 wheel under .whl/ (the GPU image has no blake3; see
# the device README); cuda-bindings, msgpack, attrs, toolz are on the image.
# Usage: bash tools/gpu/bench-restore.sh [OUT_DIR] [tests|bench|compare|all]  (default all)
set -uo pipefail
OUT=${1:-${OUT:-/tmp/wcache-gpu}}
PHASE=${2:-all}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import torch, cuda.bindings
from wcache.store import transport_vmm
print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__, "vmm", transport_vmm.available(0))
PY
[[ $PHASE == all || $PHASE == tests ]] && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_guard.py tests/store/test_store_cuda.py -rfE 2>&1 | tail -25
[[ $PHASE == all || $PHASE == bench ]] && timeout 280 python3 -m wcache.bench --device cuda --sizes 8b --no-disk 8b --formats bf16,awq,fp8 --reps 3 --handle-tensors 0 \
    --out "$OUT/gpu.json" --no-plot 2>&1 | tee "$OUT/bench.log" | tail -30
# Comparison runs (same command): the guard off, then cuda_ipc with the default guard.
[[ $PHASE == all || $PHASE == compare ]] && WCACHE_BENCH_GUARD=off timeout 280 python3 -m wcache.bench --device cuda --sizes 8b --no-disk 8b --formats bf16,awq,fp8 \
    --reps 3 --handle-tensors 0 --out "$OUT/gpu-guard-off.json" --no-plot 2>&1 | tee "$OUT/bench-off.log" | tail -14
[[ $PHASE == all || $PHASE == compare ]] && WCACHE_BENCH_TRANSPORT=cuda_ipc timeout 280 python3 -m wcache.bench --device cuda --sizes 8b --no-disk 8b --formats bf16,awq,fp8 \
    --reps 3 --handle-tensors 0 --out "$OUT/gpu-ipc.json" --no-plot 2>&1 | tee "$OUT/bench-ipc.log" | tail -14
[[ $PHASE == all || $PHASE == compare ]] && WCACHE_BENCH_TRANSPORT=cuda_ipc WCACHE_BENCH_GUARD=off timeout 280 python3 -m wcache.bench --device cuda --sizes 8b --no-disk 8b --formats bf16,awq,fp8 \
    --reps 3 --handle-tensors 0 --out "$OUT/gpu-ipc-guard-off.json" --no-plot 2>&1 | tee "$OUT/bench-ipc-off.log" | tail -14
exit 0
