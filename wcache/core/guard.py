"""The restore guard: fingerprints, byte-range checksums and :class:`RestoreGuard`
(docs/design.md section 3).

Restore runs as the same fold as load and prepare; the guard is its per-step
hook (:meth:`RestoreGuard.check_stage` after every replayed stage) plus the
content checks after a layer (:meth:`RestoreGuard.check_layer`) and after a whole
model (:meth:`RestoreGuard.check_all`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch
from attrs import field, fields, frozen

from wcache.errors import RestoreWroteSharedTensor

__all__ = [
    "CHECKSUM_WORD_BYTES",
    "TensorFingerprint",
    "tensor_checksum",
    "fingerprint",
    "guard_snapshot",
    "ByteRange",
    "layer_ranges",
    "range_sums",
    "RestoreGuard",
]

#: The content check sums a range's bytes as wrapping 64-bit words (one reduction
#: kernel per range on the range's own device). Integer addition is associative,
#: so the sum is the same whatever order a device reduces in.
CHECKSUM_WORD_BYTES = 8


@frozen
class TensorFingerprint:
    """What the restore guard compares for one shared tensor.

    ``data_ptr``, ``shape``, ``stride`` and ``dtype`` must stay equal;
    ``version`` is the autograd version counter (shared by every view of one
    storage, so it says *that* a tracked in-place write happened, not *where*);
    ``checksum`` is a per-tensor blake2b of the bytes in strict mode, else None.
    """

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    version: int
    checksum: str | None

    def diff(self, other: TensorFingerprint) -> list[str]:
        return [
            f.name
            for f in fields(TensorFingerprint)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def tensor_checksum(t: torch.Tensor) -> str:
    """blake2b of a tensor's bytes in logical order (CPU copy for device tensors)."""
    if t.device.type == "meta":
        return "meta"
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.view(torch.uint8) if flat.numel() else flat  # 1-D, so any element size views
    return hashlib.blake2b(
        raw.numpy().tobytes() if raw.numel() else b"", digest_size=16
    ).hexdigest()


def fingerprint(t: torch.Tensor, strict: bool) -> TensorFingerprint:
    return TensorFingerprint(
        data_ptr=t.data_ptr() if t.device.type != "meta" else 0,
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        dtype=str(t.dtype),
        version=t._version,
        checksum=tensor_checksum(t) if strict else None,
    )


def guard_snapshot(
    tensors: Mapping[str, torch.Tensor], strict: bool
) -> dict[str, TensorFingerprint]:
    return {name: fingerprint(t, strict) for name, t in tensors.items()}


def _quick_fp(t: torch.Tensor) -> tuple:
    """(data_ptr, shape, stride, dtype, version): what :class:`TensorFingerprint`
    holds without the checksum, as a plain tuple for the per-stage check."""
    return (
        t.data_ptr() if t.device.type != "meta" else 0,
        t.shape,
        t.stride(),
        t.dtype,
        t._version,
    )


@frozen
class ByteRange:
    """One contiguous byte range of a storage that a layer's shared tensors use.

    Attributes:
        view: ``[hi - lo]`` uint8 view of the storage bytes ``[lo, hi)`` (no copy).
        names: the layer's tensors inside the range.
        lo, hi: byte offsets in the storage; ``lo`` is a multiple of
            :data:`CHECKSUM_WORD_BYTES` and so is ``hi - lo`` unless the storage
            ends first (then the range is summed byte by byte).
    """

    view: torch.Tensor = field(eq=False, repr=False)
    names: tuple[str, ...]
    lo: int
    hi: int


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of the storage that ``t`` can address."""
    itemsize = t.element_size()
    start = int(t.storage_offset()) * itemsize  # int(): torch types sizes int | SymInt
    if t.numel() == 0:
        return start, start
    last = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * itemsize


def layer_ranges(tensors: Mapping[str, torch.Tensor]) -> tuple[ByteRange, ...]:
    """The byte ranges of a layer's shared tensors: one per storage, from the
    lowest to the highest byte any of them addresses (the padding between them
    included: nothing may write there either). In an arena a layer's tensors are
    adjacent, so a layer is one range and its check one reduction."""
    groups: dict[tuple, list[tuple[str, int, int]]] = {}
    storages: dict[tuple, torch.UntypedStorage] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        st = t.untyped_storage()
        sid = (str(t.device), st.data_ptr())
        storages[sid] = st
        groups.setdefault(sid, []).append((name, *_byte_span(t)))
    out = []
    for sid, members in groups.items():
        st = storages[sid]
        lo = min(s for _, s, _ in members) // CHECKSUM_WORD_BYTES * CHECKSUM_WORD_BYTES
        hi = min(
            -(-max(e for _, _, e in members) // CHECKSUM_WORD_BYTES) * CHECKSUM_WORD_BYTES,
            st.nbytes(),
        )
        whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(
            st, 0, (st.nbytes(),), (1,)
        )
        out.append(ByteRange(whole[lo:hi], tuple(sorted(n for n, _, _ in members)), lo, hi))
    return tuple(out)


def _device_sums(ranges: Iterable[ByteRange]) -> list[torch.Tensor]:
    """One reduction kernel per range, left on the range's device (no sync)."""
    out = []
    for r in ranges:
        v = r.view
        if v.numel() % CHECKSUM_WORD_BYTES == 0 and v.numel():
            out.append(v.view(torch.int64).sum())
        else:
            out.append(v.sum(dtype=torch.int64))
    return out


def _to_host(sums: list[torch.Tensor]) -> list[int]:
    """Device sums -> ints, one device-to-host copy per device."""
    by_dev: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_dev.setdefault(s.device, []).append(i)
    out: dict[int, int] = {}
    for idx in by_dev.values():
        out.update(zip(idx, (int(x) for x in torch.stack([sums[i] for i in idx]).tolist())))
    return [out[i] for i in range(len(sums))]


def range_sums(ranges: Iterable[ByteRange]) -> list[int]:
    """One reduction per range (on its device): the wrapping int64 sum of its
    8-byte words (of its bytes when the range is not a whole number of words);
    one device-to-host copy per device for all of them.

    Catches every write that changes the sum mod 2**64: any write of one word,
    and any ``add_``/``mul_``/assignment that changes values. A rewrite that keeps
    the sum (two equal-sum words swapped) is missed; read-only mappings (shm,
    cuda_vmm) fault on every write instead.
    """
    return _to_host(_device_sums(ranges))


class RestoreGuard:
    """The run-time guard over every shared tensor of one restore (one or many
    layers).

    Built before any restore stage runs; it records each shared tensor's
    fingerprint (pointer, shape, stride, dtype, version counter; a blake2b per
    tensor in ``strict`` mode) and, with ``content`` on, one checksum per layer
    byte range (:func:`layer_ranges`, :func:`range_sums`).

    What each check proves:

    * :meth:`check_stage` (after every stage; cheap, host-side): the layer's
      tensors keep pointer, shape, stride and dtype; a moved version counter (a
      tracked in-place write) is blamed on the stage that just ran, naming the
      layer whose bytes changed when ``content`` is on.
    * :meth:`check_layer` (after the layer is installed; one reduction per
      range): the layer's bytes are unchanged, which catches writes that bypass
      the version counter (``.data``, ``.numpy()``, ``untyped_storage()``
      views, raw pointers).
    * :meth:`check_all` (after every layer; one reduction per range): no layer's
      bytes changed during the restores of the layers after it.

    Args:
        layers: layer name -> its shared tensors (name -> tensor).
        content: checksum the byte ranges (on by default where the mapping is
            writable: cuda_ipc and copy mode; a read-only mapping faults instead).
        strict: also a blake2b of every tensor (a host copy; tests).
        defer: leave every checksum on the device and compare them all in
            :meth:`check_all` (one device-to-host copy for the whole restore
            instead of one per layer; the blame is the same). A caller that
            sets it must call :meth:`check_all`.
    """

    def __init__(
        self,
        layers: Mapping[str, Mapping[str, torch.Tensor]],
        *,
        content: bool = True,
        strict: bool = False,
        defer: bool = False,
    ):
        self.content = content
        self.strict = strict
        self.defer = defer
        self._fp = {layer: guard_snapshot(ts, strict) for layer, ts in layers.items()}
        # The hot path compares plain tuples; the fingerprint diff names fields on a mismatch.
        self._quick = {
            layer: {name: _quick_fp(t) for name, t in ts.items()} for layer, ts in layers.items()
        }
        self._ranges = {layer: layer_ranges(ts) for layer, ts in layers.items()} if content else {}
        self._dev_before = self._layer_device_sums(self._ranges) if content else {}
        self._dev_after: dict[str, list[torch.Tensor]] = {}
        self._host_before: dict[str, list[int]] | None = None

    @staticmethod
    def _layer_device_sums(
        ranges: Mapping[str, tuple[ByteRange, ...]],
    ) -> dict[str, list[torch.Tensor]]:
        flat = [(layer, r) for layer, rs in ranges.items() for r in rs]
        sums = _device_sums(r for _, r in flat)
        out: dict[str, list[torch.Tensor]] = {layer: [] for layer in ranges}
        for (layer, _), s in zip(flat, sums):
            out[layer].append(s)
        return out

    @staticmethod
    def _host(sums: Mapping[str, list[torch.Tensor]]) -> dict[str, list[int]]:
        flat = [(layer, s) for layer, ss in sums.items() for s in ss]
        values = _to_host([s for _, s in flat])
        out: dict[str, list[int]] = {layer: [] for layer in sums}
        for (layer, _), v in zip(flat, values):
            out[layer].append(v)
        return out

    @property
    def _sums(self) -> dict[str, list[int]]:
        """The snapshot's sums on the host (copied once, on first need)."""
        if self._host_before is None:
            self._host_before = self._host(self._dev_before)
        return self._host_before

    def _changed(self, layers: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """layer -> names in its ranges whose sums differ from the snapshot."""
        layers = [layer for layer in layers if layer in self._ranges]
        now = self._host(self._layer_device_sums({layer: self._ranges[layer] for layer in layers}))
        out = {}
        for layer in layers:
            hit = [
                r.names
                for r, a, b in zip(self._ranges[layer], self._sums[layer], now[layer])
                if a != b
            ]
            if hit:
                out[layer] = tuple(n for names in hit for n in names)
        return out

    @staticmethod
    def _describe(changed: Mapping[str, tuple[str, ...]]) -> str:
        return "; ".join(
            f"layer {layer!r} tensors {list(names)}" for layer, names in changed.items()
        )

    def blame_write(self, layer: str, stage_name: str, names: Iterable[str]) -> None:
        """A stage of ``layer`` bumped the version counter of shared ``names``:
        raise, naming the layer(s) whose bytes changed when the content check can
        tell (views of one arena share one counter)."""
        names = sorted(names)
        where = ""
        if self.content:
            changed = self._changed(self._ranges)
            where = (
                f"; the bytes changed in {self._describe(changed)}"
                if changed
                else "; no layer's bytes changed (the write kept the values)"
            )
        raise RestoreWroteSharedTensor(
            f"restore of layer {layer!r}: stage {stage_name!r} wrote in place into shared "
            f"memory (version counter of {names} bumped{where}). Restore stages must never "
            f"write the daemon's bytes; return new tensors or tag it TRANSFORM."
        )

    def check_stage(self, layer: str, stage_name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Pointer, shape, stride, dtype and version of ``layer``'s shared tensors.

        Raises:
            RestoreWroteSharedTensor: one was removed, replaced or written.
        """
        before = self._fp.get(layer, {})
        quick = self._quick.get(layer, {})
        bumped = []
        for name, fp in before.items():
            now = tensors.get(name)
            if now is not None and not self.strict and _quick_fp(now) == quick[name]:
                continue
            if now is None:
                raise RestoreWroteSharedTensor(
                    f"restore of layer {layer!r}: stage {stage_name!r} removed shared tensor "
                    f"{name!r}; replayable stages must never drop or replace exported tensors. "
                    f"Fix the plan: tag the stage TRANSFORM so only the daemon runs it."
                )
            changed = fp.diff(fingerprint(now, self.strict))
            if changed == ["version"]:
                bumped.append(name)
            elif changed:
                raise RestoreWroteSharedTensor(
                    f"restore of layer {layer!r}: stage {stage_name!r} changed shared tensor "
                    f"{name!r} ({', '.join(changed)}). A restore stage wrote into the daemon's "
                    f"bytes or swapped them; fix the stage (return new tensors, never write in "
                    f"place) or tag it TRANSFORM."
                )
        if bumped:
            self.blame_write(layer, stage_name, bumped)

    def check_layer(self, layer: str, stage_names: Iterable[str]) -> None:
        """The content of ``layer``'s ranges (one reduction per range).

        Raises:
            RestoreWroteSharedTensor: the bytes changed while its stages ran.
        """
        if not self.content or layer not in self._ranges:
            return
        if self.defer:
            self._dev_after[layer] = self._layer_device_sums({layer: self._ranges[layer]})[layer]
            return
        changed = self._changed([layer])
        if changed:
            raise RestoreWroteSharedTensor(
                f"restore of layer {layer!r}: its stages {list(stage_names)} rewrote shared "
                f"bytes ({self._describe(changed)}; content checksum differs, a write that "
                f"bypassed the version counter: .data, .numpy(), untyped_storage() or a raw "
                f"pointer). Restore stages must never write the daemon's bytes; tag the "
                f"writing stage TRANSFORM."
            )

    def check_all(self, during: str = "the restore") -> None:
        """The content of every layer's ranges.

        Raises:
            RestoreWroteSharedTensor: a layer's bytes changed after its own check.
        """
        if not self.content:
            return
        after = self._host(self._dev_after) if self._dev_after else {}
        changed = self._changed(self._ranges)
        own = {
            layer: names
            for layer, names in changed.items()
            if layer in after and after[layer] != self._sums[layer]
        }
        if own:
            raise RestoreWroteSharedTensor(
                f"shared bytes were rewritten while their own layer was restored: "
                f"{self._describe(own)} (content checksum differs; a write that bypassed the "
                f"version counter: .data, .numpy(), untyped_storage() or a raw pointer). "
                f"Restore stages must never write the daemon's bytes; tag the writing stage "
                f"TRANSFORM."
            )
        if changed:
            raise RestoreWroteSharedTensor(
                f"shared bytes were rewritten during {during}: {self._describe(changed)} "
                f"(content checksum differs after every layer restored; a stage of a later "
                f"layer wrote them). Restore stages must never write the daemon's bytes."
            )
