#!/usr/bin/env bash
# On the H200 machine, after tools/gpu/device-setup.sh: where the engine's `from vllm import LLM`
# spends its time (the "vLLM import" phase of `wcache bench --phases`). Runs it three times
# (the first on a cold page cache for the bundle) with `python -X importtime`, and records the
# bytecode state of every tree on sys.path. Writes $OUT/import-*.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh || exit 2
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
{
  echo "python: $(command -v python3) $(python3 -V 2>&1)"
  python3 -c 'import sys; print("dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)'
  env | grep -E '^PYTHON' || true
  python3 - <<'PY'
import os, sys
for root in [p for p in sys.path if os.path.isdir(p)]:
    py = pyc = 0
    for _, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"): py += 1
            elif f.endswith(".pyc"): pyc += 1
    print(f"{root}: {py} .py, {pyc} .pyc")
PY
  df -hT /tmp /opt "$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null)" 2>&1
} > "$OUT/import-env.txt" 2>&1
for i in 1 2 3; do
  s=$(date +%s.%N)
  python3 -X importtime -c 'import torch; from vllm import LLM' 2> "$OUT/import-$i.txt" >/dev/null
  echo "run $i: $(python3 -c "import sys;print(round($(date +%s.%N)-$s,2))") s" >> "$OUT/import-env.txt"
done
s=$(date +%s.%N); python3 -c 'import torch' ; echo "bare import torch: $(python3 -c "print(round($(date +%s.%N)-$s,2))") s" >> "$OUT/import-env.txt"
cat "$OUT/import-env.txt"
# the 25 slowest cumulative imports of the last run
sort -t'|' -k2 -n -r "$OUT/import-3.txt" | head -25
