"""Reference kernel decisions of x86 host classes, as vLLM 0.32 makes them.

wcache takes a host's decisions from vLLM on that host (:mod:`wcache.vllm.probe`).
These tables are what that probe printed for host classes, kept for the plan
docs and for plan-match tests of hosts the test machine is not (an AMX host,
say). They are never used to decide anything at run time.
"""

from __future__ import annotations

from typing import Any

from wcache.core import Target

__all__ = ["AVX512_BF16", "AMX", "AVX2", "reference_target"]

#: ``python -m wcache.vllm.probe`` on an AVX512-BF16 host without AMX (AMD EPYC).
AVX512_BF16 = {
    "cpu.kernel_library": "_C",
    "op.convert_weight_packed": "present",
    "op.convert_weight_packed_scale_zp": "present",
    "op.int4_scaled_mm_cpu": "present",
    "op.cpu_gemm_wna16": "present",
    "op.create_onednn_mm_handler": "present",
    "op.create_onednn_scaled_mm_handler": "present",
    "op.int8_scaled_mm_with_quant": "present",
    "op.weight_packed_linear": "present",
    "unquantized_gemm[bfloat16]": "onednn",
    "unquantized_gemm[bfloat16,sgl_shape]": "onednn",
    "unquantized_gemm[float16]": "torch_linear",
    "unquantized_gemm[float16,sgl_shape]": "torch_linear",
    "unquantized_gemm[float32]": "onednn",
    "unquantized_gemm[float32,sgl_shape]": "onednn",
    "w8a8_int8[sgl_shape]": "onednn",
}
#: What an AMX host decides differently (vLLM's check_cpu_sgl_kernel accepts the
#: small tile-aligned class); read from vLLM's source, no AMX host was probed.
AMX = {"unquantized_gemm[bfloat16,sgl_shape]": "sgl", "w8a8_int8[sgl_shape]": "sgl"}
#: The probe under vLLM's AVX2 build (``_C_AVX2``; oneDNN refuses bf16 and fp16).
AVX2 = {
    "cpu.kernel_library": "_C_AVX2",
    "op.convert_weight_packed": "absent",
    "op.convert_weight_packed_scale_zp": "absent",
    "op.int4_scaled_mm_cpu": "absent",
    "op.cpu_gemm_wna16": "absent",
    "op.create_onednn_mm_handler": "present",
    "op.create_onednn_scaled_mm_handler": "present",
    "op.int8_scaled_mm_with_quant": "absent",
    "op.weight_packed_linear": "absent",
    "unquantized_gemm[bfloat16]": "torch_linear",
    "unquantized_gemm[bfloat16,sgl_shape]": "torch_linear",
    "unquantized_gemm[float16]": "torch_linear",
    "unquantized_gemm[float16,sgl_shape]": "torch_linear",
    "unquantized_gemm[float32]": "onednn",
    "unquantized_gemm[float32,sgl_shape]": "onednn",
    "w8a8_int8[sgl_shape]": "onednn",
}


def reference_target(
    isa: Any = ("avx512", "avx512_bf16"), env: Any = (), **decisions: str
) -> Target:
    """A CPU Target of a reference host class: AVX512-BF16 decisions, then the AMX
    ones when ``"amx"`` is in ``isa``, then ``decisions`` (pass ``**AVX2`` for an
    AVX2-only host)."""
    kernels = {**AVX512_BF16, **(AMX if "amx" in isa else {}), **decisions}
    return Target("cpu", isa=frozenset(isa), env=dict(env), kernels=kernels)
