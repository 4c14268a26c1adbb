"""Reference kernels for CUDA-only layouts: dequantize the processed tensors, then matmul.

Each ``*_forward(layer, config, x)`` reads a layer in the layout a plan produced
(Marlin, CUTLASS FP8, MXFP8-on-Marlin, NVFP4 CUTLASS) and returns what the real
kernel computes up to its accumulation order: the weight is dequantized to fp32
exactly (every step here is exact: integer unpacking, fp8/fp4 decoding, products
with power-of-two or single-rounding scales), cropped to the logical ``(K, N)``,
and multiplied in fp32. The matching ``*_checkpoint_forward`` dequantizes the
checkpoint-format tensors directly; equality of the two (bit for bit) shows the
layout is a faithful permutation of the checkpoint.

The CUTLASS FP8 reference slices the output with ``layer.logical_output_size``
and, like vLLM's ``apply_scaled_mm``, fails without it.
"""

from __future__ import annotations

import torch

from wcache.stages import marlin as M
from wcache.stages import nvfp4 as F4
from wcache.stages import packing as P

#: E2M1 code -> value (sign bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class MissingLogicalWidth(AssertionError):
    """The CUTLASS FP8 layer has no logical output width (vLLM: ``assert output_size``)."""


# --------------------------------------------------------------------------- inverses


def marlin_unrepack(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Marlin ``[Kp/16, Np*bits/2]`` int32 -> unpacked values ``[Kp, Np]`` int32."""
    pf = 32 // num_bits
    size_k = q.shape[0] * M.MARLIN_TILE
    size_n = q.shape[1] * pf // M.MARLIN_TILE
    vals = P.unpack_int32(q, num_bits, -1)  # [Kp/16, Np*16]
    perm = M.marlin_weight_perm(num_bits)
    flat = vals.reshape(-1, perm.numel())
    inv = torch.empty_like(flat)
    inv[:, perm] = flat
    t = M.MARLIN_TILE
    return inv.reshape(size_k // t, size_n // t, t, t).permute(0, 2, 1, 3).reshape(size_k, size_n)


def marlin_unpermute_scales(
    s: torch.Tensor, size_k: int, size_n: int, group_size: int
) -> torch.Tensor:
    """Inverse of :func:`wcache.stages.marlin.marlin_permute_scales`."""
    scale_perm, single = M.marlin_scale_perms()
    perm = list(scale_perm) if (group_size < size_k and group_size != -1) else list(single)
    flat = s.reshape(-1, len(perm))
    inv = torch.empty_like(flat)
    inv[:, perm] = flat
    return inv.reshape(-1, size_n)


def marlin_unzero_points(zp: torch.Tensor, size_n: int, num_bits: int) -> torch.Tensor:
    """Marlin zero points ``[G, Np/pf]`` -> values ``[G, Np]``."""
    scale_perm, _ = M.marlin_scale_perms()
    interleave = list(M._INTERLEAVE[num_bits])
    vals = P.unpack_int32(zp, num_bits, -1).reshape(-1, len(interleave))
    inv = torch.empty_like(vals)
    inv[:, interleave] = vals
    inv = inv.reshape(-1, len(scale_perm))
    out = torch.empty_like(inv)
    out[:, list(scale_perm)] = inv
    return out.reshape(-1, size_n)


def marlin_unpermute_bias(b: torch.Tensor) -> torch.Tensor:
    _, single = M.marlin_scale_perms()
    flat = b.reshape(-1, len(single))
    inv = torch.empty_like(flat)
    inv[:, list(single)] = flat
    return inv.reshape(b.shape)


def e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` uint8 (two E2M1 codes per byte, low nibble first) -> ``[R, 2C]`` fp32."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    mag = lut[codes & 0x7]
    return torch.where((codes & 0x8) != 0, -mag, mag)


# --------------------------------------------------------------------------- helpers


def _expand_groups(s: torch.Tensor, size_k: int) -> torch.Tensor:
    """``[G, N]`` group scales -> ``[size_k, N]`` (one row per K)."""
    return s.repeat_interleave(size_k // s.shape[0], dim=0)


def _matmul(x: torch.Tensor, w_kn: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # contiguous: BLAS picks its summation order by layout; equal values, equal order
    out = x.to(torch.float32) @ w_kn.contiguous()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def _int_zero(num_bits: int, zero_point: bool) -> int:
    # symmetric uint4b8 / uint8b128 carry a fixed bias of 2**(bits-1)
    return 0 if zero_point else 2 ** (num_bits - 1)


# --------------------------------------------------------------------------- Marlin int


_MARLIN_NAMES = {
    "awq": ("qweight", "scales", "qzeros"),
    "gptq": ("qweight", "scales", "qzeros"),
    "ct_w4a16": ("weight_packed", "weight_scale", "weight_zero_point"),
}


def marlin_int_weight(layer: torch.nn.Module, config) -> torch.Tensor:
    """Dequantized ``[K, N]`` fp32 weight of a Marlin-layout integer layer."""
    q = config.quant
    wq, ws, wz = _MARLIN_NAMES[q.method]
    bits = q.num_bits
    qw = getattr(layer, wq)
    vals = marlin_unrepack(qw, bits)
    kp, np_ = vals.shape
    scales = marlin_unpermute_scales(getattr(layer, ws), kp, np_, q.group_size).float()
    zp_t = getattr(layer, wz, None)
    if zp_t is not None and zp_t.numel() > 0:
        zp = marlin_unzero_points(zp_t, np_, bits)
        zero = _expand_groups(zp, kp)
    else:
        zero = _int_zero(bits, False)
    w = (vals - zero).to(torch.float32) * _expand_groups(scales, kp)
    return w[: config.size_k, : config.size_n]


def marlin_int_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference ``marlin_gemm`` for AWQ/GPTQ/CT-W4A16 Marlin layouts: ``[..., K] -> [..., N]``."""
    bias = getattr(layer, "bias", None)
    if bias is not None:
        bias = marlin_unpermute_bias(bias)[: config.size_n]
    return _matmul(x, marlin_int_weight(layer, config), bias)


def int_checkpoint_weight(tensors: dict, config) -> torch.Tensor:
    """Dequantized ``[K, N]`` fp32 weight from AWQ/GPTQ/CT-W4A16 checkpoint tensors."""
    q = config.quant
    bits, k = q.num_bits, config.size_k
    if q.method == "awq":
        w_std, z_std = P.awq_to_standard(tensors["qweight"], tensors["qzeros"], bits)
        vals = P.unpack_int32(w_std.t().contiguous(), bits, -1).t()
        zero = _expand_groups(P.unpack_int32(z_std.t().contiguous(), bits, -1), k)
        scales = tensors["scales"]
    elif q.method == "gptq":
        vals = P.unpack_int32(tensors["qweight"].t().contiguous(), bits, -1).t()
        zero = _int_zero(bits, False)
        scales = tensors["scales"]
    else:
        vals = P.unpack_int32(tensors["weight_packed"], bits, -1).t()
        scales = tensors["weight_scale"].t()
        if q.zero_point:
            zero = _expand_groups(
                P.unpack_int32(tensors["weight_zero_point"].t().contiguous(), bits, -1), k
            )
        else:
            zero = _int_zero(bits, False)
    return (vals - zero).to(torch.float32) * _expand_groups(scales.float(), k)


def int_checkpoint_forward(tensors: dict, config, x: torch.Tensor) -> torch.Tensor:
    return _matmul(x, int_checkpoint_weight(tensors, config), tensors.get("bias"))


# --------------------------------------------------------------------------- FP8


def cutlass_fp8_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference ``cutlass_scaled_mm`` (weight dequantized; activations in high precision).

    Raises:
        MissingLogicalWidth: ``layer.logical_output_size`` is absent or None.
    """
    n = getattr(layer, "logical_output_size", None)
    if n is None:
        raise MissingLogicalWidth("logical_output_size is None (vLLM: assert output_size)")
    w = layer.weight  # [Kp, Np] column-major
    s = layer.weight_scale.float()
    w = w.float() * (s.reshape(1, -1) if s.numel() > 1 else s.reshape(()))
    return _matmul(x, w[: x.shape[-1], :n], getattr(layer, "bias", None))


def fp8_checkpoint_forward(
    weight_nk: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, K]`` fp8 with a 0-d/[1] or ``[N, 1]`` scale."""
    s = scale.float()
    w = weight_nk.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    return _matmul(x, w.t(), bias)


def block_fp8_weight(
    weight_nk: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    n, k = weight_nk.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return weight_nk.float() * s


def block_fp8_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference block-scaled FP8 GEMM: ``[N, K]`` fp8 with ``[N/128, K/128]`` scales."""
    return _matmul(
        x, block_fp8_weight(layer.weight, layer.weight_scale_inv).t(), getattr(layer, "bias", None)
    )


def fp8_marlin_weight(layer: torch.nn.Module, config) -> torch.Tensor:
    vals = marlin_unrepack(layer.weight, 8)  # bytes of W[n, k] at [k, n]
    kp, np_ = vals.shape
    fp8 = vals.to(torch.uint8).view(torch.float8_e4m3fn).float()
    s = marlin_unpermute_scales(layer.weight_scale, kp, np_, -1)
    s = s.float() / 2.0 ** M.fp8_exponent_bias(layer.weight_scale.dtype)
    return (fp8 * s)[: config.size_k, : config.size_n]


def fp8_marlin_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference FP8 weight-only ``marlin_gemm``."""
    bias = getattr(layer, "bias", None)
    if bias is not None:
        bias = marlin_unpermute_bias(bias)[: config.size_n]
    return _matmul(x, fp8_marlin_weight(layer, config), bias)


def mxfp8_marlin_weight(layer: torch.nn.Module, config) -> torch.Tensor:
    vals = marlin_unrepack(layer.weight, 8)
    kp, np_ = vals.shape
    fp8 = vals.to(torch.uint8).view(torch.float8_e4m3fn).float()
    s = layer.weight_scale  # [Kp/32, Np] e8m0
    s = s.view(-1, 4)[:, list(M.MXFP8_SCALE_REORDER)].reshape(s.shape).float()
    s = marlin_unpermute_scales(s, kp, np_, M.MXFP8_GROUP_SIZE)
    return (fp8 * _expand_groups(s, kp))[: config.size_k, : config.size_n]


def mxfp8_marlin_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference MXFP8 ``marlin_gemm``."""
    bias = getattr(layer, "bias", None)
    if bias is not None:
        bias = marlin_unpermute_bias(bias)[: config.size_n]
    return _matmul(x, mxfp8_marlin_weight(layer, config), bias)


def mxfp8_checkpoint_weight(q_nk: torch.Tensor, scales_u8: torch.Tensor) -> torch.Tensor:
    s = torch.exp2(scales_u8.float() - 127.0).repeat_interleave(M.MXFP8_GROUP_SIZE, dim=1)
    return q_nk.float() * s


# --------------------------------------------------------------------------- NVFP4


def nvfp4_weight(
    weight: torch.Tensor, scale_swizzled: torch.Tensor, global_scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """Dequantized ``[n, k]`` fp32 from a padded ``[Np, Kp/2]`` weight and swizzled scales."""
    vals = e2m1_decode(weight)[:n, :k]
    sf = F4.unswizzle_blockscale(scale_swizzled, n, k // F4.NVFP4_GROUP_SIZE).float()
    return vals * sf.repeat_interleave(F4.NVFP4_GROUP_SIZE, dim=1) * global_scale.float()


def nvfp4_linear_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference ``cutlass_scaled_fp4_mm`` with dequantized weight (activation unquantized)."""
    w = nvfp4_weight(
        layer.weight, layer.weight_scale, layer.weight_global_scale, config.size_n, config.size_k
    )
    return _matmul(x, w.t(), getattr(layer, "bias", None))


def nvfp4_moe_forward(layer: torch.nn.Module, config, x: torch.Tensor) -> torch.Tensor:
    """Reference CUTLASS NVFP4 experts, every token through every expert.

    GEMM1 = ``(x / a13[e]) @ dq(w13[e]).T * w13_weight_scale_2[e]`` (the fused alpha),
    SiLU-and-mul, GEMM2 likewise with ``a2``. Returns ``[E, T, H]``.
    """
    outs = []
    e_count, two_i, _ = layer.w13_weight.shape
    hidden = layer.w2_weight.shape[1]
    inter = layer.w2_weight.shape[2] * 2
    one = torch.ones((), dtype=torch.float32)
    for e in range(e_count):
        w13 = nvfp4_weight(layer.w13_weight[e], layer.w13_weight_scale[e], one, two_i, hidden)
        w2 = nvfp4_weight(layer.w2_weight[e], layer.w2_weight_scale[e], one, hidden, inter)
        h = (x.float() / layer.w13_input_scale[e]) @ w13.t() * layer.w13_weight_scale_2[e]
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        outs.append(
            ((a / layer.w2_input_scale[e]) @ w2.t() * layer.w2_weight_scale_2[e]).to(x.dtype)
        )
    return torch.stack(outs)
