"""The ``gpu`` tier: every test under tests/gpu is marked ``gpu`` and skipped
without CUDA. Run on the H200 with ``python -m pytest tests/gpu -q -m gpu``.

Helpers are handed to the tests as fixtures (``checkpoints``, ``fp8_forward``):
synthetic checkpoint-format layers for every method a plan exists for, and the
CUTLASS FP8 forward through ``torch._scaled_mm``. Nothing here imports vLLM or
hypothesis.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec
from wcache.stages.packing import pack_awq, pack_int32

_HERE = Path(__file__).resolve().parent
HAVE_CUDA = torch.cuda.is_available()
#: Dry run of this tier's logic on CPU tensors (``WCACHE_GPU_TIER_ON_CPU=1``), for
#: developing the tests without a GPU; it proves nothing about CUDA. The cuda_ipc
#: test still needs a GPU.
DRY_RUN_ENV = "WCACHE_GPU_TIER_ON_CPU"
DRY_RUN = os.environ.get(DRY_RUN_ENV) == "1" and not HAVE_CUDA

#: Group size of the synthetic int4 checkpoints (AWQ/GPTQ/CT default).
GROUP_SIZE = 128
#: float8_e4m3fn NaN bit patterns (S.1111.111); synthetic fp8 bytes avoid them.
FP8_NAN_BITS = (0x7F, 0xFF)
#: Largest finite float8_e4m3fn value (dynamic activation scales divide by it).
FP8_MAX = 448.0
#: Positive scale range of synthetic checkpoints: small, like trained models.
SCALE_LOW, SCALE_SPAN = 1e-3, 2e-2
#: Smallest activation amax of the dynamic FP8 quantization (vLLM clamps likewise
#: so an all-zero row does not divide by zero).
ACT_AMAX_FLOOR = 1e-12
#: NVFP4: values per FP8 block scale along K.
NVFP4_BLOCK = 16


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="gpu tier: torch sees no CUDA device")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not HAVE_CUDA and not DRY_RUN:
                item.add_marker(skip)


# --------------------------------------------------------------------------- checkpoints


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nibbles(g: torch.Generator, shape: tuple[int, ...], bits: int = 4) -> torch.Tensor:
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.int32)


def _scales(g: torch.Generator, shape: tuple[int, ...], dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.rand(shape, generator=g) * SCALE_SPAN + SCALE_LOW).to(dtype)


def fp8_bits(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random finite float8_e4m3fn values drawn as bit patterns."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    for nan in FP8_NAN_BITS:
        b = torch.where(b == nan, torch.zeros_like(b), b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def _config(method: str, n: int, k: int, **quant) -> LayerConfig:
    widths = quant.pop("logical_widths", (n,))
    dtype = quant.pop("params_dtype", "bfloat16")
    return LayerConfig(
        QuantSpec(method, **quant),
        size_k=k,
        size_n=n,
        params_dtype=dtype,
        has_bias=False,
        name=f"{method}.layer",
        extra=(("logical_widths", tuple(widths)),),
    )


def checkpoint(
    method: str, n: int, k: int, seed: int = 0, strategy: str | None = None
) -> tuple[LayerConfig, dict[str, torch.Tensor]] | None:
    """A synthetic checkpoint-format linear layer (CPU tensors) and its config, or
    None for a method this tier has no synthetic layer for (attention, KV cache, MoE).

    Shapes follow each format: AWQ ``qweight [K, N/8]``; GPTQ ``qweight [K/8, N]``;
    CT W4A16 ``weight_packed [N, K/8]``; CT W8A8 INT8 ``weight [N, K]`` int8; online
    FP8/MXFP8 ``weight [N, K]`` bf16; serialized FP8 ``weight [N, K]`` fp8 with
    per-shard ``weight_scale``/``input_scale`` (two shards); block FP8
    ``weight_scale_inv [N/128, K/128]``; NVFP4 ``weight [N, K/2]`` uint8 with
    ``weight_scale [N, K/16]`` fp8, ``weight_scale_2``/``input_scale`` fp32 ``[1]``.
    """
    g = _gen(seed)
    groups = k // GROUP_SIZE
    if method == "unquantized":
        return _config(method, n, k), {"weight": torch.randn(n, k, generator=g).bfloat16()}
    if method == "awq":
        q, zp = _nibbles(g, (k, n)), _nibbles(g, (groups, n))
        return (
            _config(
                method,
                n,
                k,
                num_bits=4,
                group_size=GROUP_SIZE,
                zero_point=True,
                params_dtype="float16",
            ),
            {
                "qweight": pack_awq(q, 4),
                "qzeros": pack_awq(zp, 4),
                "scales": _scales(g, (groups, n), torch.float16),
            },
        )
    if method == "gptq":
        q = _nibbles(g, (k, n))
        return (
            _config(method, n, k, num_bits=4, group_size=GROUP_SIZE, params_dtype="float16"),
            {
                "qweight": pack_int32(q.t().contiguous(), 4, -1).t().contiguous(),
                "qzeros": pack_int32(torch.full((groups, n), 7, dtype=torch.int32), 4, -1),
                "scales": _scales(g, (groups, n), torch.float16),
            },
        )
    if method == "ct_w4a16":
        q = _nibbles(g, (n, k))
        return (
            _config(method, n, k, num_bits=4, group_size=GROUP_SIZE, strategy="group"),
            {
                "weight_packed": pack_int32(q, 4, -1),
                "weight_scale": _scales(g, (n, groups)),
                "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            },
        )
    if method == "ct_w8a8_int8":
        return (
            _config(method, n, k, num_bits=8, act_bits=8, strategy="channel"),
            {
                "weight": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                "weight_scale": _scales(g, (n, 1), torch.float32),
            },
        )
    if method in ("fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "mxfp8"):
        strat = {
            "fp8_per_tensor": "tensor",
            "fp8_per_channel": "channel",
            "fp8_per_block": "block",
            "mxfp8": None,
        }[method]
        return (
            _config(method, n, k, num_bits=8, act_bits=8, strategy=strat),
            {"weight": (torch.randn(n, k, generator=g) * 0.05).bfloat16()},
        )
    if method in ("fp8", "ct_w8a8_fp8"):
        strat = strategy or "tensor"
        if strat == "block":
            bn, bk = -(-n // 128), -(-k // 128)
            return (
                _config(method, n, k, num_bits=8, act_bits=8, strategy="block", static_input=False),
                {
                    "weight": fp8_bits(g, (n, k)),
                    "weight_scale_inv": _scales(g, (bn, bk), torch.float32),
                },
            )
        half = n // 2
        widths = (half, n - half)
        scale = (
            _scales(g, (len(widths),), torch.float32)
            if strat == "tensor"
            else _scales(g, (n, 1), torch.float32)
        )
        return (
            _config(
                method,
                n,
                k,
                num_bits=8,
                act_bits=8,
                strategy=strat,
                static_input=True,
                logical_widths=widths,
            ),
            {
                "weight": fp8_bits(g, (n, k)),
                "weight_scale": scale,
                "input_scale": _scales(g, (len(widths),), torch.float32),
            },
        )
    if method == "modelopt_fp4":
        return (
            _config(method, n, k, num_bits=4, act_bits=4, group_size=NVFP4_BLOCK),
            {
                "weight": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(
                    torch.uint8
                ),
                "weight_scale": _scales(g, (n, k // NVFP4_BLOCK), torch.float32).to(
                    torch.float8_e4m3fn
                ),
                "weight_scale_2": _scales(g, (1,), torch.float32),
                "input_scale": _scales(g, (1,), torch.float32),
            },
        )
    return None


def module_with(tensors: dict[str, torch.Tensor], device: torch.device | str) -> torch.nn.Module:
    """A plain module holding copies of ``tensors`` on ``device`` as frozen Parameters."""
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_parameter(name, torch.nn.Parameter(t.to(device, copy=True), requires_grad=False))
    return m


# --------------------------------------------------------------------------- FP8 forward


def scaled_mm_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The CUTLASS FP8 layer's forward through ``torch._scaled_mm``.

    Activations are quantized dynamically (per tensor with a per-tensor weight
    scale, per token with a per-channel one, as vLLM pairs them; a static
    ``layer.input_scale`` tensor is used when the plan left one), padded along K
    to the weight's ``K16``; the ``[M, N16]`` output is sliced to
    ``layer.logical_output_size``.

    Args:
        layer: holds ``weight [K16, N16]`` float8_e4m3fn column-major,
            ``weight_scale`` (0-d/[1] or ``[N16, 1]`` fp32) and
            ``logical_output_size``.
        x: ``[M, K]`` bfloat16 on the layer's device.

    Returns:
        ``[M, logical_output_size]`` bfloat16.

    Source: vLLM ``CutlassFP8ScaledMMLinearKernel.apply_weights`` (``cutlass_scaled_mm``
    then ``output[:, :logical_output_size]``).
    """
    w = layer.weight
    k16, _ = w.shape
    ws = layer.weight_scale.to(torch.float32)
    n = layer.logical_output_size
    x = torch.nn.functional.pad(x, (0, k16 - x.shape[-1]))
    per_channel = ws.numel() > 1
    static = getattr(layer, "input_scale", None)
    if isinstance(static, torch.Tensor) and not per_channel:
        xs = static.to(torch.float32).reshape(())
    elif per_channel:
        xs = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(ACT_AMAX_FLOOR) / FP8_MAX
    else:
        xs = x.abs().amax().float().clamp_min(ACT_AMAX_FLOOR) / FP8_MAX
    xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale_b = ws.reshape(1, -1).contiguous() if per_channel else ws.reshape(())
    out = torch._scaled_mm(
        xq, w, scale_a=xs.contiguous(), scale_b=scale_b, out_dtype=torch.bfloat16
    )
    return out[:, :n]


@pytest.fixture
def checkpoints():
    """``checkpoint(method, n, k, seed=0, strategy=None)`` and ``module_with``."""
    return checkpoint, module_with


@pytest.fixture
def fp8_forward():
    """:func:`scaled_mm_forward`."""
    return scaled_mm_forward


@pytest.fixture
def cuda():
    """``cuda:0`` (``cpu`` in a dry run)."""
    return torch.device("cpu") if DRY_RUN else torch.device("cuda:0")
