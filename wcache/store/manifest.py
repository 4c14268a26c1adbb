"""Export values, the cache key and the versioned JSON manifest of an arena.

Everything here is a frozen value with no I/O: :class:`Export` (what a daemon
serves), :class:`CacheKey` (what must match), :class:`TensorEntry` /
:class:`AliasEntry` / :class:`Manifest` (where each tensor lies in the arena).
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

import blake3
from attrs import field, frozen

from wcache.store.errors import ProtocolError, StoreError

if TYPE_CHECKING:  # torch is imported where tensors are built or viewed, not to serve
    import torch

__all__ = [
    "MANIFEST_FORMAT_VERSION",
    "KIND_PARAM",
    "KIND_BUFFER",
    "KINDS",
    "Export",
    "CacheKey",
    "TensorEntry",
    "AliasEntry",
    "Manifest",
    "dtype_from_name",
    "dtype_name",
    "span_elements",
    "canonical_json",
]

# Bumped whenever a manifest field changes meaning; a client refuses other versions.
MANIFEST_FORMAT_VERSION = 1
KIND_PARAM = "param"
KIND_BUFFER = "buffer"
KINDS = frozenset({KIND_PARAM, KIND_BUFFER})

#: Bytes per element of every dtype an arena entry may have, by torch's short name:
#: the manifest is checked with this table, so a serving process that never views a
#: tensor (the lean server, :mod:`wcache.store.lean`) needs no torch. It equals
#: torch's own table (every non-complex ``torch.dtype``; tests/store/test_store_lean.py
#: compares them); a dtype a newer torch adds is refused until it is listed here.
DTYPE_ITEMSIZES: types.MappingProxyType = types.MappingProxyType(
    {
        "bfloat16": 2,
        "bits16": 2,
        "bits1x8": 1,
        "bits2x4": 1,
        "bits4x2": 1,
        "bits8": 1,
        "bool": 1,
        "float16": 2,
        "float32": 4,
        "float4_e2m1fn_x2": 1,
        "float64": 8,
        "float8_e4m3fn": 1,
        "float8_e4m3fnuz": 1,
        "float8_e5m2": 1,
        "float8_e5m2fnuz": 1,
        "float8_e8m0fnu": 1,
        "int1": 1,
        "int16": 2,
        "int2": 1,
        "int3": 1,
        "int32": 4,
        "int4": 1,
        "int5": 1,
        "int6": 1,
        "int64": 8,
        "int7": 1,
        "int8": 1,
        "qint32": 4,
        "qint8": 1,
        "quint2x4": 1,
        "quint4x2": 1,
        "quint8": 1,
        "uint1": 1,
        "uint16": 2,
        "uint2": 1,
        "uint3": 1,
        "uint32": 4,
        "uint4": 1,
        "uint5": 1,
        "uint6": 1,
        "uint64": 8,
        "uint7": 1,
        "uint8": 1,
    }
)


def _as_tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple(items)``, typed for attrs converters (this module stays torch-free, so not
    wcache.core.values.as_tuple)."""
    return tuple(items)


def _as_frozenset(items: Iterable[Any]) -> frozenset[Any]:
    """``frozenset(items)``, typed for attrs converters."""
    return frozenset(items)


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype that can be a view of raw bytes, by its short name
    (``"float16"``), limited to :data:`DTYPE_ITEMSIZES`. Imports torch."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    return {
        name: obj
        for name in dir(torch)
        if isinstance(obj := getattr(torch, name), torch.dtype)
        and not obj.is_complex  # complex views of uint8 need conj-bit care; none are exported today
        and str(obj) == f"torch.{name}"
        and name in DTYPE_ITEMSIZES
    }


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in torch_dtypes():
        raise StoreError(f"dtype {dtype} cannot be stored in an arena")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"float16"`` -> ``torch.float16``.

    Raises:
        ProtocolError: an unknown dtype name.
    """
    try:
        return torch_dtypes()[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype {name!r} in manifest") from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of dtype ``name`` (torch-free: :data:`DTYPE_ITEMSIZES`).

    Raises:
        ProtocolError: an unknown dtype name.
    """
    try:
        return DTYPE_ITEMSIZES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unknown dtype {name!r} in manifest") from None


def span_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of storage elements a strided view spans: 0 when it is empty,
    else ``1 + sum((size - 1) * stride)`` (strides are non-negative in torch)."""
    if 0 in shape:
        return 0
    return 1 + sum([(s - 1) * st for s, st in zip(shape, stride)])


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces, no NaN/inf); tuples become lists.

    Raises:
        StoreError: a value that is not JSON (object, NaN, non-str key).
    """
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False
        )
    except (TypeError, ValueError) as e:
        raise StoreError(f"value is not canonical JSON: {e}") from e


def _ro_dict(value: Mapping) -> types.MappingProxyType:
    return types.MappingProxyType(dict(value))


# --------------------------------------------------------------------------- export


def _check_export(inst: Export) -> None:
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    errors = []
    for name, t in inst.tensors.items():
        if not isinstance(name, str) or not name:
            errors.append(f"tensor name {name!r} is not a non-empty string")
        if not isinstance(t, torch.Tensor):
            errors.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        if t.device.type == "meta":
            errors.append(f"{name}: on the meta device (no bytes to export)")
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            errors.append(f"{name}: only plain strided tensors can be exported")
        if inst.kinds.get(name) not in KINDS:
            errors.append(f"{name}: kind {inst.kinds.get(name)!r} is not one of {sorted(KINDS)}")
    for alias, target in inst.aliases.items():
        if alias in inst.tensors:
            errors.append(f"alias {alias} is also a canonical tensor name")
        if target not in inst.tensors:
            errors.append(f"alias {alias} -> {target}: the target is not a canonical tensor")
        kind = inst.kinds.get(alias, inst.kinds.get(target))
        if kind not in KINDS:
            errors.append(f"alias {alias}: kind {kind!r} is not one of {sorted(KINDS)}")
    for name in inst.nonpersistent:
        if inst.kinds.get(name, inst.kinds.get(inst.aliases.get(name, ""))) != KIND_BUFFER:
            errors.append(f"{name}: only buffers can be non-persistent")
    for what, value in (("layers", dict(inst.layers)), ("extra", dict(inst.extra))):
        try:
            canonical_json(value)
        except StoreError as e:
            errors.append(f"{what}: {e}")
    if errors:
        raise StoreError("invalid export:\n  " + "\n  ".join(errors))


@frozen
class Export:
    """What one rank's daemon serves.

    Attributes:
        tensors: canonical name -> tensor (any device, any strides; views of a
            shared storage are stored once).
        kinds: name -> ``"param"`` | ``"buffer"`` for every canonical name
            (alias names may be given too; they default to their target's kind).
        aliases: alias name -> canonical name (tied weights; the client returns
            the SAME tensor object for both).
        layers: layer name -> JSON-able per-layer data (plan id/version, kernel,
            Target dict, recorded values, drops).
        extra: JSON-able data for the whole export.
        nonpersistent: names of buffers registered with ``persistent=False``.
    """

    tensors: Mapping[str, torch.Tensor] = field(converter=_ro_dict)
    kinds: Mapping[str, str] = field(converter=_ro_dict)
    aliases: Mapping[str, str] = field(factory=dict, converter=_ro_dict)
    layers: Mapping[str, dict] = field(factory=dict, converter=_ro_dict)
    extra: Mapping[str, Any] = field(factory=dict, converter=_ro_dict)
    nonpersistent: frozenset[str] = field(factory=frozenset, converter=_as_frozenset)

    def __attrs_post_init__(self):
        _check_export(self)


# --------------------------------------------------------------------------- key


def _normalize_json(value: Any) -> Any:
    return json.loads(canonical_json(value))


#: Longest rendering of one key field's value in a mismatch message (characters).
MISMATCH_VALUE_CHARS = 120


def leaf_diffs(path: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted path, a, b)`` for each differing leaf of two JSON values: nested
    objects are walked, so a differing kernel decision is named as
    ``target.kernels.unquantized_gemm[bfloat16]`` rather than as ``target``. A side
    that lacks the key shows ``null``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(a.keys() | b.keys())
            if a.get(k, ...) != b.get(k, ...)
            for d in leaf_diffs(f"{path}.{k}", a.get(k, ...), b.get(k, ...))
        ]
    return [(path, None if a is ... else a, None if b is ... else b)]


def mismatch_value(value: Any) -> str:
    """One key field's value as a mismatch message shows it: JSON, cut to
    :data:`MISMATCH_VALUE_CHARS` characters (then ``...``)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MISMATCH_VALUE_CHARS else text[:MISMATCH_VALUE_CHARS] + "..."


#: Differing leaves a mismatch message names per key field where it caps them (a
#: checkpoint's config differs in dozens of entries from another model's); the rest
#: are counted.
MAX_NAMED_LEAVES = 3
#: The key fields that hold the checkpoint's own config.json (the model's
#: ``hf_config`` and, for a text model, the same again as ``hf_text_config``).
CHECKPOINT_CONFIG_FIELDS = ("model_config.hf_config", "model_config.hf_text_config")
#: Key fields that repeat another's value for most models (a text model's
#: ``hf_text_config`` is its ``hf_config``): named once when they differ alike.
ECHO_FIELDS = {"model_config.hf_text_config": "model_config.hf_config"}


def field_mismatch_lines(
    name: str,
    a: Any,
    b: Any,
    mine: str = "engine",
    theirs: str = "daemon",
    limit: int | None = MAX_NAMED_LEAVES,
) -> list[str]:
    """``path: engine=<value> daemon=<value>`` for the differing leaves of key field
    ``name`` (values ``a`` and ``b``; ``...`` for a side that lacks it): the first
    ``limit`` of them (all with ``None``), then ``name: N more differ``."""
    leaves = leaf_diffs(name, a, b)
    named = leaves if limit is None else leaves[:limit]
    out = [
        f"{path}: {mine}={mismatch_value(x)} {theirs}={mismatch_value(y)}" for path, x, y in named
    ]
    if len(leaves) > len(named):
        out.append(f"{name}: {len(leaves) - len(named)} more differ")
    return out


#: Display names of the key's ``versions`` entries.
VERSION_NAMES = {"vllm": "vLLM", "torch": "torch", "wcache": "wcache"}


@frozen(init=False)
class CacheKey:
    """Everything that must match for an engine to use a daemon's bytes.

    Built from JSON-able fields (checkpoint content digest, quant config, dtype,
    parallel layout, plan ids, Target, versions). Equality and the digest are
    over the canonical JSON, so field order never matters.

    Raises:
        StoreError: fields that are not a str-keyed mapping of JSON values.
    """

    canonical: str

    def __init__(self, fields: Mapping[str, Any]):
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise StoreError("CacheKey fields must be a mapping with str keys")
        self.__attrs_init__(canonical=canonical_json(_normalize_json(dict(fields))))

    @property
    def fields(self) -> dict[str, Any]:
        """A fresh copy of the fields (changing it changes no key)."""
        return json.loads(self.canonical)

    @property
    def digest(self) -> str:
        """blake3 hex digest (64 characters) of the canonical JSON."""
        return blake3.blake3(self.canonical.encode()).hexdigest()

    def diff(self, other: CacheKey | Mapping[str, Any]) -> list[str]:
        """Sorted names of the fields that differ or exist on one side only."""
        mine = self.fields
        theirs = other.fields if isinstance(other, CacheKey) else CacheKey(other).fields
        return sorted(
            k for k in mine.keys() | theirs.keys() if mine.get(k, ...) != theirs.get(k, ...)
        )

    def describe_diff(self, other: CacheKey, mine: str = "engine", theirs: str = "daemon") -> str:
        """``path: engine=<value> daemon=<value>`` for each differing leaf of each
        differing field, for error messages, values cut to
        :data:`MISMATCH_VALUE_CHARS`: every leaf (a kernel decision of ``target`` is
        always named), except that the checkpoint's config
        (:data:`CHECKPOINT_CONFIG_FIELDS`: dozens of entries against another model) gets
        its first :data:`MAX_NAMED_LEAVES` and a count, and a field of
        :data:`ECHO_FIELDS` that differs exactly as the field it repeats is named once
        (``model_config.hf_text_config: as model_config.hf_config``)."""

        a, b = self.fields, other.fields
        diff = self.diff(other)
        differing = set(diff)
        parts: list[str] = []
        for f in diff:
            echoed = ECHO_FIELDS.get(f)
            if echoed in differing and (a.get(f, ...), b.get(f, ...)) == (
                a.get(echoed, ...),
                b.get(echoed, ...),
            ):
                parts.append(f"{f}: as {echoed}")
                continue
            limit = MAX_NAMED_LEAVES if f in CHECKPOINT_CONFIG_FIELDS else None
            parts += field_mismatch_lines(f, a.get(f, ...), b.get(f, ...), mine, theirs, limit)
        return "; ".join(parts)

    def versions_note(self, other: CacheKey, mine: str = "engine", theirs: str = "daemon") -> str:
        """A lead sentence for a refusal when the keys' ``versions`` differ (an engine
        and a daemon of different vLLM, torch or wcache releases), naming both sides'
        versions; ``""`` when they agree."""
        a, b = self.fields.get("versions") or {}, other.fields.get("versions") or {}
        if not isinstance(a, dict) or not isinstance(b, dict) or a == b:
            return ""
        parts = [
            f"{VERSION_NAMES.get(n, n)} {a.get(n)} ({mine}) vs {b.get(n)} ({theirs})"
            for n in sorted(a.keys() | b.keys())
            if a.get(n) != b.get(n)
        ]
        return (
            f"the {mine} and the {theirs} run different releases ({', '.join(parts)}): "
            f"a daemon's bytes come from its own vLLM's post-load, so it serves only "
            f"engines of the same versions; run `wcache serve` under the {mine}'s. "
        )

    def to_json(self) -> str:
        return self.canonical

    @classmethod
    def from_json(cls, text: str) -> CacheKey:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise StoreError(f"CacheKey JSON does not parse: {e}") from e
        return cls(value)

    def __repr__(self) -> str:
        return f"CacheKey({self.digest[:12]}, fields={sorted(self.fields)})"


# --------------------------------------------------------------------------- manifest


@frozen
class TensorEntry:
    """One canonical tensor: the view ``arena[offset : offset + nbytes]`` as
    ``dtype``, rebuilt with ``as_strided(shape, stride)``. ``nbytes`` is the
    storage span of the view (``span_elements * itemsize``), so non-contiguous
    tensors keep their strides."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...] = field(converter=_as_tuple)
    stride: tuple[int, ...] = field(converter=_as_tuple)
    kind: str
    persistent: bool = True


@frozen
class AliasEntry:
    """A second name for a canonical tensor (same object on the client)."""

    name: str
    target: str
    kind: str
    persistent: bool = True


def _check_manifest(m: Manifest) -> None:
    """Every entry must lie inside the arena, aligned, with a known dtype and a
    span that matches its shape and stride (runs on every attach: kept lean)."""
    errors = []
    names: set[str] = set()
    itemsizes: dict[str, int] = {}
    arena = m.arena_nbytes
    for e in m.tensors:
        name, shape, stride = e.name, e.shape, e.stride
        if not (
            type(name) is str
            and type(e.offset) is int
            and type(e.nbytes) is int
            and type(e.dtype) is str
            and type(e.kind) is str
            and type(e.persistent) is bool
        ):
            errors.append(f"{name!r}: a field has the wrong type")
            continue
        if name in names:
            errors.append(f"{name}: listed twice")
        names.add(name)
        if e.kind not in KINDS:
            errors.append(f"{name}: kind {e.kind!r}")
        itemsize = itemsizes.get(e.dtype)
        if itemsize is None:
            try:
                itemsize = itemsizes[e.dtype] = dtype_itemsize(e.dtype)
            except ProtocolError as err:
                errors.append(f"{name}: {err}")
                continue
        if (
            len(shape) != len(stride)
            or not all(type(v) is int and v >= 0 for v in shape)
            or not all(type(v) is int and v >= 0 for v in stride)
        ):
            errors.append(f"{name}: shape {shape} / stride {stride} do not fit")
            continue
        if span_elements(shape, stride) * itemsize != e.nbytes:
            errors.append(
                f"{name}: nbytes {e.nbytes} is not the span of shape {shape} stride {stride}"
            )
        if e.offset < 0 or e.offset % itemsize or e.offset + e.nbytes > arena:
            errors.append(
                f"{name}: offset {e.offset} (+{e.nbytes}) misaligned or outside the arena "
                f"({arena} bytes)"
            )
    canonical = frozenset(names)
    for a in m.aliases:
        if not (
            type(a.name) is str
            and type(a.target) is str
            and type(a.kind) is str
            and type(a.persistent) is bool
        ):
            errors.append(f"alias {a.name!r}: a field has the wrong type")
            continue
        if a.name in names:
            errors.append(f"alias {a.name} repeats a name")
        if a.target not in canonical:
            errors.append(f"alias {a.name} -> {a.target}: unknown target")
        if a.kind not in KINDS:
            errors.append(f"alias {a.name}: kind {a.kind!r}")
        names.add(a.name)
    if errors:
        raise ProtocolError("invalid manifest:\n  " + "\n  ".join(errors))


@frozen
class Manifest:
    """Where every tensor of one export lies in its arena (versioned JSON).

    Attributes:
        format_version: :data:`MANIFEST_FORMAT_VERSION` of the writer.
        key: the daemon's :class:`CacheKey` fields.
        device: ``"cpu"`` or ``"cuda"``.
        alignment: bytes every storage block is aligned to (page size on CPU,
            256 on CUDA).
        arena_nbytes: total bytes of the arena (a multiple of ``alignment``).
        tensors: canonical entries, in arena order.
        aliases: alias entries.
        layers: per-layer JSON data.
        extra: export-wide JSON data.
    """

    format_version: int
    key: Mapping[str, Any] = field(converter=_ro_dict)
    device: str
    alignment: int
    arena_nbytes: int
    tensors: tuple[TensorEntry, ...] = field(converter=_as_tuple)
    aliases: tuple[AliasEntry, ...] = field(converter=_as_tuple)
    layers: Mapping[str, Any] = field(converter=_ro_dict)
    extra: Mapping[str, Any] = field(converter=_ro_dict)

    def __attrs_post_init__(self):
        _check_manifest(self)

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "key": dict(self.key),
            "device": self.device,
            "alignment": self.alignment,
            "arena_nbytes": self.arena_nbytes,
            "tensors": [
                [
                    e.name,
                    e.offset,
                    e.nbytes,
                    e.dtype,
                    list(e.shape),
                    list(e.stride),
                    e.kind,
                    e.persistent,
                ]
                for e in self.tensors
            ],
            "aliases": [[a.name, a.target, a.kind, a.persistent] for a in self.aliases],
            "layers": dict(self.layers),
            "extra": dict(self.extra),
        }

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """Parse and validate a manifest dict (from the wire or a file).

        Raises:
            ProtocolError: another format version, a missing field, or entries
                that fall outside the arena.
        """
        if not isinstance(d, dict):
            raise ProtocolError("manifest is not a mapping")
        if d.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ProtocolError(
                f"manifest format {d.get('format_version')!r} is not "
                f"{MANIFEST_FORMAT_VERSION}; upgrade the older side (daemon or engine)."
            )
        try:
            return cls(
                format_version=d["format_version"],
                key=d["key"],
                device=str(d["device"]),
                alignment=int(d["alignment"]),
                arena_nbytes=int(d["arena_nbytes"]),
                tensors=[
                    TensorEntry(n, o, b, dt, sh, st, k, p)
                    for n, o, b, dt, sh, st, k, p in d["tensors"]
                ],
                aliases=[AliasEntry(n, t, k, p) for n, t, k, p in d["aliases"]],
                layers=d["layers"],
                extra=d["extra"],
            )
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"manifest is malformed: {type(e).__name__}: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"manifest JSON does not parse: {e}") from e
