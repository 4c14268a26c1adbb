#!/usr/bin/env bash
# One poll of a long H200 run started in the background (docs/gpu.md, "Long runs"): wait, print
# where the run is, and pack its folder into $OUT, so every poll brings the results so far back.
# The machine can be taken back for other work in the middle of a call; what a poll packed
# before that is all that survives of /tmp.
#
#   bash tools/gpu/poll.sh [SECONDS]     (default 150; keep each call under the 600 s limit)
#   environment: RUN_DIR (the background run's output folder, default /tmp/gout)
#
# Waits SECONDS at most: it reports at once when the run's pipe.log says the pipeline is
# done (pipeline.sh's last line), so a poll never holds the GPU idle after the run ended
# (on 2026-12-05 a fixed 285 s wait held an H100 4.5 minutes past the end of its run).
# While it waits it packs $OUT/run.tgz every POLL_PACK_S seconds too (default 60): a call cut
# at the end of the session's device time still brings back the rows of its last minute.
#
# Prints the run's pipe.log, the tier's and feature modules' latest pytest lines, the fresh-node
# pairs' ratios so far (pipeline.sh's pairs stage), the row
# counts of results.jsonl, arch-sweep-cuda.jsonl and arch-sweep-gemma3.jsonl and every row that is not `restored`
# (case, outcome, reason), then GPU memory and load; writes $OUT/run.tgz (model weights left out).
set -uo pipefail
G=${RUN_DIR:-/tmp/gout}
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
pack() {
  tar czf "$OUT/run.tgz.part" --exclude='*.safetensors' --exclude='*.gguf' \
    -C "$(dirname "$G")" "$(basename "$G")" 2>/dev/null && mv "$OUT/run.tgz.part" "$OUT/run.tgz"
}
end=$((SECONDS + ${1:-150})); packed=$SECONDS
while [ "$SECONDS" -lt "$end" ]; do
  tail -n 1 "$G/pipe.log" 2>/dev/null | grep -qE '^\[pipe [0-9:]+\] done$' && break
  [ $((SECONDS - packed)) -ge "${POLL_PACK_S:-60}" ] && { pack; packed=$SECONDS; }
  sleep 2
done
cat "$G/pipe.log" 2>/dev/null
grep -hE "passed|failed|error" "$G/tier.log" 2>/dev/null | tail -3
grep -E "^\[run-features\]" "$G/features.log" 2>/dev/null | tail -4
grep -HE " (passed|failed)|^(FAILED|ERROR) " "$G"/features-*.log 2>/dev/null | tail -6
grep -hE "phases: pair [0-9]+:|^Target:|primed snapshot|: starting" "$G/bench-run.log" "$G/phases.log" 2>/dev/null | tail -6
python3 - "$G" <<'PY'
import json, sys
from pathlib import Path

for name in ("results.jsonl", "arch-sweep-cuda.jsonl", "arch-sweep-gemma3.jsonl"):
    f = Path(sys.argv[1]) / name
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []
    print(f"{name}: {len(rows)} row(s)")
    for r in rows:
        if r.get("outcome") != "restored":
            print(" ", r.get("case"), r.get("outcome"), str(r.get("reason") or "")[:300])
PY
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null; uptime
pack
ls -la "$OUT"
