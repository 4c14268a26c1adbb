#!/usr/bin/env bash
# The H200 side of the GPU harness, one verb per call (docs/gpu.md):
#
#   bash tools/gpu/device.sh recv            # copy the bundle chunks this call carried to /tmp/vx
#   bash tools/gpu/device.sh setup           # reassemble + install (tools/gpu/device-setup.sh)
#   bash tools/gpu/device.sh tier [ARGS]     # fixtures, then the gpu_engine tier (tools/gpu/run-tier.sh)
#   bash tools/gpu/device.sh all [ARGS]      # recv + setup + tier: the last transfer call
#
# The machine keeps /tmp only while it stays in use (about 30 s between calls): issue the
# transfer calls back to back, or `setup` finds chunks missing and says which.
set -euo pipefail
cd "$(dirname "$0")/../.."
RECV=${WCACHE_GPU_RECV:-/tmp/vx}
verb=${1:-}; shift || true
recv() {
  mkdir -p "$RECV"
  local n=0
  for c in .vx/chunk.*; do
    [ -f "$c" ] || continue
    cp "$c" "$RECV/"; n=$((n + 1))
  done
  echo "[device] received $n chunk(s); $RECV now holds: $(cd "$RECV" && ls | tr '\n' ' ')"
}
case "$verb" in
  recv) recv ;;
  setup) bash tools/gpu/device-setup.sh .vx/bundle.sha ;;
  tier) bash tools/gpu/run-tier.sh "$@" ;;
  all) recv; bash tools/gpu/device-setup.sh .vx/bundle.sha; bash tools/gpu/run-tier.sh "$@" ;;
  *) echo "usage: tools/gpu/device.sh recv|setup|tier|all [run-tier args]" >&2; exit 2 ;;
esac
