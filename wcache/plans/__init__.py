"""Plans, one module per quantization method; importing this package registers them.

Public API: :func:`plan_for`, :func:`all_plans`, :func:`register`.
"""

import importlib
from collections.abc import Iterable

from wcache.plans.registry import (  # noqa: F401 (re-exported)
    PlanArgumentError,
    all_plans,
    plan_for,
    refuse,
    refused,
    register,
)

#: Every plan module, imported (and so registered) here. Order matters within a
#: method: earlier plans are preferred (as in vLLM's kernel lists).
#: tests/plans/test_registry.py checks that this names every module under
#: wcache/plans/ that registers a plan.
PLAN_MODULES = (
    "unquantized",
    "awq",
    "gptq",
    "compressed_tensors",
    "kv_cache",
    "attention",  # CPU (issue 2)
    "marlin",
    "fp8",
    "mxfp8",
    "nvfp4",  # CUDA layouts (issue 3)
    "machete",
    "cutlass_int8",  # the kernels vLLM picks on Hopper
    "fused_moe",  # fused MoE, CUDA and CPU (issue 42)
    "mxfp4",  # canonical MXFP4 MoE on Marlin, GPT-OSS MXFP4 refused (issue 46)
    "marlin_moe",  # int4/int8 fused MoE on Marlin (issue 46)
)


def _import_plan_modules(names: Iterable[str]) -> None:
    """Import ``wcache.plans.<name>`` for each name.

    Raises:
        ModuleNotFoundError: a listed module is missing (never skipped silently).
    """
    for name in names:
        importlib.import_module(f"wcache.plans.{name}")


_import_plan_modules(PLAN_MODULES)
