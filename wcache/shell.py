"""The one shell that mutates modules (docs/design.md section 3).

Every other wcache function returns new values; these two install them:

* :func:`apply_state_`: make one layer hold a runner's :class:`~wcache.core.LayerState`
  (ordinary load, the daemon's prepare, the engine's restore).
* :func:`install_tensors_`: register the daemon's mapped tensors on the engine's
  meta-built model before the restores run.

Imports nothing from wcache but the errors, so :mod:`wcache.core` can use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from wcache.errors import ModelMismatch

if TYPE_CHECKING:  # the type only; core imports this module
    from wcache.core import LayerState

__all__ = ["apply_state_", "install_tensors_", "resolve_parent"]


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


def apply_state_(module: torch.nn.Module, state: "LayerState", *,
                 keep: Iterable[str] = ()) -> None:
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
            param = tensor if isinstance(tensor, torch.nn.Parameter) else \
                torch.nn.Parameter(base, requires_grad=False)
            module._parameters[name] = param
    for path, value in state.attrs.items():
        obj, leaf = resolve_parent(module, path)
        setattr(obj, leaf, value)


def _split(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _module_of(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module], name: str
               ) -> tuple[torch.nn.Module, str]:
    mod, leaf = _split(name)
    if mod not in modules:
        raise ModelMismatch(f"the daemon exports {name!r} but the engine's model has no module "
                            f"{mod!r}: daemon and engine were started on different models or "
                            f"engine arguments; restart the daemon with the engine's arguments.")
    return modules[mod], leaf


def _check_shapes(modules: Mapping[str, torch.nn.Module], tensors: Mapping[str, torch.Tensor],
                  transformed: Mapping[str, Iterable[str]]) -> None:
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
        mine = module._parameters.get(leaf)
        if mine is None:
            mine = module._buffers.get(leaf)
        if mine is None:
            continue
        if tuple(mine.shape) != tuple(t.shape) or mine.dtype != t.dtype:
            raise ModelMismatch(
                f"the daemon exports {name!r} as {list(t.shape)} {t.dtype} but the engine's "
                f"model expects {list(mine.shape)} {mine.dtype}: daemon and engine were started "
                f"with different engine arguments (e.g. hf_overrides, max_model_len); restart "
                f"the daemon with the engine's arguments.")


def install_tensors_(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                     kinds: Mapping[str, str], persistent: Mapping[str, bool],
                     aliases: Mapping[str, str], *, writes: Mapping[str, Iterable[str]],
                     transformed: Mapping[str, Iterable[str]]) -> None:
    """Register mapped tensors on a meta-built model (the engine side).

    Canonical tensors become plain ``nn.Parameter(requires_grad=False)`` or
    buffers (with their persistence); aliases are registered as the *same*
    object. A tensor the model has no slot for is accepted only when the plan
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

    Raises:
        ModelMismatch: an exported tensor that the model cannot hold, or of
            another shape or dtype than the engine's (code ``model-mismatch``).
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    plan_writes = {name: set(ws) for name, ws in writes.items()}
    _check_shapes(modules, tensors, transformed)
    objects: dict[str, torch.Tensor] = {}
    for name in tensors:
        canonical = aliases.get(name, name)
        module, leaf = _module_of(model, modules, name)
        mod_name = _split(name)[0]
        known = leaf in module._parameters or leaf in module._buffers
        if not known and leaf not in plan_writes.get(mod_name, ()):
            raise ModelMismatch(
                f"the daemon exports {name!r}, which the engine's model does not have and no "
                f"plan of layer {mod_name!r} produces; the daemon serves a different model.")
        kind = kinds[name]
        obj = objects.get((canonical, kind))
        if obj is None:
            t = tensors[canonical]
            obj = torch.nn.Parameter(t, requires_grad=False) if kind == "param" else t
            objects[(canonical, kind)] = obj
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
        if kind == "param":
            module._parameters[leaf] = obj
        else:
            module.register_buffer(leaf, obj, persistent=persistent.get(name, True))
