#!/usr/bin/env bash
# On the H200 machine, after tools/gpu/device-setup.sh: the phase breakdown of a whole engine
# start (`wcache bench --phases`, issue 24 item 2) on the 8B-shaped bf16 Llama, production
# defaults. Writes phases-h200.json, .md and .png to $OUT (the device tool brings it back).
#
#   bash tools/gpu/bench-phases.sh [ROWS]   (default: every row; e.g. disk-compiled-cold,fresh-node)
#
# Cost on one H200 (estimated from the earlier 8B starts, not yet measured by this script):
# the 8B checkpoint ~1 min once, each compiled cold start ~75 s, each other start 20-40 s, a
# daemon ~30 s: about 6-8 min for every row. Split the rows over two calls when a command's
# limit is 10 min (the checkpoint under $WCACHE_BENCH_DIR is reused on a warm machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh || exit 2
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
ROWS=${1:-disk-eager,daemon-eager,disk-compiled-cold,disk-compiled-warm,daemon-compiled-cold,daemon-compiled-warm,fresh-node}
nvidia-smi -L
python3 -m wcache.testing.fixtures --formats bf16 >>"$OUT/fixtures.log" 2>&1 \
  || { tail -20 "$OUT/fixtures.log"; exit 1; }   # SmolLM2's tokenizer for the 8B checkpoint
timeout "${BENCH_TIMEOUT:-580}" python3 -m wcache.cli bench --phases --device cuda --rows "$ROWS" \
    --root "${WCACHE_BENCH_DIR:-/tmp/wcache-phases}" --out "$OUT/phases-h200.json" \
    --markdown "$OUT/phases-h200.md" --plot "$OUT/phases-h200.png" 2>&1 | tee "$OUT/phases.log" | tail -40
exit 0
