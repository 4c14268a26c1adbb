"""The ``cuda_ipc`` transport: one legacy CUDA IPC handle for the whole arena.

The daemon calls ``torch.multiprocessing.reductions.reduce_tensor`` on its
single uint8 arena tensor once per client request (a fresh export, with its
own producer-side reference counter, so one client's release never frees
memory another client maps). The arguments travel as msgpack values, never as
pickle: classes and dtypes are sent by name and checked on the client, which
calls ``rebuild_cuda_tensor``.

Legacy IPC does not work on ``expandable_segments`` allocations; the daemon
must run with the default caching allocator settings.

Source: torch/multiprocessing/reductions.py (reduce_tensor, rebuild_cuda_tensor).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from wcache.store.errors import TransportFailed

__all__ = [
    "TRANSPORT",
    "CudaServing",
    "open_cuda",
    "encode_reduce_args",
    "decode_reduce_args",
    "drain_before_free",
]

log = logging.getLogger("wcache.store")
#: Device memory an error path could not drain: kept referenced for the life of
#: the process rather than freed under a copy that may still write it.
_QUARANTINED: list[Any] = []

TRANSPORT = "cuda_ipc"
_ARG_NAMES = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
# reduce_tensor passes the class of tensor._typed_storage() (TypedStorage); both
# classes are accepted by rebuild_cuda_tensor. Sent by name, never pickled.
_STORAGE_CLASSES = {
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}


def drain_before_free(device_index: int, what: str, *keep: Any) -> bool:
    """On an error path, wait until every copy queued on ``cuda:<device_index>``
    (any stream: a fill's side streams, NCCL's) has finished, so that the caller
    may free the buffer those copies write (``torch.empty`` blocks go back to the
    caching allocator, which only tracks their allocation stream; a VMM mapping is
    unmapped and released).

    Returns:
        True when drained: free the buffer now. False when the device cannot be
        synchronized (a sticky CUDA error): ``keep`` (the buffer, its mapping) is
        then kept referenced for the rest of the process, never freed under a
        possibly pending write, and the error is logged.

    Source: LMCache#4830 (a fill that raised with copies queued freed the buffer
    they wrote, corrupting the next allocation); torch.cuda.synchronize.
    """
    try:
        torch.cuda.synchronize(device_index)
    except Exception:  # the original error is the caller's; this one is logged
        _QUARANTINED.extend(keep)
        log.exception(
            "cannot drain cuda:%d before freeing %s; keeping it allocated rather than "
            "freeing memory a queued copy may still write",
            device_index,
            what,
        )
        return False
    return True


def encode_reduce_args(tensor: torch.Tensor) -> dict[str, Any]:
    """``reduce_tensor(tensor)`` as a msgpack-able dict (no classes, no pickle).

    Raises:
        TransportFailed: the tensor is not a CUDA tensor torch can share.
    """

    if tensor.device.type != "cuda" or type(tensor) is not torch.Tensor:
        raise TransportFailed("cuda_ipc exports plain CUDA tensors only")
    fn, args = reduce_tensor(tensor)
    if fn is not rebuild_cuda_tensor:
        raise TransportFailed(
            f"reduce_tensor chose {getattr(fn, '__name__', fn)}, not rebuild_cuda_tensor"
        )
    d = dict(zip(_ARG_NAMES, args))
    storage_names = {cls: name for name, cls in _STORAGE_CLASSES.items()}
    if d["storage_cls"] not in storage_names:
        raise TransportFailed(f"unexpected storage class {d['storage_cls']}")
    d["tensor_cls"] = "Tensor"
    d["storage_cls"] = storage_names[d["storage_cls"]]
    d["dtype"] = str(d["dtype"]).removeprefix("torch.")
    d["tensor_size"] = list(d["tensor_size"])
    d["tensor_stride"] = list(d["tensor_stride"])
    return d


def decode_reduce_args(d: object) -> tuple:
    """Inverse of :func:`encode_reduce_args`, with every field type checked.

    Raises:
        TransportFailed: a missing field or a value of the wrong type.
    """
    types_ok: dict[str, type | tuple[type, ...]] = {
        "tensor_size": list,
        "tensor_stride": list,
        "tensor_offset": int,
        "storage_device": int,
        "storage_handle": bytes,
        "storage_size_bytes": int,
        "storage_offset_bytes": int,
        "requires_grad": bool,
        "ref_counter_handle": bytes,
        "ref_counter_offset": int,
        "event_handle": (bytes, type(None)),
        "event_sync_required": bool,
    }
    if not isinstance(d, dict) or set(d) != set(_ARG_NAMES):
        raise TransportFailed("cuda_ipc handle does not carry the reduce_tensor fields")
    bad = [k for k, t in types_ok.items() if not isinstance(d[k], t)]
    if (
        bad
        or d["tensor_cls"] != "Tensor"
        or d["storage_cls"] not in _STORAGE_CLASSES
        or d["dtype"] != "uint8"
    ):
        raise TransportFailed(f"cuda_ipc handle has bad fields: {bad or ['class/dtype']}")
    out = dict(d)
    out["tensor_cls"] = torch.Tensor
    out["storage_cls"] = _STORAGE_CLASSES[d["storage_cls"]]
    out["dtype"] = torch.uint8
    out["tensor_size"] = torch.Size(d["tensor_size"])
    out["tensor_stride"] = tuple(d["tensor_stride"])
    return tuple(out[k] for k in _ARG_NAMES)


class CudaServing:
    """Daemon side: owns the arena tensor; exports it afresh per client."""

    def __init__(self, arena: torch.Tensor):
        #: the arena; None once closed
        self.arena: torch.Tensor | None = arena
        self.nbytes = arena.numel()

    def export(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        if self.arena is None:
            raise TransportFailed("this cuda_ipc arena was closed; its daemon stopped")
        return {
            "kind": TRANSPORT,
            "nbytes": self.nbytes,
            "args": encode_reduce_args(self.arena),
        }, ()

    def collect(self) -> None:
        """Free producer-side IPC bookkeeping of clients that have gone."""
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self.arena = None
        torch.cuda.ipc_collect()


def open_cuda(handle: dict[str, Any], arena_nbytes: int, device_index: int) -> torch.Tensor:
    """Client side: open the arena's IPC handle (no copy).

    Args:
        handle: the daemon's handle.
        arena_nbytes: from the manifest.
        device_index: the client's own index of the daemon's GPU (the caller
            matched it by UUID; indices differ between processes when
            ``CUDA_VISIBLE_DEVICES`` differs).

    Returns:
        ``[arena_nbytes]`` uint8 tensor on ``cuda:<device_index>``.

    Raises:
        TransportFailed: a bad handle, or the IPC open failed.
    """

    if handle.get("kind") != TRANSPORT or handle.get("nbytes") != arena_nbytes:
        raise TransportFailed(f"expected a cuda_ipc handle of {arena_nbytes} bytes")
    args = list(decode_reduce_args(handle.get("args")))
    args[_ARG_NAMES.index("storage_device")] = device_index
    try:
        base = rebuild_cuda_tensor(*args)
    except RuntimeError as e:
        raise TransportFailed(f"CUDA IPC open failed: {e}") from e
    if base.numel() != arena_nbytes:
        raise TransportFailed(f"IPC arena has {base.numel()} bytes, manifest {arena_nbytes}")
    return base
