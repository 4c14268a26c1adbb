"""The heart of wcache: tagged stages, plans, the runner and the restore guard.

A quantization method's post-load work is an ordered tuple of :class:`Stage`
values. Each stage is a pure function over a layer's tensors, tagged with what
it does to state (:class:`Tag`). A :class:`Plan` runs its stages as a fold over
an immutable :class:`LayerState`:

* ``plan.load(layer)``: every stage (an ordinary load).
* ``plan.prepare(layer)``: TRANSFORM, METADATA and VALIDATE stages (the daemon);
  the tensors left afterwards are exported, METADATA values are recorded.
* ``plan.restore(layer, recorded)``: METADATA, ALLOCATE, DERIVE and VALIDATE
  stages only (a restarting engine, on mapped tensors), under the restore guard.

Only :mod:`wcache.shell` (``apply_state_``, ``install_tensors_``) mutates a module;
everything here returns new values.
This module imports no vLLM (docs/design.md section 2).
"""

from __future__ import annotations

import enum
import hashlib
import re
import types
from collections.abc import Callable, Iterable, Mapping
from functools import reduce
from typing import Any

import torch
from attrs import evolve, field, fields, frozen
from toolz import assoc, dissoc, merge

# The errors and the mutating shell live in their own modules (the shell and the
# layers below use them without importing core); core re-exports them.
from wcache.errors import (
    NoPlan, PlanInvalid, RecordedMismatch, RestoreIncomplete, RestoreWroteSharedTensor,
    StageContractError, WcacheError,
)
from wcache.shell import apply_state_, resolve_parent

__all__ = [
    "Tag", "Target", "QuantSpec", "LayerConfig", "StageOut", "Stage", "Plan", "BoundPlan",
    "LayerState", "Prepared", "TensorFingerprint",
    "WcacheError", "NoPlan", "PlanInvalid", "StageContractError",
    "RestoreWroteSharedTensor", "RecordedMismatch", "RestoreIncomplete",
    "stage", "registered_stages", "STAGE_NAME", "apply_state_", "state_from_module", "snapshot",
    "guard_snapshot",
    "RestoreGuard", "ByteRange", "layer_ranges", "range_sums", "tensor_checksum",
    "LOAD_TAGS", "PREPARE_TAGS", "RESTORE_TAGS",
]


# --------------------------------------------------------------------------- values


class Tag(enum.Enum):
    """What a stage does to state; a property not declared is not granted.

    TRANSFORM: new tensor bytes from checkpoint bytes (daemon and load only).
    METADATA: Python-side state from config, shapes and recorded values; no tensor.
    ALLOCATE: process-local tensors independent of checkpoint bytes (not exported).
    DERIVE: process-local private state from final tensors (read-only on them).
    VALIDATE: read-only checks.
    """

    TRANSFORM = "transform"
    METADATA = "metadata"
    ALLOCATE = "allocate"
    DERIVE = "derive"
    VALIDATE = "validate"


LOAD_TAGS = frozenset(Tag)
PREPARE_TAGS = frozenset({Tag.TRANSFORM, Tag.METADATA, Tag.VALIDATE})
RESTORE_TAGS = frozenset({Tag.METADATA, Tag.ALLOCATE, Tag.DERIVE, Tag.VALIDATE})


def _freeze(value: Any) -> Any:
    """Lists/sets/dicts to tuples/frozensets/sorted item tuples, recursively."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(v) for v in value)
    return value


def _ro(mapping: Mapping) -> Mapping:
    """A read-only copy of ``mapping`` (``types.MappingProxyType``): the frozen
    values below hold mappings nobody can change after construction."""
    if isinstance(mapping, types.MappingProxyType):
        return mapping
    return types.MappingProxyType(dict(mapping))


def _ro_nested(mapping: Mapping) -> Mapping:
    """:func:`_ro` of a mapping of mappings (stage name -> recorded values)."""
    return types.MappingProxyType({k: _ro(v) for k, v in mapping.items()})


@frozen
class Target:
    """Where processed weights will run; part of every plan's identity.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"`` (``"meta"`` only for shape checks).
        capability: CUDA compute capability ``(major, minor)``, ``None`` on CPU.
        isa: CPU ISA flags that decide layouts: ``"avx512"``, ``"avx512_bf16"``,
            ``"amx"``, ``"riscv"``, ``"power"``.
        env: kernel-selection settings that decide layouts, as sorted
            ``(name, value)`` pairs (e.g. ``("VLLM_CPU_INT4_W4A8", "1")``).
            Stages read them from here, never from ``os.environ``.
        kernels: the kernel decisions the engine itself made on this host, as
            sorted ``(decision, outcome)`` pairs, e.g.
            ``("cpu.kernel_library", "_C_AVX2")``,
            ``("unquantized_gemm[bfloat16]", "torch_linear")``,
            ``("op.cpu_gemm_wna16", "absent")``. Established by asking vLLM
            (:func:`wcache.vllm.probe.host_target`), never re-derived from CPU
            flags; empty when nobody asked (CPU plans then refuse, naming why).
    """

    device_type: str = "cpu"
    capability: tuple[int, int] | None = None
    isa: frozenset[str] = field(default=frozenset(), converter=frozenset)
    env: tuple[tuple[str, str], ...] = field(default=(), converter=_freeze)
    kernels: tuple[tuple[str, str], ...] = field(default=(), converter=_freeze)

    def env_value(self, name: str, default: str) -> str:
        return dict(self.env).get(name, default)

    def has(self, flag: str) -> bool:
        return flag in self.isa

    def kernel(self, decision: str) -> str | None:
        """The engine's recorded outcome for ``decision``, or ``None`` if not probed."""
        return dict(self.kernels).get(decision)

    def to_json(self) -> dict:
        return {"device_type": self.device_type,
                "capability": list(self.capability) if self.capability else None,
                "isa": sorted(self.isa), "env": [list(p) for p in self.env],
                "kernels": dict(self.kernels)}

    @classmethod
    def from_json(cls, data: Mapping) -> "Target":
        cap = data.get("capability")
        return cls(device_type=data["device_type"],
                   capability=tuple(cap) if cap else None,
                   isa=frozenset(data.get("isa", ())),
                   env=tuple(tuple(p) for p in data.get("env", ())),
                   kernels=dict(data.get("kernels", {})))

    @classmethod
    def detect(cls, device: str | torch.device = "cpu",
               env: Mapping[str, str] | None = None) -> "Target":
        """The Target of this host for ``device``. The only place that queries the
        host (``/proc/cpuinfo``, CUDA properties); stages never do.

        Args:
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            env: kernel-selection variables to pin (default: read from
                ``os.environ`` for the names in ``TARGET_ENV_VARS``).
        """
        import os
        import platform

        dev = torch.device(device)
        if env is None:
            env = {k: os.environ[k] for k in TARGET_ENV_VARS if k in os.environ}
        env = _normalize_env(env)
        if dev.type == "cuda":
            cap = torch.cuda.get_device_capability(dev)
            return cls("cuda", (int(cap[0]), int(cap[1])), frozenset(), env)
        isa: set[str] = set()
        machine = platform.machine().lower()
        if machine.startswith("riscv"):
            isa.add("riscv")
        elif machine.startswith(("ppc", "power")):
            isa.add("power")
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln.split(":", 1)[1].split() for ln in f
                              if ln.startswith("flags")), [])
        except OSError:
            flags = []
        fset = set(flags)
        # The x86 flags that decide vLLM's layouts come from the same torch queries
        # vLLM asks (platforms/cpu.py::import_kernels, cpu.py::_get_isa_hint), so a
        # host (or a test) that makes torch report a smaller ISA is that ISA here too.
        cpu = torch.cpu
        queries = {"avx512": getattr(cpu, "_is_avx512_supported", None),
                   "avx512_bf16": getattr(cpu, "_is_avx512_bf16_supported", None),
                   "amx": getattr(cpu, "_is_amx_tile_supported", None)}
        cpuinfo = {"avx512": "avx512f" in fset, "avx512_bf16": "avx512_bf16" in fset,
                   "amx": {"amx_bf16", "amx_tile"} <= fset}
        for flag, query in queries.items():
            if query() if query is not None else cpuinfo[flag]:
                isa.add(flag)
        return cls(dev.type, None, frozenset(isa), env)


#: Environment variables that change which kernel (and so which layout) vLLM picks.
TARGET_ENV_VARS = ("VLLM_CPU_INT4_W4A8", "VLLM_MARLIN_INPUT_DTYPE",
                   "VLLM_DISABLED_KERNELS", "VLLM_BATCH_INVARIANT")
#: vLLM 0.32's defaults (vllm/envs.py) for the integer flags among them: a variable
#: set to its default is the same Target as one left unset.
TARGET_ENV_DEFAULTS = {"VLLM_CPU_INT4_W4A8": "1", "VLLM_BATCH_INVARIANT": "0"}


def _normalize_env(env: Mapping[str, str]) -> dict[str, str]:
    """Canonical values (``"01"`` -> ``"1"`` for integer flags), without entries that
    equal vLLM's default or are empty, so equal settings give equal Targets."""
    out = {}
    for name, value in env.items():
        if name in TARGET_ENV_DEFAULTS:
            try:
                value = str(int(value))
            except ValueError:
                pass
            if value == TARGET_ENV_DEFAULTS[name]:
                continue
        if value == "":
            continue
        out[name] = value
    return out


@frozen
class QuantSpec:
    """A quantization method, independent of vLLM.

    Attributes:
        method: ``"unquantized"``, ``"awq"``, ``"gptq"``, ``"ct_w4a16"``,
            ``"ct_w8a8_int8"``, ``"ct_w8a8_fp8"``, ``"fp8"``, ``"fp8_per_tensor"``,
            ``"fp8_per_channel"``, ``"fp8_per_block"``, ``"mxfp8"``,
            ``"modelopt_fp4"``, ``"kv_cache"``.
        num_bits: weight bits (4 or 8), 16 for unquantized.
        group_size: quantization group along K; -1 for channelwise.
        zero_point: asymmetric (has zero points).
        act_bits: activation bits (16 = weight only; 8 for W8A8).
        strategy: scale strategy where it matters: ``"tensor"``, ``"channel"``,
            ``"group"``, ``"block"``.
        static_input: static (checkpoint) activation scales.
        input_symmetric: symmetric activation quantization (W8A8 INT8).
        layer_kind: ``"linear"``, ``"embedding"``, ``"moe"``, ``"attention"``.
        kernel: the kernel id chosen for the layer (e.g. ``"cpu_wna16"``,
            ``"marlin"``, ``"cutlass"``, ``"onednn"``); ``None`` lets the registry
            pick the default for the Target.
        options: anything else, as sorted ``(name, value)`` pairs.
    """

    method: str
    num_bits: int = 16
    group_size: int = -1
    zero_point: bool = False
    act_bits: int = 16
    strategy: str | None = None
    static_input: bool = False
    input_symmetric: bool = True
    layer_kind: str = "linear"
    kernel: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=(), converter=_freeze)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@frozen
class LayerConfig:
    """One layer's frozen configuration, everything a stage may read besides tensors.

    Attributes:
        quant: the method.
        size_k: input features of this partition (``input_size_per_partition``).
        size_n: output features of this partition (``output_size_per_partition``).
        params_dtype: activation/params dtype name, e.g. ``"bfloat16"``.
        has_bias: the layer has a bias.
        name: the module's qualified name (for error messages only).
        extra: method-specific facts as sorted ``(name, value)`` pairs
            (e.g. ``("logical_widths", (64, 64))``, ``("tp_size", 1)``).
    """

    quant: QuantSpec
    size_k: int
    size_n: int
    params_dtype: str = "bfloat16"
    has_bias: bool = False
    name: str = ""
    extra: tuple[tuple[str, Any], ...] = field(default=(), converter=_freeze)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.extra).get(name, default)


@frozen
class StageOut:
    """What a stage returns. Nothing here aliases an input it changed.

    Attributes:
        tensors: new or replaced tensors, by local name (registered as
            parameters, or as buffers when the name was a buffer or is listed in
            ``buffers``).
        buffers: names in ``tensors`` to register as buffers.
        drop: tensor or attribute names to delete from the layer.
        attrs: attribute values by dotted path relative to the layer
            (``"isa_hint"``, ``"quant_method.kernel.logical_output_size"``); a
            value of ``None`` for a tensor slot empties the slot as vLLM does.
        record: values to record for restore (JSON-able: ints, floats, strs,
            bools, lists, dicts, None).
        release: DERIVE only: tensors this process stops referencing once it
            has derived private state from them (vLLM's CPU dispatch replaces a
            linear weight by an empty ``(0,)`` Parameter after prepacking). The
            runner installs that empty placeholder (the params dtype for a
            floating-point tensor, else its own dtype; same device); the
            shared bytes are untouched and the guard keeps checking them. A
            released name also set to ``None`` in ``attrs`` becomes an empty
            ``None`` slot instead (vLLM's ``setattr(layer, "weight", None)``
            after building the W8A8 oneDNN handler).
    """

    tensors: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)
    buffers: frozenset[str] = field(default=frozenset(), converter=frozenset)
    drop: tuple[str, ...] = field(default=(), converter=tuple)
    attrs: Mapping[str, Any] = field(factory=dict, converter=_ro)
    record: Mapping[str, Any] = field(factory=dict, converter=_ro)
    release: tuple[str, ...] = field(default=(), converter=tuple)


StageFn = Callable[[Mapping[str, torch.Tensor], LayerConfig, Target, Mapping[str, Any]], StageOut]


@frozen
class Stage:
    """One named, tagged, pure step of a method's post-load work.

    Attributes:
        name: ``family.verb_object``, e.g. ``"awq.unpack_reorder"``.
        tag: what it does to state.
        fn: ``fn(tensors, config, target, recorded) -> StageOut``; ``tensors`` is a
            read-only mapping of the layer's current tensors, ``recorded`` the
            values this stage recorded at prepare time (empty during load and
            prepare). Never mutates an input, reads no globals, env or host.
        reads: tensor names it reads (must exist, unless in ``optional``).
        writes: tensor names it may return or drop.
        drops: the names in ``writes`` it may delete for good (not return again);
            the plan's reachability check subtracts them from what a restore has.
        attrs: attribute paths it may set. A tensor name here is a write (it
            replaces or empties the slot): only stages that may write tensors
            set one, except a name also in ``optional``, which the stage sets only
            when the layer has no such tensor (checked at run time).
        optional: reads that may be absent (e.g. ``bias``).
        version: bumped whenever the produced bytes or values change.
        source: the upstream function it mirrors.
        memoized: ``fn`` also takes ``memo=``, a dict private to this stage that
            lives for one restore of a whole model (``None`` elsewhere), to share
            work between layers whose inputs are the *same* tensors (a tied
            embedding and lm_head share one oneDNN prepack).

    Two stages are equal only if their functions are the same object too (the
    stage factories are cached, so equal arguments give the same stage).
    """

    name: str
    tag: Tag
    fn: StageFn = field(repr=False)
    reads: tuple[str, ...] = field(default=(), converter=tuple)
    writes: tuple[str, ...] = field(default=(), converter=tuple)
    attrs: tuple[str, ...] = field(default=(), converter=tuple)
    optional: frozenset[str] = field(default=frozenset(), converter=frozenset)
    version: int = 1
    source: str = ""
    memoized: bool = False
    drops: tuple[str, ...] = field(default=(), converter=tuple)

    @property
    def replayable(self) -> bool:
        return self.tag in RESTORE_TAGS


#: A stage name: ``family.verb_object`` in lower snake case, e.g. ``awq.unpack_reorder``,
#: ``marlin.permute_scales`` (the family is the ``wcache.stages`` module, or the
#: kernel, whose layout the stage produces).
STAGE_NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*\.[a-z][a-z0-9]*(_[a-z0-9]+)*$")

#: name -> the code object bound to it by :func:`stage` (a factory's closures
#: share one code object: ``cpu_wna16.repack("qweight")`` and
#: ``repack("weight_packed")`` are one definition over different tensor names).
_STAGE_CODE: dict[str, Any] = {}
#: name -> every stage value registered under it, in registration order.
_STAGES: dict[str, list[Stage]] = {}


def _definition(fn: Callable) -> Any:
    """What identifies a stage function's definition: its code object."""
    return getattr(fn, "__code__", fn)


def stage(name: str, tag: Tag, *, reads: Iterable[str] = (), writes: Iterable[str] = (),
          attrs: Iterable[str] = (), optional: Iterable[str] = (), version: int = 1,
          source: str = "", memoized: bool = False,
          drops: Iterable[str] = ()) -> Callable[[StageFn], Stage]:
    """Decorator: turn a pure function into a :class:`Stage` value and register it.

    The registry (:func:`registered_stages`) is what the completeness tests walk:
    every registered stage must be used by a plan, drawable by a hypothesis
    strategy and listed in docs/plans.md.

    Raises:
        PlanInvalid: ``name`` is not ``family.verb_object`` (:data:`STAGE_NAME`),
            ``tag`` is not a :class:`Tag`, or another function definition is
            already bound to ``name`` (a conditional variant must be its own
            stage, or a parameter of the one factory).
    """
    if not isinstance(tag, Tag):
        raise PlanInvalid(f"stage {name!r}: tag {tag!r} is a {type(tag).__name__}, not a Tag; "
                          f"use Tag.TRANSFORM/METADATA/ALLOCATE/DERIVE/VALIDATE")
    if not STAGE_NAME.match(name):
        raise PlanInvalid(f"stage name {name!r} is not family.verb_object in lower snake case "
                          f"(e.g. 'awq.unpack_reorder')")

    def wrap(fn: StageFn) -> Stage:
        bound = _STAGE_CODE.setdefault(name, _definition(fn))
        if bound is not _definition(fn):
            raise PlanInvalid(
                f"stage {name!r} is already bound to another function "
                f"({getattr(bound, 'co_filename', '?')}:{getattr(bound, 'co_firstlineno', '?')}); "
                f"give the new function its own name, or make it a parameter of the stage "
                f"factory that defines {name!r}")
        st = Stage(name=name, tag=tag, fn=fn, reads=tuple(reads), writes=tuple(writes),
                   attrs=tuple(attrs), optional=frozenset(optional), version=version,
                   source=source, memoized=memoized, drops=tuple(drops))
        if st not in _STAGES.setdefault(name, []):
            _STAGES[name].append(st)
        return st

    return wrap


def registered_stages() -> dict[str, tuple[Stage, ...]]:
    """Every stage name registered with :func:`stage` -> its stage values (several
    for a factory called with different tensor names), in registration order."""
    return {name: tuple(values) for name, values in _STAGES.items()}


# --------------------------------------------------------------------------- state


@frozen
class LayerState:
    """The fold's accumulator: a layer's tensors and attributes as plain values.

    Attributes:
        tensors: name -> tensor (parameters and buffers of the layer itself).
        buffers: names in ``tensors`` that are buffers.
        attrs: attribute path -> value set by stages so far.
        drops: names deleted so far.
        recorded: stage name -> recorded values.
        released: name -> the tensor a DERIVE stage released (kept so the guard
            can still check the shared bytes).
    """

    tensors: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)
    buffers: frozenset[str] = field(default=frozenset(), converter=frozenset)
    attrs: Mapping[str, Any] = field(factory=dict, converter=_ro)
    drops: tuple[str, ...] = field(default=(), converter=tuple)
    recorded: Mapping[str, Mapping[str, Any]] = field(factory=dict, converter=_ro_nested)
    released: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)


@frozen
class Prepared:
    """What the daemon keeps of a prepared layer.

    Attributes:
        plan_id: ``Plan.id``.
        tensors: exported tensors by local name (the bytes to share).
        buffers: names in ``tensors`` that are buffers.
        recorded: stage name -> recorded values (JSON-able).
        drops: names the plan deletes (the engine deletes its meta placeholders).
        attrs: attribute values the prepare run set (for the manifest; restore
            recomputes them).
    """

    plan_id: str
    tensors: Mapping[str, torch.Tensor]
    buffers: frozenset[str]
    recorded: Mapping[str, Mapping[str, Any]]
    drops: tuple[str, ...]
    attrs: Mapping[str, Any]


def state_from_module(module: torch.nn.Module) -> LayerState:
    """Read a module's own (non-recursive) parameters and buffers into a state."""
    params = {k: v for k, v in module._parameters.items() if v is not None}
    bufs = {k: v for k, v in module._buffers.items() if v is not None}
    return LayerState(tensors={**params, **bufs}, buffers=frozenset(bufs))


# --------------------------------------------------------------------------- guard

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

    def diff(self, other: "TensorFingerprint") -> list[str]:
        return [f.name for f in fields(TensorFingerprint)
                if getattr(self, f.name) != getattr(other, f.name)]


def tensor_checksum(t: torch.Tensor) -> str:
    """blake2b of a tensor's bytes in logical order (CPU copy for device tensors)."""
    if t.device.type == "meta":
        return "meta"
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.view(torch.uint8) if flat.numel() else flat  # 1-D, so any element size views
    return hashlib.blake2b(raw.numpy().tobytes() if raw.numel() else b"",
                           digest_size=16).hexdigest()


def fingerprint(t: torch.Tensor, strict: bool) -> TensorFingerprint:
    return TensorFingerprint(
        data_ptr=t.data_ptr() if t.device.type != "meta" else 0,
        shape=tuple(t.shape), stride=tuple(t.stride()), dtype=str(t.dtype),
        version=t._version, checksum=tensor_checksum(t) if strict else None)


def guard_snapshot(tensors: Mapping[str, torch.Tensor], strict: bool) -> dict[str, TensorFingerprint]:
    return {name: fingerprint(t, strict) for name, t in tensors.items()}


def _quick_fp(t: torch.Tensor) -> tuple:
    """(data_ptr, shape, stride, dtype, version): what :class:`TensorFingerprint`
    holds without the checksum, as a plain tuple for the per-stage check."""
    return (t.data_ptr() if t.device.type != "meta" else 0, t.shape, t.stride(), t.dtype,
            t._version)


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
    start = t.storage_offset() * itemsize
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
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
        hi = min(-(-max(e for _, _, e in members) // CHECKSUM_WORD_BYTES) * CHECKSUM_WORD_BYTES,
                 st.nbytes())
        whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))
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

    def __init__(self, layers: Mapping[str, Mapping[str, torch.Tensor]], *,
                 content: bool = True, strict: bool = False, defer: bool = False):
        self.content = content
        self.strict = strict
        self.defer = defer
        self._fp = {layer: guard_snapshot(ts, strict) for layer, ts in layers.items()}
        # The hot path compares plain tuples; the fingerprint diff names fields on a mismatch.
        self._quick = {layer: {name: _quick_fp(t) for name, t in ts.items()}
                       for layer, ts in layers.items()}
        self._ranges = {layer: layer_ranges(ts) for layer, ts in layers.items()} if content else {}
        self._dev_before = self._layer_device_sums(self._ranges) if content else {}
        self._dev_after: dict[str, list[torch.Tensor]] = {}
        self._host_before: dict[str, list[int]] | None = None

    @staticmethod
    def _layer_device_sums(ranges: Mapping[str, tuple[ByteRange, ...]]) -> dict[str, list[torch.Tensor]]:
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
            hit = [r.names for r, a, b in zip(self._ranges[layer], self._sums[layer], now[layer])
                   if a != b]
            if hit:
                out[layer] = tuple(n for names in hit for n in names)
        return out

    @staticmethod
    def _describe(changed: Mapping[str, tuple[str, ...]]) -> str:
        return "; ".join(f"layer {layer!r} tensors {list(names)}" for layer, names in changed.items())

    def blame_write(self, layer: str, stage_name: str, names: Iterable[str]) -> None:
        """A stage of ``layer`` bumped the version counter of shared ``names``:
        raise, naming the layer(s) whose bytes changed when the content check can
        tell (views of one arena share one counter)."""
        names = sorted(names)
        where = ""
        if self.content:
            changed = self._changed(self._ranges)
            where = (f"; the bytes changed in {self._describe(changed)}" if changed else
                     "; no layer's bytes changed (the write kept the values)")
        raise RestoreWroteSharedTensor(
            f"restore of layer {layer!r}: stage {stage_name!r} wrote in place into shared "
            f"memory (version counter of {names} bumped{where}). Restore stages must never "
            f"write the daemon's bytes; return new tensors or tag it TRANSFORM.")

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
                    f"Fix the plan: tag the stage TRANSFORM so only the daemon runs it.")
            changed = fp.diff(fingerprint(now, self.strict))
            if changed == ["version"]:
                bumped.append(name)
            elif changed:
                raise RestoreWroteSharedTensor(
                    f"restore of layer {layer!r}: stage {stage_name!r} changed shared tensor "
                    f"{name!r} ({', '.join(changed)}). A restore stage wrote into the daemon's "
                    f"bytes or swapped them; fix the stage (return new tensors, never write in "
                    f"place) or tag it TRANSFORM.")
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
                f"writing stage TRANSFORM.")

    def check_all(self, during: str = "the restore") -> None:
        """The content of every layer's ranges.

        Raises:
            RestoreWroteSharedTensor: a layer's bytes changed after its own check.
        """
        if not self.content:
            return
        after = self._host(self._dev_after) if self._dev_after else {}
        changed = self._changed(self._ranges)
        own = {layer: names for layer, names in changed.items()
               if layer in after and after[layer] != self._sums[layer]}
        if own:
            raise RestoreWroteSharedTensor(
                f"shared bytes were rewritten while their own layer was restored: "
                f"{self._describe(own)} (content checksum differs; a write that bypassed the "
                f"version counter: .data, .numpy(), untyped_storage() or a raw pointer). "
                f"Restore stages must never write the daemon's bytes; tag the writing stage "
                f"TRANSFORM.")
        if changed:
            raise RestoreWroteSharedTensor(
                f"shared bytes were rewritten during {during}: {self._describe(changed)} "
                f"(content checksum differs after every layer restored; a stage of a later "
                f"layer wrote them). Restore stages must never write the daemon's bytes.")


def _check_guard(layer: str, stage_name: str, before: Mapping[str, TensorFingerprint],
                 tensors: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Compare ``tensors`` with a :func:`guard_snapshot` (kept for callers of the
    per-tensor snapshot; :class:`RestoreGuard` is what restore uses)."""
    guard = RestoreGuard({}, content=False, strict=strict)
    guard._fp = {layer: dict(before)}
    guard.check_stage(layer, stage_name, tensors)


# --------------------------------------------------------------------------- plan


def _run_stage(st: Stage, state: LayerState, config: LayerConfig, target: Target,
               recorded: Mapping[str, Any], *, shared: frozenset[str],
               check_purity: bool, guard: "RestoreGuard | None" = None,
               memo: dict[str, dict] | None = None) -> LayerState:
    missing = [r for r in st.reads if r not in state.tensors and r not in st.optional]
    if missing:
        raise RestoreIncomplete(
            f"layer {config.name!r}: stage {st.name!r} reads {missing} but the layer has "
            f"only {sorted(state.tensors)}; the checkpoint or the export lacks them.")
    view = _ro(state.tensors)
    before = ({k: (v._version, v.data_ptr() if v.device.type != "meta" else 0)
               for k, v in state.tensors.items()} if check_purity else None)
    if st.memoized:
        out = st.fn(view, config, target, _ro(recorded),
                    memo=None if memo is None else memo.setdefault(st.name, {}))
    else:
        out = st.fn(view, config, target, _ro(recorded))
    if not isinstance(out, StageOut):
        raise StageContractError(f"stage {st.name!r} returned {type(out).__name__}, not StageOut")
    if before is not None:
        # Purity: no input's version counter moved and no input's data pointer
        # changed (``t.data = other`` swaps the bytes without a version bump).
        touched = [k for k, (ver, ptr) in before.items()
                   if state.tensors[k]._version != ver or
                   (state.tensors[k].device.type != "meta" and state.tensors[k].data_ptr() != ptr)]
        hit_shared = sorted(set(touched) & shared)
        if hit_shared and guard is not None:
            guard.blame_write(config.name, st.name, hit_shared)
        if hit_shared:
            raise RestoreWroteSharedTensor(
                f"restore of layer {config.name!r}: stage {st.name!r} wrote in place into "
                f"shared tensors {hit_shared} (version counter bumped or data pointer "
                f"swapped). Restore stages must "
                f"never write the daemon's bytes; return new tensors or tag it TRANSFORM.")
        if touched:
            raise StageContractError(
                f"stage {st.name!r} mutated its input tensors {touched} in place; stages "
                f"are pure: return new tensors instead.")
    undeclared = sorted((set(out.tensors) | set(out.drop)) - set(st.writes) - set(st.attrs))
    if undeclared:
        raise StageContractError(
            f"stage {st.name!r} wrote {undeclared} without declaring them in writes")
    bad_attrs = sorted(set(out.attrs) - set(st.attrs) - set(st.writes))
    if bad_attrs:
        raise StageContractError(
            f"stage {st.name!r} set attributes {bad_attrs} without declaring them in attrs")
    if st.tag is not Tag.TRANSFORM:
        if st.tag in (Tag.METADATA, Tag.VALIDATE, Tag.DERIVE) and out.tensors:
            raise StageContractError(
                f"{st.tag.name} stage {st.name!r} returned tensors {sorted(out.tensors)}; "
                f"only TRANSFORM and ALLOCATE stages produce tensors")
        none_slots = {n for n in out.release if n in out.attrs and out.attrs[n] is None}
        hit = sorted((set(out.tensors) | set(out.drop) | (set(out.attrs) - none_slots))
                     & shared)
        if hit:
            raise RestoreWroteSharedTensor(
                f"restore of layer {config.name!r}: stage {st.name!r} replaces or drops "
                f"shared tensors {hit}")
    if st.tag is Tag.DERIVE and out.drop:
        raise StageContractError(f"DERIVE stage {st.name!r} may not drop tensors ({out.drop})")
    gone = sorted(set(out.drop) - set(out.tensors) - set(st.drops))
    if gone:
        raise StageContractError(f"stage {st.name!r} dropped {gone} without declaring them "
                                 f"in drops")
    if st.tag in (Tag.METADATA, Tag.VALIDATE):
        slots = sorted(set(out.attrs) & set(state.tensors))
        if slots:
            raise StageContractError(
                f"{st.tag.name} stage {st.name!r} set tensors {slots} through attrs; only "
                f"TRANSFORM/ALLOCATE write tensors (a name in optional is set only when the "
                f"layer has no such tensor)")
    if out.release and (st.tag is not Tag.DERIVE or not set(out.release) <= set(st.reads)):
        raise StageContractError(
            f"stage {st.name!r} releases {list(out.release)}; only DERIVE stages may release, "
            f"and only tensors they read")
    tensors = merge(dissoc(state.tensors, *out.drop), out.tensors)
    released = dict(state.released)
    for name in out.release:
        src = tensors[name]
        released.setdefault(name, src)
        if name in out.attrs and out.attrs[name] is None:
            del tensors[name]          # the slot becomes None through attrs
        else:  # vLLM's empty Parameter in the layer's params dtype (the packed SGL weight
            # of an N < 16 layer is fp32, but vLLM's placeholder keeps the weight's dtype)
            dtype = config.dtype if src.is_floating_point() else src.dtype
            tensors[name] = torch.empty(0, dtype=dtype, device=src.device)
    attr_values = merge(state.attrs, out.attrs)
    rec = state.recorded
    if out.record:
        old = recorded
        if old and dict(old) != dict(out.record):
            diff = {k: (old.get(k), out.record.get(k)) for k in set(old) | set(out.record)
                    if old.get(k) != out.record.get(k)}
            raise RecordedMismatch(
                f"layer {config.name!r}, stage {st.name!r}: values recomputed here differ "
                f"from the daemon's (recorded, here): {diff}. The daemon ran on a different "
                f"target; restart it on this host's settings.")
        rec = assoc(rec, st.name, out.record)
    drops = tuple(dict.fromkeys(state.drops + tuple(d for d in out.drop)))
    buffers = (state.buffers - set(out.drop)) | out.buffers
    return LayerState(tensors=tensors, buffers=buffers, attrs=attr_values,
                      drops=drops, recorded=rec, released=released)


def _validate(stages: tuple[Stage, ...], checkpoint: frozenset[str]) -> list[str]:
    """Build-time rules (docs/design.md section 3); returns every violation found.

    1. every stage is a :class:`Stage` whose tag is a :class:`Tag` and whose name
       is ``family.verb_object`` (:data:`STAGE_NAME`); names are unique;
    2. every read is a checkpoint tensor or an earlier stage's write;
    3. no TRANSFORM/METADATA/VALIDATE stage (the daemon runs them) depends on an
       ALLOCATE/DERIVE output;
    4. METADATA/VALIDATE/DERIVE stages write no tensor: no ``writes``, no
       ``drops``, and no tensor name in ``attrs`` (emptying a slot through an
       attribute is a write), unless the name is in ``optional`` and so set only
       when the tensor is absent; DERIVE may empty a slot it reads (a release);
    5. ``drops`` are declared writes;
    6. ALLOCATE writes no exported tensor;
    7. reachability: what a replayed stage reads is what a restore has, the
       export (checkpoint tensors, plus TRANSFORM writes, minus drops) plus the
       earlier ALLOCATE outputs.
    """
    errors: list[str] = []
    bad = [s for s in stages if not isinstance(s, Stage)]
    if bad:
        return [f"{b!r} is not a Stage (use the @stage decorator)" for b in bad]
    for st in stages:
        if not isinstance(st.tag, Tag):
            errors.append(f"stage {st.name!r} has tag {st.tag!r} ({type(st.tag).__name__}), "
                          f"not a Tag: it would run in no mode; use Tag.{str(st.tag).upper()}")
        if not STAGE_NAME.match(st.name):
            errors.append(f"stage name {st.name!r} is not family.verb_object in lower snake "
                          f"case (e.g. 'awq.unpack_reorder')")
    if errors:
        return errors
    names = [s.name for s in stages]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"stage name {dup!r} is used more than once")
    available = set(checkpoint)
    producer: dict[str, Stage] = {}
    for st in stages:
        for r in st.reads:
            if r not in available and r not in st.optional:
                errors.append(f"stage {st.name!r} reads {r!r}, which no earlier stage "
                              f"produces and the checkpoint does not hold")
            src = producer.get(r)
            if src is not None and src.tag in (Tag.ALLOCATE, Tag.DERIVE) and \
                    st.tag in PREPARE_TAGS:
                errors.append(f"{st.tag.name} stage {st.name!r} depends on {src.tag.name} "
                              f"output {r!r} of {src.name!r}, which the daemon never has")
        if st.tag in (Tag.METADATA, Tag.VALIDATE, Tag.DERIVE):
            if st.writes or st.drops:
                errors.append(f"{st.tag.name} stage {st.name!r} declares tensor writes "
                              f"{list(dict.fromkeys(st.writes + st.drops))}; only "
                              f"TRANSFORM/ALLOCATE write tensors")
            allowed = set(st.optional) | (set(st.reads) if st.tag is Tag.DERIVE else set())
            slots = sorted((set(st.attrs) & available) - allowed)
            if slots:
                errors.append(f"{st.tag.name} stage {st.name!r} sets tensors {slots} through "
                              f"attrs (a write that replaces or empties the slot); only "
                              f"TRANSFORM/ALLOCATE write tensors")
        undeclared = sorted(set(st.drops) - set(st.writes))
        if undeclared:
            errors.append(f"stage {st.name!r} drops {undeclared} without declaring them in "
                          f"writes")
        for w in st.writes:
            available.add(w)
            producer[w] = st
        available.difference_update(st.drops)
    # what a restore starts from: the export (every PREPARE stage has run)
    exported = set(checkpoint)
    for st in stages:
        if st.tag is Tag.TRANSFORM:
            exported.update(st.writes)
            exported.difference_update(st.drops)
    restorable = set(exported)
    for st in stages:
        if st.tag is Tag.ALLOCATE:
            clash = sorted(set(st.writes) & exported)
            if clash:
                errors.append(f"ALLOCATE stage {st.name!r} writes exported tensors {clash}; "
                              f"restore would rewrite shared bytes")
        if st.tag in RESTORE_TAGS:
            lost = sorted(r for r in st.reads if r not in restorable and r not in st.optional)
            if lost:
                errors.append(f"{st.tag.name} stage {st.name!r} replays at restore and reads "
                              f"{lost}, which the export does not hold (a TRANSFORM drops or "
                              f"never writes it); read the final tensors or record the value")
        if st.tag is Tag.ALLOCATE:
            restorable.update(st.writes)
    return errors


@frozen
class Plan:
    """One method's post-load work for one kernel and target class.

    Attributes:
        method: quant method id (``QuantSpec.method``).
        kernel: kernel id (``"cpu_wna16"``, ``"marlin"``, ``"cutlass"``, ...).
        version: bumped whenever any stage's output changes.
        stages: ordered stages.
        checkpoint: tensor names the layer holds before post-load (some optional).
        match: ``match(config, target) -> None`` when the plan applies, else the
            reason string.
        description: one line for ``wcache plans``.

    Raises:
        PlanInvalid: at construction, listing every rule the stages break
            (:func:`_validate`). There is no switch to skip it; tests that need
            an invalid plan use :class:`wcache.testing.plans.UncheckedPlan`.
    """

    method: str
    kernel: str
    stages: tuple[Stage, ...] = field(converter=tuple)
    checkpoint: frozenset[str] = field(converter=frozenset)
    match: Callable[[LayerConfig, Target], str | None] = field(
        default=lambda config, target: None, eq=False, repr=False)
    version: int = 1
    description: str = ""

    def __attrs_post_init__(self) -> None:
        errors = _validate(self.stages, self.checkpoint)
        if errors:
            raise PlanInvalid(f"plan {self.method}/{self.kernel} is invalid:\n  - " +
                              "\n  - ".join(errors))

    @property
    def id(self) -> str:
        return f"{self.method}/{self.kernel}@{self.version}"

    @property
    def stage_versions(self) -> tuple[tuple[str, int], ...]:
        return tuple((s.name, s.version) for s in self.stages)

    # -- pure runner ---------------------------------------------------------

    def run(self, state: LayerState, config: LayerConfig, target: Target, tags: frozenset[Tag],
            recorded: Mapping[str, Mapping[str, Any]] | None = None, *,
            shared: frozenset[str] = frozenset(), check_purity: bool = False,
            memo: dict[str, dict] | None = None) -> LayerState:
        """Fold the stages whose tag is in ``tags`` over ``state``.

        Args:
            recorded: stage name -> values recorded at prepare (restore only).
            shared: tensor names that are mapped from the daemon; replayable
                stages may not replace or drop them.
            check_purity: verify no stage bumps an input's version counter.
            memo: per-restore memo for ``memoized`` stages (see :class:`Stage`).
        """
        recorded = recorded or {}
        steps = tuple(s for s in self.stages if s.tag in tags)
        return reduce(lambda acc, st: _run_stage(
            st, acc, config, target, recorded.get(st.name, {}),
            shared=shared, check_purity=check_purity, memo=memo), steps, state)

    # -- module-level entry points (the shell) -------------------------------

    def load(self, layer: torch.nn.Module, config: LayerConfig, target: Target) -> LayerState:
        """Ordinary load: run every stage and install the result on ``layer``."""
        state = self.run(state_from_module(layer), config, target, LOAD_TAGS)
        apply_state_(layer, state)
        return state

    def prepare(self, layer: torch.nn.Module, config: LayerConfig, target: Target) -> Prepared:
        """Daemon side: run TRANSFORM/METADATA/VALIDATE stages, install the result on
        ``layer`` (so the daemon can keep serving a consistent module) and return
        the tensors to export with the recorded values."""
        state = self.run(state_from_module(layer), config, target, PREPARE_TAGS)
        apply_state_(layer, state)
        return Prepared(plan_id=self.id, tensors=dict(state.tensors), buffers=state.buffers,
                        recorded={k: dict(v) for k, v in state.recorded.items()},
                        drops=state.drops, attrs=dict(state.attrs))

    def restore(self, layer: torch.nn.Module, config: LayerConfig, target: Target,
                recorded: Mapping[str, Mapping[str, Any]], *, strict: bool = False,
                guard: "bool | RestoreGuard" = True, content: bool = True,
                drops: Iterable[str] = (), memo: dict[str, dict] | None = None) -> LayerState:
        """Engine side: ``layer`` already holds the mapped tensors; replay the
        METADATA/ALLOCATE/DERIVE/VALIDATE stages under the restore guard.

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
            memo: one dict for a whole model's restore, passed to ``memoized``
                stages (e.g. one oneDNN prepack for tied weights); ``None``
                shares nothing.

        Raises:
            RestoreWroteSharedTensor: a stage changed a shared tensor.
            RecordedMismatch: a recomputed value differs from the recorded one.
            RestoreIncomplete: a needed tensor is missing.
        """
        unknown = sorted(set(recorded) - {s.name for s in self.stages})
        if unknown:
            raise RecordedMismatch(
                f"layer {config.name!r}: the daemon recorded values for stages {unknown} "
                f"that plan {self.id} does not have; daemon and engine run different plans.")
        initial = state_from_module(layer)
        drops = tuple(d for d in drops if d not in initial.tensors or
                      initial.tensors[d].device.type == "meta")
        initial = evolve(
            initial, tensors={k: v for k, v in initial.tensors.items() if k not in drops},
            drops=drops)
        shared = frozenset(k for k, v in initial.tensors.items() if v.device.type != "meta")
        if guard is True:
            guard = RestoreGuard({config.name: {k: initial.tensors[k] for k in shared}},
                                 content=content, strict=strict)
        elif guard is False:
            guard = None
        steps = tuple(s for s in self.stages if s.tag in RESTORE_TAGS)
        state = initial
        for st in steps:
            state = _run_stage(st, state, config, target, recorded.get(st.name, {}),
                               shared=shared, check_purity=guard is not None, guard=guard,
                               memo=memo)
            if guard is not None:
                guard.check_stage(config.name, st.name, {**state.tensors, **state.released})
        apply_state_(layer, state)
        if guard is not None:
            guard.check_stage(config.name, "(install)",
                              {**state_from_module(layer).tensors, **state.released})
            guard.check_layer(config.name, [s.name for s in steps])
        return state

    def describe(self) -> str:
        """A markdown table: stage, tag, reads, writes, attrs, source."""
        rows = [f"### `{self.id}`", "", self.description, "",
                "| # | stage | tag | reads | writes | attrs | source |",
                "|---|---|---|---|---|---|---|"]
        for i, s in enumerate(self.stages, 1):
            rows.append(f"| {i} | `{s.name}` | {s.tag.name} | {', '.join(s.reads) or '-'} | "
                        f"{', '.join(s.writes) or '-'} | {', '.join(s.attrs) or '-'} | "
                        f"{s.source or '-'} |")
        return "\n".join(rows) + "\n"


@frozen
class BoundPlan:
    """A :class:`Plan` bound to one layer's config and its :class:`Target`: what
    :func:`wcache.plans.plan_for` returns, so the card's API reads as written::

        bound = plan_for(config, target=target)
        bound.load(layer)                 # ordinary load
        prepared = bound.prepare(layer)   # the daemon
        bound.restore(layer, recorded)    # a restarting engine, on mapped tensors

    Attributes:
        plan: the resolved plan (its id, stages and checkpoint names are also
            readable here: ``bound.id``, ``bound.stages``, ...).
        config: the layer's frozen config the plan was resolved for.
        target: where the layer runs.
    """

    plan: Plan
    config: LayerConfig
    target: Target

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def method(self) -> str:
        return self.plan.method

    @property
    def kernel(self) -> str:
        return self.plan.kernel

    @property
    def version(self) -> int:
        return self.plan.version

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.plan.stages

    @property
    def checkpoint(self) -> frozenset[str]:
        return self.plan.checkpoint

    @property
    def stage_versions(self) -> tuple[tuple[str, int], ...]:
        return self.plan.stage_versions

    def load(self, layer: torch.nn.Module) -> LayerState:
        """:meth:`Plan.load` with this binding's config and target."""
        return self.plan.load(layer, self.config, self.target)

    def prepare(self, layer: torch.nn.Module) -> Prepared:
        """:meth:`Plan.prepare` with this binding's config and target."""
        return self.plan.prepare(layer, self.config, self.target)

    def restore(self, layer: torch.nn.Module,
                recorded: Mapping[str, Mapping[str, Any]], **kwargs: Any) -> LayerState:
        """:meth:`Plan.restore` with this binding's config and target; ``kwargs``
        (``strict``, ``guard``, ``content``, ``drops``, ``memo``) pass through.

        Raises:
            RestoreWroteSharedTensor, RecordedMismatch, RestoreIncomplete: as
            :meth:`Plan.restore`.
        """
        return self.plan.restore(layer, self.config, self.target, recorded, **kwargs)

    def run(self, state: LayerState, tags: frozenset[Tag], **kwargs: Any) -> LayerState:
        """:meth:`Plan.run` with this binding's config and target."""
        return self.plan.run(state, self.config, self.target, tags, **kwargs)

    def describe(self) -> str:
        return self.plan.describe()


# --------------------------------------------------------------------------- snapshots


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


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
                out[name] = (kind, tuple(t.shape), str(t.dtype), tuple(t.stride()),
                             tensor_checksum(t))
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
