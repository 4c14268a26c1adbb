"""What vLLM decides on this host, asked of vLLM itself (docs/design.md section 4).

vLLM-CPU picks its kernels at run time: which kernel library it loads
(``_C`` for AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``; ``platforms/cpu.py::
import_kernels``), which ops that library has, and per unquantized GEMM which
branch ``dispatch_cpu_unquantized_gemm`` takes (zentorch, the AMX SGL kernel,
oneDNN, or ``F.linear`` when oneDNN refuses the dtype on this ISA). wcache
never re-derives these from CPU flags: it runs vLLM's own code on tiny layers
once per process and records the *outcome* in :attr:`Target.kernels`, so the
outcome is part of every plan match and of the cache key.

``python -m wcache.vllm.probe`` prints this host's decisions as JSON (the tests
and ``make demo`` use it to learn what a child process with a given
environment would decide).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Mapping

import torch
from attrs import evolve

from wcache.core import Target
from wcache.core.decisions import (
    GEMM_ONEDNN,
    GEMM_SGL,
    KERNEL_LIBRARIES,
    KERNEL_LIBRARY,
    OP_ABSENT,
    OP_PRESENT,
    W8A8_INT8_SGL,
    gemm_decision,
    op_decision,
)
from wcache.vllm import compat

__all__ = [
    "PROBED_DTYPES",
    "PROBED_OPS",
    "KERNEL_LIBRARIES",
    "cpu_kernel_decisions",
    "host_target",
    "unquantized_gemm_kernel",
    "w8a8_int8_kernel",
]

#: Activation/weight dtypes vLLM-CPU serves unquantized linears in.
PROBED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Ops whose presence decides whether a vLLM CPU kernel can run at all
#: (``_C_AVX2`` lacks the first five; ``_C_AVX512`` all but ``cpu_gemm_wna16``
#: and the oneDNN ones: the SGL and the w4a8 ops are ``_C``'s only).
PROBED_OPS = (
    "cpu_gemm_wna16",
    "convert_weight_packed",
    "int8_scaled_mm_with_quant",
    "convert_weight_packed_scale_zp",
    "int4_scaled_mm_cpu",
    "weight_packed_linear",
    "create_onednn_mm_handler",
    "create_onednn_scaled_mm_handler",
)
#: A probe shape outside vLLM's SGL rule (K not a multiple of its 32-wide tile)
#: and tiny, so dispatch reaches the oneDNN / F.linear branches: ``(N, K)``.
PROBE_SHAPE_GENERAL = (16, 48)
#: A probe shape inside vLLM's SGL rule (N % 16 == 0, K % 32 == 0, 1 KiB):
#: what vLLM does with small, tile-aligned weights (``(N, K)``).
PROBE_SHAPE_SGL = (16, 32)

#: Names a ``cpu_linear`` closure references -> the branch vLLM took.
_BRANCH_MARKERS = (
    ("zentorch_linear_unary", "zentorch"),
    ("weight_packed_linear_cpu", "sgl"),
    ("onednn_mm", "onednn"),
    ("linear", "torch_linear"),
)


def _loaded_library() -> str:
    """Which of vLLM's kernel libraries this process mapped (``/proc/self/maps``)."""
    compat.load_custom_ops()  # vLLM's import_kernels runs here

    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    found = sorted({lib for lib in KERNEL_LIBRARIES if f"/vllm/{lib}.abi3.so" in maps})
    return ",".join(found) if found else "none"


def _branch_of(cpu_linear: object) -> str:
    """Classify the ``layer.cpu_linear`` vLLM's dispatch installed."""
    if cpu_linear is torch.nn.functional.linear:
        return "torch_linear"
    code = getattr(cpu_linear, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    for marker, branch in _BRANCH_MARKERS:
        if marker in names:
            return branch
    return f"unknown:{getattr(cpu_linear, '__qualname__', type(cpu_linear).__name__)}"


def _dispatch_outcome(dtype: torch.dtype, shape: tuple[int, int]) -> str:
    """Run vLLM's own ``dispatch_cpu_unquantized_gemm`` on a tiny linear of
    ``shape`` ``(N, K)`` and return the branch it took."""

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    # torch types Module.__setattr__'s value Tensor | Module; vLLM's layers carry a
    # plain None bias attribute, as here
    layer.bias = None  # type: ignore[assignment]
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # its "fallback to torch linear" warning is our probe
    try:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    except Exception as exc:  # noqa: BLE001  (a branch that raises is an outcome too)
        return f"error:{type(exc).__name__}"
    finally:
        vllm_logger.setLevel(level)
    return _branch_of(getattr(layer, "cpu_linear", None))


@functools.cache
def cpu_kernel_decisions() -> tuple[tuple[str, str], ...]:
    """vLLM-CPU's kernel decisions on this host, probed once per process.

    Returns sorted ``(decision, outcome)`` pairs:

    * ``cpu.kernel_library``: ``_C``, ``_C_AVX512`` or ``_C_AVX2``.
    * ``op.<name>``: ``present`` / ``absent`` for each of :data:`PROBED_OPS`.
    * ``unquantized_gemm[<dtype>]`` and ``unquantized_gemm[<dtype>,sgl_shape]``:
      the branch of ``dispatch_cpu_unquantized_gemm`` (``onednn``,
      ``torch_linear``, ``sgl``, ``zentorch``) for a general and for a small
      tile-aligned weight.
    * ``w8a8_int8[sgl_shape]``: ``sgl`` when vLLM's ``check_cpu_sgl_kernel``
      accepts a tile-aligned int8 weight (AMX), else ``onednn``.

    Source: vllm/platforms/cpu.py::import_kernels,
    vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm and
    check_cpu_sgl_kernel (all run, not re-implemented).
    """
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    out = {KERNEL_LIBRARY: _loaded_library()}
    for op in PROBED_OPS:
        out[op_decision(op)] = OP_PRESENT if compat.has_custom_op(op) else OP_ABSENT
    with torch.device("cpu"):
        for dtype in PROBED_DTYPES:
            out[gemm_decision(dtype)] = _dispatch_outcome(dtype, PROBE_SHAPE_GENERAL)
            out[gemm_decision(dtype, True)] = _dispatch_outcome(dtype, PROBE_SHAPE_SGL)
    n, k = PROBE_SHAPE_SGL
    out[W8A8_INT8_SGL] = GEMM_SGL if check_cpu_sgl_kernel(n, k, torch.int8) else GEMM_ONEDNN
    return tuple(sorted(out.items()))


def host_target(device: str | torch.device = "cpu", env: Mapping[str, str] | None = None) -> Target:
    """:meth:`Target.detect` plus, on CPU, vLLM's own kernel decisions.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        env: kernel-selection variables to pin (see :meth:`Target.detect`).
    """
    target = Target.detect(device, env=env)
    if target.device_type != "cpu":
        return target

    return evolve(target, kernels=cpu_kernel_decisions())


def unquantized_gemm_kernel(size_n: int, size_k: int, dtype: torch.dtype) -> str:
    """The branch vLLM's ``dispatch_cpu_unquantized_gemm`` takes for an ``[N, K]``
    weight of ``dtype`` on this host: vLLM's own ``check_cpu_sgl_kernel`` for the
    shape, then the probed outcome for that class of shape and dtype."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    decisions = dict(cpu_kernel_decisions())
    sgl = bool(size_n and size_k and check_cpu_sgl_kernel(size_n, size_k, dtype))
    return decisions.get(gemm_decision(dtype, sgl), f"unprobed:{dtype}")


def w8a8_int8_kernel(size_n: int, size_k: int, input_symmetric: bool) -> str:
    """``sgl`` or ``onednn``: the branch vLLM's ``CPUInt8ScaledMMLinearKernel``
    takes (``process_weights_after_loading``) for an int8 ``[N, K]`` weight."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if input_symmetric and size_n and size_k and check_cpu_sgl_kernel(size_n, size_k, torch.int8):
        return "sgl"
    return "onednn"


def main(argv: list[str] | None = None) -> int:
    """Print this host's decisions as one JSON object."""

    ap = argparse.ArgumentParser(
        prog="python -m wcache.vllm.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.parse_args(argv)
    target = host_target("cpu")
    print(json.dumps({"isa": sorted(target.isa), "kernels": dict(target.kernels)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
