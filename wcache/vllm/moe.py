"""Fused MoE on the vLLM side: the backend vLLM's oracle resolved, and the one table
of the kernel objects vLLM rebuilds after a restore.

After its post-load, every vLLM fused-MoE method holds process-local kernel objects
built from the layer's final tensors: ``quant_method.moe_quant_config`` (the scales,
biases and block shape the kernel reads) and ``quant_method.moe_kernel`` (a
``FusedMoEKernel``: prepare/finalize plus the experts class the oracle picked).
vLLM's ``apply`` asserts both are set. A restored layer holds the daemon's tensors
but no kernel objects: :func:`rebuild_moe_kernel_` builds them from :data:`KERNELS`,
**one row per (vLLM method class, resolved backend)** that a wcache plan covers.
Adding a MoE method is a plan, its stages and one row here.

A row's ``rebuild`` is one of:

* :func:`vllm_preprocessed_branch`: vLLM's own restore branch (the method's
  ``process_weights_after_loading`` under vLLM's ``weights_already_processed()``:
  ``_init_moe_kernel`` and nothing else), for methods whose branch is exactly that
  (``supports_pre_processed_weights``);
* a function here that calls vLLM's public kernel factory (``make_fp8_moe_kernel``:
  :func:`fp8_kernel`; ``make_nvfp4_moe_kernel``; ``make_mxfp4_moe_kernel``;
  ``make_wna16_moe_kernel``: :func:`wna16_kernel`) without the method's or the
  experts' own post-load (which would replay an in-place transform on shared bytes),
  binding the result through :func:`wcache.vllm.compat.set_moe_kernel_`.

What vLLM keeps about the resolution (its backend enum and experts class) is read by
:func:`resolved_backend`, which the adapter puts into each MoE layer's
:class:`~wcache.core.MoeShape` (hence the plan, its match and the cache key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from wcache.errors import NoPlan
from wcache.vllm import compat

__all__ = [
    "MoeKernelRow",
    "KERNELS",
    "resolved_backend",
    "kernel_row",
    "rebuild_moe_kernel_",
    "vllm_preprocessed_branch",
    "wna16_kernel",
    "BACKEND_ATTRS",
]

#: The attribute each vLLM MoE method keeps its resolved backend enum in (0.32, 0.33).
BACKEND_ATTRS = (
    "unquantized_backend",
    "fp8_backend",
    "nvfp4_backend",
    "mxfp4_backend",
    "wna16_moe_backend",  # AutoAWQMoEMethod, AutoGPTQMoEMethod
    "wna16_backend",  # CompressedTensorsWNA16MoEMethod
)


def resolved_backend(quant_method: Any) -> tuple[str, str]:
    """``(backend, experts)``: the name of the backend enum member vLLM's MoE oracle
    resolved for this method (``"TRITON"``, ``"CPU"``, ``"FLASHINFER_CUTLASS"``, ...) and
    the experts class it picked (``"TritonExperts"``, ``"CPUUnquantizedExperts"``; ``""``
    where vLLM keeps none, as for TPU/OOT). ``("", "")`` for a method that keeps no
    resolved backend (a method wcache has no MoE plan for)."""
    for attr in BACKEND_ATTRS:
        backend = getattr(quant_method, attr, None)
        if backend is not None:
            experts = getattr(quant_method, "experts_cls", None)
            return (
                getattr(backend, "name", str(backend)),
                getattr(experts, "__name__", "") if experts is not None else "",
            )
    return "", ""


def vllm_preprocessed_branch(module: torch.nn.Module, quant_method: Any) -> None:
    """vLLM's own restore branch of the method: ``process_weights_after_loading`` with
    vLLM's ``weights_already_processed()`` set, which for the methods of the rows
    using it is ``self._init_moe_kernel(layer)`` and nothing else (0.32 and 0.33).

    Source: ``UnquantizedFusedMoEMethod.process_weights_after_loading``,
    ``Fp8MoEMethod.process_weights_after_loading`` (the ``is_weights_pre_processed()``
    early return).
    """
    from vllm.model_executor.utils import weights_already_processed  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    with weights_already_processed():
        quant_method.process_weights_after_loading(module)


def fp8_kernel(module: torch.nn.Module, quant_method: Any) -> None:
    """The kernel objects of an FP8 MoE method without a pre-processed branch: the
    last lines of its post-load (``get_fused_moe_quant_config``, then vLLM's
    ``make_fp8_moe_kernel`` with the backend and experts class its oracle resolved) on
    the restored tensors. The rest of those methods' post-load would quantize the
    (already FP8) weights again (online FP8) or requantize the w1/w3 shards in place
    (compressed-tensors per tensor), writing into shared bytes.

    Source: ``online.fp8._Fp8OnlineMoEBase._setup_kernel``;
    ``CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading`` (its last
    statement).
    """
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        make_fp8_moe_kernel,
    )

    quant_config = quant_method.get_fused_moe_quant_config(module)
    kernel = make_fp8_moe_kernel(
        moe_quant_config=quant_config,
        moe_config=quant_method.moe,
        fp8_backend=quant_method.fp8_backend,
        experts_cls=quant_method.experts_cls,
        routing_tables=compat.moe_routing_tables(module),
    )
    compat.set_moe_kernel_(quant_method, quant_config, kernel)


def nvfp4_kernel(module: torch.nn.Module, quant_method: Any) -> None:
    """ModelOpt NVFP4 MoE's kernel objects: ``_build_moe_kernel`` without its last line,
    the experts' ``process_weights_after_loading``: for ``CutlassExpertsFp4`` that line
    multiplies the activation scales into ``w*_weight_scale_2`` in place, which the
    plan's TRANSFORM (``nvfp4.fuse_moe_activation_scale``) already did; run again it
    would write into shared bytes and square the scales. For ``MarlinExperts`` (backend
    ``MARLIN``) that line is the base class's no-op, and vLLM's own pre-processed
    branch refuses every backend but FLASHINFER_TRTLLM, so both rows use this.

    Source: ``ModelOptNvFp4FusedMoE._build_moe_kernel`` (0.32).
    """
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        make_nvfp4_moe_kernel,
    )

    quant_config = quant_method.get_fused_moe_quant_config(module)
    kernel = make_nvfp4_moe_kernel(
        moe_quant_config=quant_config,
        moe_config=quant_method.moe,
        experts_cls=quant_method.experts_cls,
        backend=quant_method.nvfp4_backend,
        routing_tables=compat.moe_routing_tables(module),
        per_token_activation=quant_method.per_token_activation,
    )
    compat.set_moe_kernel_(quant_method, quant_config, kernel)


def mxfp4_kernel(module: torch.nn.Module, quant_method: Any) -> None:
    """MXFP4 MoE's kernel objects (canonical ``Mxfp4MoEMethod`` and GPT-OSS's
    ``GptOssMxfp4MoEMethod``, each through its own ``get_fused_moe_quant_config``):
    ``_build_moe_kernel`` / the end of ``_setup_kernel`` without its last line,
    the experts' ``process_weights_after_loading`` (``MarlinExperts``: the base no-op
    today; left out so a future in-place step there never runs on shared bytes). vLLM's
    own pre-processed branch cannot serve: it raises for every backend but
    FLASHINFER_TRTLLM_MXFP4_MXFP8.

    Source: ``Mxfp4MoEMethod._build_moe_kernel``, ``GptOssMxfp4MoEMethod._setup_kernel``
    (0.33).
    """
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        make_mxfp4_moe_kernel,
    )

    quant_config = quant_method.get_fused_moe_quant_config(module)
    kernel = make_mxfp4_moe_kernel(
        moe_quant_config=quant_config,
        moe_config=quant_method.moe,
        mxfp4_backend=quant_method.mxfp4_backend,
        experts_cls=quant_method.experts_cls,
        routing_tables=compat.moe_routing_tables(module),
    )
    compat.set_moe_kernel_(quant_method, quant_config, kernel)


@attrs.frozen
class MoeKernelRow:
    """One (vLLM method class, resolved backend) whose kernel objects wcache rebuilds.

    Attributes:
        method: the vLLM quant-method class name (a key of compat's class table).
        backend: the resolved backend enum member's name.
        plans: the wcache plans (``method/kernel``, no version) that leave a layer in
            the state ``rebuild`` expects.
        rebuild: ``rebuild(module, quant_method)``: sets ``moe_quant_config`` and
            ``moe_kernel`` from the module's final tensors.
    """

    method: str
    backend: str
    plans: tuple[str, ...]
    rebuild: Callable[[torch.nn.Module, Any], None] = attrs.field(eq=False)


def wna16_kernel(module: torch.nn.Module, quant_method: Any) -> None:
    """The kernel objects of vLLM's int4/int8 weight-only MoE methods (AWQ, GPTQ,
    compressed-tensors WNA16): ``_setup_kernel`` (quant config from the final tensors,
    then ``make_wna16_moe_kernel``), without the post-load's repacks, which the plan's
    TRANSFORMs already did (run again they would scramble the shared bytes). These
    methods do not support vLLM's pre-processed branch.

    Source: ``AutoAWQMoEMethod._setup_kernel``, ``AutoGPTQMoEMethod._setup_kernel``,
    ``CompressedTensorsWNA16MoEMethod._setup_kernel`` (0.32, 0.33; the last one's
    ZEN_CPU post-load line is CPU only).
    """
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        make_wna16_moe_kernel,
    )

    backend = getattr(quant_method, "wna16_moe_backend", None) or quant_method.wna16_backend
    quant_config = quant_method.get_fused_moe_quant_config(module)
    kernel = make_wna16_moe_kernel(
        moe_quant_config=quant_config,
        moe_config=quant_method.moe,
        experts_cls=quant_method.experts_cls,
        backend=backend,
        routing_tables=compat.moe_routing_tables(module),
    )
    compat.set_moe_kernel_(quant_method, quant_config, kernel)


#: The one table: every MoE (method, backend) a wcache plan restores.
KERNELS = (
    MoeKernelRow(
        "UnquantizedFusedMoEMethod", "TRITON", ("unquantized_moe/triton",), vllm_preprocessed_branch
    ),
    MoeKernelRow(
        "UnquantizedFusedMoEMethod",
        "CPU",
        ("unquantized_moe/cpu_vec", "unquantized_moe/cpu_amx"),
        vllm_preprocessed_branch,
    ),
    MoeKernelRow(
        "Fp8MoEMethod",
        "TRITON",
        ("fp8_moe_block/triton", "fp8_moe_tensor/triton"),
        vllm_preprocessed_branch,
    ),
    MoeKernelRow(
        "Fp8MoEMethod",
        "MARLIN",
        ("fp8_moe_tensor/marlin", "fp8_moe_block/marlin"),
        vllm_preprocessed_branch,
    ),
    MoeKernelRow(
        "Fp8PerTensorOnlineMoEMethod", "TRITON", ("fp8_per_tensor_moe/triton",), fp8_kernel
    ),
    MoeKernelRow(
        "CompressedTensorsW8A8Fp8MoEMethod",
        "VLLM_CUTLASS",
        ("ct_w8a8_fp8_moe_channel/vllm_cutlass", "ct_w8a8_fp8_moe_tensor/vllm_cutlass"),
        fp8_kernel,
    ),
    MoeKernelRow(
        "CompressedTensorsW8A8Fp8MoEMethod",
        "TRITON",
        ("ct_w8a8_fp8_moe_channel/triton", "ct_w8a8_fp8_moe_tensor/triton"),
        fp8_kernel,
    ),
    MoeKernelRow("Mxfp4MoEMethod", "MARLIN", ("mxfp4_moe/marlin",), mxfp4_kernel),
    MoeKernelRow("GptOssMxfp4MoEMethod", "MARLIN", ("gpt_oss_mxfp4/marlin",), mxfp4_kernel),
    MoeKernelRow(
        "ModelOptNvFp4FusedMoE", "VLLM_CUTLASS", ("modelopt_fp4/cutlass_moe",), nvfp4_kernel
    ),
    MoeKernelRow("ModelOptNvFp4FusedMoE", "MARLIN", ("modelopt_fp4/marlin_moe",), nvfp4_kernel),
    MoeKernelRow("AutoAWQMoEMethod", "MARLIN", ("awq_moe/marlin",), wna16_kernel),
    MoeKernelRow("AutoGPTQMoEMethod", "MARLIN", ("gptq_moe/marlin",), wna16_kernel),
    MoeKernelRow(
        "CompressedTensorsWNA16MoEMethod", "MARLIN", ("ct_w4a16_moe/marlin",), wna16_kernel
    ),
)


def kernel_row(quant_method: Any) -> MoeKernelRow | None:
    """The row of ``quant_method``'s exact class and resolved backend, or None."""
    backend, _ = resolved_backend(quant_method)
    for row in KERNELS:
        if row.backend == backend and compat.is_type(quant_method, row.method):
            return row
    return None


def rebuild_moe_kernel_(module: torch.nn.Module) -> bool:
    """Build a restored fused-MoE layer's kernel objects from its final tensors
    (:data:`KERNELS`); a no-op (False) for other layers and for layers that have them.

    Raises:
        NoPlan: the layer is a fused-MoE layer without kernel objects whose
            (method, backend) has no row (a plan without its row: a wcache bug).
    """
    quant_method = getattr(module, "quant_method", None)
    if (
        quant_method is None
        or not hasattr(quant_method, "moe_kernel")
        or quant_method.moe_kernel is not None
    ):
        return False
    row = kernel_row(quant_method)
    if row is None:
        backend, _ = resolved_backend(quant_method)
        raise NoPlan(
            f"{type(quant_method).__name__} on backend {backend or '?'}: wcache has no "
            f"row in wcache.vllm.moe.KERNELS to rebuild its MoE kernel after a "
            f"restore; add the row with the plan, or load without wcache"
        )
    row.rebuild(module, quant_method)
    return True
