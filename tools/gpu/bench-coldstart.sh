#!/usr/bin/env bash
# Cold start on the H200 machine with two GPUs, one command (measured for issues
# 14/16): the gpu tier and the CUDA store/snapshot tests (NCCL seeding included),
# then the 8B-shaped cold-start benchmark (checkpoint vs snapshot vs peer over NCCL, raw read/copy in the same run).
# Needs blake3 as a cp312 wheel under .whl/ (see tools/gpu/bench-restore.sh).
# Usage: bash tools/gpu/bench-coldstart.sh [OUT_DIR] [tests|bench|all]  (default all)
set -uo pipefail
OUT=${1:-${OUT:-/tmp/wcache-gpu}}
PHASE=${2:-all}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L
if [[ $PHASE == all || $PHASE == tests ]]; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider -rfEs tests/gpu \
      tests/store/test_store_cuda.py tests/store/test_store_snapshot.py 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $PHASE == all || $PHASE == bench ]]; then
  timeout 240 python3 -m wcache.bench --cold-start --device cuda --sizes 8b --formats bf16,awq,fp8 \
      --bench-dir /tmp/wb --snapshot-dir /tmp --out "$OUT/coldstart-h200x2.json" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
exit 0
