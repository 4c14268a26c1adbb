"""Fixtures of the vLLM integration tests: ``vllm_cfg``, SmolLM2's VllmConfig with
vLLM's 1-rank world (module-scoped: one world per test module)."""

from __future__ import annotations

import tempfile

import pytest

from wcache.daemon.process import ENGINE_ARGS


@pytest.fixture(scope="module")
def vllm_cfg():
    """A VllmConfig for the bf16 SmolLM2 with vLLM's 1-rank world initialized."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import model_parallel_is_initialized

    from wcache.testing.fixtures import build
    from wcache.vllm.build import engine_config, init_distributed, prepare_platform

    cfg = engine_config(str(build("bf16")), list(ENGINE_ARGS))
    with prepare_platform(cfg), set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():  # the plan tests may have done it
            tmp = tempfile.mkdtemp(prefix="wcache-dist-")
            init_distributed(cfg, 0, 1, f"file://{tmp}/init")
        yield cfg
