"""The on-disk start-up caches a vLLM engine reads and writes, redirected per run.

An engine on a fresh node finds every one of these empty; a restart on the same
node finds what the last start wrote. Tests and benchmarks give each engine (or
each "node") its own set under one root to control which it sees:

- ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``): vLLM's torch.compile cache
  (``torch_compile_cache/``: the AOT-compiled function and, with AOT compile, the
  Inductor cache of that hash under ``torch_aot_compile/{hash}/inductor_cache``),
  and vLLM's other per-model files.
- ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``): compiled Triton kernels
  (the TRITON_ATTN attention kernels, Inductor's generated kernels).
- ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``): Inductor's
  FX-graph and autotune cache (vLLM's AOT compile points it under its own hash dir
  once it runs; set here so nothing lands in the shared default before that).
- ``CUDA_CACHE_PATH`` (default ``~/.nv/ComputeCache``): the driver's PTX JIT cache.

Source: vllm/envs.py (VLLM_CACHE_ROOT), vllm/compilation/decorators.py
(``torch_aot_compile/{hash}``, TORCHINDUCTOR_CACHE_DIR), triton/runtime/cache.py.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CACHE_ENV_DIRS", "cache_env"]

#: Environment variable -> sub-directory of the root it is pointed at.
CACHE_ENV_DIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "CUDA_CACHE_PATH": "nv",
}


def cache_env(root: str | Path) -> dict[str, str]:
    """The environment that points every start-up cache of an engine under ``root``
    (created if missing): an empty ``root`` is a fresh node, a reused one a restart.

    Returns:
        ``{variable: path}`` for each of :data:`CACHE_ENV_DIRS`.
    """
    root = Path(root)
    env = {}
    for var, sub in CACHE_ENV_DIRS.items():
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(root / sub)
    return env
