"""Test-only: make this Python process see an AVX2-only x86 host.

Put this folder on ``PYTHONPATH`` together with ``WCACHE_EMULATE_CPU_BUILD=avx2``
(see :func:`wcache.testing.isa.build_env`): torch then reports no AVX512,
AVX512-BF16 or AMX, so vLLM's ``import_kernels`` loads ``_C_AVX2`` exactly as on
an AVX2 host; ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` (set
by the same helper) cap oneDNN and ATen. Spawned children inherit both, so
vLLM's workers see the same host. Never used outside tests and benchmarks.
"""

import os

if os.environ.get("WCACHE_EMULATE_CPU_BUILD") == "avx2":
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
