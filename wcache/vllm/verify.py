"""``wcache verify``: prove on this host, with this checkpoint, that a restore is
the model vLLM's own loader builds.

    wcache verify --model DIR [vLLM engine args]            # in-process arena
    wcache verify --model DIR --socket-dir S [engine args]  # what a running daemon serves

Steps, in one process (one rank):

1. **vLLM's load**: ``DefaultModelLoader`` (load format ``auto``) builds the model
   and runs vLLM's own ``process_weights_after_loading``. Every module is
   snapshotted (tensor names, kinds, shapes, dtypes, strides, content checksums;
   the attributes the plan's stages declare and every plain attribute the module
   holds; each parameter's class, ``requires_grad`` and attributes; which names
   are one tensor) and a fixed forward runs. The model is then
   dropped, so at most two copies of the weights are alive at any time.
2. **The wcache way**: a second real load runs every plan's ``prepare`` and is
   exported into an arena served by an in-process daemon on a private socket
   (``wcache serve``'s own :func:`wcache.vllm.build.build_export` and
   :class:`wcache.store.DaemonServer`); or, with ``socket_dir``, nothing is built
   and the running daemon is asked. The engine's own loader
   (:class:`wcache.vllm.loader.WcacheModelLoader`, ``fallback=false``,
   ``strict=true``) builds the meta model, attaches, installs and replays every
   restore under the guard. The restored model is snapshotted and runs the same
   forward.
3. **Compare** module by module and the logits bit for bit; every planned layer's
   row gives its plan id and the kernel vLLM decided for it on this host.

The forward: the checkpoint's real kernels for every linear and embedding
(oneDNN, CPUWNA16, the W8A8 int8 GEMM, ...), vLLM's norms, rotary embedding and
logits processor, on :data:`DEFAULT_TOKEN_IDS` as one causal prefill. Attention
itself is computed by a pure-torch causal reference in both models (vLLM's
attention kernels need the engine's KV cache and scheduler metadata); the
attention layers' post-load state is compared by the snapshot.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import functools
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import attrs
import psutil
import torch
import torch.nn.functional as F
from tqdm import tqdm

from wcache.cli_args import job_without_socket_dir
from wcache.core import tensor_checksum
from wcache.errors import (  # VerifyRefused re-exported: its old home
    LoadFailed,
    RestoreFailed,
    VerifyRefused,
    WcacheError,
    clip,
)
from wcache.shell import snapshot
from wcache.vllm import compat, vllm_logs_quiet
from wcache.vllm.build import (
    REASON_CHARS,
    WHOLE_ERROR,
    build_server,
    checked_engine_config,
    engine_load_options,
    expected_key,
    init_distributed,
    loader_config,
    meta_model,
    prepare_platform,
    refusal_reason,
)
from wcache.vllm.compat import check_vllm_version
from wcache.vllm.model import planned_layers
from wcache.vllm.probe import host_target

logger = logging.getLogger("wcache.vllm")

#: Token ids of the fixed forward: 16 ids spread over the vocabulary by a prime
#: stride (taken modulo the vocabulary size), one causal prefill.
DEFAULT_NUM_TOKENS = 16
TOKEN_STRIDE = 7919
#: Memory kept free beyond the two copies of the weights (bytes): vLLM's own
#: state, activations of the 16-token forward, the arena's page rounding.
MEMORY_HEADROOM_BYTES = 1 << 30
#: Weight copies alive at once: the checkpoint's bytes as prepared (the daemon's
#: arena) and as restored or loaded; vLLM's load is dropped before the second load.
COPIES_HELD = 2
#: Added to the engine arguments: verify's forward runs eagerly.
EAGER_FLAG = "--enforce-eager"
#: Checkpoint files whose sizes estimate the weights' bytes.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
#: Attributes that are not load state: ``kv_cache`` is the load-time placeholder
#: the model runner rebinds to the engine-sized KV cache after loading;
#: ``compat.ATTACHMENT_ATTR`` keeps a restored model's mapping alive.
IGNORED_ATTRS = frozenset({"kv_cache", compat.ATTACHMENT_ATTR})
#: How deep attribute objects are opened (1: the module's own attributes; 2: those
#: of e.g. its attention ``impl`` or quant method; 3: e.g. the method's kernel).
MAX_ATTR_DEPTH = 3
#: Only objects of these packages are opened (vLLM's layers' helpers, wcache's
#: bound callables); configs of other libraries stay compared by type.
OPENED_MODULES = ("vllm.", "wcache.")
#: ... except vLLM's engine-wide configs: the same objects for both builds, and they
#: hold process-wide counters (compilation_config.enabled_custom_ops) that the
#: second build increments.
CLOSED_MODULES = ("vllm.config",)
#: Longest rendering of one value in a message (characters).
MAX_VALUE_CHARS = 120
#: How deep the kernel-object audit (:func:`kernel_tensor_owners`) follows objects for
#: tensors: a fused-MoE layer's ``quant_method.moe_kernel.fused_experts.quant_config
#: ._w1.scale`` is 5 levels below the layer; one more for a container on the way.
MAX_AUDIT_DEPTH = 6
#: The audit's owner of a tensor that lies in none of its layer's own parameters and
#: buffers (a workspace, a converted copy; or a stale tensor the restore replaced).
PRIVATE = "<private>"

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


@attrs.frozen
class Row:
    """One line of the per-layer table.

    Attributes:
        layer: the module's qualified name (``"(ties)"``, ``"(forward)"`` and
            ``"(logits)"`` for the model-wide checks).
        plan: the plan id, ``"-"`` for modules without post-load work.
        kernel: the kernel vLLM decided for this layer on this host (as recorded
            in the layer's config and the Target), ``"-"`` where none.
        difference: ``None`` when equal, else the first differing field with both
            values (vLLM's load first, then the restore).
    """

    layer: str
    plan: str
    kernel: str
    difference: str | None = None

    @property
    def ok(self) -> bool:
        return self.difference is None


@attrs.frozen
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        rows: planned layers, other modules with state, then the model-wide checks.
        mode: ``"in-process"`` or ``"daemon <socket dir>"``.
        seconds: wall time of each step (``load``, ``forward``, ``prepare``,
            ``restore``, ...) in seconds.
        logits_equal: the fixed forward's logits are bit-identical.
        note: said after the verdict, which it does not change: the daemon of
            ``socket_dir`` mode exited after the restore attached (empty: none).
    """

    rows: tuple[Row, ...]
    mode: str
    seconds: Mapping[str, float]
    logits_equal: bool
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if not r.ok)

    def table(self, *, only_failures: bool = False) -> str:
        """The per-layer table as aligned text."""
        rows = [r for r in self.rows if not (only_failures and r.ok)]
        head = ("layer", "plan", "kernel", "result")
        body = [
            (r.layer, r.plan, r.kernel, "OK" if r.ok else f"DIFFERS: {r.difference}") for r in rows
        ]
        widths = [max([len(head[i])] + [len(b[i]) for b in body]) for i in range(3)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(line[:3], widths)) + "  " + line[3]
            for line in [head, *body]
        ]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        planned = [r for r in self.rows if r.plan != "-"]
        if self.ok:
            return (
                f"wcache verify: OK ({self.mode}): {len(planned)} planned layers and "
                f"{len(self.rows) - len(planned)} other checks equal vLLM's load; "
                f"logits bit-identical." + (f" {self.note}" if self.note else "")
            )
        first = self.failures[0]
        text = (
            f"wcache verify: FAILED ({self.mode}): {len(self.failures)} of "
            f"{len(self.rows)} checks differ; first: {first.layer}: {first.difference}"
        )
        if any(r.difference == NONFINITE_LOGITS for r in self.rows):
            text += f" ({NONFINITE_LOGITS_CAUSE})"
        return text + (f" {self.note}" if self.note else "")


def default_token_ids(vocab_size: int, n: int = DEFAULT_NUM_TOKENS) -> list[int]:
    """``n`` fixed token ids spread over ``[0, vocab_size)``."""
    return [(i * TOKEN_STRIDE) % vocab_size for i in range(1, n + 1)]


# --------------------------------------------------------------------------- memory


def checkpoint_weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's weight files (an estimate of one copy, bytes)."""
    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(WEIGHT_SUFFIXES):
            total += os.path.getsize(os.path.join(model_dir, name))
    return total


def available_bytes(device: torch.device) -> int:
    """Memory this process can still use on ``device`` (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])

    return int(psutil.virtual_memory().available)


def memory_note(model_dir: str, device: torch.device) -> tuple[str, bool]:
    """A line saying what verify holds and whether this host has it.

    Returns:
        (the note, whether enough memory is available).
    """
    one = checkpoint_weight_bytes(model_dir)
    need = COPIES_HELD * one + MEMORY_HEADROOM_BYTES
    have = available_bytes(device)
    note = (
        f"wcache verify: holds two copies of the model's weights at once (vLLM's load "
        f"is dropped before the wcache build; about {COPIES_HELD} x {one / 2**30:.2f} GiB "
        f"+ {MEMORY_HEADROOM_BYTES / 2**30:.0f} GiB headroom = {need / 2**30:.2f} GiB on "
        f"{device.type}; {have / 2**30:.2f} GiB available)"
    )
    return note, have >= need


# --------------------------------------------------------------------------- snapshot


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), tensor_checksum(value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (tuple, list)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return tuple(value)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    if callable(value):
        # vLLM binds closures where a plan binds an equivalent callable object
        # (layer.cpu_linear): like wcache.shell.snapshot, compared as "callable";
        # what they compute is checked through the forward
        return "<callable>"
    # process-local handles (oneDNN handlers, kernels, quant methods): compared by
    # type, like wcache.shell.snapshot
    return f"<{type(value).__name__}>"


def _attributes(
    prefix: str, obj: Any, depth: int, seen: set[int], out: dict[str, Any], skip: Iterable[str] = ()
) -> None:
    """Every attribute of ``obj`` as ``~prefix.name``, normalized by :func:`_plain`;
    objects that hold attributes themselves (an attention ``impl``, a quant method
    and its kernel) are opened up to :data:`MAX_ATTR_DEPTH` levels, each once."""
    for name, value in vars(obj).items():
        if (
            name in skip
            or name in IGNORED_ATTRS
            or isinstance(value, torch.nn.Module)
            or getattr(value, compat.COPY_ON_WRITE_HOOK, False)
        ):
            continue
        if _empty_bookkeeping(name, value):
            continue
        key = f"{prefix}{name}"
        out[key] = _plain(value)
        if (
            depth < MAX_ATTR_DEPTH
            and isinstance(out[key], str)
            and out[key].startswith("<")
            and id(value) not in seen
            and _opened(value)
        ):
            seen.add(id(value))
            _attributes(f"{key}.", value, depth + 1, seen, out)


def _empty_bookkeeping(name: str, value: Any) -> bool:
    """Whether an attribute is an empty private container: a weight reader's scratch
    space with nothing left in it, which says what its absence says (nothing pending).

    The rule, issue 47 item 1: vLLM's ``load_weights`` may create such scratch on the
    model (``DeepseekV2Model.load_weights``: ``_pending_indexer_wk_fp8 = {}``, filled
    and drained while reading fused indexer shards, read back with
    ``getattr(self, ..., None)``). A restore runs no weight reader, so the attribute is
    absent there; both sides hold no pending state. A non-empty one (a reader that left
    work undone) is still compared, as is every public attribute, every set and every
    non-container.

    Source: vLLM ``models/deepseek_v2.py::DeepseekV2Model.load_weights`` (0.32, 0.33).
    """
    # sets are left out: :func:`_plain` compares a set by its type only (an empty and a
    # filled one are equal), so dropping empty ones would make them differ
    return name.startswith("_") and isinstance(value, (dict, list, tuple)) and not value


def foreign_private_attrs(module: torch.nn.Module) -> frozenset[str]:
    """The attributes of ``module`` that are another library's private bookkeeping:
    names with a leading underscore on a module whose class vLLM and wcache do not
    define (:data:`OPENED_MODULES`). Empty for vLLM's and wcache's own modules.

    The rule: under vLLM's Transformers modeling backend the model is transformers'
    own module tree (vLLM swaps in its linear, attention and embedding layers). Their
    private attributes record transformers' construction, not the load; they differ
    with the device the tree was built under, which is not load state. Transformers
    sets ``_is_hf_initialized`` on every module its ``init_weights`` visits and skips
    that pass when the tree is built under a ``torch.device("meta")`` context
    (``PreTrainedModel.init_weights``); vLLM builds it on the engine's device (only
    parameters on meta: ``init_on_device_without_buffers``), wcache's restore under
    ``torch.device("meta")``, so the flag is on one side only while every weight,
    buffer and public attribute is equal. vLLM reads no private attribute of these
    modules after construction (the one it reads, ``_keep_in_fp32_modules_strict``,
    in the constructor on both sides). Public attributes of foreign modules and every
    attribute of vLLM's and wcache's modules are still compared.

    Source: transformers ``modeling_utils.PreTrainedModel.init_weights`` and
    ``_initialize_weights``; vLLM ``models/transformers/base.py::Base.__init__``.
    """
    if type(module).__module__.startswith(OPENED_MODULES):
        return frozenset()
    return frozenset(name for name in vars(module) if name.startswith("_"))


def parameter_flags(module: torch.nn.Module) -> dict[str, Any]:
    """Per own parameter of ``module``, as ``%name``: its class, ``requires_grad``
    and the attributes set on the parameter object (vLLM's ``weight_loader``,
    ``output_dim``, ``input_dim``, ``packed_dim``, ``tp_rank``, ...; normalized by
    :func:`_param_attr`, so a loader compares by its function's name). What vLLM's
    weight updates read: ``reload_weights`` in kernel format copies into a parameter
    that requires grad only under ``torch.no_grad``, ``load_weights`` calls each
    parameter's ``weight_loader`` with its ``output_dim`` (a no-op loader and a
    layer's ``weight_loader_v2`` differ: break18 D2).

    Every parameter is compared, the ones vLLM's post-load re-registers included: the
    restore gives each the class and attributes of vLLM's own load in this release
    (``wcache.vllm.compat.param_outcomes``; issue 44 item 6).

    Source: vllm/model_executor/parameter.py::BasevLLMParameter;
    vllm/model_executor/utils.py::set_weight_attrs, replace_parameter.
    """
    out: dict[str, Any] = {}
    for name, p in module._parameters.items():
        if p is None:
            continue
        attrs_ = tuple(
            sorted(
                (k, _param_attr(v))
                for k, v in vars(p).items()
                if not getattr(v, compat.COPY_ON_WRITE_HOOK, False)
            )
        )
        out[f"%{name}"] = (f"{type(p).__module__}.{type(p).__qualname__}", p.requires_grad, attrs_)
    return out


@contextlib.contextmanager
def _vllms_own(step: str, model: str) -> Iterator[None]:
    """Turn a failure of vLLM's own ``step`` (its meta build, its disk load) into
    :class:`LoadFailed` (``wcache verify`` exit 2: nothing to compare), keeping
    wcache's own errors (``meta-build``, ...) as they are (break19 D1: exit 1, "a
    layer differs", or a traceback)."""
    try:
        yield
    except WcacheError:
        raise
    except Exception as exc:  # vLLM's, of any kind: named in the message
        reason = clip(refusal_reason(exc), REASON_CHARS, WHOLE_ERROR["wcache verify"])
        raise LoadFailed(
            f"vLLM's own {step} of {model} fails on this host ({type(exc).__name__}: "
            f"{reason}), so there is no disk load to compare a restore with; a vLLM "
            f"engine could not serve it here from disk either"
        ) from exc


def _param_attr(value: Any) -> Any:
    """A parameter attribute as :func:`parameter_flags` compares it: :func:`_plain`,
    but a callable (the weight loader) as ``<callable NAME>``, NAME its function's
    ``__name__`` (through a ``functools.partial``), after the class of the object a
    bound method is bound to (``QKVParallelLinear.weight_loader``): which function
    ``load_weights`` calls and on what kind of layer, not which closure or object
    (vLLM's AWQ no-op loader is a closure; the restore's is a module function of its
    name). A closure's or partial's captured values are not compared (break19 N1)."""
    if callable(value) and not isinstance(value, (torch.Tensor, type)):
        fn = getattr(value, "func", None) if isinstance(value, functools.partial) else value
        owner = getattr(fn, "__self__", None)  # a bound method: its object's class
        fn = getattr(fn, "__func__", fn)
        name = getattr(fn, "__name__", type(fn).__name__)
        return f"<callable {type(owner).__name__ + '.' if owner is not None else ''}{name}>"
    return _plain(value)


def _opened(value: Any) -> bool:
    """Whether the audit and the attribute walk look inside ``value``: an object of
    vLLM or wcache (:data:`OPENED_MODULES`), not an engine-wide config."""
    mod = type(value).__module__
    return (
        hasattr(value, "__dict__")
        and mod.startswith(OPENED_MODULES)
        and not mod.startswith(CLOSED_MODULES)
    )


def kernel_tensor_owners(module: torch.nn.Module, skip: Iterable[str] = ()) -> dict[str, str]:
    """Issue 44 item 5, the audit by data pointer: every tensor that ``module``'s
    plain attributes and the vLLM/wcache objects below them hold (quant method, MoE
    kernel and quant config, Marlin workspaces, scale structs; up to
    :data:`MAX_AUDIT_DEPTH` levels, through lists, tuples and dicts), as ``&path``
    -> the name of the module's own parameter or buffer whose bytes it lies in
    (``data_ptr`` within that tensor's byte range: the tensor itself or a view of
    it), else :data:`PRIVATE`; ``"<empty>"`` for a tensor of no elements.

    Compared between vLLM's load and the restore, a kernel object that kept a tensor
    the restore replaced shows as ``&path: 'w13_weight_scale' != '<private>'``, which
    the checksums cannot see when the stale copy holds the same bytes. Submodules are
    not followed (each module is audited on its own), nor the attribute paths in
    ``skip``: the plan's declared attributes, which the snapshot compares (vLLM binds
    closures there where wcache binds equivalent callable objects, as :func:`_plain`
    says).
    """
    skipped = set(skip)
    ranges = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if t.numel() and t.device.type != "meta"
    )

    def owner(t: torch.Tensor) -> str:
        if t.numel() == 0:
            return "<empty>"
        ptr = t.data_ptr()
        for start, end, name in ranges:
            if start <= ptr < end:
                return name
        return PRIVATE

    out: dict[str, str] = {}
    seen = {id(module)}

    def walk(key: str, value: Any, depth: int) -> None:
        if key[1:] in skipped:
            return
        if isinstance(value, torch.Tensor):
            out[key] = owner(value)
            return
        if depth >= MAX_AUDIT_DEPTH or isinstance(value, torch.nn.Module) or id(value) in seen:
            return
        if isinstance(value, (list, tuple)):
            seen.add(id(value))
            for i, v in enumerate(value):
                walk(f"{key}[{i}]", v, depth + 1)
        elif isinstance(value, Mapping):
            seen.add(id(value))
            for k, v in value.items():
                walk(f"{key}[{k!r}]", v, depth + 1)
        elif _opened(value):
            seen.add(id(value))
            for name, v in vars(value).items():
                walk(f"{key}.{name}", v, depth + 1)

    for name, value in vars(module).items():
        if name in _MODULE_INTERNALS or name in IGNORED_ATTRS:
            continue
        if getattr(value, compat.COPY_ON_WRITE_HOOK, False):
            continue
        walk(f"&{name}", value, 1)
    return out


def module_state(module: torch.nn.Module, attr_paths: Iterable[str] = ()) -> dict[str, Any]:
    """One module's comparable state: :func:`wcache.shell.snapshot` (its own
    parameters and buffers: kind, shape, dtype, stride, checksum; and the values at
    ``attr_paths``) plus every other attribute it holds (``~name``, and
    ``~impl.scale`` inside vLLM/wcache objects), normalized by :func:`_plain`;
    without :data:`IGNORED_ATTRS` and :func:`foreign_private_attrs`; plus the
    kernel-object audit (``&path``: :func:`kernel_tensor_owners`)."""
    paths = sorted(set(attr_paths) - IGNORED_ATTRS)
    out = snapshot(module, paths)
    _attributes(
        "~",
        module,
        1,
        {id(module)},
        out,
        skip=_MODULE_INTERNALS | set(paths) | foreign_private_attrs(module),
    )
    out.update(kernel_tensor_owners(module, paths))
    return out


def model_state(
    model: torch.nn.Module,
    attr_paths: Mapping[str, Iterable[str]],
) -> dict[str, dict[str, Any]]:
    """:func:`module_state` of every module with its parameters' flags
    (:func:`parameter_flags`: what a disk and a restored engine must share for vLLM's
    weight updates), by qualified name."""
    return {
        name: {
            **module_state(m, attr_paths.get(name, ())),
            **parameter_flags(m),
        }
        for name, m in model.named_modules()
    }


def ties(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Groups of parameter/buffer names that are one tensor object (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(t), []).append(name)
    return sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


_TENSOR_FIELDS = ("kind", "shape", "dtype", "stride", "checksum")


def _field_difference(field: str, a: Any, b: Any) -> str:
    """``field: <what> a != b``; a tensor's tuple names the part that differs."""
    if (
        isinstance(a, tuple)
        and isinstance(b, tuple)
        and len(a) == len(b) == 5
        and a[0] in ("param", "buffer")
    ):
        for part, x, y in zip(_TENSOR_FIELDS, a, b):
            if x != y:
                return f"{field} {part}: {_short(x)} != {_short(y)}"
    return f"{field}: {_short(a)} != {_short(b)}"


def first_difference(loaded: Mapping[str, Any], restored: Mapping[str, Any]) -> str | None:
    """The first field (sorted: tensors, then ``@``declared attributes, then other
    ``~``attributes, then the ``&``kernel-object audit) whose value differs, with
    vLLM's value first; ``None`` when equal."""
    missing = "<absent>"
    order = {"@": 1, "~": 2, "&": 3}
    for field in sorted(set(loaded) | set(restored), key=lambda k: (order.get(k[0], 0), k)):
        a, b = loaded.get(field, missing), restored.get(field, missing)
        if a != b:
            return _field_difference(field, a, b)
    return None


# --------------------------------------------------------------------------- forward


def _reference_attention_forward(
    self,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output_shape: Any = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Causal attention of one prefill in pure torch, for ``Attention.forward``.

    Args:
        query: ``[num_tokens, num_heads * head_size]``.
        key, value: ``[num_tokens, num_kv_heads * head_size]``.

    Returns:
        ``[num_tokens, num_heads * head_size_v]`` in ``output_dtype`` (default the
        query's dtype).
    """

    n = query.shape[0]
    heads, kv_heads = self.num_heads, self.num_kv_heads
    head_v = getattr(self, "head_size_v", self.head_size)
    q = query.reshape(n, heads, self.head_size).transpose(0, 1)
    k = key.reshape(n, kv_heads, self.head_size).transpose(0, 1)
    v = value.reshape(n, kv_heads, head_v).transpose(0, 1)
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.impl.scale)
    return out.transpose(0, 1).reshape(n, heads * head_v).to(output_dtype or query.dtype)


class _CausalLM(Protocol):
    """The vLLM model method :func:`run_forward` calls besides ``forward``."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


def run_forward(
    model: torch.nn.Module, vllm_config: Any, token_ids: Sequence[int]
) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """The fixed forward: logits of ``token_ids`` as one causal prefill.

    Returns:
        (logits ``[len(token_ids), vocab]``, ``(module name, output checksum)`` in
        call order, for naming the first module whose output differs).
    """
    from vllm.forward_context import set_forward_context  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    outputs: list[tuple[str, str]] = []

    def hook(name: str):
        def record(_module, _inputs, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(t, torch.Tensor):
                outputs.append((name, tensor_checksum(t)))

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    device = next(iter(model.parameters())).device
    compat.init_workspace_manager_(device)  # fused-MoE kernels take their scratch from it
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), dtype=torch.long, device=device)
    try:
        with (
            torch.inference_mode(),
            compat.attention_forward_replaced(_reference_attention_forward),
            set_forward_context(None, vllm_config, num_tokens=len(token_ids)),
        ):
            hidden = model(ids, positions)
            # cast: vLLM's model method, which torch's Module types Tensor | Module
            logits = cast(_CausalLM, model).compute_logits(hidden)
    finally:
        for h in handles:
            h.remove()
    return logits.detach().cpu(), outputs


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


#: The (logits) check's difference when vLLM's own load gives non-finite logits (and the
#: restore the same bits): the fixed forward proves nothing. The architecture sweep
#: reads it (``wcache.testing.engine_acceptance.NONFINITE_LOGITS``).
NONFINITE_LOGITS = "logits: bit-identical but not finite, so the forward proves nothing"
#: What the verdict adds then: vLLM's own load is broken, so the differences may be
#: vLLM's too. vLLM's loader checks that an unquantized model's linear and MoE weights
#: came from the checkpoint only per module (a module with post-load work is exempt), so
#: a weight the checkpoint lacks (a MoE config.json without its experts' tensors) stays
#: ``torch.empty``: different bytes in each build, and non-finite logits.
NONFINITE_LOGITS_CAUSE = (
    "vLLM's own load gives non-finite logits, so these differences may be its own: a "
    "weight the checkpoint lacks (e.g. a MoE config.json without its experts' tensors) "
    "is left uninitialized by vLLM's loader; check the checkpoint's tensors against "
    "the model, and its load from disk (load_format='auto'), first"
)


def _logits_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if _bits_equal(a, b):
        if not bool(torch.isfinite(a).all()):
            # equal NaNs prove nothing: the fixed forward must be a meaningful one
            return NONFINITE_LOGITS
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"logits: {list(a.shape)} {a.dtype} != {list(b.shape)} {b.dtype}"
    diff = (a.float() - b.float()).abs()
    pos = int((diff.reshape(a.shape[0], -1) > 0).any(dim=1).nonzero()[0])
    return (
        f"logits: not bit-identical (first at token {pos}; max |diff| "
        f"{float(diff.nan_to_num(float('inf')).max()):.6g})"
    )


def _forward_difference(
    a: list[tuple[str, str]], b: list[tuple[str, str]]
) -> tuple[str | None, str | None]:
    """(the first module, in call order, whose output differs or ``None``; the
    difference or ``None``)."""
    for (name_a, sum_a), (name_b, sum_b) in zip(a, b):
        if name_a != name_b:
            return None, f"call order: {name_a} != {name_b}"
        if sum_a != sum_b:
            return name_a, (f"first differing output: {name_a} (checksum {sum_a} != {sum_b})")
    if len(a) != len(b):
        return None, f"module calls: {len(a)} != {len(b)}"
    return None, None


# --------------------------------------------------------------------------- builds


@contextlib.contextmanager
def _forgetting_registrations(vllm_config: Any) -> Iterator[None]:
    """Undo the process-global registrations one model build leaves
    (:func:`wcache.vllm.compat.forget_registrations_`), so the next build in this
    process does not collide with or reuse them."""
    before = compat.registrations(vllm_config)
    try:
        yield
    finally:
        compat.forget_registrations_(vllm_config, before)


def _ensure_world(vllm_config: Any) -> None:
    from vllm.distributed import model_parallel_is_initialized  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if not model_parallel_is_initialized():
        tmp = tempfile.mkdtemp(prefix="wcache-verify-dist-")
        # the group's file store lives as long as the process: remove it on the way out
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        init_distributed(vllm_config, 0, 1, f"file://{tmp}/init")


@attrs.frozen
class _Side:
    state: dict[str, dict[str, Any]]
    ties: list[tuple[str, ...]]
    logits: torch.Tensor | None
    outputs: list[tuple[str, str]]
    error: str | None = None  # the forward raised (``Type: message``)


def _observe(
    model: torch.nn.Module,
    vllm_config: Any,
    attr_paths: Mapping[str, Iterable[str]],
    token_ids: Sequence[int],
    seconds: dict[str, float],
    label: str,
) -> _Side:
    t0 = time.perf_counter()
    state = model_state(model, attr_paths)
    tied = ties(model)
    t1 = time.perf_counter()
    logits: torch.Tensor | None = None
    outputs: list[tuple[str, str]] = []
    error: str | None = None
    try:
        logits, outputs = run_forward(model, vllm_config, token_ids)
    except Exception as exc:  # a broken restore is a finding, not a crash
        logger.debug("verify: forward of the %s model raised", label, exc_info=True)
        error = f"{type(exc).__name__}: {exc}"
    seconds[f"snapshot ({label})"] = t1 - t0
    seconds[f"forward ({label})"] = time.perf_counter() - t1
    return _Side(state, tied, logits, outputs, error)


def _plan_rows(
    model: torch.nn.Module, target: Any
) -> tuple[dict[str, tuple[str, str]], dict[str, list[str]]]:
    """Per planned layer of vLLM's loaded model: (plan id, kernel), and the attribute
    paths its plan's stages declare, each where vLLM keeps it (a kernel binding's
    path on vLLM's kernel object: :func:`wcache.vllm.compat.bound_attr_path`)."""

    info, paths = {}, {}
    for p in planned_layers(model, target):
        info[p.name] = (p.plan.id, p.config.quant.kernel or p.plan.kernel)
        paths[p.name] = sorted(
            {compat.bound_attr_path(p.module, a) for s in p.plan.stages for a in s.attrs}
        )
    return info, paths


def _compare(
    loaded: _Side, restored: _Side, plans: Mapping[str, tuple[str, str]]
) -> tuple[list[Row], bool]:
    rows = []
    names = list(loaded.state) + [n for n in restored.state if n not in loaded.state]
    planned = [n for n in names if n in plans]
    others = [n for n in names if n not in plans]
    for name in planned + others:
        plan, kernel = plans.get(name, ("-", "-"))
        a, b = loaded.state.get(name), restored.state.get(name)
        diff: str | None
        if a is None or b is None:
            diff = f"module: present in {'vLLM load' if b is None else 'restore'} only"
        else:
            diff = first_difference(a, b)
        if name in plans or diff is not None or any(k[0] not in "@~&" for k in a or {}):
            rows.append(Row(name or "(model)", plan, kernel, diff))
    tie_diff = (
        None
        if loaded.ties == restored.ties
        else f"tied names: {_short(loaded.ties)} != {_short(restored.ties)}"
    )
    rows.append(Row("(ties)", "-", "-", tie_diff))
    forward_diff: str | None
    logits_diff: str | None
    if loaded.logits is None or restored.logits is None:  # no logits: that forward raised
        forward_diff = (
            f"the forward raised: vLLM load: {loaded.error or 'no error'}; "
            f"restore: {restored.error or 'no error'}"
        )
        logits_diff = "logits: no logits to compare (the forward raised)"
    else:
        culprit, forward_diff = _forward_difference(loaded.outputs, restored.outputs)
        logits_diff = _logits_difference(loaded.logits, restored.logits)
        for i, row in enumerate(rows):
            # state that the snapshot cannot see (a private oneDNN handle, a released
            # weight) shows in the output of the first module that computes differently
            if row.layer == culprit and row.ok:
                rows[i] = attrs.evolve(
                    row,
                    difference=(
                        "forward output differs (the first module in call order that does; "
                        "its state compares equal)"
                    ),
                )
    rows.append(Row("(forward)", "-", "-", forward_diff))
    rows.append(Row("(logits)", "-", "-", logits_diff))
    return rows, logits_diff is None


def _steps(progress: bool, total: int):
    if not progress:
        return None

    return tqdm(
        total=total,
        desc="wcache verify",
        unit="step",
        file=sys.stderr,
        bar_format="{desc}: {n}/{total} steps [{elapsed}]",
    )


def _advance(bar: Any, desc: str) -> None:
    if bar is not None:
        bar.set_description_str(f"wcache verify: {desc}")
        bar.update(0)


#: The restore options verify sets itself: it never loads from disk in the restore's
#: place, and refuses a restore that leaves a layer unrestored.
VERIFY_OWN_OPTIONS = {"fallback": False, "strict": True}
#: Restore options that write the engine's own files: verify's restore leaves them out,
#: so a check never appends to the engine's timing or profile file nor overwrites its
#: artifact record (break17 #5).
ENGINE_OUTPUT_OPTIONS = ("timing_file", "profile_file", "artifacts_record")
#: ``--load-format`` values verify takes: vLLM's side always loads with ``auto``, the
#: restored side with ``wcache`` (and the engine's ``--model-loader-extra-config``).
VERIFY_LOAD_FORMATS = ("auto", "wcache")


def engine_restore_options(
    load_format: str, extra: Any, socket_dir: str | None, job: str
) -> tuple[dict[str, Any], str | None, str]:
    """The engine's own wcache options for verify's restore: ``--load-format wcache
    --model-loader-extra-config JSON`` (what the engine runs with) is honoured, not
    dropped (break16 #5): ``load_format`` and ``extra`` (its
    ``model_loader_extra_config``, a dict or JSON text) as
    :func:`wcache.vllm.build.engine_load_options` reads them from the engine's
    arguments. Its ``socket_dir`` and ``job`` name the daemon to compare
    against when ``--socket-dir``/``--job`` are not given (an empty ``socket_dir``
    counts as none); ``fallback`` and ``strict`` are verify's own
    (:data:`VERIFY_OWN_OPTIONS`); the engine's output files
    (:data:`ENGINE_OUTPUT_OPTIONS`) are left out; every other option (``mode``,
    ``share_prepacks``, ``connect_timeout_s``, ...) goes to the restore as given.

    Returns:
        ``(options, socket_dir, job)``: the options that reach the restore, and the
        daemon to compare against.

    Raises:
        VerifyRefused: a ``--load-format`` other than ``auto``/``wcache``, options
            wcache's loader refuses (an unknown key, a wrong type), a ``socket_dir``
            or ``job`` that contradicts ``--socket-dir``/``--job``, or a job with no
            socket dir to find its daemon in (code ``config-invalid``).
    """
    from wcache.vllm.loader import LoaderOptions  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if load_format not in VERIFY_LOAD_FORMATS:
        raise VerifyRefused(
            f"--load-format {load_format}: verify compares vLLM's load from disk "
            f"(load_format='auto') with the restore (load_format='wcache'); give the "
            f"engine's wcache arguments, or none",
            code="config-invalid",
        )
    extra = extra if load_format == "wcache" else None
    try:
        given = LoaderOptions.from_extra(extra)  # the engine's load would refuse the same
    except ValueError as exc:
        raise VerifyRefused(f"--model-loader-extra-config: {exc}", code="config-invalid") from None
    if isinstance(extra, str):  # JSON text, as from_extra read it
        extra = json.loads(extra) if extra.strip() else {}
    if given.socket_dir:
        if socket_dir is not None and os.path.realpath(socket_dir) != os.path.realpath(
            given.socket_dir
        ):
            raise VerifyRefused(
                f"--socket-dir {socket_dir} and the engine's socket_dir {given.socket_dir} "
                f"(--model-loader-extra-config) name two daemons' directories; give one",
                code="config-invalid",
            )
        socket_dir = given.socket_dir
    if given.job:
        if job and job != given.job:
            raise VerifyRefused(
                f"--job {job!r} and the engine's job {given.job!r} "
                f"(--model-loader-extra-config) name two daemons; give one",
                code="config-invalid",
            )
        job = given.job
    if job and socket_dir is None:  # without a daemon to name, the job would be ignored
        raise VerifyRefused(job_without_socket_dir(job), code="config-invalid")
    left_out = ("socket_dir", "job", *VERIFY_OWN_OPTIONS, *ENGINE_OUTPUT_OPTIONS)
    options = {k: v for k, v in (extra or {}).items() if k not in left_out}
    return options, socket_dir, job


def verify(
    model: str,
    engine_args: Sequence[str] = (),
    *,
    socket_dir: str | None = None,
    job: str = "",
    progress: bool = True,
    check_memory: bool = True,
    token_ids: Sequence[int] | None = None,
    out: Any = None,
) -> VerifyReport:
    """Build ``model`` with vLLM's loader and the wcache way; compare every module
    and the logits of a fixed forward.

    Args:
        model: checkpoint directory.
        engine_args: vLLM engine arguments (as for ``wcache serve``), e.g.
            ``["--dtype", "bfloat16"]``; they must be the engine's.
        socket_dir: compare against the daemon serving this socket directory
            instead of an in-process arena.
        job: the daemon's ``--job`` (``socket_dir`` mode).
        progress: progress bars on stderr.
        check_memory: refuse when the host lacks memory for two copies.
        token_ids: the forward's tokens (default :func:`default_token_ids`).
        out: where the memory note goes (default stderr).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is the verdict.

    Raises:
        ConfigInvalid: vLLM refused the checkpoint's config or the engine arguments.
        VerifyRefused: too little memory, or more than one rank.
        RestoreFailed: the wcache side could not be built (a key mismatch with
            the running daemon, a guard violation, ...), with its reason code.
    """
    from vllm.config import set_current_vllm_config  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    out = out if out is not None else sys.stderr
    # vLLM's torch.compile wrapper would trace the forward hooks; eager mode changes
    # neither the weights nor the cache key (vLLM's ModelConfig hash leaves it out)
    eager = [] if EAGER_FLAG in engine_args else [EAGER_FLAG]
    # vLLM's refusal of the arguments (a pydantic ValidationError, ...) is ConfigInvalid:
    # verify could not compare (exit 2), not "a layer differs" (exit 1)
    vllm_config = checked_engine_config(model, [*engine_args, *eager], prog="wcache verify")
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size != 1:
        raise VerifyRefused(
            "wcache verify checks one rank; run it without "
            "--tensor-parallel-size/--pipeline-parallel-size (the plans and "
            "kernels per layer are the same on every rank)."
        )
    # the engine's own --load-format/--model-loader-extra-config (vllm_config holds the
    # daemon's disk load instead)
    load_format, extra = engine_load_options(model, list(engine_args), prog="wcache verify")
    options, socket_dir, job = engine_restore_options(load_format, extra, socket_dir, job)
    device = torch.device(vllm_config.device_config.device)
    note, enough = memory_note(vllm_config.model_config.model, device)
    print(note, file=out, flush=True)
    if check_memory and not enough:
        raise VerifyRefused(
            f"{note}: not enough memory for two copies; free memory or run "
            f"verify on a larger host of the same class.",
            code="insufficient-memory",
        )
    model_config = vllm_config.model_config
    seconds: dict[str, float] = {}
    mode = "in-process" if socket_dir is None else f"daemon {socket_dir}"
    if options:  # the engine's restore options, as the restore ran with them
        mode += "; " + ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    bar = _steps(progress, total=5 if socket_dir else 6)
    try:
        with prepare_platform(vllm_config), set_current_vllm_config(vllm_config):
            _ensure_world(vllm_config)
            target = host_target(device)
            # seconds, where vLLM's load takes minutes: what would refuse the restore
            if socket_dir is not None:
                _check_daemon_key(vllm_config, device, socket_dir, job)
            else:
                # MetaBuildUnsupported: no engine restores it; vLLM's own build failing
                # here is LoadFailed (exit 2), not "a layer differs"
                with _vllms_own("build", model_config.model), meta_model(vllm_config):
                    pass
            _advance(bar, "vLLM load")
            t0 = time.perf_counter()
            with _forgetting_registrations(vllm_config):
                with _vllms_own("load", model_config.model):
                    loaded_model = DefaultModelLoader(
                        loader_config(
                            vllm_config.load_config,
                            progress,
                            load_format="auto",
                            model_loader_extra_config={},
                        )
                    ).load_model(vllm_config, model_config)
                seconds["load (vLLM)"] = time.perf_counter() - t0
                plans, attr_paths = _plan_rows(loaded_model, target)
                if bar is not None:
                    bar.update(1)
                _advance(bar, "forward (vLLM load)")
                if token_ids is None:
                    token_ids = default_token_ids(model_config.get_vocab_size())
                loaded = _observe(loaded_model, vllm_config, attr_paths, token_ids, seconds, "vLLM")
                del loaded_model
            gc.collect()
            if bar is not None:
                bar.update(1)
            restored = _wcache_side(
                vllm_config,
                model_config,
                device,
                socket_dir,
                job,
                attr_paths,
                token_ids,
                seconds,
                bar,
                progress,
                options,
            )
            _advance(bar, "compare")
            rows, logits_equal = _compare(loaded, restored, plans)
            if bar is not None:
                bar.update(1)
            note = (
                ""
                if socket_dir is None
                else _daemon_gone_note(vllm_config, device, socket_dir, job)
            )
    finally:
        if bar is not None:
            bar.close()
    return VerifyReport(tuple(rows), mode, dict(seconds), logits_equal, note)


def _daemon_socket(vllm_config: Any, device: torch.device, socket_dir: str, job: str) -> str:
    """The socket the engine's restore attaches to in ``socket_dir`` (as the loader names it)."""
    from wcache.store.paths import socket_path  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)
    from wcache.vllm.key import device_id, parallel_layout  # noqa: PLC0415 (imported at call time: tests patch device_id)

    return socket_path(
        socket_dir, device_id(device, vllm_config.model_config, parallel_layout(), job)
    )


def _daemon_gone_note(vllm_config: Any, device: torch.device, socket_dir: str, job: str) -> str:
    """After the comparison in ``socket_dir`` mode: empty while the daemon still answers;
    else a sentence saying it exited after the restore attached (the verdict stands for
    the bytes compared, but no engine can attach to them now), or, where its socket
    still takes connections, that it did not answer (stalled, not gone)."""
    from wcache.store import DaemonMissing, daemon_status  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

    sock = _daemon_socket(vllm_config, device, socket_dir, job)
    try:
        daemon_status(sock)
    except DaemonMissing as exc:
        if _listening(sock):  # alive, not answering: SIGSTOP, overload
            return (
                f"Note: the daemon did not answer after the comparison ({exc}); an "
                f"engine attaching now would wait for it."
            )
        return (
            f"Note: the daemon has exited since the restore attached ({exc}): the bytes "
            f"compared were its, but no engine can attach to it now; start `wcache serve` "
            f"again."
        )
    return ""


def _listening(sock_path: str) -> bool:
    """Whether a process listens on the Unix socket ``sock_path``
    (:func:`wcache.store.paths.socket_accepts`: the kernel queues a connection to a
    stopped one too); False when it is gone, refuses, or cannot be probed."""
    from wcache.store.paths import socket_accepts  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)

    try:
        return socket_accepts(sock_path)
    except OSError:
        return False


def _check_daemon_key(vllm_config: Any, device: torch.device, socket_dir: str, job: str) -> None:
    """``socket_dir`` mode, before vLLM's load: the daemon on this engine's socket
    there answers and serves the key the restore will ask for
    (:func:`wcache.vllm.build.expected_key`: a meta build and the checkpoint's
    digests, no weight read). A wrong checkpoint, a dead daemon or another ``--job``
    is refused in seconds, not after vLLM's load and forward (minutes for a large
    model); the restore itself checks again.

    Raises:
        RestoreFailed: ``daemon-missing`` (naming a daemon of another configuration or
            job where one answers, as the engine's load does) or ``key-mismatch``,
            worded as a failure of the restored side.
        MetaBuildUnsupported: no engine could restore this model.
    """
    from wcache.store import CacheKey, DaemonMissing, KeyMismatch, daemon_status  # noqa: PLC0415 (call-time lookup: a test's patch of wcache.store applies)
    from wcache.vllm.loader import _diagnose_mismatch, _diagnose_missing  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    key = expected_key(vllm_config)
    sock = _daemon_socket(vllm_config, device, socket_dir, job)
    cause: Exception | None = None
    try:
        theirs = CacheKey(daemon_status(sock)["key_fields"])
        if theirs != key:
            cause = _diagnose_mismatch(
                KeyMismatch(
                    f"the daemon on {sock} serves another key: {key.versions_note(theirs)}"
                    f"{key.describe_diff(theirs)}. Fix: give verify the checkpoint and engine "
                    f"arguments the daemon was started with, or restart the daemon with these "
                    f"(a daemon serves the checkpoint's bytes as they were when it loaded them)",
                    fields=key.diff(theirs),
                ),
                key,
                socket_dir,
                job,
            )
    except DaemonMissing as exc:
        cause = _diagnose_missing(exc, key, socket_dir, job)
    if cause is not None:
        raise RestoreFailed(
            f"the restored side could not be built from {socket_dir}: {cause}",
            code=getattr(cause, "code", "restore-error"),
        ) from cause


def _wcache_side(
    vllm_config: Any,
    model_config: Any,
    device: torch.device,
    socket_dir: str | None,
    job: str,
    attr_paths: Mapping[str, Iterable[str]],
    token_ids: Sequence[int],
    seconds: dict[str, float],
    bar: Any,
    progress: bool,
    options: Mapping[str, Any] | None = None,
) -> _Side:
    """Prepare and serve in-process (unless ``socket_dir``), restore with the
    engine's loader and the engine's restore ``options``
    (:func:`engine_restore_options`), observe, and drop everything."""
    from wcache.vllm.key import device_id, parallel_layout  # noqa: PLC0415 (imported at call time: tests patch device_id)
    from wcache.vllm.loader import WcacheModelLoader  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    with contextlib.ExitStack() as stack:
        if socket_dir is None:
            _advance(bar, "load + prepare + export (wcache)")
            t0 = time.perf_counter()
            sockets = stack.enter_context(tempfile.TemporaryDirectory(prefix="wcache-verify-"))
            dev_id = device_id(device, model_config, parallel_layout(), job)
            # wcache serve's own build: load, prepare, export into the arena, then the
            # model and its registrations are dropped
            stack.enter_context(
                build_server(vllm_config, socket_dir=sockets, device_id=dev_id, progress=progress)
            )
            seconds["load + prepare + export (wcache)"] = time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
            serving = sockets
        else:
            serving = socket_dir
        _advance(bar, "restore (wcache)")
        load_config = dataclasses.replace(
            vllm_config.load_config,
            load_format="wcache",
            model_loader_extra_config={
                **(options or {}),
                **VERIFY_OWN_OPTIONS,
                "socket_dir": serving,
                "job": job,
            },
        )
        t0 = time.perf_counter()
        with _forgetting_registrations(vllm_config):
            try:
                restored_model = WcacheModelLoader(load_config).load_model(
                    vllm_config, model_config
                )
            except RestoreFailed as exc:  # the engine's wording names its fallback: say ours
                raise RestoreFailed(
                    f"the restored side could not be built from {serving}: {exc.__cause__ or exc}",
                    code=exc.code,
                ) from exc.__cause__
            seconds["restore (wcache)"] = time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
            _advance(bar, "forward (restore)")
            try:
                side = _observe(
                    restored_model,
                    vllm_config,
                    attr_paths,
                    token_ids,
                    seconds,
                    "restore",
                )
            finally:
                attachment = compat.attachment_of(restored_model)
                del restored_model
                gc.collect()
                if attachment is not None:
                    attachment.close()
        if bar is not None:
            bar.update(1)
    return side


def main(args: Any, rest: list[str]) -> int:
    """``wcache verify`` entry point (arguments parsed by :mod:`wcache.cli`).

    stdout carries the table and the verdict only: vLLM's own log lines go to
    stderr, at WARNING and above, unless the environment says otherwise.
    """
    with vllm_logs_quiet():  # for the run only: a caller's environment is left as it was
        check_vllm_version()  # as wcache serve and the load format do
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        t0 = time.perf_counter()
        report = verify(
            args.model,
            rest,
            socket_dir=args.socket_dir,
            job=args.job,
            progress=not args.no_progress,
            check_memory=not args.ignore_memory_check,
        )
    sys.stdout.write(report.table(only_failures=args.only_failures))
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    print(f"{report.summary()}\ntimes: {steps}; total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0 if report.ok else 1
