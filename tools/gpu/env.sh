# Source on the H200 machine after tools/gpu/device-setup.sh: the environment every wcache GPU
# command needs there. The checkout comes first on PYTHONPATH (the code under test), then one vLLM
# version's tree (WCACHE_GPU_VLLM, e.g. 0.33.0; default: the first version the bundle holds), then
# the shared dependencies, then wcache's installed metadata (its vllm.general_plugins entry point).
# Switch versions in one shell with `export WCACHE_GPU_VLLM=0.32.0; source tools/gpu/env.sh` (a bare
# `WCACHE_GPU_VLLM=0.32.0 source ...` would not keep the variable for later commands).
_wc_site=${WCACHE_GPU_SITE:-/tmp/site}
if [ ! -s "$_wc_site/.wcache-gpu-ready" ]; then
  echo "env.sh: no vLLM bundle installed ($_wc_site/.wcache-gpu-ready missing): run tools/gpu/device-setup.sh first" >&2
  return 2 2>/dev/null || exit 2
fi
WCACHE_GPU_VLLM=${WCACHE_GPU_VLLM:-$(head -1 "$_wc_site/.wcache-gpu-ready")}
if ! grep -qx "$WCACHE_GPU_VLLM" "$_wc_site/.wcache-gpu-ready"; then
  echo "env.sh: vLLM $WCACHE_GPU_VLLM is not in the bundle (it holds: $(tr '\n' ' ' < "$_wc_site/.wcache-gpu-ready")); set WCACHE_GPU_VLLM to one of those, or rebuild the bundle with it (tools/gpu/build-bundle.sh)" >&2
  return 2 2>/dev/null || exit 2
fi
export WCACHE_GPU_VLLM
export PYTHONPATH=$PWD:$(dirname "$_wc_site")/vllm-$WCACHE_GPU_VLLM:$_wc_site:/tmp/wcache-dist
unset _wc_site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# FlashInfer is not in the bundle (vLLM imports it for its sampler unless told not to);
# FlashAttention's kernels were left out unless the bundle was built with WCACHE_GPU_FA=1 (engines
# use TRITON_ATTN; MLA cases prefill on vLLM's PyTorch "CPU" MLA prefill backend, see
# wcache.testing.arch_sweep.MLA_PREFILL_BACKEND).
export VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's usage reporting and its version check would try the network, which the machine lacks.
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Keep NVLink multicast off (the device README: it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WCACHE_FIXTURES_DIR=${WCACHE_FIXTURES_DIR:-/tmp/wcache-fixtures}
