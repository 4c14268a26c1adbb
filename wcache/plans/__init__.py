"""Plans, one module per quantization method; importing this package registers them.

Public API: :func:`plan_for`, :func:`all_plans`, :func:`register`.
"""

from wcache.plans.registry import all_plans, plan_for, refuse, refused, register  # noqa: F401

# Each module below registers its plans at import. Order matters within a
# method: earlier plans are preferred (as in vLLM's kernel lists).
_PLAN_MODULES = (
    "unquantized", "awq", "gptq", "compressed_tensors", "kv_cache", "attention",  # CPU (issue 2)
    "marlin", "fp8", "mxfp8", "nvfp4",                                  # CUDA layouts (issue 3)
)


def _import_plan_modules() -> None:
    import importlib
    import importlib.util

    for mod in _PLAN_MODULES:
        name = f"wcache.plans.{mod}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


_import_plan_modules()
