"""The frozen values of wcache's functional core (docs/design.md section 3).

:class:`Tag`, :class:`Target`, :class:`QuantSpec`, :class:`LayerConfig`,
:class:`StageOut`, :class:`Stage`, :class:`LayerState` and :class:`Prepared`:
attrs-frozen, hashable where their fields are, with read-only mappings, so they
compare, print and serve as keys. Nothing here runs a stage or touches a module.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from attrs import field, frozen

from wcache.core import host

__all__ = [
    "Tag",
    "LOAD_TAGS",
    "PREPARE_TAGS",
    "RESTORE_TAGS",
    "Target",
    "TARGET_ENV_VARS",
    "TARGET_ENV_DEFAULTS",
    "QuantSpec",
    "MoeShape",
    "LayerConfig",
    "StageOut",
    "StageFn",
    "Stage",
    "LayerState",
    "Prepared",
]


# --------------------------------------------------------------------------- values


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


class Reregistration(enum.Enum):
    """How vLLM's post-load re-registers a parameter it rewrites; with the vLLM release
    (``wcache.vllm.compat``: ``VllmRelease.reregistration``) it decides the class and
    attributes the parameter has on a disk-loaded engine (:class:`ParamOutcome`).

    DATA: ``param.data = new`` or an in-place copy: the built object stays.
    NEW: ``layer.name = Parameter(new, requires_grad=False)`` or ``register_parameter``:
        a plain parameter without attributes.
    REPLACE: ``vllm/model_executor/utils.py::replace_parameter(layer, name, new)``.
    REPLACE_LAYER: ``vllm/model_executor/layers/quantization/utils/layer_utils.py::
        replace_parameter(layer, name, new)`` with ``new`` not of the old parameter's
        class (0.32: ``Parameter(new)``, no attributes; 0.33: ``REPLACE``).
    REPLACE_OWN: ``REPLACE`` with a ``new`` that carries the built parameter's
        attributes (the parameter itself, or ``Parameter`` wrapping it): where a new
        parameter is registered, it carries them (but the loader's backing field).
    """

    DATA = "data"
    NEW = "new"
    REPLACE = "replace"
    REPLACE_LAYER = "replace_layer"
    REPLACE_OWN = "replace_own"


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@frozen
class ParamOutcome:
    """What one parameter is on a disk-loaded engine after post-load, relative to the
    parameter the model's build created (the restored engine rebuilds it so:
    :func:`wcache.shell.install_tensors_`).

    Attributes:
        kept: the built object: its class (``ModelWeightParameter``, ...) and every
            attribute (``weight_loader``, ``output_dim``, ...), its ``requires_grad``.
        carried: not kept: a plain ``nn.Parameter(requires_grad=False)`` carrying these
            attributes of the built one (``("weight_loader",)``); ``"*"`` for all of its
            public and private attributes but the loader's backing field.
        attrs: attributes set over those, ``(name, JSON value)`` pairs
            (``(("input_dim", 0), ("output_dim", 1))``).
    """

    kept: bool
    carried: tuple[str, ...] = field(default=(), converter=_names)
    attrs: tuple[tuple[str, Any], ...] = field(
        default=(), converter=lambda v: tuple(sorted(dict(v).items()))
    )


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


def as_tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple(items)``, typed for attrs converters (the builtin's generic signature
    reads as ``Iterable[_T_co]`` to a type checker)."""
    return tuple(items)


def as_frozenset(items: Iterable[Any]) -> frozenset[Any]:
    """``frozenset(items)``, typed for attrs converters (see :func:`as_tuple`)."""
    return frozenset(items)


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
    isa: frozenset[str] = field(default=frozenset(), converter=as_frozenset)
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
        return {
            "device_type": self.device_type,
            "capability": list(self.capability) if self.capability else None,
            "isa": sorted(self.isa),
            "env": [list(p) for p in self.env],
            "kernels": dict(self.kernels),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Target:
        cap = data.get("capability")
        return cls(
            device_type=data["device_type"],
            capability=tuple(cap) if cap else None,
            isa=frozenset(data.get("isa", ())),
            env=tuple(tuple(p) for p in data.get("env", ())),
            kernels=dict(data.get("kernels", {})),
        )

    @classmethod
    def detect(
        cls, device: str | torch.device = "cpu", env: Mapping[str, str] | None = None
    ) -> Target:
        """The Target of this host for ``device``. The only place that queries the
        host (through :mod:`wcache.core.host`: ``/proc/cpuinfo``, CUDA properties,
        the environment); stages never do.

        Args:
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            env: kernel-selection variables to pin (default: read from
                ``os.environ`` for the names in ``TARGET_ENV_VARS``).
        """
        dev = torch.device(device)
        env = _normalize_env(host.environment(TARGET_ENV_VARS) if env is None else env)
        if dev.type == "cuda":
            return cls("cuda", host.cuda_capability(dev), frozenset(), env)
        return cls(dev.type, None, host.cpu_isa(), env)


#: Environment variables that change which kernel (and so which layout) vLLM picks.
TARGET_ENV_VARS = (
    "VLLM_CPU_INT4_W4A8",
    "VLLM_MARLIN_INPUT_DTYPE",
    "VLLM_DISABLED_KERNELS",
    "VLLM_BATCH_INVARIANT",
)
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
class MoeShape:
    """A fused-MoE layer's shape and the experts kernel vLLM resolved for it.

    A fused-MoE layer (vLLM's ``RoutedExperts``) holds every local expert's weights
    in two tensors: ``w13_weight [num_experts, w13_num_shards *
    intermediate_size_per_partition, hidden_size]`` (gate and up projections
    fused, gate first, when ``is_act_and_mul``; one projection otherwise) and
    ``w2_weight [num_experts, hidden_size, intermediate_size_per_partition]``
    (the down projection), with per-expert scales in the quantized methods
    (``w13_weight_scale [num_experts, 2]`` per tensor,
    ``w13_weight_scale_inv [num_experts, 2 * I / 128, H / 128]`` per block, ...).

    Attributes:
        num_experts: experts held by this rank (vLLM's ``local_num_experts``).
        global_num_experts: experts of the whole model (``global_num_experts``).
        hidden_size: the layer's hidden size as allocated (vLLM's rounded-up
            ``hidden_size``).
        intermediate_size_per_partition: this rank's share of the experts'
            intermediate size, as allocated (vLLM's rounded-up value, before any
            post-load padding).
        is_act_and_mul: gated experts (SiLU/GELU and mul): w13 holds two shards.
        has_bias: the experts have ``w13_bias``/``w2_bias``.
        backend: the backend vLLM's MoE oracle **resolved** for the layer
            (``select_*_moe_backend``: ``"TRITON"``, ``"CPU"``,
            ``"FLASHINFER_CUTLASS"``, ``"VLLM_CUTLASS"``, ...), not the requested
            ``moe_backend`` string: two processes whose oracles resolve differently
            (another optional package, another DeepGEMM switch) lay the bytes out
            differently and so get different plans and keys.
        experts: the experts class the oracle picked with it
            (``"TritonExperts"``, ``"CPUUnquantizedExperts"``, ...); on CPU it
            decides the prepacked layout (its ISA), and ``"zentorch"`` marks a
            layer vLLM hands to ZenDNN instead.
        activation: the experts' activation (``"silu"``, ``"gelu"``, ...).
    """

    num_experts: int
    global_num_experts: int
    hidden_size: int
    intermediate_size_per_partition: int
    backend: str
    experts: str = ""
    is_act_and_mul: bool = True
    has_bias: bool = False
    activation: str = "silu"

    @property
    def w13_num_shards(self) -> int:
        """Shards fused in ``w13_weight`` (2 gated, 1 otherwise); vLLM's ``w13_num_shards``."""
        return 2 if self.is_act_and_mul else 1

    def w13_shape(self) -> tuple[int, int, int]:
        """``w13_weight``'s shape as allocated: ``[E, shards * I, H]``."""
        return (
            self.num_experts,
            self.w13_num_shards * self.intermediate_size_per_partition,
            self.hidden_size,
        )

    def w2_shape(self) -> tuple[int, int, int]:
        """``w2_weight``'s shape as allocated: ``[E, H, I]``."""
        return (self.num_experts, self.hidden_size, self.intermediate_size_per_partition)

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "global_num_experts": self.global_num_experts,
            "hidden_size": self.hidden_size,
            "intermediate_size_per_partition": self.intermediate_size_per_partition,
            "backend": self.backend,
            "experts": self.experts,
            "is_act_and_mul": self.is_act_and_mul,
            "has_bias": self.has_bias,
            "activation": self.activation,
        }


@frozen
class LayerConfig:
    """One layer's frozen configuration, everything a stage may read besides tensors.

    Attributes:
        quant: the method.
        size_k: input features of this partition (``input_size_per_partition``);
            0 for fused-MoE layers, whose sizes are in ``moe``.
        size_n: output features of this partition (``output_size_per_partition``);
            0 for fused-MoE layers.
        params_dtype: activation/params dtype name, e.g. ``"bfloat16"``.
        has_bias: the layer has a bias.
        name: the module's qualified name (for error messages only).
        extra: method-specific facts as sorted ``(name, value)`` pairs
            (e.g. ``("logical_widths", (64, 64))``, ``("tp_size", 1)``).
        moe: a fused-MoE layer's shape and resolved experts backend
            (``quant.layer_kind == "moe"``); ``None`` for every other layer.
    """

    quant: QuantSpec
    size_k: int
    size_n: int
    params_dtype: str = "bfloat16"
    has_bias: bool = False
    name: str = ""
    extra: tuple[tuple[str, Any], ...] = field(default=(), converter=_freeze)
    moe: MoeShape | None = None

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
        memo: ``memoized`` stages only: new entries for this stage's per-restore
            memo (key -> value); the runner collects them in
            :attr:`LayerState.memo` and the caller of the restore keeps them.
    """

    tensors: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)
    buffers: frozenset[str] = field(default=frozenset(), converter=as_frozenset)
    drop: tuple[str, ...] = field(default=(), converter=as_tuple)
    attrs: Mapping[str, Any] = field(factory=dict, converter=_ro)
    record: Mapping[str, Any] = field(factory=dict, converter=_ro)
    release: tuple[str, ...] = field(default=(), converter=as_tuple)
    memo: Mapping[Any, Any] = field(factory=dict, converter=_ro)


StageFn = Callable[[Mapping[str, torch.Tensor], LayerConfig, Target, Mapping[str, Any]], StageOut]


@frozen
class Stage:
    """One named, tagged, pure step of a method's post-load work.

    Attributes:
        name: ``family.verb_object`` (verb from :data:`STAGE_VERBS`), e.g.
            ``"awq.convert_to_standard"``.
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
        memoized: ``fn`` also takes ``memo=``: a read-only mapping of the entries
            this stage added earlier in one restore of a whole model (``None``
            elsewhere), to share work between layers whose inputs are the *same*
            tensors (a tied embedding and lm_head share one oneDNN prepack). The
            stage returns new entries in :attr:`StageOut.memo`; the memo itself
            belongs to the caller of the restore, never to the stage.
        params: a parameterized stage's parameter values, as ``(name, value)``
            pairs in the definition's order (``(("w_q", "qweight"),
            ("n_major", False))``), passed to ``fn`` as keywords; shown in the
            repr and part of the value (:func:`wcache.core.stage` with
            ``params=``).

    A stage is a value: two stages are equal when every field is, their function
    (a module-level function, compared by identity) included. A registered stage
    pickles by reference to its registered definition (name and parameters; see
    :mod:`wcache.core.registry`), so ``pickle.loads(pickle.dumps(s)) == s`` in any
    process that can import its module.
    """

    name: str
    tag: Tag
    fn: StageFn = field(repr=False)
    reads: tuple[str, ...] = field(default=(), converter=as_tuple)
    writes: tuple[str, ...] = field(default=(), converter=as_tuple)
    attrs: tuple[str, ...] = field(default=(), converter=as_tuple)
    optional: frozenset[str] = field(default=frozenset(), converter=as_frozenset)
    version: int = 1
    source: str = ""
    memoized: bool = False
    drops: tuple[str, ...] = field(default=(), converter=as_tuple)
    params: tuple[tuple[str, Any], ...] = field(default=(), converter=_freeze)

    @property
    def replayable(self) -> bool:
        return self.tag in RESTORE_TAGS

    def __call__(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: LayerConfig,
        target: Target,
        recorded: Mapping[str, Any],
        **kwargs: Any,
    ) -> StageOut:
        """``fn(tensors, config, target, recorded, **params, **kwargs)``: the stage's
        function with its parameters (``kwargs``: ``memo=`` for memoized stages)."""
        return self.fn(tensors, config, target, recorded, **dict(self.params), **kwargs)

    @property
    def module(self) -> str:
        """The module that defines the stage's function (``wcache.stages.marlin``)."""
        return getattr(self.fn, "__module__", "") or ""


#: A stage name's shape: lower snake ``family.verb[_object]``, e.g.
#: ``awq.convert_to_standard``, ``marlin.permute_scales``, ``cpu_wna16.repack`` (the
#: family is the ``wcache.stages`` module, or the kernel, whose layout the stage
#: produces). The verb is checked


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
        memo: stage name -> the memo entries ``memoized`` stages returned in this
            run (:attr:`StageOut.memo`); the caller merges them into its memo.
    """

    tensors: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)
    buffers: frozenset[str] = field(default=frozenset(), converter=as_frozenset)
    attrs: Mapping[str, Any] = field(factory=dict, converter=_ro)
    drops: tuple[str, ...] = field(default=(), converter=as_tuple)
    recorded: Mapping[str, Mapping[str, Any]] = field(factory=dict, converter=_ro_nested)
    released: Mapping[str, torch.Tensor] = field(factory=dict, converter=_ro)
    memo: Mapping[str, Mapping[Any, Any]] = field(factory=dict, converter=_ro_nested)


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

    Every mapping (``recorded``'s inner ones too) is a read-only copy
    (``types.MappingProxyType``): a caller that needs to change one copies it.
    """

    plan_id: str
    tensors: Mapping[str, torch.Tensor] = field(converter=_ro)
    buffers: frozenset[str] = field(converter=as_frozenset)
    recorded: Mapping[str, Mapping[str, Any]] = field(converter=_ro_nested)
    drops: tuple[str, ...] = field(converter=as_tuple)
    attrs: Mapping[str, Any] = field(converter=_ro)
