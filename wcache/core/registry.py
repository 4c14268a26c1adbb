"""The stage registry: the ``@stage`` decorator, stage names and their verbs.

One registered name, one value: ``@stage`` binds a name to one definition, either
a :class:`~wcache.core.Stage` (a plain stage) or a :class:`StageDef` (a
parameterized stage, whose parameter values are part of each stage value it
gives). A second definition under a registered name is an error. Registered stages
pickle by reference to their entry here (:func:`registered_stage`).
"""

from __future__ import annotations

import copyreg
import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

from attrs import field, frozen

from wcache.core.values import Stage, StageFn, StageOut, Tag, as_tuple
from wcache.errors import PlanInvalid

__all__ = [
    "STAGE_NAME",
    "STAGE_VERBS",
    "StageDef",
    "stage",
    "stage_name_problem",
    "registered_stages",
    "registered_stage",
    "is_registered",
]


#: A stage name's shape: lower snake ``family.verb[_object]``, e.g.
#: ``awq.convert_to_standard``, ``marlin.permute_scales``, ``cpu_wna16.repack`` (the
#: family is the ``wcache.stages`` module, or the kernel, whose layout the stage
#: produces). The verb is checked against :data:`STAGE_VERBS` (:func:`stage_name_problem`).
STAGE_NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*\.[a-z][a-z0-9]*(_[a-z0-9]+)*$")

#: The closed set of verbs a stage name starts with (the first word after the dot),
#: each with what it means for a stage. A name is ``family.<verb>`` or
#: ``family.<verb>_<object>``, the object in the field's terms (a tensor or
#: attribute name: ``marlin.permute_zero_points``, ``nvfp4.reduce_weight_scale_2``).
#: A new stage that fits no verb here adds one, with its meaning, in the same change.
STAGE_VERBS: Mapping[str, str] = types.MappingProxyType(
    {
        "alloc": "create a process-local tensor that depends on no checkpoint bytes",
        "bind": "attach a callable over the final tensors to the layer (layer.cpu_linear)",
        "cast": "convert a tensor to another dtype",
        "clear": "set a layer attribute to None (vLLM: layer.x = None)",
        "compute": "compute a new tensor or value from existing ones (alpha, azp_adj)",
        "convert": "re-encode a tensor in another format's convention (AWQ -> standard, "
        "per-tensor -> channelwise)",
        "copy": "copy values into another tensor or onto the host",
        "drop": "delete a tensor (vLLM: del layer.x)",
        "empty": "replace a tensor by an empty [0] one (vLLM: marlin_make_empty)",
        "fold": "fold one scale into another tensor",
        "fuse": "multiply scales into one (vLLM: the fused activation scale)",
        "pack": "pack a weight into a kernel's packed layout",
        "pad": "zero-pad tensors to a kernel's tile sizes",
        "permute": "reorder values into a kernel's order (scales, zero points, bias)",
        "prepack": "build a kernel's prepacked weight handle (oneDNN)",
        "process": "run the vLLM process_* helper of the same name (several steps in one)",
        "quantize": "quantize a high-precision weight",
        "reduce": "reduce over shards or a dimension (the max of per-shard scales)",
        "register": "register a tensor as a layer parameter or buffer",
        "repack": "re-pack a packed weight into a kernel's layout",
        "select": "keep a slice or subset of a tensor",
        "set": "set layer attributes from config, shapes, recorded values or the Target",
        "swizzle": "swizzle block scales into a kernel's tiled layout",
        "transpose": "transpose a tensor",
        "validate": "check tensors without writing anything",
    }
)


def stage_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid stage name, or None when it is.

    A valid name is lower snake ``family.<verb>[_<object>]`` (:data:`STAGE_NAME`)
    whose verb is in :data:`STAGE_VERBS`. The message names the rule, the allowed
    verbs and the fix; :func:`stage` raises it and plan validation lists it.
    """
    if not isinstance(name, str) or not STAGE_NAME.match(name):
        return (
            f"stage name {name!r} is not family.verb_object in lower snake case "
            f"(e.g. 'awq.convert_to_standard', 'cpu_wna16.repack')"
        )
    verb = name.partition(".")[2].split("_", 1)[0]
    if verb not in STAGE_VERBS:
        return (
            f"stage name {name!r} is not family.verb_object: {verb!r} is not a stage "
            f"verb; start the part after the dot with one of {', '.join(STAGE_VERBS)} "
            f"(wcache.core.STAGE_VERBS), e.g. 'nvfp4.compute_alpha', or add the verb "
            f"there with its meaning"
        )
    return None


#: name -> the one definition registered under it: a :class:`Stage`, or the
#: :class:`StageDef` of a parameterized stage (``cpu_wna16.repack("qweight")`` and
#: ``repack("weight_packed")`` are two values of the one definition).
_REGISTRY: dict[str, Stage | StageDef] = {}

#: The declarations a parameterized stage's ``params`` function may return.
_DECLARED = frozenset({"reads", "writes", "attrs", "optional", "drops"})


def _definition(fn: Callable) -> Any:
    """What identifies a stage function's definition: its code object."""
    return getattr(fn, "__code__", fn)


@frozen
class StageDef:
    """A parameterized stage: one registered definition; calling it with parameter
    values gives the :class:`Stage` value (``marlin.repack_stage("qweight",
    n_major=True)``), equal to any other call with the same values.

    Attributes:
        name, tag, version, source, memoized: as :class:`Stage`.
        fn: the module-level stage function; it takes the parameters as keywords
            after ``(tensors, config, target, recorded)``.
        declare: ``declare(**params) -> {"reads": ..., "writes": ..., ...}``: the
            declarations that depend on the parameters; its signature names the
            parameters and their defaults.
        base: the declarations that do not (``(name, value)`` pairs).
    """

    name: str
    tag: Tag
    fn: StageFn = field(repr=False)
    declare: Callable[..., Mapping[str, Any]] = field(repr=False)
    base: tuple[tuple[str, Any], ...] = field(default=(), converter=as_tuple)

    def params(self, *args: Any, **kwargs: Any) -> tuple[tuple[str, Any], ...]:
        """The parameter values of a call, defaults filled in, in signature order.

        Raises:
            TypeError: an unknown or missing parameter.
        """
        bound = inspect.signature(self.declare).bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.items())

    def __call__(self, *args: Any, **kwargs: Any) -> Stage:
        params = self.params(*args, **kwargs)
        declared = dict(self.declare(**dict(params)))
        unknown = sorted(set(declared) - _DECLARED)
        if unknown:
            raise PlanInvalid(
                f"stage {self.name!r}: its params function declares {unknown}; "
                f"it may declare only {sorted(_DECLARED)}"
            )
        return Stage(
            name=self.name,
            tag=self.tag,
            fn=self.fn,
            **{**dict(self.base), **declared},
            params=params,
        )

    def __reduce__(self) -> tuple:
        return registered_stage, (getattr(self.fn, "__module__", ""), self.name, None)


#: The function a parameterized stage wraps: ``(tensors, config, target, recorded,
#: **params) -> StageOut``; its parameters follow the four positional ones as keywords,
#: so it is not a plain :data:`StageFn`.
ParamStageFn = Callable[..., StageOut]


# The overloads say what the decorator gives: without ``params`` a plain Stage (called
# on tensors), with it a StageDef (called with parameter values), so a type checker
# sees ``marlin.repack_stage("qweight")`` as a StageDef call, not a Stage call.
@overload
def stage(
    name: str,
    tag: Tag,
    *,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    attrs: Iterable[str] = (),
    optional: Iterable[str] = (),
    version: int = 1,
    source: str = "",
    memoized: bool = False,
    drops: Iterable[str] = (),
    params: None = None,
) -> Callable[[StageFn], Stage]: ...


@overload
def stage(
    name: str,
    tag: Tag,
    *,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    attrs: Iterable[str] = (),
    optional: Iterable[str] = (),
    version: int = 1,
    source: str = "",
    memoized: bool = False,
    drops: Iterable[str] = (),
    params: Callable[..., Mapping[str, Any]],
) -> Callable[[ParamStageFn], StageDef]: ...


def stage(
    name: str,
    tag: Tag,
    *,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    attrs: Iterable[str] = (),
    optional: Iterable[str] = (),
    version: int = 1,
    source: str = "",
    memoized: bool = False,
    drops: Iterable[str] = (),
    params: Callable[..., Mapping[str, Any]] | None = None,
) -> Callable[[ParamStageFn], Stage | StageDef]:
    """Decorator: turn a pure module-level function into a :class:`Stage` value (or,
    with ``params``, a :class:`StageDef`) and register it under ``name``.

    The registry (:func:`registered_stages`) is what the completeness tests walk:
    every registered stage must be used by a plan, drawable by a hypothesis
    strategy and listed in docs/plans.md.

    Args:
        params: for a parameterized stage, ``params(**values) -> declarations``
            (any of ``reads``, ``writes``, ``attrs``, ``optional``, ``drops``);
            its signature names the parameters (with defaults), which the
            function receives as keywords. The declarations given here directly
            are those that do not depend on them.

    Raises:
        PlanInvalid: ``name`` is not ``family.verb_object`` with a verb from
            :data:`STAGE_VERBS` (:func:`stage_name_problem`),
            ``tag`` is not a :class:`Tag`, or another function definition is
            already bound to ``name`` (a conditional variant must be its own
            stage, or a parameter of the one definition).
    """
    if not isinstance(tag, Tag):
        raise PlanInvalid(
            f"stage {name!r}: tag {tag!r} is a {type(tag).__name__}, not a Tag; "
            f"use Tag.TRANSFORM/METADATA/ALLOCATE/DERIVE/VALIDATE"
        )
    problem = stage_name_problem(name)
    if problem:
        raise PlanInvalid(problem)
    # Stage's declaration fields by name; the values differ in type (tuples, a
    # frozenset, an int, a str, a bool), checked by Stage's own field types.
    base: dict[str, Any] = dict(
        reads=tuple(reads),
        writes=tuple(writes),
        attrs=tuple(attrs),
        optional=frozenset(optional),
        version=version,
        source=source,
        memoized=memoized,
        drops=tuple(drops),
    )

    def wrap(fn: ParamStageFn) -> Stage | StageDef:
        held = _REGISTRY.get(name)
        if held is not None and _definition(held.fn) is not _definition(fn):
            code = _definition(held.fn)
            raise PlanInvalid(
                f"stage {name!r} is already bound to another function "
                f"({getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', '?')}); "
                f"give the new function its own name, or make it a parameter of the stage "
                f"that defines {name!r}"
            )
        value: Stage | StageDef = (
            Stage(name=name, tag=tag, fn=fn, **base)
            if params is None
            else StageDef(name=name, tag=tag, fn=fn, declare=params, base=tuple(base.items()))
        )
        if held is None:
            _REGISTRY[name] = value
        return _REGISTRY[name]

    return wrap


def registered_stages() -> dict[str, Stage | StageDef]:
    """Every stage name registered with :func:`stage` -> its one definition (a
    :class:`Stage`, or the :class:`StageDef` of a parameterized stage)."""
    return dict(_REGISTRY)


def is_registered(st: Stage) -> bool:
    """``st`` is the registered stage of its name, or a value of its registered
    :class:`StageDef` (same function and parameters)."""
    held = _REGISTRY.get(st.name)
    if isinstance(held, StageDef):
        return held.fn is st.fn and held(**dict(st.params)) == st
    return held is not None and held == st


def registered_stage(
    module: str, name: str, params: tuple[tuple[str, Any], ...] | None = ()
) -> Stage | StageDef:
    """The registered value ``name`` (importing ``module``, which registers it):
    the :class:`Stage`, a value of its :class:`StageDef` for ``params``, or
    (``params=None``) the :class:`StageDef` itself. What pickles resolve.

    Raises:
        PlanInvalid: nothing is registered under ``name`` once ``module`` is imported.
    """
    if module:
        importlib.import_module(module)
    held = _REGISTRY.get(name)
    if held is None:
        raise PlanInvalid(
            f"no stage {name!r} is registered (module {module!r}); the pickle "
            f"was written by a wcache with other stages"
        )
    if params is None or isinstance(held, Stage):
        return held
    return held(**dict(params))


def _stage_from_fields(*values: Any) -> Stage:
    """Rebuild an unregistered :class:`Stage` from its field values (pickle)."""
    return Stage(**dict(zip(_STAGE_FIELDS, values)))


_STAGE_FIELDS = tuple(a.name for a in Stage.__attrs_attrs__)


def _reduce_stage(st: Stage) -> tuple:
    """Pickle a stage by reference: a registered one as (module, name, parameters),
    rebuilt from the registry; any other by its fields (its function must pickle)."""
    if is_registered(st):
        return registered_stage, (st.module, st.name, st.params)
    return _stage_from_fields, tuple(getattr(st, f) for f in _STAGE_FIELDS)


copyreg.pickle(Stage, _reduce_stage)
