"""vLLM's reload metadata (what an in-place ``reload_weights`` reads): skipped during a
build, recorded for a model built on ``meta``, pointed at the real device, and the
kernel tensors of a reload in progress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from wcache.vllm.compat.patches import _patched


@contextlib.contextmanager
def without_reload_metadata() -> Iterator[None]:
    """Skip vLLM's ``record_metadata_for_reloading`` inside the block.

    It snapshots every layer for a later in-place weight reload (RL refit), which a
    restored model refuses anyway (its tensors are the daemon's read-only bytes).
    """
    from vllm.model_executor.model_loader import utils as loader_utils  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if getattr(loader_utils, "record_metadata_for_reloading", None) is None:
        yield
        return
    with _patched(loader_utils, "record_metadata_for_reloading", lambda model: None):
        yield


def set_reload_device_(model: torch.nn.Module, device: torch.device) -> int:
    """Point vLLM's reload metadata of ``model`` at ``device``.

    ``initialize_model`` records, per module, the tensors' metadata and the device
    to materialize them on for a later in-place ``reload_weights``
    (``record_metadata_for_reloading``), taking the device from
    ``torch.get_default_device()``: ``meta`` for a model built on the meta device,
    which would make a reload materialize its new weights on ``meta``.

    Returns:
        The number of modules whose record was updated.

    Source: vllm/model_executor/model_loader/reload/layerwise.py::
        record_metadata_for_reloading, materialize_layer (LayerReloadingInfo.restore_device)
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    count = 0
    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None:
            info.restore_device = device
            count += 1
    return count


class _StoragePtrsOnDemand:
    """The set vLLM's ``_parameter_storage_ptrs(layer)`` returns, computed on its first
    membership test: vLLM consults it only for a layer's non-persistent buffers
    (``_is_non_persistent_parameter_alias_buffer``), but computes it for every module,
    each time walking the module's whole subtree of parameters."""

    __slots__ = ("_compute", "_layer", "_ptrs")

    def __init__(self, compute: Callable[[torch.nn.Module], set[int]], layer: torch.nn.Module):
        self._compute = compute
        self._layer: torch.nn.Module | None = layer  # None once the set is computed
        self._ptrs: set[int] = set()

    def __contains__(self, ptr: object) -> bool:
        if self._layer is not None:
            self._ptrs, self._layer = self._compute(self._layer), None
        return ptr in self._ptrs


def record_reload_metadata_(model: torch.nn.Module, device: torch.device) -> int:
    """vLLM's ``record_metadata_for_reloading(model)`` for a model built on the meta
    device inside :func:`without_reload_metadata`, with ``device`` as the device a
    later in-place ``reload_weights`` materializes layers on.

    The records are vLLM's own (its function runs); the same as the call
    ``initialize_model`` makes inside the build, in about half the time: it runs
    outside the ``torch.device("meta")`` context (whose ``__torch_function__``
    dispatch every tensor call pays) and each module's parameter storage pointers are
    computed only where vLLM consults them (:class:`_StoragePtrsOnDemand`).

    Returns:
        The number of modules recorded (:func:`set_reload_device_`).

    Source: vllm/model_executor/model_loader/reload/layerwise.py::
        record_metadata_for_reloading; reload/meta.py::capture_layer_to_meta
    """
    from vllm.model_executor.model_loader.reload import layerwise, meta  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    real = meta._parameter_storage_ptrs
    with _patched(meta, "_parameter_storage_ptrs", lambda layer: _StoragePtrsOnDemand(real, layer)):
        layerwise.record_metadata_for_reloading(model)
    return set_reload_device_(model, device)


def reload_kernel_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors an in-place ``reload_weights`` in progress will copy its
    processed weights into (vLLM keeps them aside while the layer is rebuilt on
    ``meta``); empty when no reload is in progress.

    Source: vllm/model_executor/model_loader/reload/layerwise.py::
        initialize_layerwise_reload (LayerReloadingInfo.kernel_tensors)
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    out = []
    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None and info.kernel_tensors is not None:
            params, buffers = info.kernel_tensors
            out.extend(params.values())
            out.extend(buffers.values())
    return out
