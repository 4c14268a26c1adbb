"""The engine's model: the attachment kept alive with it, the copy-on-write wrappers of
its weight writers, and the daemon's ``EngineArgs`` pointed at vLLM's disk loader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

#: Marks the instance attributes wcache puts on a restored CUDA model
#: (``wcache.vllm.loader._install_update_hooks_``: copy-on-write wrappers of
#: ``model.load_weights`` and ``model.get_submodule``). ``wcache verify`` leaves them out
#: of its comparison: vLLM's disk-loaded model has none, and what they wrap is vLLM's.
COPY_ON_WRITE_HOOK = "__wcache_copy_on_write__"


#: The attribute that keeps a restored model's attachment (its mapping) alive for as
#: long as the model lives; ``wcache verify`` leaves it out of its comparison.
ATTACHMENT_ATTR = "_wcache_attachment"


def keep_attachment_(model: torch.nn.Module, attachment: Any) -> None:
    """Keep ``attachment`` (the daemon's mapping) alive with vLLM's ``model``."""
    setattr(model, ATTACHMENT_ATTR, attachment)


def attachment_of(model: torch.nn.Module) -> Any:
    """The attachment :func:`keep_attachment_` put on ``model``, or ``None``."""
    return getattr(model, ATTACHMENT_ATTR, None)


class _HookedModel(Protocol):
    """The two methods of a vLLM model that :func:`wrap_weight_writers_` wraps
    (attributes here: the wrappers are set on the instance)."""

    load_weights: Callable[..., Any]
    get_submodule: Callable[[str], torch.nn.Module]


def wrap_weight_writers_(
    model: torch.nn.Module,
    *,
    before_load_weights: Callable[[], None],
    before_module_write: Callable[[torch.nn.Module], None],
) -> None:
    """Run a callback before each of vLLM's two ways of writing a model's weights
    (wcache's copy on write for a CUDA ``zero_copy`` model):

    * ``model.load_weights`` (called directly through ``collective_rpc``, and by
      ``reload_weights`` in checkpoint format): ``before_load_weights()`` first;
    * ``model.get_submodule`` (``reload_weights(is_checkpoint_format=False)``
      resolves each name through it, then ``param.copy_``):
      ``before_module_write(module)`` on the module it returns.

    Both wrappers are instance attributes marked :data:`COPY_ON_WRITE_HOOK`.

    Source: vllm/v1/worker/gpu_model_runner.py::reload_weights,
    vllm/model_executor/model_loader/reload/inplace.py
    """
    # cast: vLLM's model classes add load_weights, which torch's Module types
    # Tensor | Module; both are replaced by instance attributes here
    hooked = cast(_HookedModel, model)
    load_weights, get_submodule = hooked.load_weights, hooked.get_submodule

    def privatizing_load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        before_load_weights()
        return load_weights(weights, *args, **kwargs)

    def privatizing_get_submodule(target: str) -> torch.nn.Module:
        module = get_submodule(target)
        before_module_write(module)
        return module

    for hook in (privatizing_load_weights, privatizing_get_submodule):
        setattr(hook, COPY_ON_WRITE_HOOK, True)
    hooked.load_weights = privatizing_load_weights
    hooked.get_submodule = privatizing_get_submodule


def disk_load_engine_args_(engine_args: Any) -> Any:
    """Point vLLM's ``EngineArgs`` at its own disk loader (load format ``auto``, no
    loader options): the daemon loads the checkpoint the ordinary way whatever the
    engine's ``--load-format``. Returns ``engine_args``."""
    engine_args.load_format = "auto"
    engine_args.model_loader_extra_config = {}
    return engine_args


def hook_reload_start_(model: torch.nn.Module, before: Callable[[], None]) -> bool:
    """Run ``before()`` when vLLM starts a checkpoint-format ``reload_weights`` (with
    an iterator, or from disk), before it touches any tensor.

    vLLM's ``initialize_layerwise_reload`` moves every layer's tensors aside (onto
    ``meta``) *before* it calls ``model.load_weights``, and asks each module's
    ``LayerReloadingInfo.can_load()`` first, the root module's before any other: the
    root's record is given a subclass whose ``can_load`` calls ``before`` at the
    start of a reload (no kernel tensors set aside yet). A refusal raised there
    leaves every layer as it was.

    (wcache's private writes for a CUDA ``zero_copy`` model,
    ``wcache.vllm.loader._install_update_hooks_``.)

    Returns:
        False when the model has no reload record (vLLM's reload then fails on its own).

    Source: vllm/model_executor/model_loader/reload/layerwise.py::
        initialize_layerwise_reload, LAYERWISE_INFO (the same in vLLM 0.32 and 0.33).
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    info = layerwise.LAYERWISE_INFO.get(model)
    if info is None:
        return False
    base = type(info)

    # base is type(info), vLLM's LayerReloadingInfo: a class known only at run time
    class _ReloadStartHook(base):  # type: ignore[misc, valid-type]
        def can_load(self) -> bool:
            if self.kernel_tensors is None and not base.can_load(self):
                try:
                    before()
                except BaseException:
                    # initialize_layerwise_reload set this just before asking us
                    if "_original_do_torchao_reload" in vars(model):
                        model._do_torchao_reload = vars(model).pop("_original_do_torchao_reload")
                    raise
            return base.can_load(self)

    info.__class__ = _ReloadStartHook
    return True
