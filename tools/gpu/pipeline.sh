#!/usr/bin/env bash
# A long H200 session in the background (docs/gpu.md, "Long runs"): stages run in the order given,
# from a private copy of the checkout ($WCACHE_PIPELINE_DIR, default /tmp/wc), so the tree the
# device tool re-sends on every later call never changes code under a running stage; output in
# $RUN_DIR (default /tmp/gout), which
# `bash tools/gpu/poll.sh SECONDS` (one call each, back to back) reports and packs into $OUT.
#
#   bash tools/gpu/pipeline.sh STAGE[,STAGE...]    (after tools/gpu/device.sh setup; returns at once)
#
# Stages (WCACHE_GPU_VLLM=0.33.0 unless set):
#   moe-compiled    the compiled MoE tier rows (run-tier.sh -k "moe and compiled", 10 workers;
#                   ~6 min for the ten rows on one H200, 2026-12-05)
#   dense           the dense tier rows (not moe, gemma3 or a feature module; 12 workers; ~15 min
#                   on an H100 80GB, 2026-12-06, 25 rows)
#   features[=M:M]  run-features.sh with those modules (default sleep:spec:lora), started beside
#                   the next tier stage and stopped when that stage ends (sleep ~2.5 min, then
#                   spec, then LoRA); features=spec:lora runs only those two, in that order
#   arch=A,B,...    (use ':' between names: arch=deepseek_v2:llava) the architecture sweep of those
#                   architectures, bf16 and online-fp8, 4 workers, beside the next tier stage
#   gemma3-270m     the real Gemma 3 270M: its bf16 fixture (with the bundle's transformers for
#                   its GGUF tokenizer), its six tier cases (-k gemma3, 6 workers) and its four
#                   sweep rows (bf16, online-fp8, fp8, ct_w8a8_fp8; 4 workers); needs a
#                   WCACHE_GPU_GEMMA3=1 bundle. On an H100 (2026-12-06) with 3 tier workers and
#                   one sweep worker: fixture 1.5 min, tier 10 min, ~4.7 min a sweep row
#   gemma3-sweep    beside the next stages: the real Gemma 3 270M's bf16 fixture, then its sweep
#                   rows only (bf16, online-fp8, fp8; 3 workers; arch-sweep-gemma3.jsonl, apart
#                   from arch-all's file, which it writes beside), no tier cases; needs a
#                   WCACHE_GPU_GEMMA3=1 bundle. With it in the list, arch-all runs the tiny
#                   architectures only (--archs tiny)
#   arch-all        the whole architecture sweep (--resume over arch-sweep-cuda.jsonl),
#                   $ARCH_WORKERS workers (default 16); ARCH_WHICH=tiny: without the real
#                   models' rows (a bundle without Gemma 3); ARCH_RESUME=FILE (absolute, or in the
#                   checkout): that file's rows are copied in first, and their cases skipped
#                   (e.g. the rows an earlier session's cut run got on this GPU)
#   pairs=N         the fresh-node pairs of issue 48 (bench-phases.sh disk-compiled-cold,fresh-node,
#                   PAIRS=N, startup plan on), alone on the GPU: the 8B checkpoint (~30 s when
#                   written beside a tier stage), the primed snapshot (~170 s, alone: see below),
#                   ~3-4 min a pair (on an H100 80GB, 2026-12-05: the disk row 103-158 s, the
#                   fresh node 23-24 s, 13-19 s with MEGA_AOT=1); MEGA_AOT=1 in the environment: vLLM's mega AOT
#                   artifact on every engine (bench-phases.sh); MODEL_KIND=moe30b-fp8
#                   (MOE_LAYERS, default 12) in the environment: the Qwen3-30B-A3B-shaped FP8 MoE
#                   instead of the 8B Llama (the checkpoint written beside the first stage too)
#   wait            let the side stages (features included) run to their own end; with `wait` in
#                   the list, the tier stages before it no longer stop the features (run the
#                   feature modules beside several short stages: features=spec:lora,gemma3-270m,wait)
#   fresh-stacks    one fresh-node row (the primed snapshot reused, or made) with every engine
#                   process's Python stacks sampled every $STACK_SAMPLES s (default 0.1): where
#                   the fresh node's "other" (~4 s: engine-core start, worker init) goes; read with
#                   python -m wcache.benchmarks.stacks fresh-stacks.logs/fresh-node.stacks --timeline
# STAGE@GPU (any stage, e.g. pairs=3@H200, arch-all@H100) runs only when GPU is a word of
# nvidia-smi's GPU name (any case) and is logged as skipped, naming the GPU, otherwise: one
# plan for a call that may land on an H100 or an H200 (a call naming nvidia-h200 can get an
# H100). Side stages (features, arch=) start with the next tier stage; the bench checkpoint
# (MODEL_KIND's, default the 8B) is written beside the first stage when a pairs or
# fresh-stacks stage runs on this GPU. Each stage's start and exit go to pipe.log.
# Example (2026-12-05's plan): bash tools/gpu/pipeline.sh features,arch=deepseek_v2:deepseek_v3:llava:gemma3,moe-compiled,pairs=4
set -uo pipefail
STAGES=${1:?stages, e.g. moe-compiled,pairs=3}
WC=${WCACHE_PIPELINE_DIR:-/tmp/wc}
G=${RUN_DIR:-/tmp/gout}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$HERE" != "$WC" ]; then  # copy the checkout (bytecode and mtimes kept), run from there
  rm -rf "$WC" "$G" && mkdir -p "$WC" "$G"
  tar -C "$HERE" --exclude=./.vx --exclude=./.venv -cf - . | tar -C "$WC" -xf -
  setsid nohup bash "$WC/tools/gpu/pipeline.sh" "$STAGES" > "$G/pipe-run.log" 2>&1 < /dev/null &
  echo "[pipeline] started in the background from $WC (pid $!): $STAGES; poll with tools/gpu/poll.sh"
  exit 0
fi
cd "$WC"
export WCACHE_GPU_VLLM=${WCACHE_GPU_VLLM:-0.33.0}
source tools/gpu/env.sh || exit 2
export OUT=$G
mkdir -p "$OUT"
L=$OUT/pipe.log
log() { echo "[pipe $(date -u +%T)] $*" >> "$L"; }
log "stages: $STAGES (vLLM $WCACHE_GPU_VLLM)"
# FIXTURE_FORMATS=bf16 when no stage needs the quantized fixtures (features=spec:lora-tx, arch-all)
FORMATS=${FIXTURE_FORMATS:-bf16,fp8,awq}
log "fixtures $FORMATS"
WCACHE_FIXTURES_DEVICE=cuda python3 -m wcache.testing.fixtures --formats "$FORMATS" >> "$OUT/fixtures.log" 2>&1
log "fixtures exit $?"
SIDE=()       # pids of side stages waiting for a tier stage to end
FEATURES=""   # the features stage's session id (stopped when its tier stage ends)
IFS=, read -r -a LIST <<< "$STAGES"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
on_this_gpu() {  # STAGE[@GPU]: true unless it names a GPU (one word of nvidia-smi's name) this is not
  [[ $1 != *@* ]] && return 0
  local only=${1#*@}
  [[ -n $only && $only != *@* && " ${GPU,,} " == *" ${only,,} "* ]]
}
BENCH_STAGES=""  # the stages that run the phases bench on this GPU (they need the checkpoint)
for st in "${LIST[@]}"; do
  on_this_gpu "$st" && [[ ${st%%@*} == pairs=* || ${st%%@*} == fresh-stacks ]] && BENCH_STAGES+="$st "
done
if [ -n "$BENCH_STAGES" ]; then
  # the primed snapshot is not made here: beside the tier its priming engine finds the GPU
  # shared (on an H100, 2026-12-05, it failed to start) and vLLM's startup plan would
  # record that busy GPU's free memory for the fresh nodes; the pairs stage primes alone
  ( python3 -c "from pathlib import Path; from wcache.benchmarks.bench_phases import model_setup; model_setup('${MODEL_KIND:-8b}', 'cuda', Path('${WCACHE_BENCH_DIR:-/tmp/wcache-phases}')${MOE_LAYERS:+, moe_layers=$MOE_LAYERS})" > "$OUT/checkpoint.log" 2>&1
    log "checkpoint ${MODEL_KIND:-8b} exit $?" ) &
  SIDE+=($!)
fi
KEEP_FEATURES=0  # a `wait` stage in the list: the features run until it, not stopped by a tier
[[ ",$STAGES," == *,wait,* ]] && KEEP_FEATURES=1
end_side() {  # after a tier stage: wait for the side stages, stop the features
  for p in "${SIDE[@]}"; do wait "$p"; done
  SIDE=()
  [ "$KEEP_FEATURES" = 1 ] && return 0
  if [ -n "$FEATURES" ] && kill -0 "$FEATURES" 2>/dev/null; then
    log "features still running: stopped"; kill -- -"$FEATURES" 2>/dev/null; sleep 5
    kill -9 -- -"$FEATURES" 2>/dev/null
  fi
  FEATURES=""
  pkill -f "wcache serve" 2>/dev/null; sleep 2
}
tier() {  # name, run-tier.sh arguments...
  local name=$1; shift
  log "$name: start"
  FIXTURE_FORMATS=bf16 TIER_TIMEOUT=${TIER_TIMEOUT:-900} TIER_LOG=tier-$name.pytest.log \
    bash tools/gpu/run-tier.sh --no-preflight "$@" > "$OUT/tier-$name.log" 2>&1
  log "$name: exit $?"
  end_side
}
gemma3_fixture() {  # stage name: Gemma 3 270M's bf16 fixture, with the bundle's newer
  # transformers (the image's 5.17 breaks Gemma 3's GGUF tokenizer; the builder refuses
  # it); the engines keep the image's
  log "$1 fixture: start"
  PYTHONPATH=$(dirname "${WCACHE_GPU_SITE:-/tmp/site}")/site-gguf-tokenizer:$PYTHONPATH \
    python3 -m wcache.testing.fixtures --model gemma3 --formats bf16 > "$OUT/fixtures-gemma3.log" 2>&1
  log "$1 fixture: exit $?"
}
for st in "${LIST[@]}"; do
  if ! on_this_gpu "$st"; then
    log "${st%%@*}: skipped (the GPU is ${GPU:-unknown}, not '${st#*@}')"; continue
  fi
  st=${st%%@*}
  case "$st" in
    features|features=*)
      mods=sleep:spec:lora; [[ $st == features=* ]] && mods=${st#features=}
      IFS=: read -r -a MODS <<< "$mods"
      setsid bash tools/gpu/run-features.sh "${MODS[@]}" > "$OUT/features-run.log" 2>&1 &
      FEATURES=$!; log "features: started (session $FEATURES): ${MODS[*]}" ;;
    arch=*)
      archs=${st#arch=}; archs=${archs//:/,}
      ( python3 -m wcache.testing.arch_sweep --device cuda --archs "$archs" --formats bf16,online-fp8 \
          --workers 4 --stop-after "${ARCH_STOP_AFTER:-420}" --resume --out "$OUT/arch-sweep-cuda.jsonl" > "$OUT/arch-run.log" 2>&1
        log "arch $archs: exit $?" ) &
      SIDE+=($!); log "arch $archs: started" ;;
    arch-all)
      which=${ARCH_WHICH:-all}; [[ ",$STAGES," == *,gemma3-sweep,* ]] && which=tiny  # gemma3-sweep runs its rows
      if [ -n "${ARCH_RESUME:-}" ]; then
        cat "$ARCH_RESUME" >> "$OUT/arch-sweep-cuda.jsonl" && log "arch-all: resumes over $ARCH_RESUME"
      fi
      log "arch-all: start (--archs $which, ${ARCH_WORKERS:-16} workers)"
      python3 -m wcache.testing.arch_sweep --device cuda --archs "$which" --formats bf16,online-fp8 \
        --workers "${ARCH_WORKERS:-16}" --resume --out "$OUT/arch-sweep-cuda.jsonl" > "$OUT/arch-all.log" 2>&1
      log "arch-all: exit $?" ;;
    gemma3-sweep)  # a side stage: the fixture (bundle's transformers), then the sweep rows
      ( gemma3_fixture gemma3-sweep
        python3 -m wcache.testing.arch_sweep --device cuda --archs gemma3-270m \
          --formats bf16,online-fp8,fp8 --workers 3 --resume --out "$OUT/arch-sweep-gemma3.jsonl" \
          > "$OUT/arch-gemma3-270m.log" 2>&1
        log "gemma3-sweep rows: exit $?" ) &
      SIDE+=($!); log "gemma3-sweep: started" ;;
    moe-compiled) tier moe-compiled --workers 10 -k "moe and compiled" ;;
    gemma3-270m)  # needs a WCACHE_GPU_GEMMA3=1 bundle (the real Gemma 3 270M; docs/gpu.md)
      gemma3_fixture gemma3-270m
      tier gemma3-270m --workers 6 -k gemma3
      log "gemma3-270m sweep: start"
      python3 -m wcache.testing.arch_sweep --device cuda --archs gemma3-270m \
        --formats bf16,online-fp8,fp8,ct_w8a8_fp8 --workers 4 --resume --out "$OUT/arch-sweep-cuda.jsonl" \
        > "$OUT/arch-gemma3-270m.log" 2>&1
      log "gemma3-270m sweep: exit $?" ;;
    # gemma3: its own stage (its fixture needs the bundle's transformers: built here with the
    # image's, each case failed in the builder, 2026-12-06)
    dense) tier dense --workers 12 -k "not moe and not lora and not sleep and not spec_decode and not gemma3" ;;
    pairs=*)
      end_side
      n=${st#pairs=}
      nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$L"
      log "pairs: start ($n pairs)"
      OUT_NAME=pairs PAIRS=$n STARTUP_PLAN=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-1500} \
        bash tools/gpu/bench-phases.sh disk-compiled-cold,fresh-node > "$OUT/bench-run.log" 2>&1
      log "pairs: exit $?" ;;
    fresh-stacks)
      end_side
      log "fresh-stacks: start"
      OUT_NAME=fresh-stacks STACK_SAMPLES=${STACK_SAMPLES:-0.1} STARTUP_PLAN=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-900} \
        bash tools/gpu/bench-phases.sh fresh-node > "$OUT/stacks-run.log" 2>&1
      log "fresh-stacks: exit $?" ;;
    wait)
      log "wait: the side stages and features"
      KEEP_FEATURES=0
      if [ -n "$FEATURES" ]; then wait "$FEATURES"; log "features: exit $?"; FEATURES=""; fi
      end_side ;;
    *) log "unknown stage $st: skipped" ;;
  esac
done
end_side
log "done"
