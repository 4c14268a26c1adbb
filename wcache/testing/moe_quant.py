"""Pure torch quantizers (and their reference dequantizers) for the int4 and FP4/FP8
microscaled MoE fixtures of :mod:`wcache.testing.moe_fixtures`.

Each quantizer takes one ``[size_n, size_k]`` float weight (``nn.Linear`` layout: an
expert's ``gate_proj``/``up_proj`` ``[moe_intermediate, hidden]`` or ``down_proj``
``[hidden, moe_intermediate]``) and returns the per-projection checkpoint tensors
that vLLM's MoE weight loader copies into one expert's slice of ``w13_*``/``w2_*``.
Every function is deterministic (no random state) and leaves its input unchanged.
Rounding is round-half-to-even (``torch.round``) in float32.

Formats:

* GPTQ v1 (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``), symmetric (uint4b8) or
  asymmetric (uint4 with zero points), optionally with activation order (``g_idx``
  a permutation of groups): :func:`gptq_quantize`.
* compressed-tensors ``pack-quantized`` W4A16, GROUP or CHANNEL:
  :func:`ct_w4a16_compress` (compressed-tensors' own compressor).
* OCP MXFP4 (E2M1 values, one E8M0 scale per 32 along K): :func:`mxfp4_quantize`
  (vLLM's canonical ``mxfp4`` expert layout) and :func:`gpt_oss_mxfp4_pack`
  (GPT-OSS's ``*_blocks``/``*_scales`` layout of the same bits).

AWQ GEMM and ModelOpt NVFP4 / MXFP8 reuse :mod:`wcache.testing.fixtures`'
``awq_quantize``, ``nvfp4_quantize`` and ``mxfp8_quantize``; their dequantizers are
here (:func:`dequantize_expert`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from wcache.errors import FixtureError
from wcache.stages.packing import pack_int32, unpack_int32
from wcache.testing import fixtures as fx

if TYPE_CHECKING:  # compressed-tensors is an optional extra, imported where used
    from compressed_tensors.quantization import QuantizationScheme

__all__ = [
    "GPTQ_V1_ZERO_OFFSET",
    "MXFP4_BLOCK",
    "E2M1_EMAX",
    "gptq_quantize",
    "ct_w4a16_scheme",
    "ct_w4a16_compress",
    "mxfp4_quantize",
    "gpt_oss_mxfp4_pack",
    "e2m1_decode",
    "dequantize_expert",
    "act_order_permutation",
]

INT4_BITS = fx.INT4_BITS
#: GPTQ v1 stores ``zero - 1`` in ``qzeros`` (AutoGPTQ's historical off-by-one); vLLM's
#: GPTQ kernels add the 1 back.
GPTQ_V1_ZERO_OFFSET = 1
#: Smallest asymmetric zero point written: v1 stores ``zero - 1``, and AutoGPTQ's
#: packer turns a stored -1 into 0xF...F that spills into the neighbouring nibbles.
GPTQ_ASYM_ZERO_MIN = 1
#: OCP MX block: values per E8M0 scale along K.
MXFP4_BLOCK = fx.MX_BLOCK
#: E2M1's largest exponent (6 = 1.5 * 2**2): the MX shared exponent is
#: ``floor(log2(amax)) - 2`` (OCP MX v1.0 section 6.3).
E2M1_EMAX = 2
#: Bytes of one GPT-OSS MXFP4 block: 32 E2M1 values, two a byte.
GPT_OSS_BLOCK_BYTES = MXFP4_BLOCK // 2


def _check(weight: torch.Tensor, multiple: int, what: str) -> tuple[int, int]:
    if weight.ndim != 2 or not weight.is_floating_point():
        raise FixtureError(
            f"{what}: expected a 2-D float [size_n, size_k] weight, got "
            f"{tuple(weight.shape)} {weight.dtype}; pass one expert projection"
        )
    size_n, size_k = weight.shape
    if size_k % multiple or size_n % fx.INT4_PACK_FACTOR:
        raise FixtureError(
            f"{what}: weight {tuple(weight.shape)} needs size_k a multiple of "
            f"{multiple} and size_n of {fx.INT4_PACK_FACTOR}; choose a group "
            "size that divides both the hidden and the expert width"
        )
    return size_n, size_k


def act_order_permutation(weight: torch.Tensor) -> torch.Tensor:
    """GPTQ's activation order for ``weight [size_n, size_k]``: input columns sorted by
    descending ``sum_n w[n, k]**2`` (ties by index).

    GPTQ sorts by the Hessian diagonal ``diag(X^T X)`` of calibration inputs; the
    checkpoint layout does not depend on where the ordering comes from, so the weight's
    own column energy stands in (no calibration data needed, deterministic).

    Returns:
        ``perm`` int64 ``[size_k]``: ``perm[i]`` is the column quantized ``i``-th.
    """
    energy = weight.to(torch.float32).pow(2).sum(dim=0)
    return torch.sort(-energy, stable=True).indices


def gptq_quantize(
    weight: torch.Tensor, group_size: int, *, sym: bool = True, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """GPTQ v1 int4 tensors for one projection: round-to-nearest, min-max.

    Groups: without act order, input ``k`` is in group ``k // G``; with act order the
    columns are taken in :func:`act_order_permutation` order and ``g_idx[perm[i]] =
    i // G`` (what GPTQ with ``desc_act: true`` and ``static_groups: false`` writes).
    Per group ``g`` and output ``n`` (float32):

    * symmetric: ``scale = max(max / 7, min / -8)`` (1 for an all-zero group),
      ``q = clamp(round(w / scale), -8, 7) + 8``, stored zero 8 (``qzeros`` nibble 7);
    * asymmetric: ``scale = max(max - min, 1e-5) / 15``,
      ``zero = clamp(round(-min / scale), 1, 15)``, ``q = clamp(round(w / scale) +
      zero, 0, 15)``, stored ``zero - 1``.

    The dequantized weight is ``(q[k] - zero[g_idx[k]]) * scale[g_idx[k]]``.

    Args:
        weight: ``[size_n, size_k]`` float.
        group_size: inputs per group; divides ``size_k``.
        sym: symmetric (uint4b8) or asymmetric (uint4 + zero points).
        act_order: write a permuted ``g_idx`` (``desc_act: true``).

    Returns:
        ``qweight`` int32 ``[size_k // 8, size_n]`` (packed along K, low nibble first);
        ``qzeros`` int32 ``[size_k // G, size_n // 8]`` (packed along N, ``zero - 1``);
        ``scales`` float16 ``[size_k // G, size_n]``; ``g_idx`` int32 ``[size_k]``.

    Raises:
        FixtureError: not 2-D float, or G does not divide size_k.

    Source: AutoGPTQ ``QuantLinear.pack`` (v1 ``zeros - 1``) and ``Quantizer.find_params``;
    vLLM ``quant_utils.gptq_quantize_weights`` (``act_order`` permutes ``g_idx``).
    """
    size_n, size_k = _check(weight, group_size, "gptq")
    w = weight.to(torch.float32)
    perm = act_order_permutation(w) if act_order else torch.arange(size_k)
    g_idx = torch.empty(size_k, dtype=torch.int64)
    g_idx[perm] = torch.arange(size_k) // group_size
    grouped = w[:, perm].reshape(size_n, size_k // group_size, group_size)
    w_min, w_max = grouped.amin(dim=-1).t(), grouped.amax(dim=-1).t()  # [K/G, N]
    if sym:
        scales = torch.maximum(w_max / fx.UINT4B8_MAX, w_min / fx.UINT4B8_MIN)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        zeros = torch.full_like(scales, fx.UINT4B8_BIAS, dtype=torch.int32)
    else:
        scales = (w_max - w_min).clamp(min=fx.AWQ_SCALE_MIN) / fx.UINT4_MAX
        zeros = torch.round(-w_min / scales).clamp(GPTQ_ASYM_ZERO_MIN, fx.UINT4_MAX).to(torch.int32)
    scales = scales.to(torch.float16).to(torch.float32)  # quantize against what is stored
    s_k, z_k = scales[g_idx], zeros[g_idx]  # [K, N]
    q = (torch.round(w.t() / s_k).to(torch.int32) + z_k).clamp(0, fx.UINT4_MAX)
    return {
        "qweight": pack_int32(q, INT4_BITS, 0).contiguous(),
        "qzeros": pack_int32(zeros - GPTQ_V1_ZERO_OFFSET, INT4_BITS, 1).contiguous(),
        "scales": scales.to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def ct_w4a16_scheme(group_size: int) -> QuantizationScheme:
    """compressed-tensors W4A16 scheme: int4 symmetric static weights, GROUP of
    ``group_size`` (CHANNEL when ``group_size`` is -1), no activation quantization.

    Source: compressed-tensors ``quant_scheme.W4A16`` preset.
    """
    from compressed_tensors.quantization import (  # noqa: PLC0415 (optional dependency (the fixtures extra))
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    grouped = group_size > 0
    args = QuantizationArgs(
        num_bits=INT4_BITS,
        type=QuantizationType.INT,
        symmetric=True,
        strategy=QuantizationStrategy.GROUP if grouped else QuantizationStrategy.CHANNEL,
        group_size=group_size if grouped else None,
        dynamic=False,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_w4a16_compress(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` W4A16 tensors for one projection.

    ``scale = max|w| / 7.5`` per group (or output channel) in the weight's dtype
    (compressed-tensors' ``calculate_qparams``), then ``q = clamp(round(w / scale), -8,
    7)`` in float32, offset by 8 and packed eight to an int32 along K.

    Args:
        weight: ``[size_n, size_k]`` float.
        group_size: inputs per scale; -1 for one scale per output channel.

    Returns:
        ``weight_packed`` int32 ``[size_n, size_k // 8]``; ``weight_scale`` (the
        weight's dtype) ``[size_n, size_k // G]`` or ``[size_n, 1]``; ``weight_shape``
        int64 ``[2]``.

    Raises:
        FixtureError: not 2-D float or G does not divide size_k.

    Source: compressed-tensors ``calculate_qparams`` and
    ``PackedQuantizationCompressor.compress``.
    """
    from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))
    from compressed_tensors.quantization.utils import calculate_qparams  # noqa: PLC0415 (optional dependency (the fixtures extra))

    _check(weight, group_size if group_size > 0 else 1, "ct_w4a16")
    scheme = ct_w4a16_scheme(group_size)
    if group_size > 0:
        grouped = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
        scale, zp = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme.weights)
    else:
        scale, zp = calculate_qparams(
            weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True), scheme.weights
        )
    return dict(
        PackedQuantizationCompressor.compress(
            {"weight": weight.to(torch.float32), "weight_scale": scale, "weight_zero_point": zp},
            scheme,
        )
    )


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (uint8, sign in bit 3)."""
    grid = torch.tensor(fx.FP4_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K / 2]`` uint8 -> ``[..., K]`` float32 (low nibble = even column)."""
    lo, hi = e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4)
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def mxfp4_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """OCP MXFP4 tensors for one projection (vLLM's canonical ``mxfp4`` layout).

    Per 32 inputs along K: ``e = clamp(floor(log2(amax)) - 2, -127, 127)`` (E8M0 shared
    exponent, ``2**e`` the scale), ``x = clamp(w / 2**e, -6, 6)`` rounded to the nearest
    E2M1 value (ties to the lower magnitude). An all-zero block gets the smallest scale.

    Args:
        weight: ``[size_n, size_k]`` float; 32 divides size_k.

    Returns:
        ``weight`` uint8 ``[size_n, size_k // 2]`` (two E2M1 codes a byte, even column in
        the low nibble); ``weight_scale`` uint8 ``[size_n, size_k // 32]`` (E8M0 bits,
        ``e + 127``).

    Raises:
        FixtureError: not 2-D float or 32 does not divide size_k.

    Source: OCP Microscaling Formats (MX) v1.0, section 6.3 (conversion); vLLM
    ``Mxfp4MoEMethod.create_weights`` (uint8 values and scales); transformers
    ``convert_moe_packed_tensors`` (nibble order, ``2**(scale - 127)``).
    """
    _check(weight, MXFP4_BLOCK, "mxfp4")
    w = weight.to(torch.float32)
    blocks = w.reshape(w.shape[0], -1, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = (torch.floor(torch.log2(amax)) - E2M1_EMAX).clamp(-fx.E8M0_BIAS, fx.E8M0_BIAS)
    scaled = (blocks / torch.exp2(exponent).unsqueeze(-1)).clamp(-fx.FP4_E2M1_MAX, fx.FP4_E2M1_MAX)
    codes = fx._fp4_codes(scaled).reshape(w.shape[0], -1)
    return {
        "weight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
        "weight_scale": (exponent + fx.E8M0_BIAS).to(torch.uint8),
    }


def gpt_oss_mxfp4_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPT-OSS's checkpoint layout of MXFP4 experts (``*_blocks``/``*_scales``).

    Args:
        weight: ``[num_experts, size_n, size_k]`` float, out-major (for GPT-OSS's
            ``gate_up_proj`` that is transformers' ``[E, hidden, 2 * inter]`` transposed;
            its gate/up rows stay interleaved, gate at even rows).

    Returns:
        ``blocks`` uint8 ``[E, size_n, size_k // 32, 16]``; ``scales`` uint8
        ``[E, size_n, size_k // 32]``: the bits of :func:`mxfp4_quantize`, reshaped.

    Raises:
        FixtureError: not 3-D, or 32 does not divide size_k.

    Source: openai/gpt-oss checkpoints (``mlp.experts.gate_up_proj_blocks``);
    transformers ``convert_moe_packed_tensors`` (its inverse); vLLM
    ``GptOssModel._load_weights_mxfp4`` (views blocks as ``[E, N, K / 2]``).
    """
    if weight.ndim != 3:
        raise FixtureError(
            f"gpt_oss_mxfp4_pack: expected [E, N, K], got "
            f"{tuple(weight.shape)}; pass the stacked experts"
        )
    parts = [mxfp4_quantize(w) for w in weight.unbind(0)]
    e, n, k = weight.shape
    return {
        "blocks": torch.stack([p["weight"] for p in parts]).reshape(
            e, n, k // MXFP4_BLOCK, GPT_OSS_BLOCK_BYTES
        ),
        "scales": torch.stack([p["weight_scale"] for p in parts]),
    }


def dequantize_expert(tensors: Mapping[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """The float32 ``[size_n, size_k]`` weight one quantized projection stands for.

    Args:
        tensors: the projection's tensors by local name, as the quantizers return them.
        fmt: ``awq``, ``gptq`` (any of sym/asym/act order), ``ct_w4a16``, ``nvfp4``,
            ``mxfp4`` or ``mxfp8``.

    Raises:
        FixtureError: unknown format.

    Source: AWQ ``(q - z) * s`` in AWQ order; GPTQ v1 ``(q - (z + 1)) * s[g_idx]``;
    compressed-tensors ``PackedQuantizationCompressor.decompress``; NVFP4
    ``e2m1 * weight_scale * weight_scale_2`` (ModelOpt); MX ``value * 2**(scale - 127)``.
    """
    if fmt == "awq":
        return fx.dequantize_linear(tensors, "awq")
    if fmt == "gptq":
        q = unpack_int32(tensors["qweight"], INT4_BITS, 0)  # [K, N]
        z = unpack_int32(tensors["qzeros"], INT4_BITS, 1) + GPTQ_V1_ZERO_OFFSET
        g = tensors["g_idx"].long()
        return ((q - z[g]) * tensors["scales"].to(torch.float32)[g]).t().contiguous()
    if fmt == "ct_w4a16":
        from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))

        n, k = (int(v) for v in tensors["weight_shape"])
        group = k // tensors["weight_scale"].shape[1]
        scheme = ct_w4a16_scheme(group if tensors["weight_scale"].shape[1] > 1 else -1)
        return PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"].to(
            torch.float32
        )
    if fmt == "nvfp4":
        values = _unpack_fp4(tensors["weight"])
        scale = tensors["weight_scale"].to(torch.float32).repeat_interleave(fx.NVFP4_BLOCK, 1)
        return values * scale * tensors["weight_scale_2"].to(torch.float32)
    if fmt in ("mxfp4", "mxfp8"):
        values = (
            _unpack_fp4(tensors["weight"])
            if fmt == "mxfp4"
            else tensors["weight"].to(torch.float32)
        )
        exponent = tensors["weight_scale"].to(torch.float32) - fx.E8M0_BIAS
        return values * torch.exp2(exponent).repeat_interleave(MXFP4_BLOCK, 1)
    raise FixtureError(f"cannot dequantize {fmt!r}; use awq, gptq, ct_w4a16, nvfp4, mxfp4 or mxfp8")
