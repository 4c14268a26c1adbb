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

import getpass
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_ENV_DIRS",
    "cache_env",
    "host_cache_dirs",
    "tree_state",
    "cache_states",
    "cache_writes",
]

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


def host_cache_dirs(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The start-up caches :func:`cache_env` does not redirect, by name: what an engine
    on one machine shares with every later engine there (FlashInfer's and torch's JIT
    kernels and the rest of ``XDG_CACHE_HOME``, the defaults of the redirected ones,
    Inductor's default root).

    Source: flashinfer/jit/env.py (``~/.cache/flashinfer``), torch/_inductor/runtime/
    cache_dir_utils.py (``/tmp/torchinductor_$USER``), the CUDA driver
    (``~/.nv/ComputeCache``), triton/runtime/cache.py (``~/.triton``).
    """
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return {
        "xdg_cache": Path(env.get("XDG_CACHE_HOME") or home / ".cache"),
        "nv_default": home / ".nv",
        "triton_default": home / ".triton",
        "inductor_default": Path(tempfile.gettempdir()) / f"torchinductor_{user}",
        "vllm_config": home / ".config" / "vllm",
    }


def tree_state(base: Path) -> dict[str, int]:
    """``{path relative to base: size in bytes}`` of every regular file under ``base``
    (symlinks not followed; ``{}`` when ``base`` is missing)."""
    out: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue  # removed while walking
            if stat.S_ISREG(st.st_mode):
                out[os.path.relpath(p, base)] = st.st_size
    return out


def cache_states(dirs: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """:func:`tree_state` of each of ``dirs``."""
    return {name: tree_state(Path(d)) for name, d in dirs.items()}


#: New files listed per cache by :func:`cache_writes`, largest first.
LARGEST_LISTED = 5


def cache_writes(
    before: Mapping[str, Mapping[str, int]],
    after: Mapping[str, Mapping[str, int]],
    largest: int = LARGEST_LISTED,
) -> dict[str, dict[str, Any]]:
    """What appeared in each cache during a run, from :func:`cache_states` before and
    after: ``{name: {"files": new files, "bytes": their bytes, "changed": files whose
    size changed, "largest": [[path, bytes], ...]}}``, only for caches that changed.
    The host's caches (:func:`host_cache_dirs`) are shared: what another process wrote
    meanwhile counts too; and an engine's own writes include what its loader installed
    (a start-up bundle)."""
    out: dict[str, dict[str, Any]] = {}
    for name, now in after.items():
        was = before.get(name, {})
        new = {p: s for p, s in now.items() if p not in was}
        changed = sum(1 for p, s in now.items() if p in was and was[p] != s)
        if new or changed:
            out[name] = {
                "files": len(new),
                "bytes": sum(new.values()),
                "changed": changed,
                "largest": [[p, s] for p, s in sorted(new.items(), key=lambda x: -x[1])[:largest]],
            }
    return out
