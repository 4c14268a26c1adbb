"""The one shell that touches modules (docs/design.md section 3).

Every other wcache function returns new values; this module reads a module into
a :class:`~wcache.core.LayerState`, runs the pure fold of :mod:`wcache.core` and
installs the result:

* :func:`load_`, :func:`prepare_`, :func:`restore_`: a bound plan's ordinary
  load, the daemon's prepare and the engine's restore of one layer
  (``state_from_module`` -> the fold -> ``apply_state_``).
* :func:`apply_state_`: make one layer hold a runner's :class:`~wcache.core.LayerState`.
* :func:`install_tensors_`: register the daemon's mapped tensors on the engine's
  meta-built model before the restores run.
* :func:`state_from_module`, :func:`snapshot`: read a layer (no mutation).

Imports :mod:`wcache.core` and the errors; core imports nothing from here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any, cast

import attrs
import torch

from wcache.core import (
    LOAD_TAGS,
    PREPARE_TAGS,
    BoundPlan,
    LayerState,
    ParamOutcome,
    Prepared,
    RestoreGuard,
    tensor_checksum,
)
from wcache.errors import ModelMismatch

__all__ = [
    "load_",
    "prepare_",
    "restore_",
    "apply_state_",
    "install_tensors_",
    "param_flags",
    "likeness",
    "created_attrs",
    "parameter_like",
    "rebind_captured_",
    "resolve_parent",
    "state_from_module",
    "child_reads",
    "own_state",
    "snapshot",
]


def state_from_module(module: torch.nn.Module, children: Iterable[str] = ()) -> LayerState:
    """Read a module's own (non-recursive) parameters and buffers into a state.

    Args:
        children: dotted names (``"kv_b_proj.weight"``) of submodules' tensors a plan
            reads (:func:`child_reads`); added under those names when present. They
            are read-only inputs: :func:`own_state` strips them before anything is
            installed or exported (the child's own plan owns them).
    """
    params = {k: v for k, v in module._parameters.items() if v is not None}
    bufs = {k: v for k, v in module._buffers.items() if v is not None}
    tensors = {**params, **bufs}
    for dotted in children:
        child, _, leaf = dotted.rpartition(".")
        sub = module.get_submodule(child)
        t = sub._parameters.get(leaf, sub._buffers.get(leaf))
        if t is not None:
            tensors[dotted] = t
    return LayerState(tensors=tensors, buffers=frozenset(bufs))


def child_reads(bound: BoundPlan) -> tuple[str, ...]:
    """The dotted reads (a submodule's tensor, ``"kv_b_proj.weight"``) of ``bound``'s
    stages: MLA's post-load reads its ``kv_b_proj`` child's weight."""
    return tuple(sorted({r for st in bound.plan.stages for r in st.reads if "." in r}))


def own_state(state: LayerState) -> LayerState:
    """``state`` without the submodule tensors :func:`state_from_module` read in
    (dotted names): what the layer itself holds, installs and exports."""
    if not any("." in k for k in state.tensors):
        return state
    return attrs.evolve(state, tensors={k: v for k, v in state.tensors.items() if "." not in k})


# --------------------------------------------------------------------------- entry points


def load_(layer: torch.nn.Module, bound: BoundPlan) -> LayerState:
    """Ordinary load: run every stage of ``bound`` and install the result on ``layer``."""
    state = own_state(bound.run(state_from_module(layer, child_reads(bound)), LOAD_TAGS))
    apply_state_(layer, state)
    return state


def prepare_(layer: torch.nn.Module, bound: BoundPlan) -> Prepared:
    """Daemon side: run TRANSFORM/METADATA/VALIDATE stages, install the result on
    ``layer`` (so the daemon can keep serving a consistent module) and return
    the tensors to export with the recorded values."""
    state = own_state(bound.run(state_from_module(layer, child_reads(bound)), PREPARE_TAGS))
    apply_state_(layer, state)
    return bound.prepared(state)


def restore_(
    layer: torch.nn.Module,
    bound: BoundPlan,
    recorded: Mapping[str, Mapping[str, Any]],
    *,
    strict: bool = False,
    guard: bool | RestoreGuard = True,
    content: bool = True,
    drops: Iterable[str] = (),
    memo: MutableMapping[str, dict] | None = None,
) -> LayerState:
    """Engine side: ``layer`` already holds the mapped tensors; replay the
    METADATA/ALLOCATE/DERIVE/VALIDATE stages (the restore fold, with the guard as
    its per-step hook) and install the result.

    Args:
        recorded: the daemon's recorded values for this layer.
        strict: also compare a blake2b of every shared tensor (host copy).
        guard: ``True`` guards this layer alone (:class:`RestoreGuard`);
            a :class:`RestoreGuard` built over many layers (keyed by
            ``config.name``) guards them together, so a write into another
            layer is blamed on the stage that made it; ``False`` no guard.
        content: with ``guard=True``, checksum the layer's byte ranges
            before and after (default on; pass False only when the mapping
            is read-only, so that a write faults instead).
        drops: names the daemon's prepare deleted; leftover placeholders are
            removed here.
        memo: one dict for a whole model's restore (stage name -> entries), the
            caller's: ``memoized`` stages read it (e.g. one oneDNN prepack for
            tied weights) and the entries they return are added to it here;
            ``None`` shares nothing.

    Raises:
        RestoreWroteSharedTensor: a stage changed a shared tensor.
        RecordedMismatch: a recomputed value differs from the recorded one.
        RestoreIncomplete: a needed tensor is missing.
    """
    name = bound.config.name
    initial = bound.restore_start(state_from_module(layer, child_reads(bound)), recorded, drops)
    step_guard: RestoreGuard | None
    if guard is True:
        step_guard = RestoreGuard(
            {
                name: {
                    k: initial.tensors[k]
                    for k in sorted(initial.tensors)
                    if initial.tensors[k].device.type != "meta"
                }
            },
            content=content,
            strict=strict,
        )
    elif guard is False:
        step_guard = None
    else:
        step_guard = guard
    state = own_state(bound.restore_run(initial, recorded, guard=step_guard, memo=memo))
    if memo is not None:
        for stage_name, entries in state.memo.items():
            memo.setdefault(stage_name, {}).update(entries)
    apply_state_(layer, state)
    if step_guard is not None:
        installed = state_from_module(layer, child_reads(bound)).tensors
        step_guard.check_stage(name, "(install)", {**installed, **state.released})
        step_guard.check_layer(name, [s.name for s in bound.stages if s.replayable])
    return state


# --------------------------------------------------------------------------- snapshots


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def resolve_parent(root: Any, path: str) -> tuple[Any, str]:
    """The object holding the last component of dotted ``path`` under ``root``, and
    that component (``"quant_method.kernel.x"`` -> ``(root.quant_method.kernel, "x")``).

    Raises:
        AttributeError: a parent on the path does not exist.
    """
    *parents, leaf = path.split(".")
    obj = root
    for p in parents:
        obj = getattr(obj, p)
    return obj, leaf


def apply_state_(module: torch.nn.Module, state: LayerState, *, keep: Iterable[str] = ()) -> None:
    """The one shell that mutates: make ``module`` hold ``state``.

    Tensors whose object is already installed under the same name are left
    alone (so mapped tensors keep their identity); others are registered as
    ``nn.Parameter(requires_grad=False)`` or buffers. Dropped names are
    deleted; attributes are set by dotted path.

    Args:
        keep: tensor names that must not be replaced (the shared ones); the
            guard checks them, this only avoids needless re-registration.
    """
    for name in state.drops:
        if name in state.tensors or (name in state.attrs and state.attrs[name] is None):
            continue  # kept, or emptied to a None slot by the attrs below (as vLLM does)
        if name in module._parameters:
            del module._parameters[name]
        elif name in module._buffers:
            del module._buffers[name]
        elif name in module.__dict__:
            delattr(module, name)
    for name, tensor in state.tensors.items():
        current = module._parameters.get(name, module._buffers.get(name))
        if current is tensor:
            continue
        base = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        if name in state.buffers:
            module._parameters.pop(name, None)
            module._buffers.pop(name, None)
            module.register_buffer(name, base)
        else:
            module._buffers.pop(name, None)
            if name in module.__dict__:
                delattr(module, name)
            param = (
                tensor
                if isinstance(tensor, torch.nn.Parameter)
                else torch.nn.Parameter(base, requires_grad=False)
            )
            module._parameters[name] = param
    for path, value in state.attrs.items():
        obj, leaf = resolve_parent(module, path)
        setattr(obj, leaf, value)


def snapshot(module: torch.nn.Module, attr_paths: Iterable[str] = ()) -> dict[str, Any]:
    """A comparable picture of a layer: per tensor (kind, shape, dtype, stride, bytes
    checksum), tensor-slot Nones, and the values at ``attr_paths``.

    Used by the restore-invariant tests: ``snapshot(restored) == snapshot(loaded)``.
    """
    out: dict[str, Any] = {}
    for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
        for name, t in table.items():
            if t is None:
                out[name] = (kind, None)
            else:
                out[name] = (
                    kind,
                    tuple(t.shape),
                    str(t.dtype),
                    tuple(t.stride()),
                    tensor_checksum(t),
                )
    for path in attr_paths:
        try:
            obj, leaf = resolve_parent(module, path)
            value = getattr(obj, leaf)
        except AttributeError:
            value = "<missing>"
        if isinstance(value, torch.Tensor):
            value = ("tensor", tuple(value.shape), str(value.dtype), tensor_checksum(value))
        elif callable(value):
            value = "<callable>"
        elif not _is_plain(value):
            # process-local handles (oneDNN handlers, ...): compared by type; their
            # behaviour is checked through the forward output
            value = f"<{type(value).__name__}>"
        out[f"@{path}"] = value
    return out


def _split(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _module_of(
    model: torch.nn.Module, modules: Mapping[str, torch.nn.Module], name: str
) -> tuple[torch.nn.Module, str]:
    mod, leaf = _split(name)
    if mod not in modules:
        raise ModelMismatch(
            f"the daemon exports {name!r} but the engine's model has no module "
            f"{mod!r}: daemon and engine were started on different models or "
            f"engine arguments; restart the daemon with the engine's arguments."
        )
    return modules[mod], leaf


def _by_every_name(
    modules: Mapping[str, torch.nn.Module], per_layer: Mapping[str, Iterable[str]]
) -> dict[str, set[str]]:
    """``per_layer`` (layer name -> tensor names) under every name of each layer's module.

    One module can hang under two names: vLLM 0.33's fused-MoE layers keep the router
    gate as ``mlp.gate`` and ``mlp.experts.gate``. The plan is resolved for one of them,
    and the export names the tensor by whichever ``named_parameters`` meets first, so
    what a plan writes must be known under both.
    """
    by_module: dict[int, set[str]] = {}
    for name, names in per_layer.items():
        if name in modules:
            by_module.setdefault(id(modules[name]), set()).update(names)
    out = {name: set(names) for name, names in per_layer.items()}
    for name, module in modules.items():
        if id(module) in by_module:
            out.setdefault(name, set()).update(by_module[id(module)])
    return out


def _check_shapes(
    modules: Mapping[str, torch.nn.Module],
    tensors: Mapping[str, torch.Tensor],
    transformed: Mapping[str, Iterable[str]],
) -> None:
    """Shape and dtype of every exported tensor against the engine's meta model,
    except those a TRANSFORM stage of their layer's plan writes.

    Raises:
        ModelMismatch: names the first tensor that differs, with both shapes/dtypes.
    """
    for name, t in tensors.items():
        mod_name, leaf = _split(name)
        module = modules.get(mod_name)
        if module is None or leaf in transformed.get(mod_name, ()):
            continue
        mine: torch.Tensor | None = module._parameters.get(leaf)
        if mine is None:
            mine = module._buffers.get(leaf)
        if mine is None:
            continue
        if tuple(mine.shape) != tuple(t.shape) or mine.dtype != t.dtype:
            raise ModelMismatch(
                f"the daemon exports {name!r} as {list(t.shape)} {t.dtype} but the engine's "
                f"model expects {list(mine.shape)} {mine.dtype}: daemon and engine were started "
                f"with different engine arguments (e.g. hf_overrides, max_model_len); restart "
                f"the daemon with the engine's arguments."
            )


#: Key of the export's ``extra`` under which the daemon records, per parameter name,
#: ``[kept, requires_grad, carried, attrs]`` (:func:`param_flags`; read by
#: :func:`install_tensors_`).
PARAM_FLAGS_EXTRA = "param_flags"
#: :attr:`ParamOutcome.carried` entry: every attribute of the built parameter.
CARRY_ALL = "*"
#: ``BasevLLMParameter``'s backing field of its ``weight_loader`` property, which
#: vLLM's ``replace_parameter`` never carries (it sets ``weight_loader`` itself).
LOADER_BACKING_FIELD = "_weight_loader"


def _outcomes_by_every_name(
    modules: Mapping[str, torch.nn.Module], outcomes: Mapping[str, Mapping[str, ParamOutcome]]
) -> dict[str, dict[str, ParamOutcome]]:
    """``outcomes`` (layer name -> parameter name -> outcome) under every name of each
    layer's module (:func:`_by_every_name` says why)."""
    by_module = {id(modules[n]): dict(o) for n, o in outcomes.items() if n in modules}
    out = {n: dict(o) for n, o in outcomes.items()}
    for name, module in modules.items():
        if id(module) in by_module:
            out.setdefault(name, {}).update(by_module[id(module)])
    return out


def likeness(p: torch.nn.Parameter) -> tuple[str, tuple[str, ...]]:
    """A parameter's class and attribute names (what a kept parameter carries)."""
    return (f"{type(p).__module__}.{type(p).__qualname__}", tuple(sorted(vars(p))))


def param_flags(
    model: torch.nn.Module,
    built: Mapping[str, Any],
    outcomes: Mapping[str, Mapping[str, ParamOutcome]],
    built_grad: Mapping[str, bool] | None = None,
    built_like: Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
) -> dict[str, list[Any]]:
    """Per parameter of ``model`` (every name, tied ones included): ``[kept,
    requires_grad, carried, attrs]``, as vLLM's disk load leaves it.

    A parameter no stage of its layer's plan writes is kept when it is still the
    object the build created (``built``: name -> a ``weakref.ref`` to it, taken right
    after the build), with its own ``requires_grad``. A parameter a stage writes is
    what its :class:`~wcache.core.ParamOutcome` says (how the plan's post-load
    re-registers it, in this vLLM release: ``wcache.vllm.compat.param_outcomes``):
    kept (the build's class and attributes, the build's ``requires_grad``), or a
    plain ``nn.Parameter(requires_grad=False)`` carrying the build's attributes named
    in ``carried``; ``attrs`` are set over either. A parameter the build did not have
    (vLLM's load created it) is ``[False, requires_grad, [], attrs, bound]``, the
    attributes the load gave it (:func:`created_attrs`); a second name for a built
    parameter (an alias a stage registers) has the original's record.

    Args:
        outcomes: layer name -> parameter name -> outcome, for each parameter its
            plan writes.
        built_grad: parameter name -> ``requires_grad`` right after the build
            (default: the parameter's now).
        built_like: parameter name -> :func:`likeness` right after the build: a
            parameter no stage writes that vLLM's load replaced by one of the same
            class and attribute names is kept too.

    Source: vllm/model_executor/utils.py::replace_parameter;
    vllm/model_executor/layers/quantization/utils/layer_utils.py::replace_parameter
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    by_name = _outcomes_by_every_name(modules, outcomes)
    grads = built_grad or {}
    out: dict[str, list[Any]] = {}
    params = list(model.named_parameters(remove_duplicate=False))
    # a second name a stage gave a built parameter (vLLM's ``layer.w13_weight =
    # layer.w13_qweight``): one object, so the built name's record
    original = {id(p): n for n, p in params if n in built}
    for name, p in params:
        ref = built.get(name)
        mod_name, leaf = _split(name)
        outcome = by_name.get(mod_name, {}).get(leaf)
        if name not in built and id(p) in original:
            continue  # filled in below, from the original's record
        if outcome is None and name not in built:
            # created by vLLM's load (the transformers backend registers lm_head.bias
            # when the checkpoint has one): the meta build has no such parameter, so
            # the record carries the attributes the load gave it
            attrs, bound = created_attrs(p, modules)
            out[name] = [False, bool(p.requires_grad), [], attrs, bound]
        elif outcome is None:
            # vLLM's own load may swap a parameter for a like one (its layerwise loader
            # materializes an online-quantized layer's meta tensors as new objects):
            # the same class and attribute names as the build's count as kept
            like = built_like is not None and built_like.get(name) == likeness(p)
            kept = (ref is not None and ref() is p) or like
            out[name] = [kept, bool(p.requires_grad), [], {}]
        elif outcome.kept and ref is not None:
            grad = grads.get(name, bool(p.requires_grad))
            out[name] = [True, bool(grad), [], dict(outcome.attrs)]
        else:
            out[name] = [False, False, list(outcome.carried), dict(outcome.attrs)]
    for name, p in params:
        if name not in out:
            out[name] = out[original[id(p)]]
    return out


def _is_record_value(value: Any) -> bool:
    """A value the daemon's record carries as it is (msgpack: no dtype, no enum)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_is_record_value(v) for v in value)


def created_attrs(
    p: torch.nn.Parameter, modules: Mapping[str, torch.nn.Module]
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The attributes of a parameter vLLM's load created (one the build did not
    have), as the daemon's record carries them: plain values (``output_dim``) by
    value, and methods bound to a module of the model (``weight_loader``, vLLM's
    ``set_weight_attrs(bias, {"weight_loader": self.weight_loader})``) as ``[module
    name, method name]``, which :func:`install_tensors_` binds again on the engine's
    module. Any other attribute (a process-local object) is left out: ``wcache
    verify`` then reports it.

    Returns:
        ``(attrs, bound)``: attribute -> value, attribute -> ``[module, method]``.

    Source: vllm/model_executor/layers/vocab_parallel_embedding.py::
    ParallelLMHead._register_bias, called by
    vllm/model_executor/models/transformers/causal.py::load_weights.
    """
    names = {id(m): n for n, m in modules.items()}
    attrs: dict[str, Any] = {}
    bound: dict[str, list[str]] = {}
    for attr, value in vars(p).items():
        owner = getattr(value, "__self__", None)
        func = getattr(value, "__func__", None)
        if _is_record_value(value):
            attrs[attr] = list(value) if isinstance(value, tuple) else value
        elif func is not None and id(owner) in names:
            bound[attr] = [names[id(owner)], func.__name__]
    return attrs, bound


def carried_attrs(built: torch.nn.Parameter, carried: Iterable[str]) -> dict[str, Any]:
    """The attributes of ``built`` that a re-registered plain parameter carries
    (:attr:`ParamOutcome.carried`; :data:`CARRY_ALL`: all but the loader's backing
    field, the loader under ``weight_loader``).

    Source: vllm/model_executor/utils.py::replace_parameter (0.32: ``new_tensor``'s
    attributes but ``weight_loader``/``_weight_loader``, then the old parameter's
    ``weight_loader``).
    """
    names = set(carried)
    out: dict[str, Any] = {}
    if CARRY_ALL in names:
        out.update((k, v) for k, v in vars(built).items() if k != LOADER_BACKING_FIELD)
        names.discard(CARRY_ALL)
        names.add("weight_loader")
    for attr in sorted(names):
        if hasattr(built, attr):
            out[attr] = getattr(built, attr)
    return out


def parameter_like(
    built: torch.nn.Parameter, data: torch.Tensor, *, requires_grad: bool
) -> torch.nn.Parameter:
    """A parameter holding ``data`` (not copied) of ``built``'s class (vLLM's
    ``ModelWeightParameter``, ``PackedvLLMParameter``, ... or ``nn.Parameter``) with
    its attributes (a shallow copy of ``vars(built)``: ``weight_loader``,
    ``output_dim``, ``input_dim``, ``packed_dim``, ``tp_rank``, ...): what the disk
    engine holds where post-load kept the built parameter. ``built`` is typically
    the meta build's parameter, whose data cannot be swapped for a real tensor.

    Source: torch/nn/parameter.py::Parameter.__new__ (``Tensor._make_subclass``,
    which vLLM's ``BasevLLMParameter.__new__`` calls through ``super()``).
    """
    out = torch.Tensor._make_subclass(type(built), data, requires_grad)
    out.__dict__.update(vars(built))
    return out


def install_tensors_(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    kinds: Mapping[str, str],
    persistent: Mapping[str, bool],
    aliases: Mapping[str, str],
    *,
    writes: Mapping[str, Iterable[str]],
    transformed: Mapping[str, Iterable[str]],
    param_flags: Mapping[str, Any] | None = None,
    param_attrs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Register mapped tensors on a meta-built model (the engine side).

    A parameter whose ``param_flags`` entry says post-load kept the object the
    model built becomes a parameter of the meta one's class with its attributes
    (``weight_loader``, ``output_dim``, ...) and the recorded ``requires_grad``
    (:func:`parameter_like`), as on a disk-loaded engine; any other parameter
    (one vLLM's post-load re-registers, or no record: an older daemon) a plain
    ``nn.Parameter`` with the recorded ``requires_grad`` (default False) carrying
    the meta one's attributes the record names (:func:`carried_attrs`). The
    record's attributes are set over either.
    Buffers keep their persistence; aliases are registered as the *same*
    object; references the model's objects took to a replaced tensor are pointed
    at the installed one (:func:`rebind_captured_`). A tensor the model has no
    slot for is accepted only when the plan
    of its layer declares it as a write. Every tensor whose slot the meta model
    already has, and which no TRANSFORM stage of its layer's plan writes (so the
    daemon could not have reshaped it), must have the meta tensor's shape and
    dtype; all of this is checked before the model is changed.

    Args:
        tensors: canonical and alias name (``"model.layers.0.mlp.down_proj.qweight"``)
            -> mapped tensor (any shape, dtype and device).
        kinds: name -> ``"param"`` | ``"buffer"``.
        persistent: buffer name -> registered persistent.
        aliases: alias name -> canonical name.
        writes: layer name -> tensor names its plan's stages may write.
        transformed: layer name -> tensor names its plan's TRANSFORM stages write.
        param_flags: parameter name -> ``[kept, requires_grad, carried, attrs,
            bound]`` as the daemon recorded them (:data:`PARAM_FLAGS_EXTRA` of the
            export, :func:`param_flags`); ``bound`` (attribute -> ``[module,
            method]``) is bound to the engine's module; a two-item record is
            ``[kept, requires_grad]``, a four-item one has no ``bound``.
        param_attrs: parameter name -> attributes set on a kept parameter over the
            build's (``Plan.param_attrs``, under the layer's name).

    Raises:
        ModelMismatch: an exported tensor that the model cannot hold, or of
            another shape or dtype than the engine's, or a recorded method its
            module lacks (code ``model-mismatch``).
    """
    param_flags = param_flags or {}
    modules = dict(model.named_modules(remove_duplicate=False))
    plan_writes = _by_every_name(modules, writes)
    _check_shapes(modules, tensors, _by_every_name(modules, transformed))
    #: (canonical name, kind) -> its installed object, the same for every alias
    objects: dict[tuple[str, str], torch.Tensor] = {}
    replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in tensors:
        canonical = aliases.get(name, name)
        module, leaf = _module_of(model, modules, name)
        mod_name = _split(name)[0]
        known = leaf in module._parameters or leaf in module._buffers
        if not known and leaf not in plan_writes.get(mod_name, ()):
            raise ModelMismatch(
                f"the daemon exports {name!r}, which the engine's model does not have and no "
                f"plan of layer {mod_name!r} produces; the daemon serves a different model."
            )
        kind = kinds[name]
        obj = objects.get((canonical, kind))
        if obj is None:
            t = tensors[canonical]
            if kind == "param":
                record = list(param_flags.get(canonical, ()))
                kept, requires_grad, carried, set_attrs, bound = (
                    record + _RECORD_DEFAULTS[len(record) :]
                )
                built = module._parameters.get(leaf)
                if kept and isinstance(built, torch.nn.Parameter):
                    obj = parameter_like(built, t, requires_grad=requires_grad)
                    obj.__dict__.update((param_attrs or {}).get(canonical, {}))
                else:
                    obj = torch.nn.Parameter(t, requires_grad=requires_grad)
                    if isinstance(built, torch.nn.Parameter):
                        obj.__dict__.update(carried_attrs(built, carried))
                obj.__dict__.update(set_attrs)
                obj.__dict__.update(_bind_methods(modules, name, bound))
            else:
                obj = t
            objects[(canonical, kind)] = obj
        old = module._parameters.pop(leaf, None)
        old_buffer = module._buffers.pop(leaf, None)
        for stale in (old, old_buffer):
            if stale is not None and stale is not obj:
                replaced[id(stale)] = (stale, obj)
        if kind == "param":
            # a Parameter: the kind decided above
            module._parameters[leaf] = cast(torch.nn.Parameter, obj)
        else:
            module.register_buffer(leaf, obj, persistent=persistent.get(name, True))
    rebind_captured_(modules.values(), replaced)


#: A parameter record's defaults (``[kept, requires_grad, carried, attrs, bound]``):
#: an older daemon's record has two or four items, none a plain parameter without grad.
_RECORD_DEFAULTS: list[Any] = [False, False, [], {}, {}]


def _bind_methods(
    modules: Mapping[str, torch.nn.Module], name: str, bound: Mapping[str, Any]
) -> dict[str, Any]:
    """``bound`` (attribute -> ``[module name, method name]``, :func:`created_attrs`)
    as methods of the engine's modules.

    Raises:
        ModelMismatch: a named module or method the engine's model does not have.
    """
    out: dict[str, Any] = {}
    for attr, (mod_name, method) in bound.items():
        module = modules.get(mod_name)
        if module is None or not callable(getattr(module, method, None)):
            raise ModelMismatch(
                f"the daemon's record gives {name!r} the method {method!r} of module "
                f"{mod_name!r} as {attr!r}, which the engine's model does not have: "
                "daemon and engine were started on different models or vLLM versions; "
                "restart the daemon with the engine's vLLM"
            )
        out[attr] = getattr(module, method)
    return out


def rebind_captured_(
    modules: Iterable[torch.nn.Module],
    replaced: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
) -> list[str]:
    """Point references that a module's own plain attributes, or the plain objects it
    holds, took to a tensor before it was replaced (the meta-built one) at the
    installed tensor.

    vLLM objects built with the model keep a reference to a layer's parameter: an
    attention backend impl keeps the attention sinks it was given
    (``TritonAttentionImpl.sinks = sinks``, GPT-OSS's ``OAIAttention.sinks``
    parameter). On an ordinary load the weight loader copies into that parameter,
    so the reference sees the bytes; installing a mapped tensor registers a new
    object, and the impl would keep the meta tensor (a kernel reading it kills the
    engine). Looks one level deep: a module's ``__dict__`` entries and the
    ``__dict__`` of the plain (non-module, non-tensor) objects among them.

    Args:
        modules: every module of the model.
        replaced: ``id(old tensor)`` -> ``(old tensor, installed tensor)``.

    Returns:
        The rebound references, ``"<ClassName>.<attr>"`` each (for tests and logs).
    """
    rebound: list[str] = []

    def rebind(owner: Any, namespace: dict[str, Any]) -> None:
        for attr, value in list(namespace.items()):
            if isinstance(value, torch.Tensor):
                hit = replaced.get(id(value))
                if hit is not None and hit[0] is value:
                    namespace[attr] = hit[1]  # not setattr: a Module would register it
                    rebound.append(f"{type(owner).__name__}.{attr}")

    for module in modules:
        namespace = vars(module)
        rebind(module, namespace)
        for value in list(namespace.values()):
            if _is_plain_object(value):
                rebind(value, vars(value))
    return rebound


def _is_plain_object(value: Any) -> bool:
    """An object whose attributes :func:`rebind_captured_` may hold tensor references:
    not a module, tensor, class, or builtin value, and with a ``__dict__``."""
    return (
        not isinstance(value, (torch.nn.Module, torch.Tensor, type, str, bytes, int, float))
        and not isinstance(value, (list, tuple, dict, set, frozenset))
        and hasattr(value, "__dict__")
    )
