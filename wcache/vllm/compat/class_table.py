"""vLLM's classes the adapter maps, resolved from the installed release's class tables
(:func:`classes`, :func:`kernel_classes`, :func:`is_type`) among the modules this process
imported, and what vLLM's post-load does per class (the base class's no-op, deferred
attention work)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from wcache.vllm.compat.releases import release


class _NotImported:
    """Stands for a vLLM class whose module this process never imported: no object
    can be an instance of it, and nothing is an instance of this."""


def _imported_class(module: str, name: str) -> type:
    """vLLM's class ``module.name`` if ``module`` is imported, else :class:`_NotImported`.

    A model's layers are instances of classes whose modules vLLM imported to build
    them, so looking only at imported modules answers every type question exactly
    without importing (and paying for) the modules of methods the model does not use.

    Raises:
        AttributeError: the module is imported but lacks the class (an untested vLLM).
    """
    mod = sys.modules.get(module)
    return _NotImported if mod is None else getattr(mod, name)


class _Classes:
    """Attribute per class name in the release's ``class_modules`` (:func:`release`),
    resolved on access."""

    def __getattr__(self, name: str) -> type:
        modules = release().class_modules
        if name not in modules:
            raise AttributeError(f"wcache.vllm.compat knows no vLLM class {name!r}")
        return _imported_class(modules[name], name)


_CLASSES = _Classes()


def classes() -> _Classes:
    """vLLM's classes the adapter maps (attribute per class name), from the modules
    this process imported (see :func:`_imported_class`)."""
    return _CLASSES


def kernel_classes() -> tuple[tuple[type, str], ...]:
    """``(vLLM kernel class, wcache kernel id)`` pairs of the imported kernel modules."""
    return tuple(
        (_imported_class(mod, cls), kid) for kid, (mod, cls) in release().kernel_classes.items()
    )


def kernel_id(kernel: Any) -> str:
    """The wcache kernel id of a vLLM kernel object; its class name when wcache does
    not know the class (``plan_for`` then refuses it naming the class)."""
    for cls, kid in kernel_classes():
        if type(kernel) is cls:
            return kid
    return type(kernel).__name__


def is_type(obj: Any, name: str) -> bool:
    """``type(obj)`` is exactly vLLM's class ``name`` (see :data:`_CLASS_MODULES`)."""
    return type(obj) is getattr(classes(), name)


def postload_layer_attrs(obj: Any) -> tuple[tuple[str, Any], ...]:
    """The module attributes this vLLM release's post-load of ``obj`` (a quant method
    or scheme) sets beyond every release's (:attr:`VllmRelease.layer_attrs`); ``()``
    for other classes."""
    name = type(obj).__name__
    attrs_ = release().layer_attrs.get(name, ())
    return attrs_ if attrs_ and is_type(obj, name) else ()


# ------------------------------------------------------------- post-load work


def _overrides(obj: Any, method: str, base: type) -> bool:
    fn = getattr(type(obj), method, None)
    return fn is not None and fn is not getattr(base, method, None)


def quant_method_postload_is_noop(quant_method: Any) -> bool:
    """The method's ``process_weights_after_loading`` is missing or the
    ``QuantizeMethodBase`` no-op."""
    return not _overrides(
        quant_method, "process_weights_after_loading", classes().QuantizeMethodBase
    )


def impl_postload_is_noop(module: torch.nn.Module) -> bool:
    """The attention backend impl's ``process_weights_after_loading`` is missing or
    ``AttentionImplBase``'s no-op."""
    impl = getattr(module, "impl", None)
    if impl is None:
        return True
    return not _overrides(impl, "process_weights_after_loading", classes().AttentionImplBase)


def is_deferred_attention_layer(module: torch.nn.Module) -> bool:
    """vLLM runs ``module.process_weights_after_loading(dtype)`` after the quant
    methods' pass (attention layers, MLA, multimodal-encoder attention).

    Source: vllm/model_executor/layers/attention/__init__.py::is_deferred_attention_layer
    """
    from vllm.model_executor.layers.attention import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        is_deferred_attention_layer as deferred,
    )

    return bool(deferred(module))


def attention_postload(module: torch.nn.Module) -> str:
    """What vLLM's deferred post-load does on an attention-like module.

    Returns:
        ``"attention"``: ``Attention.process_weights_after_loading`` itself (the
        default scales; wcache's attention and kv_cache plans); ``"none"``: no
        deferred work (not such a layer, or multimodal-encoder attention without
        FP8); ``"mla"``: MLA's ``W_UK_T``/``W_UV`` derivation; ``"mm_encoder_fp8"``:
        multimodal-encoder FP8 scale population; ``"other"``: any other override.
    """
    c = classes()
    if not is_deferred_attention_layer(module):
        return "none"
    if isinstance(module, c.Attention) and not _overrides(
        module, "process_weights_after_loading", c.Attention
    ):
        return "attention"
    if isinstance(module, c.MLAAttention):
        return "mla"
    if isinstance(module, c.MMEncoderAttention):
        return "mm_encoder_fp8" if getattr(module, "fp8_enabled", False) else "none"
    return "other"
