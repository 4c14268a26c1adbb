"""Inputs shared by the CPU stage tests (tests/stages/test_<family>.py): seeded
tensors, layer configs, the host targets, a stage runner."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec, Stage, StageOut
from wcache.stages import (
    cpu_wna16,
)

vllm = pytest.importorskip("vllm")


from vllm.scalar_type import scalar_types  # noqa: E402 (after pytest.importorskip)

from tests.helpers import vllm_layers  # noqa: E402  (one gloo world per session)
from wcache.vllm.probe import host_target  # noqa: E402 (after pytest.importorskip)

HOST = host_target("cpu", env={})

#: this host with vLLM's w4a8 layout switched off (VLLM_CPU_INT4_W4A8=0): the w4a16
#: layout on any host, with this host's isa_hint.
HOST_W4A16 = host_target("cpu", env={"VLLM_CPU_INT4_W4A8": "0"})
NON_AMX = vllm_layers.synthetic_target()

#: an AMX host with vLLM's defaults: CPUWNA16 picks its w4a8 layout for bf16.
AMX = vllm_layers.synthetic_target(("amx", "avx512", "avx512_bf16"))

#: Whether vLLM's loaded kernel library has the w4a8 layout's ops (its ``_C`` only).
HAS_W4A8_OPS = all(HOST.kernel(f"op.{op}") == "present" for op in cpu_wna16.W4A8_OPS)

#: Skip reasons name the kernel library and the op it lacks (tests/test_cpu_builds.py)
LIBRARY = HOST.kernel("cpu.kernel_library")
BF16 = torch.bfloat16

#: A dtype vLLM's dispatch gives to oneDNN on this host (bf16 unless oneDNN refuses
#: it here, as on AVX2-only hosts; fp32 is oneDNN everywhere vLLM-CPU runs on x86).
ONEDNN_DTYPE = BF16 if HOST.kernel("unquantized_gemm[bfloat16]") == "onednn" else torch.float32


def seeded_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int32(seed: int, shape) -> torch.Tensor:
    return torch.randint(
        -(2**31), 2**31 - 1, tuple(shape), dtype=torch.int32, generator=seeded_gen(seed)
    )


def module_of(**tensors: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in tensors.items():
        m.register_parameter(k, torch.nn.Parameter(v.clone(), requires_grad=False))
    return m


def run_stage(st_: Stage, tensors, config, target=NON_AMX, recorded=None) -> StageOut:
    return st_(
        types.MappingProxyType(dict(tensors)),
        config,
        target,
        types.MappingProxyType(dict(recorded or {})),
    )


def layer_cfg(method="awq", k=128, n=64, g=32, dtype="bfloat16", **kw) -> LayerConfig:
    return LayerConfig(QuantSpec(method, num_bits=4, group_size=g, **kw), k, n, dtype)


# sizes: size_k and size_n multiples of 32 (CPUWNA16), groups dividing size_k
shapes = st.tuples(
    st.integers(1, 6).map(lambda i: 32 * i),
    st.integers(1, 4).map(lambda i: 32 * i),
    st.sampled_from([-1, 32]),
    st.integers(0, 2**16),
)


def vllm_cpu_kernel(k, n, g, zero_points, act=BF16):
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    cfg = MPLinearLayerConfig(
        full_weight_shape=(k, n),
        partition_weight_shape=(k, n),
        weight_type=scalar_types.uint4 if zero_points else scalar_types.uint4b8,
        act_type=act,
        group_size=g,
        zero_points=zero_points,
    )
    return CPUWNA16LinearKernel(
        cfg, w_q_param_name="qweight", w_s_param_name="scales", w_zp_param_name="qzeros"
    )
