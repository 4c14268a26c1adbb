"""The contract checks: plan rules at build time and per-stage checks at run time.

Every check is a small function that returns its list of violations (empty when
the input keeps the rule); the caller raises. :func:`plan_problems` collects the
build-time rules (one :class:`~wcache.errors.PlanInvalid` lists them all); the
run-time :data:`STEP_CHECKS` run on every :class:`Step` of the fold, in order,
each paired with the error class its violation raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attrs import field, frozen

from wcache.core.registry import stage_name_problem
from wcache.core.values import (
    PREPARE_TAGS,
    RESTORE_TAGS,
    LayerConfig,
    LayerState,
    Stage,
    StageOut,
    Tag,
)
from wcache.errors import (
    RecordedMismatch,
    RestoreIncomplete,
    RestoreWroteSharedTensor,
    StageContractError,
    WcacheError,
)

__all__ = [
    "plan_problems",
    "Step",
    "STEP_CHECKS",
    "check_reads",
    "check_returns_stage_out",
    "check_shared_untouched",
    "check_inputs_untouched",
    "check_declared_writes",
    "check_declared_attrs",
    "check_no_tensors_from_readonly_tags",
    "check_shared_not_replaced",
    "check_derive_drops_nothing",
    "check_declared_drops",
    "check_no_tensor_slots_in_attrs",
    "check_release",
    "check_memo",
    "check_recorded",
    "touched_inputs",
]


# --------------------------------------------------------------------------- build time


def plan_problems(stages: tuple[Stage, ...], checkpoint: frozenset[str]) -> list[str]:
    """Build-time rules (docs/design.md section 3); returns every violation found.

    1. every stage is a :class:`Stage` whose tag is a :class:`Tag` and whose name
       is ``family.verb_object`` with a verb from :data:`STAGE_VERBS`
       (:func:`stage_name_problem`); names are unique;
    2. every read is a checkpoint tensor or an earlier stage's write;
    3. no TRANSFORM/METADATA/VALIDATE stage (the daemon runs them) depends on an
       ALLOCATE/DERIVE output;
    4. METADATA/VALIDATE/DERIVE stages write no tensor: no ``writes``, no
       ``drops``, and no tensor name in ``attrs`` (emptying a slot through an
       attribute is a write), unless the name is in ``optional`` and so set only
       when the tensor is absent; DERIVE may empty a slot it reads (a release);
    5. ``drops`` are declared writes;
    6. ALLOCATE writes no exported tensor;
    7. reachability: what a replayed stage reads is what a restore has, the
       export (checkpoint tensors, plus TRANSFORM writes, minus drops) plus the
       earlier ALLOCATE outputs.
    """
    errors: list[str] = []
    bad = [s for s in stages if not isinstance(s, Stage)]
    if bad:
        return [f"{b!r} is not a Stage (use the @stage decorator)" for b in bad]
    for st in stages:
        if not isinstance(st.tag, Tag):
            errors.append(
                f"stage {st.name!r} has tag {st.tag!r} ({type(st.tag).__name__}), "
                f"not a Tag: it would run in no mode; use Tag.{str(st.tag).upper()}"
            )
        problem = stage_name_problem(st.name)
        if problem:
            errors.append(problem)
    if errors:
        return errors
    names = [s.name for s in stages]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"stage name {dup!r} is used more than once")
    available = set(checkpoint)
    producer: dict[str, Stage] = {}
    for st in stages:
        for r in st.reads:
            if r not in available and r not in st.optional:
                errors.append(
                    f"stage {st.name!r} reads {r!r}, which no earlier stage "
                    f"produces and the checkpoint does not hold"
                )
            src = producer.get(r)
            if src is not None and src.tag in (Tag.ALLOCATE, Tag.DERIVE) and st.tag in PREPARE_TAGS:
                errors.append(
                    f"{st.tag.name} stage {st.name!r} depends on {src.tag.name} "
                    f"output {r!r} of {src.name!r}, which the daemon never has"
                )
        if st.tag in (Tag.METADATA, Tag.VALIDATE, Tag.DERIVE):
            if st.writes or st.drops:
                errors.append(
                    f"{st.tag.name} stage {st.name!r} declares tensor writes "
                    f"{list(dict.fromkeys(st.writes + st.drops))}; only "
                    f"TRANSFORM/ALLOCATE write tensors"
                )
            allowed = set(st.optional) | (set(st.reads) if st.tag is Tag.DERIVE else set())
            slots = sorted((set(st.attrs) & available) - allowed)
            if slots:
                errors.append(
                    f"{st.tag.name} stage {st.name!r} sets tensors {slots} through "
                    f"attrs (a write that replaces or empties the slot); only "
                    f"TRANSFORM/ALLOCATE write tensors"
                )
        undeclared = sorted(set(st.drops) - set(st.writes))
        if undeclared:
            errors.append(f"stage {st.name!r} drops {undeclared} without declaring them in writes")
        for w in st.writes:
            available.add(w)
            producer[w] = st
        available.difference_update(st.drops)
    # what a restore starts from: the export (every PREPARE stage has run)
    exported = set(checkpoint)
    for st in stages:
        if st.tag is Tag.TRANSFORM:
            exported.update(st.writes)
            exported.difference_update(st.drops)
    restorable = set(exported)
    for st in stages:
        if st.tag is Tag.ALLOCATE:
            clash = sorted(set(st.writes) & exported)
            if clash:
                errors.append(
                    f"ALLOCATE stage {st.name!r} writes exported tensors {clash}; "
                    f"restore would rewrite shared bytes"
                )
        if st.tag in RESTORE_TAGS:
            lost = sorted(r for r in st.reads if r not in restorable and r not in st.optional)
            if lost:
                errors.append(
                    f"{st.tag.name} stage {st.name!r} replays at restore and reads "
                    f"{lost}, which the export does not hold (a TRANSFORM drops or "
                    f"never writes it); read the final tensors or record the value"
                )
        if st.tag is Tag.ALLOCATE:
            restorable.update(st.writes)
    return errors


# --------------------------------------------------------------------------- run time


@frozen
class Step:
    """What the run-time checks see of one stage applied to one state.

    Attributes:
        stage: the stage.
        state: the accumulator before the stage.
        config: the layer's config (its name is in the messages).
        recorded: the values the daemon recorded for this stage (restore only).
        shared: names of the tensors mapped from the daemon.
        out: what the stage returned (``None`` before the call).
        touched: inputs whose version counter or data pointer moved during the call
            (:func:`touched_inputs`; empty when purity is not checked).
    """

    stage: Stage
    state: LayerState
    config: LayerConfig
    recorded: Mapping[str, Any] = field(factory=dict)
    shared: frozenset[str] = frozenset()
    out: Any = None
    touched: tuple[str, ...] = ()


def touched_inputs(before: Mapping[str, tuple[int, int]], state: LayerState) -> tuple[str, ...]:
    """Names whose version counter moved or whose data pointer changed (``t.data =
    other`` swaps the bytes without a version bump) since ``before``
    (name -> ``(version, data_ptr)``)."""
    return tuple(
        k
        for k, (ver, ptr) in before.items()
        if state.tensors[k]._version != ver
        or (state.tensors[k].device.type != "meta" and state.tensors[k].data_ptr() != ptr)
    )


def input_versions(state: LayerState) -> dict[str, tuple[int, int]]:
    """name -> ``(version counter, data pointer)`` of every input (meta: pointer 0)."""
    return {
        k: (v._version, v.data_ptr() if v.device.type != "meta" else 0)
        for k, v in state.tensors.items()
    }


def check_reads(s: Step) -> list[str]:
    """Every non-optional read is in the layer (before the call)."""
    missing = [r for r in s.stage.reads if r not in s.state.tensors and r not in s.stage.optional]
    if not missing:
        return []
    return [
        f"layer {s.config.name!r}: stage {s.stage.name!r} reads {missing} but the layer "
        f"has only {sorted(s.state.tensors)}; the checkpoint or the export lacks them."
    ]


def check_returns_stage_out(s: Step) -> list[str]:
    """The stage returned a :class:`StageOut`."""
    if isinstance(s.out, StageOut):
        return []
    return [f"stage {s.stage.name!r} returned {type(s.out).__name__}, not StageOut"]


def check_shared_untouched(s: Step) -> list[str]:
    """No shared input was written in place during the call."""
    hit = sorted(set(s.touched) & s.shared)
    if not hit:
        return []
    return [
        f"restore of layer {s.config.name!r}: stage {s.stage.name!r} wrote in place into "
        f"shared tensors {hit} (version counter bumped or data pointer swapped). Restore "
        f"stages must never write the daemon's bytes; return new tensors or tag it "
        f"TRANSFORM."
    ]


def check_inputs_untouched(s: Step) -> list[str]:
    """No input was written in place during the call (stages are pure)."""
    if not s.touched:
        return []
    return [
        f"stage {s.stage.name!r} mutated its input tensors {list(s.touched)} in place; "
        f"stages are pure: return new tensors instead."
    ]


def check_declared_writes(s: Step) -> list[str]:
    """Returned and dropped tensors are declared writes (or attrs)."""
    st, out = s.stage, s.out
    undeclared = sorted((set(out.tensors) | set(out.drop)) - set(st.writes) - set(st.attrs))
    if not undeclared:
        return []
    return [f"stage {st.name!r} wrote {undeclared} without declaring them in writes"]


def check_declared_attrs(s: Step) -> list[str]:
    """Set attributes are declared attrs (or writes)."""
    st, out = s.stage, s.out
    bad = sorted(set(out.attrs) - set(st.attrs) - set(st.writes))
    if not bad:
        return []
    return [f"stage {st.name!r} set attributes {bad} without declaring them in attrs"]


def check_no_tensors_from_readonly_tags(s: Step) -> list[str]:
    """METADATA, VALIDATE and DERIVE stages return no tensors."""
    st, out = s.stage, s.out
    if st.tag not in (Tag.METADATA, Tag.VALIDATE, Tag.DERIVE) or not out.tensors:
        return []
    return [
        f"{st.tag.name} stage {st.name!r} returned tensors {sorted(out.tensors)}; "
        f"only TRANSFORM and ALLOCATE stages produce tensors"
    ]


def check_shared_not_replaced(s: Step) -> list[str]:
    """A non-TRANSFORM stage replaces, drops or resets no shared tensor (a released
    slot emptied to ``None`` excepted)."""
    st, out = s.stage, s.out
    if st.tag is Tag.TRANSFORM:
        return []
    none_slots = {n for n in out.release if n in out.attrs and out.attrs[n] is None}
    hit = sorted((set(out.tensors) | set(out.drop) | (set(out.attrs) - none_slots)) & s.shared)
    if not hit:
        return []
    return [
        f"restore of layer {s.config.name!r}: stage {st.name!r} replaces or drops "
        f"shared tensors {hit}"
    ]


def check_derive_drops_nothing(s: Step) -> list[str]:
    """A DERIVE stage drops no tensor."""
    st, out = s.stage, s.out
    if st.tag is not Tag.DERIVE or not out.drop:
        return []
    return [f"DERIVE stage {st.name!r} may not drop tensors ({out.drop})"]


def check_declared_drops(s: Step) -> list[str]:
    """A dropped name that is not returned again is declared in ``drops``."""
    st, out = s.stage, s.out
    gone = sorted(set(out.drop) - set(out.tensors) - set(st.drops))
    if not gone:
        return []
    return [f"stage {st.name!r} dropped {gone} without declaring them in drops"]


def check_no_tensor_slots_in_attrs(s: Step) -> list[str]:
    """A METADATA or VALIDATE stage sets no present tensor through attrs."""
    st, out = s.stage, s.out
    if st.tag not in (Tag.METADATA, Tag.VALIDATE):
        return []
    slots = sorted(set(out.attrs) & set(s.state.tensors))
    if not slots:
        return []
    return [
        f"{st.tag.name} stage {st.name!r} set tensors {slots} through attrs; only "
        f"TRANSFORM/ALLOCATE write tensors (a name in optional is set only when the "
        f"layer has no such tensor)"
    ]


def check_release(s: Step) -> list[str]:
    """Only DERIVE stages release, and only tensors they read."""
    st, out = s.stage, s.out
    if not out.release or (st.tag is Tag.DERIVE and set(out.release) <= set(st.reads)):
        return []
    return [
        f"stage {st.name!r} releases {list(out.release)}; only DERIVE stages may release, "
        f"and only tensors they read"
    ]


def check_memo(s: Step) -> list[str]:
    """Only ``memoized`` stages return memo entries."""
    st, out = s.stage, s.out
    if not out.memo or st.memoized:
        return []
    return [f"stage {st.name!r} returned memo entries but is not declared memoized"]


def check_recorded(s: Step) -> list[str]:
    """Values the stage recorded equal the daemon's (when the daemon recorded any)."""
    old, new = s.recorded, s.out.record
    if not new or not old or dict(old) == dict(new):
        return []
    diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)}
    return [
        f"layer {s.config.name!r}, stage {s.stage.name!r}: values recomputed here differ "
        f"from the daemon's (recorded, here): {diff}. The daemon ran on a different "
        f"target; restart it on this host's settings."
    ]


Check = Callable[[Step], list[str]]

#: The checks on a stage's result, in the order they run, each with the error its
#: violation raises (:func:`check_reads` runs before the call).
STEP_CHECKS: tuple[tuple[type[WcacheError], Check], ...] = (
    (StageContractError, check_returns_stage_out),
    (RestoreWroteSharedTensor, check_shared_untouched),
    (StageContractError, check_inputs_untouched),
    (StageContractError, check_declared_writes),
    (StageContractError, check_declared_attrs),
    (StageContractError, check_no_tensors_from_readonly_tags),
    (RestoreWroteSharedTensor, check_shared_not_replaced),
    (StageContractError, check_derive_drops_nothing),
    (StageContractError, check_declared_drops),
    (StageContractError, check_no_tensor_slots_in_attrs),
    (StageContractError, check_release),
    (StageContractError, check_memo),
    (RecordedMismatch, check_recorded),
)


def raise_first(checks: tuple[tuple[type[WcacheError], Check], ...], step: Step) -> None:
    """Run ``checks`` on ``step`` in order; raise the first violation's error.

    Raises:
        WcacheError: the class paired with the first check that finds a violation.
    """
    for error, check in checks:
        problems = check(step)
        if problems:
            raise error("\n".join(problems))


#: The check before the call.
READ_CHECKS: tuple[tuple[type[WcacheError], Check], ...] = ((RestoreIncomplete, check_reads),)
