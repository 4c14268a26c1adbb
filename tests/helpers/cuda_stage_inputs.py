"""Inputs shared by the CUDA stage tests (tests/stages/test_<family>.py): seeded
generators, FP8 bit patterns, layer configs."""

from __future__ import annotations

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec, Target

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
H200 = Target("cuda", (9, 0))

#: float8_e4m3fn NaN bit patterns; drawn FP8 bytes avoid them.
FP8_NAN_BITS = (0x7F, 0xFF)


def seeded_gen(seed):
    return torch.Generator().manual_seed(seed)


def fp8_from_bits(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int32)
    for nan in FP8_NAN_BITS:
        b = torch.where(b == nan, torch.zeros_like(b), b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def cfg(method="gptq", k=128, n=128, bits=4, g=-1, zp=False, dtype="bfloat16", extra=()):
    return LayerConfig(
        QuantSpec(method, num_bits=bits, group_size=g, zero_point=zp),
        size_k=k,
        size_n=n,
        params_dtype=dtype,
        extra=extra,
    )
