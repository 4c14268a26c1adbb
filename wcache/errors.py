"""Every wcache error: one root, each class also the matching builtin, each with a
reason code of its own (CONTRIBUTING.md, "Errors"). Imports nothing from wcache, so every layer can
raise them.

The reason codes are what users see: the engine's fallback log line
(``falling back to disk ... [code]``), ``wcache serve: error [code]``, the daemon's
refusal counters (``/metrics``: ``wcache_refusals_total{code=...}``) and
docs/quickstart.md's table. A code is declared by exactly one class (a subclass
that declares none is a refinement of its parent's reason, e.g.
:class:`UnplannedLayers` is a ``plan-missing``); ``tests/test_errors.py`` checks
that, and that every class is also a builtin exception.

Left where they are (their modules are being rewritten by other work; they are
under this root and their codes are unique all the same): the stage errors of
``wcache.stages`` (``StageInputError``, ``OpUnavailable``, ``Fp8LayoutError``,
``MarlinLayoutError``, ``Mxfp8LayoutError``, ``Nvfp4LayoutError``) and
``wcache.vllm.compat.UntestedVllm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "name_some",
    # plans, stages, restore (the functional core)
    "WcacheError",
    "NoPlan",
    "PlanInvalid",
    "StageContractError",
    "RestoreWroteSharedTensor",
    "RecordedMismatch",
    "RestoreIncomplete",
    "ModelMismatch",
    "PlanArgumentError",
    "UpdateUnsupported",
    "SpecDecodeUnsupported",
    "MetaBuildUnsupported",
    # checkpoint and the daemon's load
    "CheckpointCorrupt",
    "ConfigInvalid",
    "LoadFailed",
    "PrepareFailed",
    # the weight store
    "StoreError",
    "DaemonMissing",
    "KeyMismatch",
    "TransportFailed",
    "ProtocolError",
    "ConnectionClosed",
    "IdleTimeout",
    "ShmTooSmall",
    "DaemonBusy",
    "Released",
    "UnsafePath",
    "PeerRefused",
    "CheckpointChanged",
    "ArenaInvalidated",
    "HttpListenFailed",
    "SeedListenFailed",
    "SeedFailed",
    "SeedUnavailable",
    "SeedSecretUnsafe",
    "SnapshotMissing",
    "SnapshotCorrupt",
    "SnapshotStale",
    "SnapshotWriteFailed",
    "ArtifactsMissing",
    "ArtifactsCorrupt",
    "PrimingFailed",
    # the vLLM side
    "UnplannedLayers",
    "MAX_NAMED_UNPLANNED",
    "RestoreFailed",
    "VerifyRefused",
    # benchmarks and test fixtures
    "DiskFull",
    "WorkerFailed",
    "FixtureError",
    "SweepResultsInvalid",
    "UnreadableArtifact",
]

# --------------------------------------------------------------------------- plans, stages, restore


class WcacheError(Exception):
    """Root of every wcache error. ``code`` is a stable reason code (e.g.
    ``"plan-missing"``); the message says what happened and what to do."""

    code = "wcache-error"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class NoPlan(WcacheError, ValueError):
    """No plan matches a (method, layer, target); the message gives the reason."""

    code = "plan-missing"


class PlanInvalid(WcacheError, ValueError):
    """A plan violates the stage rules (docs/design.md section 3); lists every violation."""

    code = "plan-invalid"


class StageContractError(WcacheError, RuntimeError):
    """A stage returned something its declaration does not allow (an undeclared
    write, a missing read) or mutated an input."""

    code = "stage-contract"


class RestoreWroteSharedTensor(WcacheError, RuntimeError):
    """Restore changed a shared (mapped) tensor: pointer, shape, stride, dtype,
    version counter or content. Names the layer, tensor and stage."""

    code = "guard-failed"


class RecordedMismatch(WcacheError, RuntimeError):
    """A value recomputed during restore differs from the one the daemon recorded
    (e.g. ``use_w4a8`` on a host with a different ISA than the daemon's)."""

    code = "recorded-mismatch"


class RestoreIncomplete(WcacheError, RuntimeError):
    """Restore lacks a tensor or a recorded value the plan needs."""

    code = "restore-incomplete"


class ModelMismatch(WcacheError, RuntimeError):
    """The daemon's export does not fit the engine's model (an extra or missing tensor)."""

    code = "model-mismatch"


class PlanArgumentError(WcacheError, TypeError):
    """``plan_for`` was called with something it cannot resolve (no layer sizes, a
    vLLM object outside :mod:`wcache.vllm`, no Target); the message says what to pass."""

    code = "plan-argument"


class UpdateUnsupported(WcacheError, RuntimeError):
    """A vLLM weight-mutation path cannot run on a restored model with this transport;
    refused before any tensor is touched, the engine serving on. At load: sleep mode
    on CUDA ``zero_copy``, and expert rebalancing on every device and mode (it needs
    expert parallelism over several ranks, which a restore does not build). At the
    first weight write: an
    engine with CUDA graphs or torch.compile mapping the daemon's weights over
    ``cuda_ipc`` (a private copy would need new addresses, which the captured graphs
    would never read). The message names the path and the settings that make it
    work (``cuda_vmm``, ``mode=copy``, ``enforce_eager=True``; for expert
    rebalancing, a disk load)."""

    code = "update-unsupported"


class SpecDecodeUnsupported(WcacheError, ValueError):
    """The engine's speculative-decoding method is not one a restored engine supports;
    refused at the target's load, before the daemon is contacted (so, like every
    reason code, it follows ``fallback``: with ``fallback=true`` the engine loads
    from disk). Supported: methods without draft weights (``ngram``, ``ngram_gpu``,
    ``suffix``), ``draft_model`` (the draft restored from its own daemon or loaded
    from disk) and EAGLE heads (``eagle``, ``eagle3``: loaded from disk, sharing
    the target's restored embedding and lm_head). The message names the method and
    the fix."""

    code = "spec-unsupported"


class MetaBuildUnsupported(WcacheError, RuntimeError):
    """The engine's model reads tensor values while vLLM builds it (e.g. BLOOM's ALiBi
    slopes, ``.tolist()`` in ``BloomAttention.__init__``); a restore builds the model
    on the meta device, where no value exists. Raised at the engine's load before the
    daemon is contacted, where it follows ``fallback`` (with ``fallback=true`` the
    engine loads from disk), and by ``wcache serve`` before it loads a weight (it
    builds the model on meta first, as the engines do, and serves nothing no engine
    could restore). The message names the architecture and the fix."""

    code = "meta-build"


# --------------------------------------------------------------------------- checkpoint, the daemon's load


class CheckpointCorrupt(WcacheError, ValueError):
    """A checkpoint file cannot be what it claims (a truncated or damaged
    safetensors file); the message names the file and what is wrong with it."""

    code = "checkpoint-corrupt"


class ConfigInvalid(WcacheError, ValueError):
    """The checkpoint's ``config.json`` is missing, not JSON, or not a JSON object;
    the message names the file and the position of the problem."""

    code = "config-invalid"


class LoadFailed(WcacheError, RuntimeError):
    """The daemon's load (vLLM, transformers, safetensors) raised something wcache
    does not classify; the message names the checkpoint and the error, and the
    traceback is in the log (``--verbose``). Also ``wcache verify``'s, when vLLM's
    own build or disk load of the model fails on this host (exit 2: nothing to
    compare)."""

    code = "load-failed"


class PrepareFailed(WcacheError, RuntimeError):
    """A plan's prepare (the daemon's TRANSFORM stages) failed on what vLLM's loader
    handed over; the message names the layer, the plan, the stage error and the
    layer's tensors as vLLM left them. Nothing is served."""

    code = "prepare-failed"


# --------------------------------------------------------------------------- store


class StoreError(WcacheError, RuntimeError):
    """Root of the store's errors (arena, transports, protocol, daemon, client)."""

    code = "store-error"


class DaemonMissing(StoreError):
    """No daemon answers on the socket: none was started, it died, or it is not
    answering within the timeout. Start one with ``wcache serve``."""

    code = "daemon-missing"


class KeyMismatch(StoreError, ValueError):
    """The daemon holds weights for a different cache key; ``.fields`` names the
    differing key fields (sorted), ``.theirs`` the daemon's values of them."""

    code = "key-mismatch"

    def __init__(self, message: str, *, fields: Iterable[str] = (), theirs: dict | None = None):
        super().__init__(message)
        self.fields = sorted(fields)
        self.theirs = dict(theirs or {})


class TransportFailed(StoreError):
    """A handle could not be passed or mapped (memfd not sealed, size differs
    from the manifest, CUDA IPC open failed, wrong device)."""

    code = "transport-failed"


class ProtocolError(StoreError, ValueError):
    """A frame is malformed, truncated, oversized, of an unknown command, or the
    peer speaks another protocol version."""

    code = "protocol-error"


class SeedUnavailable(StoreError):
    """This daemon cannot seed a peer now: it serves lean and already sends as many
    seedings as it runs at once (:data:`wcache.store.lean.MAX_CONCURRENT_SEEDS`,
    each a helper process with torch), or it is stopping. Start the receiver again
    once a seeding is done, or from the checkpoint or a snapshot."""

    code = "seed-unavailable"


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly between frames."""

    code = "connection-closed"


class IdleTimeout(ProtocolError):
    """The daemon closed a connection that said nothing for too long (no ``hello``
    after connecting, or no request while holding no attachment). Connect again
    when there is something to ask."""

    code = "idle-timeout"


class ShmTooSmall(StoreError, OSError):
    """``/dev/shm`` is missing or has less free space than what wcache is about to
    start needs there (NCCL, vLLM's CPU shared-memory all-reduce, torch's CUDA IPC
    ref counters); refused before any work instead of SIGBUS or NCCL's "No space
    left on device" mid-way. The message names the size, the need and the fix."""

    code = "shm-too-small"


class DaemonBusy(StoreError):
    """Another live daemon already serves this device (its lock or its socket is
    held). Stop it first (``wcache stop``) or pick another socket dir."""

    code = "daemon-busy"


class Released(StoreError):
    """The attachment was closed; its tensors are no longer served through it."""

    code = "released"


class UnsafePath(StoreError, PermissionError):
    """A socket dir, socket or lock file is a symlink, is owned by another user,
    or is group/world accessible; or a snapshot directory, rank folder or file is
    owned by another user or group/world writable (its owner could replace what a
    daemon serves)."""

    code = "unsafe-path"


class PeerRefused(StoreError, PermissionError):
    """The peer on the socket runs as another user (SO_PEERCRED check)."""

    code = "peer-refused"


class CheckpointChanged(StoreError):
    """A checkpoint file changed, shrank, vanished or could not be read while it
    was hashed or loaded, so no key can describe the bytes that were read. Wait
    until the checkpoint is fully written, then start again."""

    code = "checkpoint-changed"


class ArenaInvalidated(StoreError):
    """A client's restore guard fired on this daemon's arena, so its bytes may have
    been rewritten: the daemon serves it to no one and exits (a supervisor starts
    a fresh one, which rebuilds the arena from the checkpoint). Engines fall back
    to disk meanwhile."""

    code = "arena-invalidated"


class HttpListenFailed(StoreError):
    """``--http HOST:PORT`` cannot be bound (in use, not an address of this host,
    or a privileged port). Pick another address or port."""

    code = "http-listen-failed"


class SeedListenFailed(StoreError):
    """``--seed-listen HOST:PORT`` cannot be bound (in use, not an address of this
    host, or a privileged port); found before the rank loads anything. Pick another
    address or port."""

    code = "seed-listen-failed"


class SeedFailed(StoreError):
    """Seeding from a peer daemon failed: it refused (another key, seeding not
    offered), the transfer broke off, or what arrived does not match the
    source's digest. Start from the checkpoint or a snapshot instead, or check
    that both daemons were started with the same engine arguments."""

    code = "seed-failed"


class SeedSecretUnsafe(StoreError, PermissionError):
    """The seeding secret file is missing, not a regular file, readable by group
    or others, or too short. ``chmod 600`` it (Kubernetes: ``defaultMode: 0400``),
    or write a new one of at least 16 random bytes."""

    code = "seed-secret-unsafe"


class SnapshotMissing(StoreError, FileNotFoundError):
    """No complete snapshot of this rank in the directory (never written, or a
    write did not finish). Start the daemon from the checkpoint with
    ``--snapshot DIR`` to write one."""

    code = "snapshot-missing"


class SnapshotCorrupt(StoreError):
    """A snapshot file is missing, unreadable, malformed or does not match its
    recorded digest. Delete the snapshot directory and write it again
    (``wcache serve --snapshot DIR``)."""

    code = "snapshot-corrupt"


class SnapshotStale(KeyMismatch):
    """The snapshot was made for another cache key (changed checkpoint, other
    engine arguments, another vLLM/wcache/torch, another host decision);
    ``.fields`` names the differing key fields. Start from the checkpoint with
    ``--snapshot DIR`` to replace it."""

    code = "snapshot-stale"


class SnapshotWriteFailed(StoreError, OSError):
    """Writing a snapshot failed: the directory is not writable, the file system
    is full, a file-size limit (``ulimit -f``) was hit, or safetensors could not
    serialize. Nothing of the write was left behind (the temp dir is removed; an
    older snapshot of that name and key stays, and the message says what space it
    holds; one of another key or a corrupt one was removed before the write). Free
    space or fix the directory's permissions, or point ``--snapshot`` elsewhere."""

    code = "snapshot-write-failed"


class ArtifactsMissing(StoreError, FileNotFoundError):
    """The daemon holds no start-up artifact bundle (it was not primed with
    ``wcache serve --prime-compile``, priming failed, or its snapshot or peer had
    none). The engine compiles as usual."""

    code = "artifacts-missing"


class ArtifactsCorrupt(StoreError):
    """A start-up artifact bundle is malformed: a file's blake3 differs from its
    manifest, a tar member escapes its entry or is not a plain file or directory,
    or the memfd is not sealed. Nothing of it is installed; delete the snapshot's
    ``startup.*`` files (or prime again)."""

    code = "artifacts-corrupt"


class PrimingFailed(WcacheError, RuntimeError):
    """``wcache serve --prime-compile``'s priming engine failed, timed out,
    serves more than one rank, or recorded no compile factors. The daemon keeps
    serving (``wcache status`` shows the reason); engines compile as usual."""

    code = "priming-failed"


def name_some(items: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then `` and N more`` for
    the rest (an error message names a few and counts the others)."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


def clip(text: str, limit: int, whole: str) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out and
    where the whole of it is (``whole``): a quoted upstream error in a one-line
    message (vLLM's unknown-architecture refusal lists every supported class)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit].rstrip()} ... ({len(text) - limit} characters more; {whole})"


# --------------------------------------------------------------------------- the vLLM side

#: Unplanned layers named one by one in a refusal before the rest are counted.
MAX_NAMED_UNPLANNED = 8


class UnplannedLayers(NoPlan):
    """Some modules' post-load work has no wcache plan on this host (reason code
    ``plan-missing``, its parent's: the engine's fallback logs it so).

    Attributes:
        layers: ``(module name, reason)`` for every unplanned module.
    """

    def __init__(self, layers: list[tuple[str, str]]):
        self.layers = tuple(layers)
        by_reason: dict[str, list[str]] = {}
        for name, reason in layers:
            by_reason.setdefault(reason, []).append(name)
        parts = []
        for reason, names in by_reason.items():
            parts.append(
                f"{len(names)} layer(s) [{name_some(names, MAX_NAMED_UNPLANNED)}]: {reason}"
            )
        super().__init__(
            f"{len(layers)} layer(s) have no wcache plan on this host: "
            + "; ".join(parts)
            + ". Serve this model with load_format='auto' where vLLM itself runs it "
            "on this host (or keep fallback=true, which loads it from disk)."
        )


class RestoreFailed(WcacheError, RuntimeError):
    """The engine's restore from the daemon failed and ``fallback=false`` forbids a
    disk load. Each instance carries the code of the step that failed (``code=``:
    ``daemon-missing``, ``key-mismatch``, ...), the one the fallback would have
    logged; ``restore-failed`` is the class's own, for a raise that names none."""

    code = "restore-failed"


class VerifyRefused(WcacheError, RuntimeError):
    """``wcache verify`` cannot run here (not enough memory, more than one rank)."""

    code = "verify-refused"


# --------------------------------------------------------------------------- benchmarks, fixtures


class DiskFull(WcacheError, OSError):
    """Not enough free disk for a synthetic checkpoint; the message says what to do."""

    code = "bench-disk-full"


class WorkerFailed(WcacheError, RuntimeError):
    """A benchmark worker process raised or died; carries its traceback."""

    code = "bench-worker-failed"


class FixtureError(WcacheError, RuntimeError):
    """A test fixture cannot be built or checked; the message says what to do."""

    code = "fixture-build"


class SweepResultsInvalid(WcacheError, ValueError):
    """An architecture-sweep results file (:mod:`wcache.testing.arch_sweep`) that is
    not one JSON row object per line, each with its ``case`` and ``outcome``; the
    message names the file, the line and the fix."""

    code = "sweep-results-invalid"


class UnreadableArtifact(WcacheError, ValueError):
    """A torch.compile AOT artifact whose compiled function is of a kind
    :func:`wcache.testing.compile_cache.compiled_graphs` cannot read; load it with
    ``torch.compiler.load_compiled_function`` in the engine's environment instead."""

    code = "compile-artifact-unknown"
