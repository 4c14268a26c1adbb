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
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_ENV_DIRS",
    "cache_env",
    "host_cache_dirs",
    "tree_state",
    "cache_states",
    "cache_writes",
    "carried_triton_keys",
    "triton_compiled",
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


#: Triton's group file of a cache entry: ``__grp__{kernel}.json`` (triton/runtime/cache.py).
_TRITON_GROUP = "__grp__"
#: Files of an entry kept for a twin's diagnosis (:func:`triton_compiled`): its metadata
#: (options and the cache-invalidating environment) and its TTIR (constants and
#: specialisation inline).
_TWIN_FILES = (".json", ".ttir")


def carried_triton_keys(snapshot_dir: str | Path) -> set[str]:
    """The Triton cache keys (entry directory names) the start-up bundles of a
    snapshot carry: every ``triton`` entry of ``DIR/.startup/*/startup.json``
    (wcache.store.artifacts' manifest; wcache.store.snapshot.STARTUP_DIR).
    Unreadable manifests are skipped: this is a benchmark's diagnosis, not a check."""
    keys: set[str] = set()
    for manifest in Path(snapshot_dir).glob(".startup/*/startup.json"):
        try:
            entries = json.loads(manifest.read_text()).get("entries") or ()
        except (OSError, ValueError, AttributeError):
            continue
        for e in entries:
            if isinstance(e, Mapping) and e.get("root") == "triton" and e.get("path"):
                keys.add(str(e["path"]).split("/", 1)[0])
    return keys


def _kernel_of(entry: Path) -> str | None:
    groups = sorted(entry.glob(f"{_TRITON_GROUP}*.json"))
    return groups[0].name[len(_TRITON_GROUP) : -len(".json")] if groups else None


def triton_compiled(
    triton_dir: str | Path, carried: Collection[str], keep: str | Path | None = None
) -> dict[str, Any]:
    """What an engine compiled itself into a Triton cache a start-up bundle had filled.

    Triton keeps one directory per compiled kernel, named by its cache key
    (triton/runtime/cache.py ``get_cache_key``: Triton's own hash, the kernel's source
    with its constants and argument specialisation, the backend, the options, the
    cache-invalidating environment). An entry not in ``carried`` was compiled during
    the start. A *twin* is such an entry whose kernel name a carried entry has too:
    the same kernel under another key, so the carried one was missed. For each twin
    the metadata fields (``{kernel}.json``: options and environment) that differ from
    its carried namesake's are listed; none differing points at the key's source part.

    Args:
        triton_dir: the engine's ``TRITON_CACHE_DIR``.
        carried: the keys the bundle installed (:func:`carried_triton_keys`).
        keep: when set, each twin's and its namesakes' ``.json`` and ``.ttir`` files
            are copied under ``keep/{key}/`` for a diff.

    Returns:
        ``{"carried": carried entries present, "compiled": {kernel: count},
        "twins": {kernel: {"key": compiled key, "carried_key": namesake's key,
        "metadata_differs": {field: [carried value, compiled value]}, "ptx_same",
        "cubin_same": whether the two entries' PTX / cubin bytes are equal (None: a
        file missing)}}}``. Same metadata and PTX with another cubin: another ptxas.
    """
    base = Path(triton_dir)
    entries = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    kernel = {p.name: _kernel_of(p) for p in entries}
    carried_by_kernel: dict[str, list[str]] = {}
    for key, name in kernel.items():
        if key in carried and name:
            carried_by_kernel.setdefault(name, []).append(key)
    compiled: dict[str, int] = {}
    twins: dict[str, dict[str, Any]] = {}
    for key, name in kernel.items():
        if key in carried:
            continue
        label = name or "?"
        compiled[label] = compiled.get(label, 0) + 1
        if not name or name not in carried_by_kernel or name in twins:
            continue
        # the carried entry of the same PTX, if any (a kernel can be carried in several
        # specialisations): the one this entry stands in for
        namesake = next(
            (
                k
                for k in carried_by_kernel[name]
                if _same_bytes(base / k / f"{name}.ptx", base / key / f"{name}.ptx")
            ),
            carried_by_kernel[name][0],
        )
        twins[name] = {
            "key": key,
            "carried_key": namesake,
            "metadata_differs": _metadata_diff(
                base / namesake / f"{name}.json", base / key / f"{name}.json"
            ),
            "ptx_same": _same_bytes(base / namesake / f"{name}.ptx", base / key / f"{name}.ptx"),
            "cubin_same": _same_bytes(
                base / namesake / f"{name}.cubin", base / key / f"{name}.cubin"
            ),
        }
        if keep is not None:
            for k in (key, *carried_by_kernel[name]):
                for f in (base / k).iterdir():
                    if f.suffix in _TWIN_FILES and not f.name.startswith(_TRITON_GROUP):
                        (Path(keep) / k).mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, Path(keep) / k / f.name)
    return {
        "carried": sum(1 for k in kernel if k in carried),
        "compiled": compiled,
        "twins": twins,
    }


def _same_bytes(a: Path, b: Path) -> bool | None:
    """Whether two files hold the same bytes; None when one cannot be read."""
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return None


def _metadata_diff(a: Path, b: Path) -> dict[str, list[Any]]:
    """``{field: [a's value, b's value]}`` of two Triton metadata files, the ``hash``
    field (the key itself) left out; ``{"unreadable": [...]}`` when one cannot be read."""
    try:
        ma, mb = json.loads(a.read_text()), json.loads(b.read_text())
    except (OSError, ValueError) as exc:
        return {"unreadable": [str(a), str(exc)]}
    if not isinstance(ma, dict) or not isinstance(mb, dict):
        return {"unreadable": [str(a), "not a JSON object"]}
    return {
        k: [ma.get(k), mb.get(k)]
        for k in sorted(set(ma) | set(mb))
        if k != "hash" and ma.get(k) != mb.get(k)
    }
