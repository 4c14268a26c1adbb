"""The runner: :class:`Plan`, :class:`BoundPlan` and the fold of stages over a
:class:`~wcache.core.LayerState`.

Load, prepare and restore are one fold (:meth:`Plan.run`) over the stages whose tag
the mode allows (``LOAD_TAGS``, ``PREPARE_TAGS``, ``RESTORE_TAGS``). Each step is
:func:`step`: the stage's call between the named contract checks of
:mod:`wcache.core.checks`. A restore passes a guard, the fold's per-step hook
(:class:`StepGuard`: :class:`~wcache.core.RestoreGuard`), called after every
replayed stage. Nothing here touches a module: :mod:`wcache.shell` reads a module
into a state, runs these and installs the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import reduce
from typing import Any, Protocol

import torch
from attrs import evolve, field, frozen
from toolz import assoc, dissoc, merge

from wcache.core import checks
from wcache.core.checks import plan_problems
from wcache.core.values import (
    RESTORE_TAGS,
    LayerConfig,
    LayerState,
    Prepared,
    Reregistration,
    Stage,
    StageOut,
    Tag,
    Target,
    _ro,
    as_frozenset,
    as_tuple,
)
from wcache.errors import PlanInvalid, RecordedMismatch

__all__ = [
    "DEVICE_TYPES",
    "Plan",
    "BoundPlan",
    "StepGuard",
    "applies_always",
    "step",
    "apply_out",
    "prepared_of",
    "restore_start",
    "shared_names",
    "restore_run",
]


def applies_always(config: LayerConfig, target: Target) -> str | None:
    """The default :attr:`Plan.match`: the plan applies to every layer."""
    return None


class StepGuard(Protocol):
    """The restore fold's per-step hook (:class:`~wcache.core.RestoreGuard` is one)."""

    def check_stage(self, layer: str, stage_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """After each replayed stage: raise if a shared tensor changed."""

    def blame_write(self, layer: str, stage_name: str, names: Iterable[str]) -> None:
        """A stage wrote shared ``names`` in place: raise, naming where."""


# --------------------------------------------------------------------------- the step


def _memo_view(
    memo: Mapping[str, Mapping[Any, Any]] | None, state: LayerState, name: str
) -> Mapping[Any, Any] | None:
    """What a ``memoized`` stage sees: the caller's entries for it, plus those it
    returned earlier in this run; ``None`` when the caller keeps no memo."""
    if memo is None:
        return None
    return _ro({**memo.get(name, {}), **state.memo.get(name, {})})


def _call(
    st: Stage,
    state: LayerState,
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    memo: Mapping[str, Mapping[Any, Any]] | None,
) -> Any:
    """``st.fn`` on read-only views, with its parameters (and memo) as keywords."""
    kwargs = {"memo": _memo_view(memo, state, st.name)} if st.memoized else {}
    return st(_ro(state.tensors), config, target, _ro(recorded), **kwargs)


def apply_out(
    st: Stage, state: LayerState, out: StageOut, config: LayerConfig, *, keep_memo: bool = False
) -> LayerState:
    """The next accumulator: ``state`` with a checked :class:`StageOut` merged in.

    Drops, then new tensors; a released tensor becomes vLLM's empty placeholder
    (or a ``None`` slot through attrs) and is kept in ``released``; recorded values
    and (``keep_memo``) memo entries are filed under the stage's name.
    """
    tensors = merge(dissoc(state.tensors, *out.drop), out.tensors)
    released = dict(state.released)
    for name in out.release:
        src = tensors[name]
        released.setdefault(name, src)
        if name in out.attrs and out.attrs[name] is None:
            del tensors[name]  # the slot becomes None through attrs
        else:  # vLLM's empty Parameter in the layer's params dtype (the packed SGL weight
            # of an N < 16 layer is fp32, but vLLM's placeholder keeps the weight's dtype)
            dtype = config.dtype if src.is_floating_point() else src.dtype
            tensors[name] = torch.empty(0, dtype=dtype, device=src.device)
    rec = assoc(state.recorded, st.name, out.record) if out.record else state.recorded
    memo = state.memo
    if keep_memo and out.memo:
        memo = assoc(memo, st.name, {**memo.get(st.name, {}), **out.memo})
    return LayerState(
        tensors=tensors,
        buffers=(state.buffers - set(out.drop)) | out.buffers,
        attrs=merge(state.attrs, out.attrs),
        drops=tuple(dict.fromkeys(state.drops + tuple(out.drop))),
        recorded=rec,
        released=released,
        memo=memo,
    )


def step(
    st: Stage,
    state: LayerState,
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
    *,
    shared: frozenset[str] = frozenset(),
    check_purity: bool = False,
    guard: StepGuard | None = None,
    memo: Mapping[str, Mapping[Any, Any]] | None = None,
) -> LayerState:
    """One step of the fold: check the reads, call the stage, run
    :data:`~wcache.core.checks.STEP_CHECKS` on its result, merge it (:func:`apply_out`).

    Raises:
        RestoreIncomplete, StageContractError, RestoreWroteSharedTensor,
        RecordedMismatch: the first check that finds a violation.
    """
    checks.raise_first(checks.READ_CHECKS, checks.Step(st, state, config))
    before = checks.input_versions(state) if check_purity else None
    out = _call(st, state, config, target, recorded, memo)
    touched = checks.touched_inputs(before, state) if before is not None else ()
    hit_shared = sorted(set(touched) & shared)
    if hit_shared and guard is not None:
        guard.blame_write(config.name, st.name, hit_shared)
    checks.raise_first(
        checks.STEP_CHECKS,
        checks.Step(st, state, config, recorded=recorded, shared=shared, out=out, touched=touched),
    )
    return apply_out(st, state, out, config, keep_memo=memo is not None)


# --------------------------------------------------------------------------- plans

#: The device types a plan can run on (``Target.device_type``).
DEVICE_TYPES = ("cpu", "cuda")


def _device_tuple(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"cuda"`` -> ``("cuda",)``; a tuple or list of device types as a tuple."""
    return (value,) if isinstance(value, str) else tuple(value)


def _reregistered(value: Any) -> tuple[tuple[str, Reregistration], ...]:
    """``{"weight": Reregistration.NEW}`` as sorted pairs (hashable)."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((name, Reregistration(kind)) for name, kind in items))


def _param_attrs(value: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """``{"qweight": {"_packed_dim": 0}}`` as sorted nested tuples (hashable)."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((name, tuple(sorted(dict(attrs).items()))) for name, attrs in items))


@frozen
class Plan:
    """One method's post-load work for one kernel and target class.

    Attributes:
        method: quant method id (``QuantSpec.method``).
        kernel: kernel id (``"cpu_wna16"``, ``"marlin"``, ``"cutlass"``, ...).
        version: bumped whenever any stage's output changes.
        stages: ordered stages.
        checkpoint: tensor names the layer holds before post-load (some optional).
        match: ``match(config, target) -> None`` when the plan applies, else the
            reason string.
        description: one line for ``wcache plans``.
        devices: the device types (:data:`DEVICE_TYPES`) the plan's kernel runs on:
            ``("cpu",)`` for vLLM-CPU's kernels, ``("cuda",)`` for the CUDA ones
            (``unquantized/none`` included: vLLM's CUDA build does no post-load work
            there), both for plans whose stages are plain torch on either device
            (``attention/default``, the KV-cache scales). Every registered plan names
            it (a string is one device); the default, both, is for test plans. The
            docs' CPU and CUDA evidence tables are split by it.
        kept_params: checkpoint parameters that vLLM's post-load rewrites through
            ``param.data = ...``, so on a disk engine they stay the objects the build
            created (class such as ``PackedvLLMParameter``, attributes such as
            ``weight_loader``, ``packed_dim``); a restored engine gives them the
            same (:func:`wcache.shell.param_flags`). Every other parameter a stage
            writes is re-registered by vLLM as a plain ``nn.Parameter``
            (:class:`~wcache.core.Reregistration` ``REPLACE``, unless
            ``reregistered`` says otherwise). Not part of the plan's id: it changes
            no byte. The same as ``reregistered`` ``DATA``.
        reregistered: per parameter a stage writes, how vLLM's post-load of this
            plan re-registers it where that is not ``replace_parameter`` (``REPLACE``)
            in every supported release (``{"weight": Reregistration.NEW}``); what each
            kind leaves on a parameter depends on the release
            (``wcache.vllm.compat.param_outcomes``). Where the post-load itself
            differs between releases, compat's release table overrides it. Not part
            of the plan's id.
        param_attrs: per kept or :attr:`reregistered` parameter, attributes vLLM's
            post-load gives it that differ from the build's (``{"qweight":
            {"_packed_dim": 0}}``: vLLM's AWQ conversion re-creates the parameter
            packed along another dimension); set on the restored parameter over the
            build's where the release keeps the built object.

    A plan is a value: equal plans have equal fields (``match`` aside); it pickles
    when ``match`` is a module-level function (or a ``functools.partial`` of one),
    and its stages pickle by reference to the stage registry.

    Raises:
        PlanInvalid: at construction, listing every rule the stages break
            (:func:`wcache.core.checks.plan_problems`). There is no switch to skip it; tests that need
            an invalid plan use :class:`wcache.testing.plans.UncheckedPlan`.
    """

    method: str
    kernel: str
    stages: tuple[Stage, ...] = field(converter=as_tuple)
    checkpoint: frozenset[str] = field(converter=as_frozenset)
    match: Callable[[LayerConfig, Target], str | None] = field(
        default=applies_always, eq=False, repr=False
    )
    version: int = 1
    description: str = ""
    devices: tuple[str, ...] = field(default=DEVICE_TYPES, converter=_device_tuple)
    kept_params: frozenset[str] = field(default=frozenset(), converter=as_frozenset)
    param_attrs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = field(
        default=(), converter=_param_attrs
    )
    reregistered: tuple[tuple[str, Reregistration], ...] = field(
        default=(), converter=_reregistered
    )

    def __attrs_post_init__(self) -> None:
        errors = plan_problems(self.stages, self.checkpoint)
        if not {name for name, _ in self.param_attrs} <= self.kept_params | {
            name for name, _ in self.reregistered
        }:
            errors.append(
                "param_attrs names a parameter that neither kept_params nor reregistered does"
            )
        both = self.kept_params & {name for name, _ in self.reregistered}
        if both:
            errors.append(f"kept_params and reregistered both name {sorted(both)}")
        if not self.kept_params <= self.checkpoint:
            errors.append(
                f"kept_params {sorted(self.kept_params - self.checkpoint)} are not "
                f"checkpoint tensors of the plan"
            )
        unknown = sorted(set(self.devices) - set(DEVICE_TYPES))
        if unknown or not self.devices:
            errors.append(
                f"devices {self.devices!r}: each must be one of {DEVICE_TYPES}, and at least one"
            )
        if errors:
            raise PlanInvalid(
                f"plan {self.method}/{self.kernel} is invalid:\n  - " + "\n  - ".join(errors)
            )

    def reregistration(self, name: str) -> Reregistration:
        """How vLLM's post-load re-registers parameter ``name`` that a stage writes:
        ``DATA`` for :attr:`kept_params`, the :attr:`reregistered` entry, else
        ``REPLACE``."""
        if name in self.kept_params:
            return Reregistration.DATA
        return dict(self.reregistered).get(name, Reregistration.REPLACE)

    @property
    def id(self) -> str:
        return f"{self.method}/{self.kernel}@{self.version}"

    @property
    def stage_versions(self) -> tuple[tuple[str, int], ...]:
        return tuple((s.name, s.version) for s in self.stages)

    # -- the fold -----------------------------------------------------------

    def run(
        self,
        state: LayerState,
        config: LayerConfig,
        target: Target,
        tags: frozenset[Tag],
        recorded: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        shared: frozenset[str] = frozenset(),
        check_purity: bool = False,
        guard: StepGuard | None = None,
        memo: Mapping[str, Mapping[Any, Any]] | None = None,
    ) -> LayerState:
        """Fold the stages whose tag is in ``tags`` over ``state``: load, prepare and
        restore are this one fold.

        Args:
            recorded: stage name -> values recorded at prepare (restore only).
            shared: tensor names that are mapped from the daemon; replayable
                stages may not replace or drop them.
            check_purity: verify no stage bumps an input's version counter.
            guard: the per-step hook (restore): ``guard.check_stage`` runs after
                every stage on the state's tensors and released tensors.
            memo: the caller's per-restore memo for ``memoized`` stages (stage
                name -> entries; read only here): the entries they add are in the
                result's ``memo``, for the caller to keep.
        """
        recorded = recorded or {}

        def fold(acc: LayerState, st: Stage) -> LayerState:
            nxt = step(
                st,
                acc,
                config,
                target,
                recorded.get(st.name, {}),
                shared=shared,
                check_purity=check_purity,
                guard=guard,
                memo=memo,
            )
            if guard is not None:
                guard.check_stage(config.name, st.name, {**nxt.tensors, **nxt.released})
            return nxt

        return reduce(fold, (s for s in self.stages if s.tag in tags), state)

    def bind(self, config: LayerConfig, target: Target) -> BoundPlan:
        """This plan bound to ``config`` and ``target``."""
        return BoundPlan(self, config, target)

    def describe(self) -> str:
        """A markdown table: stage, tag, reads, writes, attrs, source."""
        rows = [
            f"### `{self.id}`",
            "",
            self.description,
            "",
            f"Runs on: {', '.join(self.devices)}.",
            "",
            "| # | stage | tag | reads | writes | attrs | source |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, s in enumerate(self.stages, 1):
            rows.append(
                f"| {i} | `{s.name}` | {s.tag.name} | {', '.join(s.reads) or '-'} | "
                f"{', '.join(s.writes) or '-'} | {', '.join(s.attrs) or '-'} | "
                f"{s.source or '-'} |"
            )
        return "\n".join(rows) + "\n"


@frozen
class BoundPlan:
    """A :class:`Plan` bound to one layer's config and its :class:`Target`: what
    :func:`wcache.plans.plan_for` returns. A pure value: the entry points that touch a
    module take it (:mod:`wcache.shell`)::

        bound = plan_for(config, target=target)
        load_(layer, bound)                    # ordinary load
        prepared = prepare_(layer, bound)      # the daemon
        restore_(layer, bound, recorded)       # a restarting engine, on mapped tensors

    Attributes:
        plan: the resolved plan (its id, stages and checkpoint names are also
            readable here: ``bound.id``, ``bound.stages``, ...).
        config: the layer's frozen config the plan was resolved for.
        target: where the layer runs.
    """

    plan: Plan
    config: LayerConfig
    target: Target

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def method(self) -> str:
        return self.plan.method

    @property
    def kernel(self) -> str:
        return self.plan.kernel

    @property
    def version(self) -> int:
        return self.plan.version

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.plan.stages

    @property
    def checkpoint(self) -> frozenset[str]:
        return self.plan.checkpoint

    @property
    def stage_versions(self) -> tuple[tuple[str, int], ...]:
        return self.plan.stage_versions

    def run(self, state: LayerState, tags: frozenset[Tag], **kwargs: Any) -> LayerState:
        """:meth:`Plan.run` with this binding's config and target."""
        return self.plan.run(state, self.config, self.target, tags, **kwargs)

    def prepared(self, state: LayerState) -> Prepared:
        """What the daemon keeps of ``state``, the result of a PREPARE run."""
        return prepared_of(self.plan, state)

    def restore_start(
        self,
        state: LayerState,
        recorded: Mapping[str, Mapping[str, Any]],
        drops: Iterable[str] = (),
    ) -> LayerState:
        """:func:`restore_start` with this binding's config."""
        return restore_start(self.plan, state, self.config, recorded, drops)

    def restore_run(
        self,
        state: LayerState,
        recorded: Mapping[str, Mapping[str, Any]],
        *,
        guard: StepGuard | None = None,
        memo: Mapping[str, Mapping[Any, Any]] | None = None,
    ) -> LayerState:
        """The restore fold: :func:`restore_run` with this binding's config and target."""
        return restore_run(
            self.plan, state, self.config, self.target, recorded, guard=guard, memo=memo
        )

    def describe(self) -> str:
        return self.plan.describe()


# --------------------------------------------------------------------------- snapshots


# --------------------------------------------------------------------------- restore, pure


def prepared_of(plan: Plan, state: LayerState) -> Prepared:
    """What the daemon keeps of ``state`` after a PREPARE run of ``plan``: the
    tensors to export, their buffer kinds, recorded values, drops and attrs."""
    return Prepared(
        plan_id=plan.id,
        tensors=state.tensors,
        buffers=state.buffers,
        recorded=state.recorded,
        drops=state.drops,
        attrs=state.attrs,
    )


def restore_start(
    plan: Plan,
    state: LayerState,
    config: LayerConfig,
    recorded: Mapping[str, Mapping[str, Any]],
    drops: Iterable[str] = (),
) -> LayerState:
    """The state a restore folds from: ``state`` (the layer holding the mapped
    tensors) without the placeholders of names the daemon's prepare deleted.

    Args:
        drops: names the daemon's prepare deleted; a placeholder still in the
            layer (meta, or absent) is removed, a real tensor kept.

    Raises:
        RecordedMismatch: values are recorded for a stage the plan lacks.
    """
    unknown = sorted(set(recorded) - {s.name for s in plan.stages})
    if unknown:
        raise RecordedMismatch(
            f"layer {config.name!r}: the daemon recorded values for stages {unknown} "
            f"that plan {plan.id} does not have; daemon and engine run different plans."
        )
    drops = tuple(
        d for d in drops if d not in state.tensors or state.tensors[d].device.type == "meta"
    )
    return evolve(
        state, tensors={k: v for k, v in state.tensors.items() if k not in drops}, drops=drops
    )


def shared_names(state: LayerState) -> frozenset[str]:
    """The tensors of ``state`` that hold bytes (not meta): the shared ones in a restore."""
    return frozenset(k for k, v in state.tensors.items() if v.device.type != "meta")


def restore_run(
    plan: Plan,
    state: LayerState,
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Mapping[str, Any]],
    *,
    guard: StepGuard | None = None,
    memo: Mapping[str, Mapping[Any, Any]] | None = None,
) -> LayerState:
    """The restore fold: :meth:`Plan.run` over ``RESTORE_TAGS`` from ``state`` (a
    :func:`restore_start` result), every non-meta tensor shared; with a ``guard``,
    purity is checked and ``guard.check_stage`` runs after every replayed stage.

    Raises:
        RestoreWroteSharedTensor: a stage changed a shared tensor.
        RecordedMismatch: a recomputed value differs from the recorded one.
        RestoreIncomplete: a needed tensor is missing.
    """
    return plan.run(
        state,
        config,
        target,
        RESTORE_TAGS,
        recorded,
        shared=shared_names(state),
        check_purity=guard is not None,
        guard=guard,
        memo=memo,
    )
