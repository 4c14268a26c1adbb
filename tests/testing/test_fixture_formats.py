"""The GPU fixture formats (wcache.testing.fixtures.GPU_FORMATS) are what their
checkpoint formats say: values within the format's error, the tensors and dtypes vLLM
creates, and configs vLLM's own config classes parse (CPU; seconds)."""

from __future__ import annotations

import pytest
import torch

from wcache.testing import fixtures as fx

#: Relative Frobenius error of a round trip on N(0, 1) weights: FP4 E2M1 with FP8 block
#: scales keeps ~3 bits (measured ~0.10), MXFP8 and per-tensor FP8 ~3 mantissa bits.
NVFP4_MAX_REL_ERR, MXFP8_MAX_REL_ERR, FP8_MAX_REL_ERR = 0.15, 0.05, 0.05


def _weight(n=32, k=128, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _nvfp4_dequant(out):
    packed = out["weight"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    grid = torch.tensor(fx.FP4_E2M1_VALUES)
    values = grid[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    scale = out["weight_scale"].float() * out["weight_scale_2"]
    return (values.reshape(values.shape[0], -1, fx.NVFP4_BLOCK) * scale.unsqueeze(-1)).reshape(
        values.shape
    )


def test_nvfp4_round_trip_layout_and_scales():
    """NVFP4: uint8 [N, K/2] codes, fp8 [N, K/16] block scales, 0-d fp32 global and input
    scales; dequantized within the format's error; the global scale is amax / (6 * 448)."""
    w = _weight()
    out = fx.nvfp4_quantize(w, input_amax=3.0)
    assert (out["weight"].dtype, tuple(out["weight"].shape)) == (torch.uint8, (32, 64))
    assert (out["weight_scale"].dtype, tuple(out["weight_scale"].shape)) == (
        torch.float8_e4m3fn,
        (32, 8),
    )
    assert out["weight_scale_2"].shape == () and out["input_scale"].shape == ()
    assert float(out["weight_scale_2"]) == pytest.approx(float(w.abs().max()) / (6 * 448))
    assert _rel(_nvfp4_dequant(out), w) < NVFP4_MAX_REL_ERR


def test_nvfp4_fused_linears_share_one_global_scale():
    """vLLM's KNvfp4Static requires q/k/v (and gate/up) to carry one weight_scale_2:
    convert_state_dict gives them the group's amax."""
    p = "model.layers.0"
    sd = {
        f"{p}.self_attn.{m}.weight": _weight(seed=i) * (i + 1)
        for i, m in enumerate(("q_proj", "k_proj", "v_proj"))
    }
    amax = {k[: -len(".weight")]: 1.0 for k in sd}
    out = fx.convert_state_dict(sd, "nvfp4", amax)
    scales = {
        float(out[f"{p}.self_attn.{m}.weight_scale_2"]) for m in ("q_proj", "k_proj", "v_proj")
    }
    assert len(scales) == 1


def test_mxfp8_round_trip_and_e8m0_scales():
    """MXFP8: fp8 [N, K] values and uint8 E8M0 [N, K/32] scales; within the error."""
    w = _weight()
    out = fx.mxfp8_quantize(w)
    assert out["weight"].dtype == torch.float8_e4m3fn
    assert (out["weight_scale"].dtype, tuple(out["weight_scale"].shape)) == (torch.uint8, (32, 4))
    scale = torch.exp2(out["weight_scale"].float() - fx.E8M0_BIAS)
    deq = (out["weight"].float().reshape(32, 4, 32) * scale.unsqueeze(-1)).reshape(32, 128)
    assert _rel(deq, w) < MXFP8_MAX_REL_ERR


def test_fp8_per_tensor_round_trip():
    """vLLM's fp8 format: fp8 weight and a 0-d fp32 scale max|w| / 448."""
    w = _weight()
    out = fx.fp8_quantize(w)
    assert out["weight_scale"].shape == ()
    assert _rel(out["weight"].float() * out["weight_scale"], w) < FP8_MAX_REL_ERR


@pytest.mark.parametrize(
    "fmt,names",
    [
        (
            "ct_w8a8_fp8",
            {"weight": (torch.float8_e4m3fn, (32, 128)), "weight_scale": (None, (32, 1))},
        ),
        (
            "ct_w8a8_fp8_static",
            {
                "weight": (torch.float8_e4m3fn, (32, 128)),
                "weight_scale": (None, (1,)),
                "input_scale": (torch.float32, (1,)),
            },
        ),
        ("ct_w8a8_int8_asym", {"weight": (torch.int8, (32, 128)), "weight_scale": (None, (32, 1))}),
        (
            "ct_w8a8_int8_static",
            {
                "weight": (torch.int8, (32, 128)),
                "weight_scale": (None, (32, 1)),
                "input_scale": (torch.float32, (1,)),
                "input_zero_point": (torch.int8, (1,)),
            },
        ),
        (
            "ct_w4a16_channel",
            {
                "weight_packed": (torch.int32, (32, 16)),
                "weight_scale": (None, (32, 1)),
                "weight_shape": (torch.int64, (2,)),
            },
        ),
    ],
)
def test_ct_gpu_formats_layout(fmt, names):
    """Each compressed-tensors GPU format has exactly the tensors (dtype, shape) of its
    scheme, made by compressed-tensors' own compressor."""
    out = fx.ct_compress(_weight(), fmt, input_amax=2.0)
    assert set(out) == set(names)
    for name, (dtype, shape) in names.items():
        assert tuple(out[name].shape) == shape
        if dtype is not None:
            assert out[name].dtype == dtype


def test_static_formats_need_calibration():
    """A static-activation format without calibrated input amax is refused by name."""
    with pytest.raises(fx.FixtureError, match="input_amax"):
        fx.convert_state_dict(
            {"model.layers.0.mlp.up_proj.weight": _weight()}, "ct_w8a8_fp8_static"
        )


def test_modelopt_configs_parse_in_vllm_and_exclude_the_lm_head():
    """vLLM's ModelOpt config classes read the NVFP4/MXFP8 fixture configs and exclude
    lm_head (the flat form's key is "ignore"; with "exclude_modules" vLLM quantized the
    tied lm_head and failed on the H200)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.modelopt import (
        ModelOptMxFp8Config,
        ModelOptNvFp4Config,
    )

    nvfp4 = ModelOptNvFp4Config.from_config(fx.quantization_config("nvfp4"))
    mxfp8 = ModelOptMxFp8Config.from_config(fx.quantization_config("mxfp8"))
    for cfg in (nvfp4, mxfp8):
        assert "lm_head" in cfg.exclude_modules
