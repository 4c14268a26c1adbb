#!/usr/bin/env bash
# On the H200 machine, after tools/gpu/device-setup.sh: the engine-feature tests whose
# engines are module-scoped (speculative decoding, sleep mode, LoRA), one module at a time
# in one serial pytest each (xdist would start each module's engines once per worker).
# Run it beside the tier with the tier excluding them:
#   bash tools/gpu/run-tier.sh -k "not lora and not sleep and not spec_decode" &
#   bash tools/gpu/run-features.sh [spec] [sleep] [lora] [lora-tx]   (default: the first three)
#   lora-tx: only LoRA on cuda_ipc and mode=copy (the bf16 transport rows of docs/quickstart.md)
# Writes to $OUT: features.log (every module's output), results.jsonl rows, fixtures.log.
# FEATURES_PARALLEL=1: the modules run side by side (one GPU holds their engines), each
# pytest's output in features-NAME.log, the start and exit lines still in features.log:
# the wall time of the longest module, not the sum, when device time is short.
# Cost: not yet measured as one script; each module ran in minutes on the H200 (2026-12-04),
# so run it in the background and poll features.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
WHAT=("$@"); [ ${#WHAT[@]} -eq 0 ] && WHAT=(spec sleep lora)
for w in "${WHAT[@]}"; do
  case "$w" in spec|sleep|lora|lora-tx) ;; *) echo "run-features: unknown module $w (spec, sleep, lora, lora-tx)" >&2; exit 2 ;; esac
done
source tools/gpu/env.sh || exit 2
OUT=${OUT:-/tmp/wcache-gpu-out}
mkdir -p "$OUT"
export WCACHE_GPU_ENGINE_RESULTS=${WCACHE_GPU_ENGINE_RESULTS:-$OUT/results.jsonl}
#: seconds per pytest run (a device call allows 600; run this script in the background)
MODULE_TIMEOUT=${MODULE_TIMEOUT:-595}
# FIXTURE_FORMATS=bf16 for spec, sleep and lora-tx (only lora's quantized cases need fp8, awq)
WCACHE_FIXTURES_DEVICE=cuda python3 -m wcache.testing.fixtures --formats "${FIXTURE_FORMATS:-bf16,fp8,awq}" \
  >>"$OUT/fixtures.log" 2>&1 || { tail -30 "$OUT/fixtures.log"; exit 1; }
eval "$(python3 -m wcache.testing.engine_acceptance --preflight "$WCACHE_FIXTURES_DIR/smollm2-135m-instruct-bf16")"
one() {  # name, log, pytest arguments...
  local name=$1 log=$2; shift 2
  echo "[run-features] $name: start $(date -u +%T)" | tee -a "$OUT/features.log"
  timeout "$MODULE_TIMEOUT" python3 -m pytest -p no:cacheprovider -s -rfEs "$@" >>"$log" 2>&1
  echo "[run-features] $name: exit $? at $(date -u +%T)" | tee -a "$OUT/features.log"
}
run() {  # name, pytest arguments...
  if [ "${FEATURES_PARALLEL:-0}" = 1 ]; then
    one "$1" "$OUT/features-$1.log" "${@:2}" &
  else
    one "$1" "$OUT/features.log" "${@:2}"
  fi
}
for w in "${WHAT[@]}"; do
  case "$w" in
    spec) run spec tests/gpu_engine/test_spec_decode_engines.py ;;
    sleep) run sleep tests/gpu_engine/test_sleep_engines.py ;;
    lora) run lora-bf16 -k bf16 tests/gpu_engine/test_lora_engines.py
          run lora-quantized -k "fp8 or awq" tests/gpu_engine/test_lora_engines.py ;;
    lora-tx) run lora-transports -k copy_and_cuda_ipc tests/gpu_engine/test_lora_engines.py ;;
  esac
done
wait
grep -hE "^\[run-features\]|passed|failed|error" "$OUT"/features*.log | tail -40
