"""Readiness for orchestrators: ``wcache status --wait-ready --model DIR [engine args]``.

An init container or a readiness probe gates the engine on "every rank of the
daemon for these engine arguments serves". The engine arguments are resolved by
vLLM's own parser and ``ModelConfig`` (the dtype and quantization vLLM decides),
giving the job digest that every rank's socket name ends with
(:func:`wcache.vllm.key.device_id`); each such socket is asked for its status and
its ``parallel`` key field says which (tp_rank, pp_rank) it serves. Sockets are
matched by digest, not by full device id, so the probe needs no GPU of its own
(a CUDA device id also names the GPU's UUID). A daemon on the right socket whose key
differs in a field the engine arguments decide (``max_model_len``, vLLM's other
weight-shaping ModelConfig factors, the quantization config, the revision:
:func:`wcache.vllm.key.config_key_fields`) does not count: the engine would refuse
it (``key-mismatch``), so the probe does too, naming the field. Those fields come
from the whole engine config, built as the daemon builds it (vLLM's VllmConfig
post-init rewrites some); where vLLM builds none here (no device, ranks of other
nodes) only the socket's fields are compared. ``wcache status`` also digests the
checkpoint's files as the engine does, once a daemon answers on the rank's socket (the
daemon's load digested them first, so this is a stat per file; a probe started beside
a loading daemon does not read the checkpoint a second time), so a daemon still
serving the files of before an in-place update does not count either
(``key-mismatch`` naming the files; break14 #1). What only the engine
knows (the plans, the versions) is checked by the engine's own key comparison.

:func:`engine_ready_spec` asks vLLM (through :mod:`wcache.vllm.build` and
:mod:`wcache.vllm.key`); :func:`check_ready` and :func:`wait_ready` only talk to
sockets.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import attrs

from wcache.daemon.ranks import local_ranks
from wcache.store import CheckpointChanged, StoreError, daemon_status, paths
from wcache.store.http import Probe
from wcache.store.manifest import CHECKPOINT_CONFIG_FIELDS, canonical_json, field_mismatch_lines

log = logging.getLogger(__name__)

#: Seconds to wait for one daemon's status reply; a serving daemon answers in
#: milliseconds, and a probe must not hang on a wedged one.
STATUS_TIMEOUT_S = 2.0
#: Seconds between two checks while waiting: a daemon takes tens of seconds to
#: minutes to become ready, so one check a second costs nothing and adds < 1 s.
POLL_S = 1.0

#: Key fields that a daemon of another configuration may differ in, named when
#: only such daemons answer.
_COMPARED = ("model_arch", "dtype", "quantization", "tp_size", "pp_size")


@attrs.frozen
class ReadySpec:
    """What must serve: the job digest and the (tp_rank, pp_rank) pairs of this node.

    Attributes:
        digest: the job digest every rank's device id ends with.
        ranks: (tp_rank, pp_rank) of each rank this node's daemon hosts, sorted.
        fields: (name, value) pairs of the key fields the digest covers
            (``_COMPARED``), to name what differs when another configuration runs.
        config: (name, canonical JSON text) pairs of the key fields the engine
            arguments decide (:func:`wcache.vllm.key.config_key_fields`); a daemon
            on the digest's socket whose key differs in one does not serve these
            engine arguments. Empty: not compared.
        checkpoint: the checkpoint directory whose files' digests a daemon's
            ``checkpoint`` key field must equal, digested when a daemon answers
            (:func:`checkpoint_files`); empty: not compared.
    """

    digest: str
    ranks: tuple[tuple[int, int], ...] = attrs.field(converter=lambda r: tuple(sorted(r)))
    fields: tuple[tuple[str, Any], ...] = ()
    config: tuple[tuple[str, str], ...] = ()
    checkpoint: str = ""


@attrs.frozen
class Readiness:
    """One check's outcome: ``ok``, the reason code when not (``daemon-missing``,
    ``key-mismatch``) and a one-line message."""

    ok: bool
    code: str | None
    message: str
    serving: tuple[tuple[int, int], ...] = ()


def rank_name(rank: tuple[int, int]) -> str:
    return f"tp_rank={rank[0]} pp_rank={rank[1]}"


def engine_ready_spec(
    model: str,
    rest: list[str],
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    job: str = "",
    prog: str = "wcache status",
    checkpoint: bool = True,
) -> ReadySpec:
    """The ranks and digest a ``wcache serve`` with these arguments serves on this node.

    Args:
        model: checkpoint directory, as given to ``wcache serve``.
        rest: the other vLLM engine arguments (``--dtype bfloat16`` ...).
        prog: the command vLLM's parser names in its errors (an unknown argument
            ends it: SystemExit 2).
        checkpoint: also compare the checkpoint files' content digests (the
            ``checkpoint`` key field; skipped where they cannot be read here). False
            for the daemon's own ``/health``, whose load digests the same files.

    Raises:
        ValueError: the ranks do not split over ``nnodes`` (as ``wcache serve``).
    """
    from wcache.vllm.build import engine_config, engine_model_config  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.vllm.key import config_key_fields, job_digest  # noqa: PLC0415 (torch import ~2 s: only when called)

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    args = [*rest, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    try:
        # the whole engine config, as the daemon builds it: vLLM's VllmConfig post-init
        # rewrites key fields (untied word embeddings when the checkpoint ships an
        # lm_head, per-architecture hf_config and max_model_len updates)
        model_config = engine_config(model, args, prog=prog).model_config
        comparable = True
    except Exception:  # no device here, ranks of other nodes: the model config alone
        log.debug("wcache status --wait-ready: no engine config here", exc_info=True)
        model_config = engine_model_config(model, args, prog=prog)
        comparable = False
    layout = {"tp_size": tp, "pp_size": pp, "dp_size": 1}
    # vLLM numbers ranks with TP fastest: rank = pp_rank * tp_size + tp_rank.
    ranks = [(r % tp, r // tp) for r in local_ranks(tp * pp, nnodes, node_rank)]
    fields = (
        ("model_arch", list(getattr(model_config.hf_config, "architectures", None) or [])),
        ("dtype", str(model_config.dtype)),
        ("quantization", model_config.quantization),
        ("tp_size", tp),
        ("pp_size", pp),
    )
    config = (
        tuple(sorted((k, canonical_json(v)) for k, v in config_key_fields(model_config).items()))
        if comparable
        else ()
    )
    return ReadySpec(
        job_digest(model_config, layout, job),
        ranks,
        fields,
        config,
        checkpoint=model_config.model if checkpoint else "",
    )


def checkpoint_files(model: str) -> dict[str, str] | str | None:
    """The content digest of each file of ``model`` as the engine's key holds it
    (:func:`wcache.store.checkpoint_digest`, cached by stat); the reason an engine's
    digest would fail the same way (a file vanished or changed while hashed, a
    dangling symlink: ``checkpoint-changed``); or None where the files cannot be
    read here (a probe beside the daemon without the weights mounted then compares
    the config only, never a false mismatch)."""
    from wcache.store import checkpoint_digest  # noqa: PLC0415

    try:
        return checkpoint_digest(model)
    except CheckpointChanged as exc:  # the engine's restore refuses on it too
        return f"[{exc.code}] {exc}"
    except (OSError, StoreError):
        log.debug("wcache status --wait-ready: checkpoint not digested", exc_info=True)
        return None


def config_differences(spec: ReadySpec, key_fields: dict[str, Any]) -> list[str]:
    """``field: engine=<value> daemon=<value>`` for each of ``spec.config`` that a
    daemon's key (its ``status`` reply's ``key_fields``) holds with another value (for
    a mapping, its first :data:`~wcache.store.manifest.MAX_NAMED_LEAVES` differing entries)."""
    return field_differences({name: json.loads(want) for name, want in spec.config}, key_fields)


def field_differences(engine: dict[str, Any], key_fields: dict[str, Any]) -> list[str]:
    """:func:`config_differences` of the engine's own key fields ``engine`` (JSON
    values: :func:`wcache.vllm.key.config_key_fields`) against a daemon's."""
    out = []
    for name, want_value in sorted(engine.items()):
        have, want = key_fields.get(name), canonical_json(want_value)
        if canonical_json(have) != want:
            out += field_mismatch_lines(name, json.loads(want), have)
    return out


#: What to do when two checkpoints meet on one socket name (its name carries the
#: device, architecture, dtype, quantization, parallel sizes and job, not the path).
TWO_CHECKPOINTS_FIX = (
    "a socket's name carries the architecture, dtype, quantization, parallel sizes and "
    "job, not the checkpoint: give each model its own job (`wcache serve --job NAME`, "
    'its engines\' model_loader_extra_config {"job": "NAME"}, `wcache status --job NAME`) '
    "or socket dir"
)


def another_checkpoint(differences: list[str]) -> bool:
    """Whether :func:`config_differences` name a field of the checkpoint's own config
    (:data:`CHECKPOINT_CONFIG_FIELDS`): the daemon serves another model."""
    return any(d.startswith(CHECKPOINT_CONFIG_FIELDS) for d in differences)


def _other_fields(key_fields: dict) -> dict[str, Any]:
    par = key_fields.get("parallel") or {}
    return {
        "model_arch": key_fields.get("model_arch"),
        "dtype": key_fields.get("dtype"),
        "quantization": key_fields.get("quantization"),
        "tp_size": par.get("tp_size"),
        "pp_size": par.get("pp_size"),
    }


def check_ready(socket_dir: str | None, spec: ReadySpec) -> Readiness:
    """Ask every socket of ``spec.digest`` in ``socket_dir`` once.

    Raises:
        UnsafePath: the socket dir is a symlink, not ours, or not 0700.
    """
    return survey(socket_dir, spec)[0]


def survey(
    socket_dir: str | None, spec: ReadySpec
) -> tuple[Readiness, dict[tuple[int, int], dict[str, Any]]]:
    """:func:`check_ready`, and the ``status`` reply of each rank of ``spec`` that
    answered (by (tp_rank, pp_rank)), for ``wcache serve --http``'s ``/metrics``.

    A rank whose arena was invalidated (it still answers for
    ``INVALIDATED_LINGER_S``, refusing every ``get``) does not serve: not ready,
    code ``arena-invalidated`` with the reason the client gave.

    Raises:
        UnsafePath: the socket dir is a symlink, not ours, or not 0700.
    """
    d = paths.resolve_socket_dir(socket_dir)
    try:
        paths.ensure_socket_dir(d, create=False)
    except FileNotFoundError:
        return Readiness(
            False,
            "daemon-missing",
            f"{d} does not exist: no daemon was started with this socket dir",
        ), {}
    serving: set[tuple[int, int]] = set()
    statuses: dict[tuple[int, int], dict[str, Any]] = {}
    others: dict[str, dict[str, Any]] = {}
    mismatched: dict[tuple[int, int], list[str]] = {}
    files: dict[str, str] | str | None = None  # the checkpoint's digests, when needed
    suffix = f"-{spec.digest}{paths.SOCKET_SUFFIX}"
    for sock in paths.list_sockets(d):
        try:
            st = daemon_status(sock, connect_timeout_s=STATUS_TIMEOUT_S)
        except StoreError:
            continue  # stale or not answering: it serves nothing
        fields = st.get("key_fields") or {}
        if sock.endswith(suffix):
            par = fields.get("parallel") or {}
            tp_rank, pp_rank = par.get("tp_rank"), par.get("pp_rank")
            if not isinstance(tp_rank, int) or not isinstance(pp_rank, int):
                continue  # a key without its rank names no rank it serves
            rank = (tp_rank, pp_rank)
            statuses[rank] = st
            diffs = config_differences(spec, fields)
            if not diffs and spec.checkpoint:
                if files is None:  # once per check: a stat per file after the daemon's load
                    files = checkpoint_files(spec.checkpoint) or {}
                if isinstance(files, str):
                    diffs = [f"checkpoint: {files}"]
                elif files:
                    diffs = field_differences({"checkpoint": files}, fields)
            if diffs:
                mismatched[rank] = diffs
            elif not st.get("invalidated"):
                serving.add(rank)
        else:
            others[os.path.basename(sock)] = _other_fields(fields)
    return _readiness(d, spec, serving, statuses, others, mismatched), statuses


def _readiness(
    d: str,
    spec: ReadySpec,
    serving: set[tuple[int, int]],
    statuses: dict[tuple[int, int], dict[str, Any]],
    others: dict[str, dict[str, Any]],
    mismatched: dict[tuple[int, int], list[str]] | None = None,
) -> Readiness:
    invalidated = [
        (r, statuses[r]["invalidated"])
        for r in spec.ranks
        if (statuses.get(r) or {}).get("invalidated")
    ]
    if invalidated:
        rank, inv = invalidated[0]
        return Readiness(
            False,
            "arena-invalidated",
            f"the arena of {rank_name(rank)} was invalidated by pid {inv.get('pid')} "
            f"[{inv.get('code')}]: {inv.get('message')}; that daemon exits and a "
            f"fresh one rebuilds it",
            tuple(sorted(serving)),
        )
    wrong = [(r, (mismatched or {})[r]) for r in spec.ranks if (mismatched or {}).get(r)]
    if wrong:
        rank, diffs = wrong[0]
        changed = [x for x in diffs if x.startswith("checkpoint")]
        message = (
            f"the daemon of {rank_name(rank)} in {d} serves the checkpoint's files as they "
            f"were when it loaded them, and they changed since ({'; '.join(changed)}): "
            f"an engine would refuse it. Restart the daemon (`wcache stop`, then `wcache "
            f"serve` with the same arguments) to load the files as they are now."
            if changed and len(changed) == len(diffs)
            else f"the daemon of {rank_name(rank)} in {d} serves another checkpoint (its "
            f"config differs: {'; '.join(diffs)}); {TWO_CHECKPOINTS_FIX}."
            if another_checkpoint(diffs)
            else f"the daemon of {rank_name(rank)} in {d} serves other engine arguments "
            f"(an engine with these would be refused): {'; '.join(diffs)}. Restart "
            f"`wcache serve` with the engine's arguments, or give the probe the "
            f"arguments the engine runs with."
        )
        return Readiness(False, "key-mismatch", message, tuple(sorted(serving)))
    missing = [r for r in spec.ranks if r not in serving]
    if not missing:
        return Readiness(
            True,
            None,
            f"all {len(spec.ranks)} rank(s) of {spec.digest} serve in {d}",
            tuple(sorted(serving)),
        )
    missing_s = ", ".join(rank_name(r) for r in missing)
    if others:
        mine = dict(spec.fields)
        diffs = sorted(
            {
                f"{k}: engine={mine[k]!r} daemon={v!r}"
                for o in others.values()
                for k, v in o.items()
                if k in mine and v != mine[k]
            }
        )
        return Readiness(
            False,
            "key-mismatch",
            f"no daemon of these engine arguments serves {missing_s} in {d}; "
            f"daemons of another configuration answer ({', '.join(sorted(others))}"
            f"{': ' + ', '.join(diffs) if diffs else ': another job'}). Start "
            f"`wcache serve` with the engine's arguments.",
            tuple(sorted(serving)),
        )
    return Readiness(
        False,
        "daemon-missing",
        f"no daemon serves {missing_s} of {spec.digest} in {d}"
        f" ({len(serving)}/{len(spec.ranks)} ranks serve)",
        tuple(sorted(serving)),
    )


def wait_ready(
    socket_dir: str | None, spec: ReadySpec, timeout_s: float, poll_s: float = POLL_S
) -> Readiness:
    """:func:`check_ready` until every rank serves or ``timeout_s`` seconds passed
    (``0``: one check). Returns the last check's outcome."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check_ready(socket_dir, spec)
        if result.ok or time.monotonic() + poll_s > deadline:
            return result
        time.sleep(poll_s)


def probe(socket_dir: str | None, spec: ReadySpec) -> Any:
    """One :func:`survey` as the :class:`wcache.store.http.Probe` that ``wcache serve
    --http`` answers ``/health`` and ``/metrics`` from.

    Raises:
        UnsafePath: the socket dir is a symlink, not ours, or not 0700.
    """

    result, statuses = survey(socket_dir, spec)
    return Probe(
        result.ok,
        result.code,
        result.message,
        spec.ranks,
        tuple(sorted((r, st) for r, st in statuses.items() if r in spec.ranks)),
    )
