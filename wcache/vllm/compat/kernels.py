"""Kernel state on vLLM's objects: what a plan leaves on a layer bound onto vLLM's kernel
objects (:data:`KERNEL_BINDINGS`, :func:`sync_kernel_state_`), the "already processed"
flag, ModelOpt NVFP4 MoE's rebuilt kernel, and vLLM's kernel library (``torch.ops._C``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import attrs
import torch

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


def load_custom_ops() -> None:
    """Import ``vllm._custom_ops``, which loads vLLM's kernel library for this host
    (``import_kernels``: ``_C``, ``_C_AVX512`` or ``_C_AVX2`` on CPU) and so
    registers the ``torch.ops._C`` ops wcache's CPU stages call."""
    import vllm._custom_ops  # noqa: PLC0415, F401 (vLLM import ~6 s: only when called)


def has_custom_op(name: str) -> bool:
    """Whether vLLM's loaded kernel library has op ``name`` (``torch.ops._C.<name>``);
    call :func:`load_custom_ops` first."""
    return hasattr(torch.ops._C, name)


class _RoutedExperts(Protocol):
    """What :func:`moe_routing_tables` calls on vLLM's fused-MoE layer."""

    def _expert_routing_tables(self) -> Any: ...


def moe_routing_tables(module: torch.nn.Module) -> Any:
    """A fused-MoE layer's expert routing tables (``RoutedExperts._expert_routing_tables()``),
    the argument vLLM's MoE kernel factories take (:mod:`wcache.vllm.moe`)."""
    # cast: vLLM's method on its layer class, which torch's Module types Tensor | Module
    return cast(_RoutedExperts, module)._expert_routing_tables()


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
    convert: Callable[[Any, Any], Any] = attrs.field(default=lambda kernel, value: value, eq=False)


#: Where a linear layer's FP8 scaled-mm kernel is: Fp8LinearMethod and online FP8 keep
#: it as ``quant_method.fp8_linear``, compressed-tensors W8A8 FP8 as
#: ``scheme.fp8_linear`` (the ``logical_output_size`` binding, the padded loader of
#: :func:`weight_loaders_as_loaded_`).
FP8_KERNEL_OWNERS = ("quant_method.fp8_linear", "scheme.fp8_linear")
#: Layer-local stage attrs -> vLLM's kernel objects (0.32). A binding whose kernel is
#: found moves the value (the layer attribute is deleted: vLLM's own layer has none,
#: and the restored layer must equal it); with no kernel found it stays on the layer
#: (a plan run on a plain module, the reference kernels of the tests).
KERNEL_BINDINGS = (
    # CUTLASS FP8: CutlassFP8ScaledMMLinearKernel.apply_scaled_mm reads it (and
    # asserts it is not None on the first forward; wcache.stages.fp8.LOGICAL_OUTPUT_ATTR)
    KernelBinding(
        "logical_output_size",
        FP8_KERNEL_OWNERS,
        "logical_output_size",
        only_existing=True,
        convert=lambda kernel, value: int(value),
    ),
    # oneDNN W8A8 INT8 on CPU (wcache.stages.onednn.prepack_scaled_weight):
    # CPUInt8ScaledMMLinearKernel, the compressed-tensors scheme's kernel, keeps the
    # handle and the apply its process_weights_after_loading chose
    KernelBinding("dnnl_handler", ("scheme.kernel",), "dnnl_handler"),
    KernelBinding(
        "linear_method",
        ("scheme.kernel",),
        "linear_method",
        convert=lambda kernel, value: _int8_linear_method(kernel, value),
    ),
)

#: ``linear_method`` as the W8A8 INT8 stages name it (oneDNN, AMX SGL) -> the method of vLLM's
#: CPUInt8ScaledMMLinearKernel that its own post-load binds for it.
_INT8_LINEAR_METHODS = {"onednn": "_apply_weights_onednn", "sgl": "_apply_weights_sgl"}


def cpu_moe_experts() -> str:
    """The experts class vLLM-CPU's MoE oracle picks here for an unquantized fused MoE:
    the first of its preference list whose ``_supports_current_device()`` holds
    (``X86CPUUnquantizedExperts`` on an AMX host, ``CPUUnquantizedExperts``, the
    portable vector path, on any other x86 host), ``""`` where vLLM has none of them.

    Source: vllm/model_executor/layers/fused_moe/oracle/unquantized.py (the
    ``UnquantizedMoeBackend.CPU`` branch); .../experts/cpu_moe.py.
    """
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    preference = (
        "X86CPUUnquantizedExperts",
        "ArmCPUUnquantizedExperts",
        "PowerCPUUnquantizedExperts",
        "CPUUnquantizedExperts",
    )
    for name in preference:
        cls = getattr(cpu_moe, name, None)
        if cls is not None and cls._supports_current_device():
            return name
    return ""


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
            if kernel is not None and (
                not binding.only_existing or hasattr(kernel, binding.kernel_attr)
            ):
                return f"{owner}.{binding.kernel_attr}"
    return layer_attr


#: The name of vLLM's layerwise wrapper of a parameter's loader (online quantization
#: and reloads): vllm/model_executor/model_loader/reload/layerwise.py
#: (``make_online_process_loader``), 0.33.
ONLINE_PROCESS_LOADER = "online_process_loader"


def weight_loaders_as_loaded_(module: torch.nn.Module) -> None:
    """Give ``module``'s parameters the weight loaders vLLM's own load leaves them
    (what ``model.load_weights`` calls on a disk engine; ``wcache verify`` compares them
    by name, break18):

    * a loader wrapped for online processing (``online_process_loader``, which vLLM
      puts on an online-quantized layer's parameters when it builds them, so the
      restore's meta build has it too) is unwrapped to the original, as vLLM's load
      leaves it once the layer is processed (``_get_original_loader``);
    * a weight the CUTLASS FP8 kernel padded to multiples of 16 (K or N, against
      ``input_size_per_partition`` and the kernel's ``logical_output_size``) gets the
      kernel's ``padded_weight_loader``, as its post-load sets it.

    Idempotent. Source: vllm/model_executor/model_loader/reload/layerwise.py;
    vllm/model_executor/kernels/linear/scaled_mm/cutlass.py::
    CutlassFP8ScaledMMLinearKernel.process_weights_after_loading (0.32 and 0.33).
    """
    for p in module._parameters.values():
        if p is None:
            continue
        # a BasevLLMParameter keeps it as _weight_loader (its property raises once deleted)
        loader: Any = vars(p).get("_weight_loader", vars(p).get("weight_loader"))
        if getattr(loader, "__name__", None) != ONLINE_PROCESS_LOADER:
            continue
        while getattr(loader, "__name__", None) == ONLINE_PROCESS_LOADER:
            loader = getattr(loader, "__wrapped__", None)  # functools.wraps sets it
        if loader is not None:
            setattr(p, "weight_loader", loader)  # noqa: B010 (the property's setter, or an attribute)
    weight = module._parameters.get("weight")
    k = getattr(module, "input_size_per_partition", None)
    for owner in FP8_KERNEL_OWNERS:
        kernel = _resolve(module, owner)
        padded = getattr(kernel, "padded_weight_loader", None)
        n = getattr(kernel, "logical_output_size", None)
        if padded is None or weight is None or weight.dim() != 2 or None in (k, n):
            continue
        if tuple(weight.shape) != (k, n):  # [K, N] (column-major B), padded
            setattr(weight, "weight_loader", padded)  # noqa: B010 (as above)


def sync_kernel_state_(module: torch.nn.Module) -> None:
    """Put the kernel state a plan left on ``module`` where vLLM keeps it; call after
    a plan's load or restore (a no-op elsewhere, and idempotent).

    * each :data:`KERNEL_BINDINGS` value the layer holds goes onto vLLM's kernel
      object, and the layer attribute is deleted once bound;
    * the "already processed" flag of the methods whose own post-load sets it
      (:func:`mark_postload_done_`);
    * the parameters' weight loaders, as vLLM's load leaves them
      (:func:`weight_loaders_as_loaded_`, after the bindings: it reads the kernel's
      ``logical_output_size``).
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
            if kernel is None or (
                binding.only_existing and not hasattr(kernel, binding.kernel_attr)
            ):
                continue
            setattr(kernel, binding.kernel_attr, binding.convert(kernel, value))
            moved = True
        if moved:
            delattr(module, binding.layer_attr)
    weight_loaders_as_loaded_(module)
