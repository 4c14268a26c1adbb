"""CPU builds of vLLM-CPU that tests and benchmarks can run on this host.

``native`` is whatever vLLM picks here. ``avx2`` makes a child process behave
as on an AVX2-only x86 host (vLLM loads ``_C_AVX2``; oneDNN and ATen capped to
AVX2) through the test-only ``sitecustomize`` in ``avx2_site/``. Only an
AVX512 host can emulate the smaller build; an AVX2 host's native build already
is ``avx2``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["BUILDS", "build_env", "probe"]

BUILDS = ("native", "avx2")
_SITE = Path(__file__).resolve().parent / "avx2_site"
#: One probe starts Python, imports vLLM and runs a few tiny dispatches (~10 s here).
PROBE_TIMEOUT_S = 300.0


def build_env(build: str) -> dict[str, str]:
    """Environment variables that select ``build`` in a child process.

    Raises:
        ValueError: an unknown build name.
    """
    if build == "native":
        return {}
    if build != "avx2":
        raise ValueError(f"unknown CPU build {build!r}; known: {BUILDS}")
    path = os.environ.get("PYTHONPATH", "")
    return {
        "WCACHE_EMULATE_CPU_BUILD": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "PYTHONPATH": f"{_SITE}{os.pathsep}{path}" if path else str(_SITE),
    }


@functools.cache
def probe(build: str = "native") -> dict:
    """What vLLM decides in a child process running ``build``:
    ``{"isa": [...], "kernels": {decision: outcome}}`` (``python -m wcache.vllm.probe``).

    Raises:
        RuntimeError: the probe process failed (its output is in the message).
    """
    env = {**os.environ, **build_env(build)}
    proc = subprocess.run(
        [sys.executable, "-m", "wcache.vllm.probe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"wcache.vllm.probe failed for build {build!r} "
            f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: vLLM ops each fixture format's CPU kernel calls (CPUWNA16 for the int4 formats,
#: the oneDNN scaled mm for W8A8 INT8); a build without one cannot serve it at all.
FORMAT_OPS = {
    "bf16": (),
    "awq": ("cpu_gemm_wna16",),
    "gptq": ("cpu_gemm_wna16",),
    "ct_w4a16": ("cpu_gemm_wna16",),
    "ct_w8a8_int8": ("create_onednn_scaled_mm_handler",),
}


def unservable_reason(fmt: str, decisions: dict[str, str]) -> str | None:
    """Why vLLM with these probed ``decisions`` cannot serve fixture format ``fmt``
    (naming the kernel library and the missing op), or ``None`` when it can."""
    from wcache.core import Target  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.stages.cpu_gemm import missing_op_reason  # noqa: PLC0415 (torch import ~2 s: only when called)

    return (
        missing_op_reason(
            Target("cpu", kernels=decisions), FORMAT_OPS[fmt], f"the {fmt} kernel", subject=fmt
        )
        if FORMAT_OPS[fmt]
        else None
    )
