"""Online MXFP8 quantization stages (the Marlin layout lives in :mod:`wcache.stages.marlin`).

MXFP8: float8_e4m3fn values with one E8M0 scale (a biased power-of-two
exponent, stored as uint8) per 32 values along K.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, WcacheError, stage
from wcache.stages.common import high_precision_weight

__all__ = ["MXFP8_BLOCK_SIZE", "E8M0_BIAS", "Mxfp8LayoutError", "mxfp8_e4m3_quantize", "quantize"]

#: Values per E8M0 scale along K (``MXFP8_BLOCK_SIZE``).
MXFP8_BLOCK_SIZE = 32
#: E8M0 exponent bias: code ``c`` means ``2 ** (c - 127)``.
E8M0_BIAS = 127.0
#: Largest E8M0 code used (254; 255 is NaN).
E8M0_MAX_CODE = 254.0
MXFP8_VALUE_DTYPE = torch.float8_e4m3fn


class Mxfp8LayoutError(WcacheError, ValueError):
    """K is not a multiple of the MX block size."""

    code = "mxfp8-layout"


def mxfp8_e4m3_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8.

    Args:
        x: ``[N, K]`` (or ``[..., K]``) bf16/fp16/fp32, ``K % 32 == 0``.

    Returns:
        ``(q [N, K] float8_e4m3fn, scales [N, K // 32] uint8 E8M0 codes
        = clamp(ceil(log2(amax / 448)) + 127, 0, 254))``.

    Raises:
        Mxfp8LayoutError: ``K % 32 != 0``.

    Source: ``mxfp8_utils._mxfp8_e4m3_quantize_torch`` (``is_sf_swizzled_layout=False``).
    """
    if x.shape[-1] % MXFP8_BLOCK_SIZE:
        raise Mxfp8LayoutError(
            f"MXFP8 needs K divisible by {MXFP8_BLOCK_SIZE}, got "
            f"K={x.shape[-1]}; this layer cannot use MXFP8"
        )
    shape = x.shape
    blocks = x.to(torch.float32).view(*shape[:-1], shape[-1] // MXFP8_BLOCK_SIZE, MXFP8_BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    fp8_max = torch.finfo(MXFP8_VALUE_DTYPE).max
    biased = (torch.ceil(torch.log2(amax / fp8_max)) + E8M0_BIAS).clamp(0, E8M0_MAX_CODE)
    descale = torch.exp2(biased - E8M0_BIAS)
    q = (blocks / descale.unsqueeze(-1)).view(shape).to(MXFP8_VALUE_DTYPE)
    return q, biased.to(torch.uint8).view(*shape[:-1], -1)


@stage(
    "mxfp8.quantize",
    Tag.TRANSFORM,
    reads=("weight",),
    writes=("weight", "weight_scale"),
    source="Mxfp8OnlineLinearMethod.process_weights_after_loading: mxfp8_e4m3_quantize",
)
def quantize(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``weight [N, K]`` -> ``weight [N, K]`` float8_e4m3fn and
    ``weight_scale [N, K/32]`` uint8 (E8M0).

    Source: Mxfp8OnlineLinearMethod.process_weights_after_loading: mxfp8_e4m3_quantize
    """
    q, s = mxfp8_e4m3_quantize(high_precision_weight(tensors, config, "online MXFP8"))
    return StageOut(tensors={"weight": q, "weight_scale": s})
