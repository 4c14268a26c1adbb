"""Reviewer's test: the priming engine (wcache.vllm.prime_engine, an LLM(...)) and a
`vllm serve` engine given the very same arguments get different compile keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL = Path(os.path.expanduser("~/.cache/wcache/fixtures/smollm2-135m-instruct-bf16"))


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs the bf16 SmolLM2 fixture")
def test_same_arguments_give_the_same_config_hash_for_llm_and_vllm_serve():
    """BUG: LLM() builds with UsageContext.LLM_CLASS, `vllm serve` with OPENAI_API_SERVER;
    their default max_num_batched_tokens/max_num_seqs differ (CPU: 4096/256 vs 2048/128;
    H200: 16384 vs 8192 tokens) and SchedulerConfig.compute_hash covers both, so a
    --prime-compile bundle is 'artifacts-stale' (config_hash) for every `vllm serve`
    engine started with the serve's own arguments."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from wcache.vllm.prime_engine import engine_kwargs

    kw = engine_kwargs(str(MODEL), ["--dtype", "bfloat16", "--max-model-len", "512"])
    llm = EngineArgs(**kw).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    srv = EngineArgs(**kw).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    assert (llm.scheduler_config.max_num_batched_tokens, llm.scheduler_config.max_num_seqs) == \
        (srv.scheduler_config.max_num_batched_tokens, srv.scheduler_config.max_num_seqs)
    assert llm.compute_hash() == srv.compute_hash()


@pytest.mark.skipif(not MODEL.is_dir(), reason="needs the bf16 SmolLM2 fixture")
def test_an_eager_engine_has_another_config_hash():
    """Fact check (cosmetic finding): an --enforce-eager engine's config_hash differs from a
    compiled one's, so against a primed daemon every eager engine logs artifacts-stale
    (WARNING) although it never compiles; the loader does not check the compile mode first."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    kw = {"model": str(MODEL), "dtype": "bfloat16", "max_model_len": 512}
    eager = EngineArgs(**kw, enforce_eager=True).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    comp = EngineArgs(**kw).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    assert eager.compute_hash() != comp.compute_hash()
