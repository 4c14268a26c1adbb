"""wcache/stages/kv_cache.py: the KV-cache dtype predicates equal vLLM's."""

from __future__ import annotations

import pytest

from wcache.stages import (
    kv_cache,
)

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("vllm_world")


@pytest.mark.parametrize(
    "dtype",
    [
        "auto",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "bfloat16",
    ],
)
def test_kv_cache_dtype_predicates_match_vllm(dtype):
    """is_quantized_kv_cache / uses_per_token_head_scales equal vLLM's functions."""
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    assert is_quantized_kv_cache(dtype) == kv_cache.is_quantized_kv_cache(dtype)
    assert kv_cache_uses_per_token_head_scales(dtype) == kv_cache.uses_per_token_head_scales(dtype)
