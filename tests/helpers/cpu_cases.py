"""Targets and hypothesis strategies of real vLLM 0.32 CPU layers, shared by
the CPU plan tests (tests/plans/test_cpu_plan_properties.py, the plan modules'
tests) and tests/plans/test_registry.py. Needs vLLM: importing
this module skips the importing test module without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from wcache.vllm.probe import host_target

#: this host as vLLM decides on it, with the kernel-selection env pinned to vLLM's defaults.
HOST = host_target("cpu", env={})
#: this host with vLLM's CPUWNA16 w4a8 layout off (VLLM_CPU_INT4_W4A8=0): the w4a16
#: layout on any host (tests that exercise w4a16 stages set the same env for vLLM).
HOST_W4A16 = host_target("cpu", env={"VLLM_CPU_INT4_W4A8": "0"})
#: the probed decisions this process runs under, for skip reasons and test ids.
HOST_LIBRARY = HOST.kernel("cpu.kernel_library")
AVX512 = vl.synthetic_target()
AVX2 = vl.synthetic_target((), **vl.AVX2_DECISIONS)
BF16 = torch.bfloat16
CPU_PLAN_IDS = (
    "unquantized/none@1",
    "unquantized/onednn@1",
    "unquantized/torch_linear@1",
    "awq/cpu_wna16@1",
    "awq/cpu_wna16_w4a8@1",
    "gptq/cpu_wna16@1",
    "gptq/cpu_wna16_w4a8@1",
    "ct_w4a16/cpu_wna16@1",
    "ct_w4a16/cpu_wna16_w4a8@1",
    "ct_w8a8_int8/onednn@1",
    "ct_w8a8_int8/sgl@1",
    "kv_cache/scales@1",
)
AMX_W4A8_OFF = vl.synthetic_target(
    ("amx", "avx512", "avx512_bf16"), env={"VLLM_CPU_INT4_W4A8": "0"}
)
AMX = vl.synthetic_target(("amx", "avx512", "avx512_bf16"))


# --------------------------------------------------------------------------- strategies

k32 = st.integers(1, 4).map(lambda i: 64 * i)
#: size_k for the CPUWNA16 families: multiples of 64 that vLLM's w4a8 layout can
#: block with any drawn group (its op needs size_k % min(group, 128) == 0, so 192
#: with group -1 fails in vLLM itself on AMX; tests/plans covers that refusal).
k_wna16 = st.sampled_from([64, 128, 256, 384])
n32 = st.integers(1, 3).map(lambda i: 32 * i)
group = st.sampled_from([-1, 32, 64])
scale_value = st.one_of(st.just(-1.0), st.floats(0.0625, 4.0, width=32))

FAMILIES = {
    "unquantized_linear": st.builds(
        vl.unquantized_linear,
        k32,
        n32,
        st.sampled_from([BF16, torch.float16, torch.float32]),
        st.booleans(),
    ),
    "embedding": st.builds(
        vl.unquantized_embedding,
        st.integers(1, 130),
        n32,
        st.sampled_from([BF16, torch.float16, torch.float32]),
    ),
    "awq": st.builds(vl.awq_linear, k_wna16, n32, group, st.just(BF16), st.booleans()),
    "gptq": st.builds(vl.gptq_linear, k_wna16, n32, group, st.just(BF16), st.booleans()),
    "ct_w4a16": st.builds(
        vl.ct_w4a16_linear,
        k_wna16,
        n32,
        st.sampled_from([32, 64]),
        st.booleans(),
        st.just(BF16),
        st.booleans(),
    ),
    # widths sum to a multiple of 32: vLLM's AMX SGL int8 kernel fails itself otherwise
    # (tests/plans covers that refusal)
    "ct_w8a8_int8": st.builds(
        vl.ct_w8a8_int8_linear,
        st.integers(1, 4).map(lambda i: 16 * i),
        st.lists(st.integers(1, 3).map(lambda i: 16 * i), min_size=1, max_size=3)
        .map(tuple)
        .filter(lambda w: sum(w) % 32 == 0),
        st.sampled_from(["tensor", "channel"]),
        st.booleans(),
        st.booleans(),
        st.just(BF16),
        st.booleans(),
    ),
    # a quantized cache with only v_scale set is invalid (vLLM asserts; see bad inputs)
    "kv_cache": st.builds(
        vl.kv_cache_layer,
        st.sampled_from(["auto", "fp8", "fp8_e5m2", "int8_per_token_head"]),
        scale_value,
        scale_value,
        scale_value,
        scale_value,
    ).filter(
        lambda c: not (c.extra["kv"][0] != "auto" and c.extra["kv"][1] < 0 < c.extra["kv"][2])
    ),
}


def dict_diff(a: dict, b: dict) -> dict:
    """The keys whose values differ between ``a`` and ``b``: ``{key: (a[key], b[key])}``."""
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
