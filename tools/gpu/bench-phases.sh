#!/usr/bin/env bash
# On the H200 machine, after tools/gpu/device-setup.sh: the phase breakdown of a whole engine
# start (`wcache bench --phases`, issue 24 item 2) on the 8B-shaped bf16 Llama, production
# defaults. Writes phases-h200.json, .md and .png (or $OUT_NAME.*) to $OUT (the device tool
# brings it back).
#
#   bash tools/gpu/bench-phases.sh [ROWS]   (default: every row; e.g. disk-compiled-cold,fresh-node)
#   environment: PAIRS (N: run the rows N times in turn, --pairs; the target is the median of
#   disk-compiled-cold / fresh-node over >= 3 pairs, each pair one run's), BENCH_TIMEOUT
#   (seconds, default 580), OUT_NAME (output files' name, default
#   phases-h200; the engines' whole logs go to $OUT/$OUT_NAME.logs/), STACK_SAMPLES (seconds:
#   also sample every engine process's Python stacks there; python -m wcache.benchmarks.stacks),
#   STARTUP_PLAN=1 (--startup-plan: VLLM_ENABLE_STARTUP_PLAN=1 on every engine), MEGA_AOT=1
#   (--mega-aot-artifact: VLLM_USE_MEGA_AOT_ARTIFACT=1 on every engine and the priming one), PRIME_ONLY=1
#   (--prime-only: only make the fresh-node rows' primed snapshot, for a later call), MODEL_KIND
#   (--model-kind: 8b by default on CUDA; moe30b-fp8, the Qwen3-30B-A3B-shaped block-FP8 MoE,
#   with MOE_LAYERS of its 48 layers, --moe-layers, default 12). The logs
#   folder is packed into $OUT/$OUT_NAME.logs.tgz (the device tool brings back 8 files at most);
#   it also holds gpu-monitor.csv, nvidia-smi's utilization, clocks, power, memory and
#   clock-event reasons every GPU_MONITOR_MS ms (default 1000) for the whole run, to match
#   against the engine logs' timestamps (both in the machine's local time).
#
# Cost on one H200 (measured 2026-12-02, vLLM 0.33.0): the 8B checkpoint, disk-eager,
# daemon-eager (its daemon 46 s), disk-compiled-cold (107 s) and disk-compiled-warm took most
# of one 10-minute call; fresh-node alone took 306 s (a primed daemon: ready 65 s, priming
# 101 s; a --from-snapshot daemon; the engine). Split the rows over calls on a warm machine
# (the checkpoint under $WCACHE_BENCH_DIR is reused), give each call its own --out name
# (OUT_NAME), and merge: wcache bench --phases --from-json a.json b.json --out all.json.
# The target's ratio is one run's: disk-compiled-cold and fresh-node in one call, about 540 s
# on a fresh machine (the 8B checkpoint ~100 s, the disk row ~120 s, fresh-node ~306 s), e.g.
# in the last transfer call after setup (11 s): STARTUP_PLAN=1 BENCH_TIMEOUT=575 ... \
#   bash tools/gpu/bench-phases.sh disk-compiled-cold,fresh-node
# Issue 48 (fresh-node through the engine template, median of 3 pairs): the primed snapshot
# (~170 s: a primed daemon and its snapshot) is made once and kept under $WCACHE_BENCH_DIR by a
# key of what it depends on, so a later call on the same warm machine reuses it; one pair is
# ~3 min (disk-compiled-cold ~120 s; the fresh node's daemon and template start side by side,
# ~30 s, then its engine). On a fresh machine:
#   call 1: OUT_NAME=pairs-a PAIRS=1 STARTUP_PLAN=1 BENCH_TIMEOUT=575 bash tools/gpu/bench-phases.sh disk-compiled-cold,fresh-node
#           (or PRIME_ONLY=1 STARTUP_PLAN=1 bash tools/gpu/bench-phases.sh: the checkpoint and the
#           primed snapshot only, ~270 s, then every later call runs pairs)
#   call 2: OUT_NAME=pairs-b PAIRS=3 STARTUP_PLAN=1 BENCH_TIMEOUT=575 bash tools/gpu/bench-phases.sh disk-compiled-cold,fresh-node
#   then (anywhere): wcache bench --phases --from-json pairs-a.json pairs-b.json --out pairs.json \
#     --markdown pairs.md --plot pairs.png      (every pair of every call counts once)
# Each row is saved as it ends: a call cut by BENCH_TIMEOUT keeps its complete pairs.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh || exit 2
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
ROWS=${1:-disk-eager,daemon-eager,disk-compiled-cold,disk-compiled-warm,daemon-compiled-cold,daemon-compiled-warm,fresh-node}
nvidia-smi -L
python3 -m wcache.testing.fixtures --formats bf16 >>"$OUT/fixtures.log" 2>&1 \
  || { tail -20 "$OUT/fixtures.log"; exit 1; }   # SmolLM2's tokenizer for the 8B checkpoint
logs=${OUT_NAME:-phases-h200}.logs
mkdir -p "$OUT/$logs"
# The GPU's own counters every second (a poll of the driver, no work on the GPU), to place
# a slow phase: busy or idle, its clocks, why they were held down. Beside the engine logs.
reasons=clocks_event_reasons.active  # the name since driver 535; older ones know the next
nvidia-smi --query-gpu=$reasons --format=csv,noheader >/dev/null 2>&1 || reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used,$reasons \
  --format=csv -lms "${GPU_MONITOR_MS:-1000}" > "$OUT/$logs/gpu-monitor.csv" 2>&1 &
monitor=$!
timeout "${BENCH_TIMEOUT:-580}" python3 -m wcache.cli bench --phases --device cuda --rows "$ROWS" \
    --root "${WCACHE_BENCH_DIR:-/tmp/wcache-phases}" --out "$OUT/${OUT_NAME:-phases-h200}.json" \
    --markdown "$OUT/${OUT_NAME:-phases-h200}.md" --plot "$OUT/${OUT_NAME:-phases-h200}.png" \
    ${STACK_SAMPLES:+--stack-samples "$STACK_SAMPLES"} $([ "${STARTUP_PLAN:-0}" = 1 ] && echo --startup-plan) \
    --pairs "${PAIRS:-1}" $([ "${PRIME_ONLY:-0}" = 1 ] && echo --prime-only) \
    $([ "${MEGA_AOT:-0}" = 1 ] && echo --mega-aot-artifact) \
    ${MODEL_KIND:+--model-kind "$MODEL_KIND"} ${MOE_LAYERS:+--moe-layers "$MOE_LAYERS"} \
    2>&1 | tee "$OUT/phases.log" | tail -60
kill "$monitor" 2>/dev/null; wait "$monitor" 2>/dev/null
if [ -d "$OUT/$logs" ]; then
  tar czf "$OUT/$logs.tgz" -C "$OUT" "$logs" && rm -rf "${OUT:?}/$logs"
fi
exit 0
