"""The engine side: vLLM load format ``wcache``.

``LLM(model, load_format="wcache", model_loader_extra_config={...})`` or
``vllm serve MODEL --load-format wcache``. Options (all optional):

==================  =========  ====================================================
option              default    meaning
==================  =========  ====================================================
socket_dir          per user   the daemon's socket directory
mode                zero_copy  ``zero_copy`` (map the daemon's bytes) or ``copy``
fallback            true       load from disk when the daemon is missing or refuses
connect_timeout_s   5.0        how long to try connecting to the daemon (seconds)
strict              false      restore guard also compares content checksums
share_prepacks      true       a tied embedding/lm_head shares one oneDNN prepack
                               (CPU; vLLM builds two identical ones)
job                 ""         separates two jobs of the same model on one host
freeze_gc           true       CUDA: freeze the gc heap before vLLM's timed load
timing_file         none       append a JSON line with the load-phase time
profile_file        none       write cProfile stats of the whole load phase there
artifacts           true       after a restore, install the daemon's start-up
                               artifacts (torch.compile, Triton) into this engine's
                               caches when they fit its vLLM (wcache.vllm.startup)
artifacts_record    none       write this engine's compile factors there (JSON;
                               ``wcache serve --prime-compile``'s priming run)
draft               restore    speculative decoding, ``draft_model``: ``restore``
                               the draft from its own daemon (``wcache serve
                               --model DRAFT --job draft``; by the ``fallback``
                               rule) or load it from ``disk`` (only the target
                               restored)
draft_job           "draft"    the ``--job`` of the draft's daemon (a socket of its
                               own: a draft of the target's architecture and dtype
                               would otherwise share the target's socket name)
==================  =========  ====================================================

Order of work: build the model on the meta device with vLLM's own
``initialize_model``; resolve a plan for every layer (unplanned layers ->
``plan-missing`` before the daemon is contacted; with ``fallback`` a WARNING names
each layer and why, and the model loads from disk); attach; install
tensors and tied aliases as the same object; replay each plan's restore under
the guard; verify nothing is left on meta; keep the mapping alive on the model.
vLLM's ``process_weights_after_loading`` is never called on mapped tensors during
the restore.

After a successful restore, vLLM's weight updates (``model.load_weights`` through
``collective_rpc``, ``reload_weights`` with an iterator, in kernel format or from
disk) work: on CPU the mapping turns copy-on-write (each page an update writes
becomes the engine's own, the daemon's bytes never change); on CUDA ``zero_copy``
over ``cuda_vmm`` the first update copies the arena into the engine at the same
addresses (CUDA graphs and torch.compile see it); over ``cuda_ipc`` an eager
engine copies the tensors an update writes, and an engine with CUDA graphs or
torch.compile refuses the update (``update-unsupported``) before any write. vLLM's reload metadata is kept for
this. Sleep mode and expert rebalancing on CUDA ``zero_copy`` are refused at load
(``update-unsupported``). See docs/quickstart.md, "Mapped weights and weight updates".

Speculative decoding (:func:`spec_role`): vLLM loads the drafter through this
loader too, after the target. A ``draft_model`` draft is a plain model of its own
checkpoint: it has its own key and its own daemon's socket, and is restored from
there (option ``draft``; a missing daemon takes the ``fallback`` rule, the log
saying "draft"). An EAGLE head (``eagle``, ``eagle3``) is built from the target's
speculative config, which no daemon builds on its own: it loads from disk (a few
MB) and vLLM then points its ``embed_tokens``/``lm_head`` at the target's restored
modules, so each shared tensor is mapped once, by the target's attachment, and
closed once with it. Methods with no draft weights (``ngram``, ``suffix``) never
reach the loader. Any other method is refused at the target's load
(``spec-unsupported``, by the ``fallback`` rule).
"""

from __future__ import annotations

import collections
import cProfile
import dataclasses
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from vllm import envs
from vllm.config import LoadConfig, ModelConfig, VllmConfig
from vllm.config.compilation import CompilationMode
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model

from wcache.core import WcacheError
from wcache.errors import (
    MetaBuildUnsupported,
    RestoreFailed,
    SpecDecodeUnsupported,
    UpdateUnsupported,
)
from wcache.shell import PARAM_FLAGS_EXTRA
from wcache.store import CacheKey, DaemonMissing, KeyMismatch, StoreError, attach
from wcache.vllm import compat, startup
from wcache.vllm.key import build_key, device_id, parallel_layout
from wcache.vllm.model import (
    ModelMismatch,
    initialize_on_meta,
    install_tensors_,
    meta_leftovers,
    plan_ids,
    planned_layers,
    restore_layers_,
)
from wcache.vllm.probe import host_target

#: Under vLLM's "vllm" logger so its handler prints our lines in engine logs.
logger = logging.getLogger("vllm.wcache")

LOAD_FORMAT = "wcache"
TIMED_DISK_FORMAT = "wcache_timed_auto"
DEFAULT_CONNECT_TIMEOUT_S = 5.0  # a local daemon answers in milliseconds; 5 s covers a busy host
#: Status probe of other daemons when ours is missing (seconds): a live local
#: daemon answers in milliseconds; this only bounds the diagnosis.
STATUS_PROBE_S = 1.0

#: Option ``draft``: restore a ``draft_model`` draft from its own daemon, or load it
#: from disk (only the target restored).
DRAFT_RESTORE, DRAFT_DISK = "restore", "disk"
DRAFT_SOURCES = (DRAFT_RESTORE, DRAFT_DISK)
#: Option ``draft_job``'s default: the socket name holds the architecture, dtype,
#: quantization, parallel sizes and job (wcache.vllm.key.job_digest), not the model,
#: so a draft like its target (two bf16 LlamaForCausalLM) needs a job of its own.
DEFAULT_DRAFT_JOB = "draft"
#: vLLM's speculative method with a separate draft model: a plain model of its own
#: checkpoint, which a ``wcache serve`` of that checkpoint serves.
#: Source: vllm/v1/spec_decode/draft_model.py::DraftModelProposer (0.32 and 0.33).
SPEC_DRAFT_MODEL = "draft_model"
#: Speculative methods whose drafter has no weights: vLLM never calls a loader for it.
#: Source: vllm/v1/spec_decode/ngram_proposer.py, ngram_proposer_gpu.py, suffix_decoding.py.
SPEC_NO_DRAFT_WEIGHTS = ("ngram", "ngram_gpu", "suffix")
#: EAGLE heads: built from the target's speculative config
#: (``EagleLlamaForCausalLM``, ``Eagle3LlamaForCausalLM``, ...), so they load from
#: disk, and vLLM then shares the target's embed_tokens/lm_head with them.
#: Source: vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.load_model
#: (``_maybe_share_embeddings``, ``_maybe_share_lm_head``).
SPEC_HEADS = ("eagle", "eagle3")
#: Every speculative method a restored engine supports (tests/vllm/test_spec_decode_loader.py;
#: engines: tests/e2e/test_spec_decode_e2e.py, tests/gpu_engine/test_spec_decode_engines.py).
SPEC_SUPPORTED = (*SPEC_NO_DRAFT_WEIGHTS, SPEC_DRAFT_MODEL, *SPEC_HEADS)
#: What :func:`spec_role` answers.
ROLE_TARGET, ROLE_DRAFT, ROLE_HEAD = "target", "draft", "head"


@attrs.frozen
class LoaderOptions:
    socket_dir: str | None = None
    mode: str = "zero_copy"
    fallback: bool = True
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    strict: bool = False
    share_prepacks: bool = True
    freeze_gc: bool = True
    job: str = ""
    timing_file: str | None = None
    profile_file: str | None = None
    artifacts: bool = True
    artifacts_record: str | None = None
    draft: str = DRAFT_RESTORE
    draft_job: str = DEFAULT_DRAFT_JOB

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | str | None) -> LoaderOptions:
        """Parse ``model_loader_extra_config``; strings (from ``vllm serve``'s command
        line) are converted.

        Raises:
            ValueError: an unknown key or a value of the wrong type, naming the key.
        """
        if isinstance(extra, str):  # vLLM's LoadConfig keeps a JSON string as given
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except ValueError as exc:
                raise ValueError(
                    f"wcache: model_loader_extra_config is not valid JSON ({exc}): {extra!r}"
                ) from None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(
                "wcache: model_loader_extra_config must be a dict (or its JSON text), "
                f"not {extra!r}"
            )
        extra = dict(extra or {})
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"wcache: unknown model_loader_extra_config keys {unknown}; known: {sorted(known)}"
            )
        if extra.get("draft", DRAFT_RESTORE) not in DRAFT_SOURCES:
            raise ValueError(
                f"wcache: draft must be one of {list(DRAFT_SOURCES)}, not {extra['draft']!r}"
            )
        if extra.get("mode", "zero_copy") not in ("zero_copy", "copy"):
            raise ValueError(f"wcache: mode must be 'zero_copy' or 'copy', not {extra['mode']!r}")
        for flag in ("fallback", "strict", "share_prepacks", "freeze_gc", "artifacts"):
            if flag in extra:
                extra[flag] = _parse_bool(flag, extra[flag])
        if "connect_timeout_s" in extra:
            value = extra["connect_timeout_s"]
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                seconds = math.nan
            if not (math.isfinite(seconds) and seconds > 0) or isinstance(value, bool):
                raise ValueError(
                    f"wcache: connect_timeout_s must be a positive number of seconds, not {value!r}"
                )
            extra["connect_timeout_s"] = seconds
        for name in (
            "socket_dir",
            "job",
            "draft_job",
            "timing_file",
            "profile_file",
            "artifacts_record",
        ):
            # job and draft_job are part of the socket's name: None (JSON null) would
            # name another socket than the daemon's default job and miss it
            nullable = name not in ("job", "draft_job")
            value = extra.get(name)
            if name in extra and not (nullable and value is None) and not isinstance(value, str):
                raise ValueError(f"wcache: {name} must be a string, not {value!r}")
        return cls(**extra)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # JSON's 0/1, as the message lists
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise ValueError(
        f"wcache: {name} must be true or false (or one of "
        f"{'/'.join(_TRUE + _FALSE)}), not {value!r}"
    )


def _same_rank_daemons(
    key: Any, socket_dir: str | None, job: str
) -> Iterator[tuple[str, Any, Any]]:
    """``(socket, key, job)`` of each daemon in ``socket_dir`` that answers ``status``
    for this engine's rank (tp, pp, dp) other than its own (equal key and job); a
    daemon that does not answer within :data:`STATUS_PROBE_S` is skipped."""
    from wcache.store import daemon_status  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)
    from wcache.store.paths import default_socket_dir, list_sockets  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

    try:
        socks = list_sockets(os.path.abspath(socket_dir or default_socket_dir()))
    except (OSError, StoreError):
        return
    ranks = ("tp_rank", "pp_rank", "dp_rank")
    mine = {r: (key.fields.get("parallel") or {}).get(r) for r in ranks}
    for sock in socks:
        try:
            st = daemon_status(sock, connect_timeout_s=STATUS_PROBE_S)
            other = CacheKey(st["key_fields"])
        except (StoreError, OSError, KeyError, TypeError, ValueError):
            continue
        if {r: (other.fields.get("parallel") or {}).get(r) for r in ranks} != mine:
            continue  # another rank's daemon (of this or another job) says nothing about ours
        if st.get("job") == job and not key.diff(other):
            continue  # our own daemon: it answers status, not the request (stalled)
        yield sock, other, st.get("job")


def _job_fix(sock: str, their_job: Any, job: str, *, own_socket_free: bool = True) -> str:
    """The sentence naming the daemon at ``sock`` that serves the engine's key under
    another job, and how to reach it; the second way, a daemon of the engine's own
    job, only where the engine's own socket is free (a daemon of another checkpoint
    holding it would refuse that start with daemon-busy: break13 #5)."""
    named = f"under job {their_job!r}" if isinstance(their_job, str) else "under another job"
    own = (
        ", or start a daemon " + (f"with --job {job}." if job else "without --job.")
        if own_socket_free
        else "."
    )
    return (
        f"the daemon at {sock} serves the same configuration (an equal key) {named}: "
        f"give the engine that daemon's `wcache serve --job` (model_loader_extra_config "
        f"job; `wcache verify --job`){own}"
    )


def _diagnose_missing(exc: Exception, key: Any, socket_dir: str | None, job: str = "") -> Exception:
    """A daemon for *another* configuration (dtype, quantization, parallel sizes,
    job) listens on a different socket; name the differing key fields instead of
    reporting no daemon at all, or, when its key equals ours, the job (which is in
    the socket's name, not in the key) and how to pass it. Returns ``exc`` when no
    other daemon answers (the engine's own daemon, equal key and job, that answered
    ``status`` but stalled on the request, is not another: break11 #3)."""
    from wcache.store import DaemonMissing, KeyMismatch  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

    best = min(  # the first daemon of the fewest differing key fields
        _same_rank_daemons(key, socket_dir, job), key=lambda d: len(key.diff(d[1])), default=None
    )
    if best is None:
        return exc
    sock, other, their_job = best
    if not key.diff(other):
        # the same key on another socket: only the job (in the socket's name) differs,
        # so no daemon serves this job: daemon-missing, not key-mismatch (break16 #8)
        return DaemonMissing(
            f"no daemon serves this engine's configuration under job {job!r} ({exc}); "
            + _job_fix(sock, their_job, job)
        )
    err = KeyMismatch(
        f"no daemon serves this engine's configuration ({exc}); the daemon at "
        f"{sock} serves another: {key.versions_note(other)}key differs in "
        f"{key.describe_diff(other)}. Start "
        f"`wcache serve` with the engine's arguments.",
        fields=key.diff(other),
    )
    return err


def _diagnose_mismatch(
    exc: KeyMismatch, key: Any, socket_dir: str | None, job: str = ""
) -> KeyMismatch:
    """The engine's own socket serves another key (``exc``, a key-mismatch); when
    another daemon of the socket dir serves exactly this engine's key under another
    job (the engine's job was forgotten or wrong), say so and how to reach it
    (break12 #3). Returns ``exc`` otherwise."""
    for sock, other, their_job in _same_rank_daemons(key, socket_dir, job):
        if not key.diff(other):
            return KeyMismatch(
                f"{exc}; but {_job_fix(sock, their_job, job, own_socket_free=False)}",
                fields=exc.fields,
                theirs=exc.theirs,
            )
    return exc


@attrs.frozen
class EngineCounters:
    """What this engine process saw of wcache, the engine-side half of ``wcache serve
    --http``'s ``/metrics`` (logged in one INFO line per load by :func:`count_load`).

    Attributes:
        restores: loads restored from a daemon.
        fallbacks: ``(reason code, count)`` of loads that fell back to disk, sorted.
        restore_s: seconds spent in restores, summed (units: seconds).
    """

    restores: int = 0
    fallbacks: tuple[tuple[str, int], ...] = ()
    restore_s: float = 0.0

    def record(self, phase: str, seconds: float, code: str | None = None) -> EngineCounters:
        """These counters after one load (``phase`` ``restore`` or ``fallback``)."""
        if phase == "restore":
            return attrs.evolve(
                self, restores=self.restores + 1, restore_s=self.restore_s + seconds
            )
        counts = dict(self.fallbacks)
        counts[str(code)] = counts.get(str(code), 0) + 1
        return attrs.evolve(self, fallbacks=tuple(sorted(counts.items())))

    def line(self) -> str:
        """The INFO line: ``restores=N restore_s=S fallbacks=M (code=n ...)``."""
        total = sum(n for _, n in self.fallbacks)
        codes = " ".join(f"{c}={n}" for c, n in self.fallbacks)
        return f"restores={self.restores} restore_s={self.restore_s:.3f} fallbacks={total}" + (
            f" ({codes})" if codes else ""
        )


_counters = EngineCounters()


def count_load(phase: str, seconds: float, code: str | None = None) -> EngineCounters:
    """Add one load to this process's :class:`EngineCounters` and log them (one INFO line)."""
    global _counters
    _counters = _counters.record(phase, seconds, code)
    last = f"{phase} {seconds:.3f} s" + (f" [{code}]" if code else "")
    logger.info("wcache: engine counters (this process): %s; last load: %s", _counters.line(), last)
    return _counters


def _record_timing(opts: LoaderOptions, phase: str, seconds: float, **info: Any) -> None:
    logger.info("wcache: weight-load phase (%s) took %.3f s", phase, seconds)
    if opts.timing_file:
        with open(opts.timing_file, "a") as f:
            f.write(json.dumps({"phase": phase, "seconds": seconds, **info}) + "\n")


#: Why an engine with expert rebalancing is not restored (update-unsupported), and the fix.
EPLB_REFUSAL = (
    "expert rebalancing (enable_eplb) is not restored: vLLM runs it only with expert "
    "parallelism over several ranks (enable_expert_parallel with TP, PCP or DP > 1), whose "
    "expert map a restore cannot build, and it rewrites expert weights in place between "
    "steps. Fix: load this engine from disk (load_format='auto'), or drop --enable-eplb "
    "and --enable-expert-parallel (the experts are then sharded by tensor parallelism, "
    "which is restored)"
)


def _update_refusal(
    vllm_config: VllmConfig, device: torch.device, opts: LoaderOptions
) -> str | None:
    """Why a weight-mutation path this engine enables cannot run on a restored
    model, or None (see docs/quickstart.md, "Mapped weights and weight updates").

    Sleep mode on CUDA with ``zero_copy``: the weights are the daemon's device
    memory, which sleep mode can neither offload nor free (level 2 then needs a
    reload into it); it works with ``mode=copy`` (a private copy, allocated inside
    the engine's own pools), and on CPU, where every write lands in copy-on-write
    pages (:meth:`Attachment.allow_private_writes_`).

    Expert rebalancing (EPLB) on every device and mode (:data:`EPLB_REFUSAL`): vLLM
    runs it only with expert parallelism over more than one rank
    (``enable_expert_parallel`` with TP, PCP or DP > 1: vllm/config/parallel.py
    ``ParallelConfig.__post_init__``, 0.32 and 0.33), whose expert map a restore
    cannot build (:func:`wcache.vllm.model.expert_parallel_ranks`); the loader asks
    this before it raises that build's ``meta-build``, so the refusal names the
    feature the user enabled.
    """
    if getattr(getattr(vllm_config, "parallel_config", None), "enable_eplb", False):
        return EPLB_REFUSAL
    if device.type == "cpu" or opts.mode == "copy":
        return None
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        return (
            "sleep mode cannot offload or free the daemon's zero_copy device memory, and "
            "level 2 reloads weights into it; set model_loader_extra_config mode='copy' "
            "(or load from disk)"
        )
    return None


def spec_method(vllm_config: VllmConfig) -> str | None:
    """The engine's speculative-decoding method (``speculative_config.method``), or
    None without speculative decoding.

    Source: vllm/config/speculative.py::SpeculativeConfig.method (0.32 and 0.33).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else str(getattr(spec, "method", None))


def spec_role(vllm_config: VllmConfig, model_config: ModelConfig) -> str:
    """Which model of a speculative-decoding engine this load builds.

    vLLM loads the drafter through the engine's loader after the target:
    ``DraftModelProposer`` with ``vllm_config.model_config`` set to the draft's
    config, EAGLE-style proposers with ``model_config=speculative_config.
    draft_model_config`` (and the target's ``vllm_config.model_config``). Both pass
    the very ``draft_model_config`` object, which is how a draft load is told apart
    (an MTP draft even has the target's model path).

    Methods without drafter weights whose ``draft_model_config`` *is* the target's
    (``ngram``, ``ngram_gpu``, ``custom_class``: vLLM points it at
    ``target_model_config``) have only the target's load.

    Returns:
        ``"target"`` (no speculative decoding, or the target's load); ``"draft"``
        (the ``draft_model`` method's draft: restorable from its own daemon);
        ``"head"`` (any other method's drafter: loads from disk).

    Source: vllm/v1/spec_decode/draft_model.py::DraftModelProposer._get_model,
        vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer._get_model;
        0.33's GPU model runner: vllm/v1/worker/gpu/spec_decode/standalone_ar/
        speculator.py::load_draft_model, eagle/utils.py::load_eagle_model (the same
        ``draft_model_config`` object; seen on the H200).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    draft = None if spec is None else getattr(spec, "draft_model_config", None)
    if draft is None or model_config is not draft:
        return ROLE_TARGET
    # ngram, ngram_gpu and custom_class set draft_model_config to the target's own
    # config object (vllm/config/speculative.py, SpeculativeConfig.__post_init__): a
    # load with it is the target's (break18 D1: ngram's target was loaded from disk)
    if draft is getattr(spec, "target_model_config", None):
        return ROLE_TARGET
    return ROLE_DRAFT if spec_method(vllm_config) == SPEC_DRAFT_MODEL else ROLE_HEAD


def _spec_refusal(vllm_config: VllmConfig) -> str | None:
    """Why a restored engine does not run this engine's speculative method, or None
    (no speculative decoding, or a method in :data:`SPEC_SUPPORTED`)."""
    method = spec_method(vllm_config)
    if method is None or method in SPEC_SUPPORTED:
        return None
    return (
        f"speculative decoding method {method!r} is not supported on a restored engine "
        f"(supported: {', '.join(SPEC_SUPPORTED)}): its drafter's weights and what it "
        f"shares with the target are untested with mapped weights. Fix: load this engine "
        f"from disk (load_format='auto'), or use method 'draft_model' (draft restored from "
        f"`wcache serve DRAFT`) or an EAGLE head ('eagle', 'eagle3')"
    )


#: The fix an engine's meta-build refusal names.
ENGINE_META_BUILD_FIX = "load this model from disk (load_format='auto'), or keep fallback=true"


def _clone_privatize_(tensors: list[torch.Tensor], lo: int, hi: int) -> int:
    """Give each tensor whose data lies in the arena ``[lo, hi)`` its own copy
    (``t.data = t.data.clone()``: the same Parameter object, so tied aliases and
    vLLM's references follow, but a **new address**: only for an engine that runs
    eagerly, see :func:`_install_update_hooks_`). Returns the bytes copied."""
    copied = 0
    for t in tensors:
        if t.numel() and lo <= t.data_ptr() < hi:
            t.data = t.data.clone()
            copied += t.numel() * t.element_size()
    return copied


#: How many frames above :func:`_called_from_reload` vLLM's
#: ``get_parameter_for_reload`` may be (the policy's callback, compat's
#: ``get_submodule`` wrapper, then its caller; one spare).
RELOAD_CALLER_DEPTH = 5
#: vLLM's kernel-format ``reload_weights`` resolves each name through this function
#: (the same in 0.32 and 0.33), then ``param.copy_``.
RELOAD_CALLER = ("vllm.model_executor.model_loader.reload.inplace", "get_parameter_for_reload")


def _called_from_reload() -> bool:
    """Whether vLLM's kernel-format reload (``get_parameter_for_reload``) is on the
    stack just above the ``get_submodule`` hook: other callers (LoRA's module
    replacement, weight tying) only read the module tree and must not trigger a
    copy or a refusal."""
    frame = inspect.currentframe()
    for _ in range(RELOAD_CALLER_DEPTH):
        frame = None if frame is None else frame.f_back
        if frame is None:
            return False
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == RELOAD_CALLER:
            return True
    return False


#: What a weight update does, per policy of :func:`_install_update_hooks_` (a log line).
_POLICY_NOTE = {
    "in_place": "the first one copies the arena into this engine at the same addresses",
    "refuse": "refused (update-unsupported): cuda_ipc with CUDA graphs or torch.compile",
    "clone": "each one copies the tensors it writes (new addresses; eager engine)",
}


def _address_bound(vllm_config: VllmConfig) -> bool:
    """Whether this engine's compiled code or captured CUDA graphs hold weight
    addresses: not ``enforce_eager``, and torch.compile (:func:`_compiles`) or a
    ``cudagraph_mode`` other than ``NONE``.

    Source: vllm/config/compilation.py (``CompilationConfig.cudagraph_mode``,
    ``CUDAGraphMode``), vllm/config/model.py (``enforce_eager``); 0.32 and 0.33.
    """
    if vllm_config.model_config.enforce_eager:
        return False
    if _compiles(vllm_config):
        return True
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def _ipc_refusal() -> UpdateUnsupported:
    return UpdateUnsupported(
        "wcache: weight update refused before any tensor was written: this engine maps the "
        "daemon's weights over cuda_ipc and runs CUDA graphs or torch.compile, which hold the "
        "weights' addresses, and cuda_ipc memory can become private only at new addresses "
        "(the graphs would keep computing with the old weights). The engine keeps serving "
        "the weights it has. Fix: serve over cuda_vmm (the daemon's default where the "
        "driver supports it; `wcache status` shows the transport), or set "
        "model_loader_extra_config mode='copy', or run the engine with enforce_eager=True."
    )


def _install_update_hooks_(
    model: torch.nn.Module, attachment: Any, address_bound: bool = False
) -> str:
    """Private writes for a CUDA ``zero_copy`` model, whose mapping cannot be made
    copy-on-write: before vLLM first writes weights, the daemon's memory is replaced
    by this engine's own; the daemon's memory is never written.

    Per transport (``attachment.keeps_addresses_on_write``):

    * ``cuda_vmm``: the whole arena is privatized in place, once
      (:meth:`Attachment.privatize_in_place_`): every address stays, so CUDA graphs
      and torch.compile'd code see the update.
    * ``cuda_ipc`` with ``address_bound`` (graphs or torch.compile): the first write
      raises :class:`UpdateUnsupported` before any tensor is touched; the engine
      keeps serving the old weights.
    * ``cuda_ipc`` eager: the tensors an update writes get private copies (new
      addresses, which an eager engine reads afresh each step).

    The hooks fire before each of vLLM's ways of writing:

    * ``model.load_weights`` (called directly through ``collective_rpc``, by
      vLLM 0.33's weight-transfer engines, and by ``reload_weights`` in checkpoint
      format);
    * the start of a checkpoint-format ``reload_weights`` (:func:`compat.hook_reload_start_`),
      before vLLM moves the layers' tensors aside;
    * ``model.get_submodule`` called by vLLM's kernel-format reload
      (``get_parameter_for_reload``, then ``param.copy_``).

    Returns:
        ``"in_place"``, ``"refuse"`` or ``"clone"``: the policy installed.

    On CPU, tests/vllm/test_update_hooks.py checks each policy with fakes standing in
    for the mapping; tests/gpu_engine/test_weight_updates_graphs.py on the H200.
    """
    lo, hi = attachment.arena_range

    if attachment.keeps_addresses_on_write:
        policy = "in_place"

        def before_write() -> None:
            copied = attachment.privatize_in_place_()
            if copied:
                logger.info(
                    "wcache: weight update: the mapped arena (%.1f MiB) copied into this "
                    "engine's own device memory at the same addresses (cuda_vmm; "
                    "outside vLLM's memory budget)",
                    copied / 2**20,
                )

        def before_load_weights() -> None:
            before_write()

        def before_module_write(module: torch.nn.Module) -> None:
            if _called_from_reload():
                before_write()
    elif address_bound:
        policy = "refuse"

        def before_write() -> None:
            raise _ipc_refusal()

        def before_load_weights() -> None:
            before_write()

        def before_module_write(module: torch.nn.Module) -> None:
            if _called_from_reload():
                before_write()
    else:
        policy = "clone"

        def before_write() -> None:
            pass  # the tensors are known only once vLLM set them aside (load_weights)

        def before_load_weights() -> None:
            copied = _clone_privatize_(
                list(model.parameters())
                + list(model.buffers())
                + compat.reload_kernel_tensors(model),
                lo,
                hi,
            )
            if copied:
                logger.info(
                    "wcache: weight update: %.1f MiB of mapped weights copied into the "
                    "engine (cuda_ipc, eager: new addresses)",
                    copied / 2**20,
                )

        def before_module_write(module: torch.nn.Module) -> None:
            if _called_from_reload():
                _clone_privatize_(
                    list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)),
                    lo,
                    hi,
                )

    compat.hook_reload_start_(model, before_write)
    compat.wrap_weight_writers_(
        model, before_load_weights=before_load_weights, before_module_write=before_module_write
    )
    return policy


def _compiles(vllm_config: VllmConfig) -> bool:
    """Whether this engine runs torch.compile: not ``enforce_eager``, and a compilation
    mode other than ``NONE`` (an eager engine's compile hash differs from a compiled
    one's, and it would use no artifact anyway).

    Source: vllm/config/compilation.py (``CompilationMode``), vllm/config/model.py
    (``ModelConfig.enforce_eager``); the same fields in vLLM 0.32 and 0.33.
    """
    return (
        not vllm_config.model_config.enforce_eager
        and vllm_config.compilation_config.mode != CompilationMode.NONE
    )


def _startup_plan_hint(
    manifest: dict[str, Any], reasons: tuple[tuple[str, str], ...], info: dict[str, Any]
) -> None:
    """Note in ``info`` (``startup_plans``, ``startup_plans_skipped``) the vLLM startup
    plans a bundle carries and how many were not installed (``reasons``: the install's),
    and say in the log when this engine does not apply them: a plan skipped for another
    ``gpu_memory_utilization``, or vLLM's switch ``VLLM_ENABLE_STARTUP_PLAN=1`` off
    (vllm/v1/worker/startup_plan.py, 0.33+; an operator's switch this loader leaves
    alone)."""

    plans = startup.startup_plans(manifest)
    if not plans:
        return
    info["startup_plans"] = len(plans)
    skipped = [n for n, why in reasons if why == startup.SKIP_PLAN_BUDGET]
    if skipped:
        info["startup_plans_skipped"] = len(skipped)
        logger.info(
            "wcache: vLLM's startup plan not installed: this engine's "
            "gpu_memory_utilization differs from the priming engine's, and a plan "
            "would set the KV cache's size regardless (start the daemon with the "
            "engines' --gpu-memory-utilization to carry a plan that fits)"
        )
    elif not getattr(envs, startup.STARTUP_PLAN_ENV, False):
        logger.info(
            "wcache: the start-up artifacts carry vLLM's startup plan (the KV-cache "
            "memory the priming engine profiled); set %s=1 on the engine to apply it "
            "and skip memory profiling",
            startup.STARTUP_PLAN_ENV,
        )


def _startup_artifacts(opts: LoaderOptions, vllm_config: VllmConfig, dev_id: str) -> dict[str, Any]:
    """After a restore: record this engine's compile factors (``artifacts_record``),
    then, when the engine compiles, fetch the daemon's start-up artifact bundle,
    check it against this engine's vLLM and install it into this engine's caches
    (never overwriting an entry). Never fails the load: every outcome is one log line.

    Returns:
        The ``artifacts`` part of the restore's timing record (``timing_file``):
        ``{"seconds", "outcome", ...}`` with outcome ``off`` (+ reason ``not
        compiling`` for an eager engine: nothing fetched), ``missing``, ``stale``
        (+ ``reason``), ``installed`` or ``present`` (every entry already there; both
        + ``installed``, ``installed_by_root`` (entries per cache root), ``skipped``,
        ``nbytes``, ``compile_dirs``, and the startup-plan counts) or ``error``
        (+ ``reason``); ``ptxas`` when a compiling engine's ``TRITON_PTXAS_PATH`` was
        set here (:func:`wcache.vllm.startup.pin_triton_ptxas`). Its seconds are not
        part of the restore's (the restore record's ``seconds`` stays the weight-load
        phase of before).
    """
    from wcache.store import socket_path  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)
    from wcache.store.client import fetch_artifacts  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    try:
        mine = startup.engine_factors(vllm_config)
        if opts.artifacts_record:
            startup.write_factors(opts.artifacts_record, mine)
        if _compiles(vllm_config) and (ptxas := startup.pin_triton_ptxas()) is not None:
            info["ptxas"] = ptxas  # the priming engine's and every restoring one's
            logger.info(
                "wcache: %s=%s (torch's ptxas, pinned before any Triton compile so this "
                "engine's Triton cache keys match the priming engine's)",
                startup.PTXAS_ENV,
                ptxas,
            )
        if not opts.artifacts:
            outcome = "off"
        elif not _compiles(vllm_config):
            outcome = "off"
            info["reason"] = "not compiling"
        else:
            bundle = fetch_artifacts(socket_path(opts.socket_dir, dev_id), opts.connect_timeout_s)
            try:
                result, reason = startup.install_for_engine(bundle, mine)
            finally:
                bundle.close()
            if result is None:  # stale: ``reason`` says why
                outcome = "stale"
                info["reason"] = reason
                logger.warning(
                    "wcache: start-up artifacts not used [artifacts-stale]: %s; this "
                    "engine compiles as usual",
                    reason,
                )
            else:
                outcome = "installed" if result.installed else "present"
                info.update(
                    installed=len(result.installed),
                    skipped=len(result.skipped),
                    installed_by_root=dict(
                        collections.Counter(n.split("/", 1)[0] for n in result.installed)
                    ),
                    nbytes=result.nbytes,
                    compile_dirs=startup.compile_dirs(bundle.manifest),
                )
                logger.info(
                    "wcache: start-up artifacts %s: %d entries installed (%.1f MiB), %d "
                    "skipped (already in this engine's caches, or a startup plan that "
                    "does not fit) (compile dirs %s)",
                    outcome,
                    len(result.installed),
                    result.nbytes / 2**20,
                    len(result.skipped),
                    info["compile_dirs"],
                )
                _startup_plan_hint(bundle.manifest, result.reasons, info)
    except Exception as exc:  # noqa: BLE001  (artifacts only save a compile; never fail the load)
        code = getattr(exc, "code", None) or type(exc).__name__
        outcome = "missing" if code == "artifacts-missing" else "error"
        info["reason"] = f"[{code}] {exc}"
        log = logger.info if outcome == "missing" else logger.warning
        log(
            "wcache: no start-up artifacts installed [%s]: %s; this engine compiles as usual",
            code,
            exc,
        )
    seconds = time.perf_counter() - t0
    logger.info("wcache: start-up artifacts phase took %.3f s (%s)", seconds, outcome)
    return {"seconds": round(seconds, 4), "outcome": outcome, **info}


@register_model_loader(LOAD_FORMAT)
class WcacheModelLoader(BaseModelLoader):
    """Restores a model from a wcache daemon; falls back to disk per ``fallback``."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        self._disk_loader().download_model(model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Bytes of weights this rank will map from its daemon instead of allocating.

        vLLM's GPU worker calls this before its memory snapshot and subtracts the
        result from its ``gpu_memory_utilization`` budget (``request_memory`` in
        ``vllm/v1/worker/utils.py``): the daemon's arena already counts as used on
        the device, and the engine must not size its KV cache as if it were free.
        With ``freeze_gc`` it first freezes the gc heap
        (:func:`wcache.vllm.compat.freeze_gc_heap`): the load phase comes next.

        Returns:
            The arena size in bytes of the daemon on this rank's socket when this
            load will map it zero-copy: the daemon answers, serves this device type,
            and its key equals the engine's in every field computable before the
            model is built (all but ``plans``). 0 in ``copy`` mode (the bytes are
            cloned into the engine's own allocations) and whenever the load will
            fall back to disk (no daemon, another configuration); with
            ``fallback=false`` such a load raises anyway. With speculative decoding
            by ``draft_model`` and ``draft='restore'``, plus the draft's daemon's
            arena on the same terms (the draft loads in the same phase).

        Source: vllm/model_executor/model_loader/weight_cache/ipc_loader.py::
            IpcModelLoader.get_external_weight_memory
        """
        opts = self.options
        if opts.freeze_gc:
            # vLLM calls this right before the load phase (CUDA workers only)
            logger.info(
                "wcache: froze the worker's gc heap before the load (%.3f s; "
                "freeze_gc=false turns this off)",
                compat.freeze_gc_heap(),
            )
        if opts.mode != "zero_copy" or _spec_refusal(vllm_config):
            return 0  # copy mode; a refused speculative method loads from disk
        nbytes = self._daemon_bytes(vllm_config, vllm_config.model_config, opts.job)
        spec = vllm_config.speculative_config
        if (
            spec is not None
            and spec_method(vllm_config) == SPEC_DRAFT_MODEL
            and opts.draft == DRAFT_RESTORE
            and spec.draft_model_config is not None
        ):
            nbytes += self._daemon_bytes(
                vllm_config, spec.draft_model_config, opts.draft_job, draft=True
            )
        return nbytes

    def _daemon_bytes(
        self, vllm_config: VllmConfig, model_config: ModelConfig, job: str, draft: bool = False
    ) -> int:
        """The arena bytes of the daemon serving ``model_config`` under ``job`` on this
        rank, or 0 when the load will not map it (see :meth:`get_external_weight_memory`)."""
        from wcache.store import daemon_status, socket_path  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

        opts = self.options
        device = torch.device(vllm_config.device_config.device)
        try:
            layout = parallel_layout()
            sock = socket_path(opts.socket_dir, device_id(device, model_config, layout, job))
            status = daemon_status(sock, connect_timeout_s=opts.connect_timeout_s)
        except (StoreError, OSError) as exc:
            logger.warning(
                "wcache: no daemon answers for this rank (%s); counting 0 bytes of "
                "external weights (the load will fall back to disk)",
                exc,
            )
            return 0
        if status.get("device") != device.type:
            logger.warning(
                "wcache: the daemon on %s serves %r, the engine runs on %r; counting "
                "0 bytes of external weights",
                sock,
                status.get("device"),
                device.type,
            )
            return 0
        try:
            mine = build_key(model_config, layout, [], host_target(device), draft=draft)
            differ = [f for f in mine.diff(CacheKey(status["key_fields"])) if f != "plans"]
        except (StoreError, WcacheError, OSError, KeyError, TypeError) as exc:
            logger.warning(
                "wcache: cannot compare keys with the daemon on %s (%s); counting 0 "
                "bytes of external weights",
                sock,
                exc,
            )
            return 0
        if differ:
            logger.warning(
                "wcache: the daemon on %s serves another configuration (key differs "
                "in %s); counting 0 bytes of external weights",
                sock,
                differ,
            )
            return 0
        return int(status["bytes_held"])

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module) -> Any:
        """The checkpoint's weights from disk, as vLLM's default loader reads them:
        ``reload_weights()`` without an iterator reads the new weights this way (a
        restored model's writes land in its own copy-on-write pages).

        Source: vllm/model_executor/model_loader/default_loader.py::get_all_weights
        """
        return self._disk_loader().get_all_weights(model_config, model)

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        """Load the checkpoint from disk into ``model``, as vLLM's default loader does."""
        self._disk_loader().load_weights(model, model_config)

    def _disk_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(
            dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        )

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> torch.nn.Module:
        """The model, restored from the daemon (or loaded from disk by the fallback
        rule); with ``profile_file`` set, the whole call under ``cProfile``, its stats
        written there (``pstats`` format; ``python -m pstats FILE`` reads them; with
        several ranks, ``FILE.tp<R>.pp<P>`` per rank). A profile that cannot be written
        is a warning, never a failed load."""
        if not self.options.profile_file:
            return self._load_model(vllm_config, model_config, prefix)
        path = self.options.profile_file
        layout = parallel_layout()
        if layout["tp_size"] * layout["pp_size"] > 1:
            path = f"{path}.tp{layout['tp_rank']}.pp{layout['pp_rank']}"
        profiler = cProfile.Profile()
        try:
            return profiler.runcall(self._load_model, vllm_config, model_config, prefix)
        finally:
            try:
                profiler.dump_stats(path)
                logger.info("wcache: load profile written to %s", path)
            except OSError as exc:
                logger.warning("wcache: could not write the load profile to %s: %s", path, exc)

    def _load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str
    ) -> torch.nn.Module:
        opts = self.options
        role = spec_role(vllm_config, model_config)
        if role == ROLE_HEAD or (role == ROLE_DRAFT and opts.draft == DRAFT_DISK):
            return self._load_drafter_from_disk(vllm_config, model_config, prefix, role)
        t0 = time.perf_counter()
        device = torch.device(vllm_config.device_config.device)
        target = host_target(device)
        before = compat.registrations(vllm_config)
        marks = {}
        model: torch.nn.Module | None = None
        build_error: MetaBuildUnsupported | None = None
        try:
            model = initialize_on_meta(
                vllm_config,
                model_config,
                ENGINE_META_BUILD_FIX,
                prefix=prefix,
                initialize=initialize_model,  # looked up here: tests stand in for it
            )
        except MetaBuildUnsupported as exc:
            build_error = exc  # raised below, under the fallback rule
        if model is not None:
            # each layer's model-format metadata, which an in-place reload_weights
            # needs (vLLM records it inside initialize_model; outside the meta context
            # it costs half), with our device as the one a reload materializes layers on
            compat.record_reload_metadata_(model, device)
        marks["meta_init"] = time.perf_counter()
        layout = parallel_layout()
        job = opts.draft_job if role == ROLE_DRAFT else opts.job
        dev_id = device_id(device, model_config, layout, job)
        attachment = None
        try:
            # before the build's own error: expert rebalancing's expert parallelism
            # also fails the meta build, and the refusal names what the user enabled
            refusal = _update_refusal(vllm_config, device, opts)
            if refusal:
                raise UpdateUnsupported(f"wcache: {refusal}")
            if build_error is not None:
                raise build_error
            assert model is not None  # built, or build_error was raised
            # Unplanned layers are found here, before any weight or socket is touched;
            # like every other reason code, plan-missing follows the fallback rule.
            spec_refusal = _spec_refusal(vllm_config) if role == ROLE_TARGET else None
            if spec_refusal:
                raise SpecDecodeUnsupported(f"wcache: {spec_refusal}")
            planned = planned_layers(model, target)
            marks["plans"] = time.perf_counter()
            key = build_key(
                model_config, layout, plan_ids(planned), target, draft=role == ROLE_DRAFT
            )
            marks["key"] = time.perf_counter()
            try:
                attachment = attach(
                    key,
                    socket_dir=opts.socket_dir,
                    device=device.type,
                    device_id=dev_id,
                    mode=opts.mode,
                    connect_timeout_s=opts.connect_timeout_s,
                )
            except DaemonMissing as exc:
                if role == ROLE_DRAFT:
                    raise DaemonMissing(
                        f"{exc}; no daemon serves the speculative draft model "
                        f"{model_config.model} under job {job!r}. Start `wcache serve "
                        f"--model {model_config.model} --job {job}` with the engine's "
                        f"arguments, or set model_loader_extra_config draft='disk' to "
                        f"load the draft from disk"
                    ) from exc
                raise _diagnose_missing(exc, key, opts.socket_dir, job) from exc
            except KeyMismatch as exc:
                raise _diagnose_mismatch(exc, key, opts.socket_dir, job) from exc
            marks["attach"] = time.perf_counter()
            install_tensors_(
                model,
                attachment.tensors,
                attachment.kinds,
                attachment.persistent,
                attachment.aliases,
                planned,
                attachment.extra.get(PARAM_FLAGS_EXTRA),
            )
            marks["install"] = time.perf_counter()
            released = restore_layers_(
                planned,
                attachment.layers,
                target,
                strict=opts.strict,
                share_prepacks=opts.share_prepacks,
                content=attachment.writable,
            )
            marks["replay"] = time.perf_counter()
            left = meta_leftovers(model)
            if left:
                raise ModelMismatch(
                    f"after restore {len(left)} tensors are still on meta "
                    f"(first: {left[:5]}); the daemon's export or a plan misses "
                    f"them.",
                    code="restore-incomplete",
                )
            if opts.mode == "zero_copy" and released:
                attachment.release_ranges_(released)
            # Weight updates (load_weights, reload_weights, ...) write into these
            # tensors: from here on they land in the engine's own pages (CPU), or
            # the tensors they touch are copied first (CUDA).
            if not attachment.allow_private_writes_():
                policy = _install_update_hooks_(model, attachment, _address_bound(vllm_config))
                logger.info(
                    "wcache: weight updates on this %s engine: %s",
                    attachment.transport,
                    _POLICY_NOTE[policy],
                )
        except Exception as exc:  # every failure takes the fallback rule
            if attachment is not None:
                if getattr(exc, "code", None) == "guard-failed":
                    # The daemon's bytes may be rewritten: it stops serving and exits.
                    attachment.invalidate("guard-failed", str(exc))
                attachment.close()
            code = (
                getattr(exc, "code", None) if isinstance(exc, (StoreError, WcacheError)) else None
            )
            if code is None:  # not one of ours: a bug or an unexpected vLLM state
                code = "restore-error"
                logger.exception("wcache: unexpected error during restore")
            rank = f"tp_rank={layout['tp_rank']} pp_rank={layout['pp_rank']}"
            if role == ROLE_DRAFT:
                rank += f" for the speculative draft model {model_config.model}"
            del model  # the meta build: neither a raise nor the disk load keeps it
            compat.forget_registrations_(vllm_config, before)
            if not opts.fallback:
                raise RestoreFailed(
                    f"wcache restore failed on {rank} [{code}]: {exc} "
                    f"(fallback=false, so no disk load).",
                    code=code,
                ) from exc
            logger.warning("wcache: falling back to disk on %s [%s]: %s", rank, code, exc)
            t1 = time.perf_counter()
            model = self._disk_loader().load_model(vllm_config, model_config, prefix)
            t2 = time.perf_counter()
            # the whole load phase: the meta build and every wait on the daemon too
            _record_timing(
                opts,
                "fallback",
                t2 - t0,
                reason=code,
                tp_rank=layout["tp_rank"],
                before_fallback_s=round(t1 - t0, 4),
                disk_s=round(t2 - t1, 4),
            )
            count_load("fallback", t2 - t0, code)
            return model
        compat.keep_attachment_(model, attachment)  # the mapping lives as long as the model
        marks["verify"] = time.perf_counter()
        steps, prev = {}, t0
        for name, t in marks.items():
            steps[name] = round(t - prev, 4)
            prev = t
        restore_s = time.perf_counter() - t0
        artifacts = _startup_artifacts(opts, vllm_config, dev_id)
        _record_timing(
            opts,
            "restore",
            restore_s,
            layers=len(planned),
            artifacts=artifacts,
            tp_rank=layout["tp_rank"],
            nbytes=attachment.nbytes,
            steps=steps,
            transport=attachment.transport,
            mode=opts.mode,
            guard="content" if attachment.writable else "read-only-mapping",
        )
        if role == ROLE_DRAFT:
            logger.info(
                "wcache: speculative draft model %s restored from its own daemon (%s)",
                model_config.model,
                dev_id,
            )
        logger.info(
            "wcache: restored %d layers via %s (%s; guard: %s)",
            len(planned),
            attachment.transport,
            opts.mode,
            "content checksums" if attachment.writable else "read-only mapping + metadata",
        )
        count_load("restore", restore_s)
        return model.eval()

    def _load_drafter_from_disk(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, role: str
    ) -> torch.nn.Module:
        """A speculative drafter that loads from disk by design (not a fallback: no
        daemon is asked): an EAGLE-style head (``role="head"``), which vLLM then
        points at the target's restored embed_tokens/lm_head, or a ``draft_model``
        draft with option ``draft='disk'``."""
        t0 = time.perf_counter()
        model = self._disk_loader().load_model(vllm_config, model_config, prefix)
        seconds = time.perf_counter() - t0
        if role == ROLE_HEAD:
            logger.info(
                "wcache: speculative %s drafter %s loaded from disk in %.3f s (no daemon "
                "builds it outside the target's engine); vLLM shares the target's "
                "restored embed_tokens/lm_head with it where it has none of its own",
                spec_method(vllm_config),
                model_config.model,
                seconds,
            )
        else:
            logger.info(
                "wcache: speculative draft model %s loaded from disk in %.3f s (draft='disk')",
                model_config.model,
                seconds,
            )
        _record_timing(self.options, "disk", seconds, spec_role=role)
        return model


@register_model_loader(TIMED_DISK_FORMAT)
class TimedDiskLoader(DefaultModelLoader):
    """vLLM's DefaultModelLoader (format ``auto``), timed the same way as restore, so
    the demo and benchmarks compare like with like."""

    def __init__(self, load_config: LoadConfig):
        self.options = LoaderOptions.from_extra(load_config.model_loader_extra_config)
        super().__init__(
            dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
        )

    def load_model(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = ""
    ) -> torch.nn.Module:
        t0 = time.perf_counter()
        model = super().load_model(vllm_config, model_config, prefix)
        _record_timing(self.options, "disk", time.perf_counter() - t0)
        return model
