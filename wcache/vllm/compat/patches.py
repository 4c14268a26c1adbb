"""vLLM's functions replaced inside a block: every patch is a context manager undone on
exit (also on an exception), through :func:`_patched`; the process-wide registrations a
model build leaves (:func:`registrations`, :func:`forget_registrations_`); online
quantization deferred while the daemon loads.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import attrs
import torch


@attrs.frozen
class Registrations:
    """Names of the process-wide registrations a model build adds (vLLM keys its
    forward context by layer name and caches rotary embeddings by parameters)."""

    forward_context: frozenset[str]
    ropes: frozenset[Any]
    #: length of ``compilation_config.static_all_moe_layers`` (vLLM appends each fused-MoE
    #: layer's name; its forward context indexes the list when ``fast_moe_cold_start``)
    moe_layers: int = 0


def registrations(vllm_config: Any) -> Registrations:
    """The registrations present now (take it before a build)."""
    from vllm.model_executor.layers import rotary_embedding  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return Registrations(
        forward_context=frozenset(vllm_config.compilation_config.static_forward_context),
        ropes=frozenset(rotary_embedding._ROPE_DICT),
        moe_layers=len(getattr(vllm_config.compilation_config, "static_all_moe_layers", ())),
    )


def forget_registrations_(vllm_config: Any, before: Registrations) -> None:
    """Drop every registration added since ``before``, so another build can run in
    this process and the built model's layers are no longer referenced."""
    from vllm.model_executor.layers import rotary_embedding  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    ctx = vllm_config.compilation_config.static_forward_context
    for k in set(ctx) - before.forward_context:
        del ctx[k]
    for k in set(rotary_embedding._ROPE_DICT) - before.ropes:
        del rotary_embedding._ROPE_DICT[k]
    # appended in build order: a second build left in it would double every MoE layer (a
    # fallback engine's compiled graph then differed from a disk engine's: a cache miss)
    moe_layers = getattr(vllm_config.compilation_config, "static_all_moe_layers", None)
    if moe_layers is not None:
        del moe_layers[before.moe_layers :]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name = value`` inside the block, the original again on exit (also on
    an exception); yields the original. Every patch of vLLM goes through here."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield real
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def gptq_config_copied_shallow() -> Iterator[None]:
    """Inside the block, vLLM's GPTQ ``get_linear_quant_method`` gives each linear
    layer a shallow copy of the quant config instead of a deep one when the config
    has no per-module ``dynamic`` rules (with rules, the deep copy stays).

    vLLM deep-copies the whole config (its ``full_config`` dict and module lists
    included) for every linear layer so that ``override_config`` can apply that
    layer's ``dynamic`` rule to a private copy. Without rules ``override_config`` only
    rebinds scalar attributes (``pack_factor``, ``quant_type``, ``desc_act``) to the
    values the base config gives, which a shallow copy keeps private to the layer as
    well; nothing writes into the nested containers. Measured on the H200 (vLLM
    0.32, 8B-shaped GPTQ, 128 linear layers, under cProfile): the deep copies were
    0.127 s of the engine's 0.446 s meta build.

    Source: vllm/model_executor/layers/quantization/utils/gptq_utils.py::
        get_linear_quant_method, override_config
    """
    from vllm.model_executor.layers.quantization.utils import gptq_utils  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    def config_copy(config: Any) -> Any:
        if getattr(config, "dynamic", None):
            return copy.deepcopy(config)
        return copy.copy(config)

    with _patched(gptq_utils, "deepcopy", config_copy):
        yield


#: Where vLLM's own modules are defined: the Transformers backend builds them on the
#: engine's device, so its ``init_parameters`` never meets their parameters on meta.
_VLLM_MODULES = "vllm."


def _is_vllm_module(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith(_VLLM_MODULES)


@contextlib.contextmanager
def transformers_parameters_as_disk() -> Iterator[None]:
    """Inside the block, vLLM's Transformers modeling backend re-creates only the
    parameters a disk build has on meta: those of transformers' own modules, not those
    of the vLLM modules it swapped in (``RMSNorm``, ``LayerNorm``, ...), which keep
    their object, class and attributes.

    A disk engine builds the transformers tree with its parameters on meta
    (``init_on_device_without_buffers("meta")``) and vLLM's replacement modules on the
    engine's device; ``Base.init_parameters`` then gives every parameter still on meta
    and without a ``weight_loader`` a fresh, attribute-less ``nn.Parameter`` on the
    device, which touches transformers' parameters only. A restore builds the whole
    model on meta (:func:`wcache.vllm.model.meta_build`), so that pass would replace
    vLLM's norm parameters too and drop what their constructor set on them: vLLM
    0.33's ``dummy_weight_value`` (``RMSNorm`` 1.0, ``LayerNorm`` bias 0.0), which
    ``wcache verify`` then reports (OLMo2, Starcoder2, GPT-NeoX, GLM, Phi on the H100,
    2026-12-05). Here those parameters are hidden from the pass (taken out of their
    module and put back in their order after it), so they stay on meta with their
    attributes, as in the disk build, and the restore fills them like any other.
    Nothing else of the pass changes (the upstream method runs).

    Source: vllm/model_executor/models/transformers/base.py::Base.__init__,
    Base.init_parameters (0.32, 0.33); vllm/model_executor/layers/layernorm.py (0.33:
    ``set_weight_attrs(self.weight, {"dummy_weight_value": 1.0})``).
    """
    try:
        from vllm.model_executor.models.transformers import base  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    except ImportError:  # a vLLM without the backend: nothing to patch
        yield
        return
    real = base.Base.init_parameters

    def init_parameters(self: Any, module: torch.nn.Module, dtype: Any = None) -> None:
        hidden: list[tuple[torch.nn.Module, list[str], dict[str, Any]]] = []
        for mod in module.modules():
            if not _is_vllm_module(mod):
                continue
            kept = {
                n: p
                for n, p in mod._parameters.items()
                if p is not None and p.device.type == "meta" and not hasattr(p, "weight_loader")
            }
            if kept:
                hidden.append((mod, list(mod._parameters), kept))
                for n in kept:
                    del mod._parameters[n]
        try:
            real(self, module, dtype)
        finally:
            for mod, order, kept in hidden:
                now = dict(mod._parameters)
                mod._parameters.clear()
                for n in order:
                    mod._parameters[n] = kept[n] if n in kept else now.get(n)
                for n, p in now.items():  # none expected: the pass only replaces
                    mod._parameters.setdefault(n, p)

    with _patched(base.Base, "init_parameters", init_parameters):
        yield


@contextlib.contextmanager
def captured_hash_factors() -> Iterator[list[dict]]:
    """Inside the block every ``hash_factors(items)`` vLLM's configs call (from
    ``compute_hash``) also appends a copy of ``items`` to the yielded list; vLLM's
    function is back on exit.

    Source: vllm/config/utils.py::hash_factors (called by ModelConfig.compute_hash)
    """
    from vllm.config import utils as config_utils  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    captured: list[dict] = []
    real = config_utils.hash_factors

    def capture(items: dict) -> str:
        captured.append(dict(items))
        return real(items)

    with _patched(config_utils, "hash_factors", capture):
        yield captured


def model_config_hash_factors(model_config: Any) -> dict[str, Any]:
    """The factors ``ModelConfig.compute_hash`` hashes, captured from vLLM itself
    (so its own ignore list and any factor it adds later apply); every field when
    vLLM no longer hashes through ``hash_factors`` (more than needed is safe: a
    spurious mismatch is refused loudly, a missing factor would lie)."""
    from vllm.config import utils as config_utils  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    with captured_hash_factors() as captured:
        model_config.compute_hash()
    if captured:
        return captured[-1]
    return config_utils.get_hash_factors(model_config, set())


@contextlib.contextmanager
def attention_forward_replaced(forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    """``Attention.forward`` is ``forward`` inside the block (for every attention
    layer of every model in this process), vLLM's own again on exit. ``wcache
    verify`` computes attention by a pure-torch reference this way (vLLM's kernels
    need the engine's KV cache and scheduler metadata)."""
    from vllm.model_executor.layers.attention import Attention  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    with _patched(Attention, "forward", forward):
        yield


@contextlib.contextmanager
def torch_accelerator_noops() -> Iterator[None]:
    """vLLM's CPU no-ops for ``torch.accelerator`` inside the block
    (``BaseModelLoader`` calls ``torch.accelerator.empty_cache()``, which raises on a
    CPU-only torch); torch's own functions again on exit. vLLM's CPU worker installs
    them for its whole process; the daemon and ``wcache verify`` scope them to
    their builds.

    Source: vllm/v1/worker/cpu_model_runner.py::_set_torch_accelerator_to_noop
    """
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    accelerator = torch.accelerator
    real = {name: getattr(accelerator, name) for name in ("synchronize", "empty_cache")}
    _set_torch_accelerator_to_noop()
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(accelerator, name, fn)


def uses_online_quantization(quant_method: Any) -> bool:
    """Whether vLLM quantizes this method's weights while loading them (an online
    method: ``OnlineLinearBase`` / ``OnlineMoEMethodBase`` with the checkpoint's
    bf16/fp16 weight created on ``meta``, ``uses_meta_device``).

    Source: vllm/model_executor/model_loader/base_loader.py::_has_online_quant
    """
    return bool(getattr(quant_method, "uses_meta_device", False))


def _skip_postload(layer: torch.nn.Module) -> None:
    """Stands in for an online method's ``process_weights_after_loading`` while the
    daemon loads (:func:`online_quantization_deferred`)."""


@contextlib.contextmanager
def online_quantization_deferred() -> Iterator[None]:
    """Inside the block vLLM's layerwise loader still materializes an online layer
    and copies the checkpoint's bf16/fp16 weight into it, but does not quantize it.

    vLLM 0.32 quantizes online FP8/MXFP8 *while loading*: each online method's
    ``create_weights`` wraps its weight loaders (``initialize_online_processing``)
    and, once a layer's last byte arrives, ``_layerwise_process`` runs the method's
    ``process_weights_after_loading`` (quantize, transpose, pad). The daemon's plans
    do that work themselves as TRANSFORM stages (so they can be checked and
    recorded), and must start from the checkpoint weight: run twice, the plan would
    quantize FP8 bytes again (``aminmax`` is not implemented for float8 on CUDA).
    The patch is undone on exit and touches only layers whose method is online.

    Source: vllm/model_executor/model_loader/reload/layerwise.py::_layerwise_process
    (called through the module global by ``make_online_process_loader`` and
    ``finalize_layerwise_processing``).
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    real = layerwise._layerwise_process

    def load_without_quantizing(layer: torch.nn.Module, info: Any) -> None:
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is None or not uses_online_quantization(quant_method):
            real(layer, info)
            return
        # an instance attribute shadows the class's method for this one call
        quant_method.process_weights_after_loading = _skip_postload
        try:
            real(layer, info)
        finally:
            del quant_method.process_weights_after_loading

    with _patched(layerwise, "_layerwise_process", load_without_quantizing):
        yield


class _LoadingModel(Protocol):
    """The method of a vLLM model that :func:`loaded_weight_names` wraps (an attribute
    here: the wrapper is set on the instance)."""

    load_weights: Callable[..., Any]


@contextlib.contextmanager
def loaded_weight_names(model: torch.nn.Module) -> Iterator[list[set[str] | None]]:
    """Inside the block, what ``model.load_weights`` returns (the names of the
    parameters the checkpoint filled; ``None`` where the model does not say) is
    appended to the yielded list, one entry per call. vLLM's loader reads that set
    only for its own check, which on an unquantized model exempts every module with
    post-load work (each linear, embedding and MoE layer); the caller checks those.
    The instance attribute that shadows the method is removed on exit. A module with
    no ``load_weights`` (a bare layer a custom loader fills) records nothing.

    Source: vllm/model_executor/model_loader/default_loader.py::load_weights
    (``loaded_weights = model.load_weights(...)``, then ``track_weights_loading``).
    """
    calls: list[set[str] | None] = []
    if not callable(getattr(model, "load_weights", None)):  # not a vLLM model: a bare layer
        yield calls
        return
    # cast: vLLM's model classes add load_weights, which torch's Module types
    # Tensor | Module; an instance attribute shadows it inside the block
    loading = cast(_LoadingModel, model)
    own = "load_weights" in vars(model)  # an instance attribute already (a wrapper)
    real = loading.load_weights

    def recording(*args: Any, **kwargs: Any) -> Any:
        loaded = real(*args, **kwargs)
        calls.append(None if loaded is None else set(loaded))
        return loaded

    loading.load_weights = recording
    try:
        yield calls
    finally:
        if own:
            loading.load_weights = real
        else:
            del loading.load_weights


def finalize_online_loading_(model: torch.nn.Module, model_config: Any) -> None:
    """Materialize the online layers whose weights were not all loaded (padding), as
    vLLM's ``BaseModelLoader.load_model`` does after ``load_weights``; call it inside
    :func:`online_quantization_deferred` so they are not quantized either.

    Source: vllm/model_executor/model_loader/base_loader.py::load_model
    (``finalize_layerwise_processing`` when ``_has_online_quant(model)``).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if any(uses_online_quantization(getattr(m, "quant_method", None)) for m in model.modules()):
        finalize_layerwise_processing(model, model_config)
