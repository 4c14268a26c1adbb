"""wcache/stages/marlin_fp4.py: NVFP4 on Marlin (linear and MoE) equals vLLM's
prepare_fp4_layer_for_marlin / prepare_nvfp4_moe_layer_for_marlin."""

from __future__ import annotations

import types

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec

mu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils")
mut = pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")


from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as mfp4  # noqa: E402 (after pytest.importorskip)

from tests.helpers.cuda_stage_inputs import H200, cfg, seeded_gen, u8  # noqa: E402
from wcache.stages import marlin_fp4 as MF4  # noqa: E402 (grouped with the section it serves)


def _vllm_repack_reference(b_q_weight, size_k, size_n, num_bits=4, is_a_8bit=False, perm=None):
    """vLLM's pure reference for ``ops.gptq_marlin_repack`` (``marlin_weights`` over
    the unpacked GPTQ rows), what its own kernel test compares the CUDA op with."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    q = unpack_quantized_values_into_int32(b_q_weight, scalar_types.uint4, packed_dim=0)
    return mut.marlin_weights(q.contiguous(), size_k, size_n, num_bits, mut.get_weight_perm(4))


def _nvfp4_scales(gen, shape, small=False):
    """Positive float8_e4m3fn block scales; ``small`` as a checkpoint whose global scale
    is 1 (scales far below 448, so vLLM rescales them by a power of two)."""
    s = torch.rand(shape, generator=gen) * (0.05 if small else 400) + (0.002 if small else 0.5)
    return s.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("n,k", [(128, 256), (100, 80), (64, 128), (256, 64)])
def test_fp4_marlin_repack_equals_vllm(n, k):
    """fp4_marlin_repack == vLLM's weight path of prepare_fp4_layer_for_marlin (view as
    int32, transpose, marlin_pad_qweight, gptq_marlin_repack reference), padded shapes
    included."""
    w = torch.randint(0, 256, (n, k // 2), generator=seeded_gen(n + k), dtype=torch.uint8)
    padded_n, padded_k = mu.marlin_padded_nk(n, k, MF4.NVFP4_GROUP_SIZE)
    q = mu.marlin_pad_qweight(w.view(torch.int32).T.contiguous(), n, k, padded_n, padded_k)
    expected = _vllm_repack_reference(q, padded_k, padded_n)
    assert torch.equal(expected, MF4.fp4_marlin_repack(w, n, k, padded_n, padded_k))


@pytest.mark.parametrize(
    "n,k,dtype,small,zeros",
    [
        (128, 256, torch.bfloat16, False, False),
        (128, 256, torch.bfloat16, True, False),  # rescaled by a power of two > 1
        (100, 80, torch.bfloat16, True, True),  # padded; some zero scales
        (64, 128, torch.float16, True, False),  # fp16: never rescaled
    ],
)
def test_nvfp4_marlin_process_scales_stage_equals_vllm(n, k, dtype, small, zeros):
    """marlin_fp4.process_scales == vLLM's scale path of prepare_fp4_layer_for_marlin
    (transpose, cast, pad, permute, nvfp4_marlin_process_scales, the global scale
    processed and divided by the same factor), bit for bit."""
    gen = seeded_gen(n * k)
    scales = _nvfp4_scales(gen, (n, k // 16), small)
    if zeros:
        scales[::7] = 0
    g = torch.tensor(0.0123 if not small else 1.0)
    padded_n, padded_k = mu.marlin_padded_nk(n, k, 16)
    s = scales.T.contiguous().to(dtype)
    s = mu.marlin_pad_scales(s, n, k, padded_n, padded_k, 16)
    s = mu.marlin_permute_scales(s, padded_k, padded_n, 16)
    exp_s, factor = mfp4.nvfp4_marlin_process_scales(s, a_dtype=dtype)
    exp_g = mfp4.nvfp4_marlin_process_global_scale(g.to(torch.float32), dtype) / factor
    config = cfg("modelopt_fp4", k, n, 4, 16, dtype=str(dtype).removeprefix("torch."))
    t = {"weight_scale": scales, "weight_global_scale": g}
    before = {key: (v.clone(), v._version) for key, v in t.items()}
    out = MF4.process_scales(t, config, H200, {}).tensors
    assert (factor > 1.0) == (small and dtype == torch.bfloat16)
    assert exp_s.dtype == out["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(u8(exp_s), u8(out["weight_scale"]))
    assert torch.equal(exp_g, out["weight_global_scale"])
    for key, (v, ver) in before.items():
        assert torch.equal(
            u8(t[key]) if v.dtype.itemsize == 1 else t[key], u8(v) if v.dtype.itemsize == 1 else v
        )
        assert t[key]._version == ver


def _moe_checkpoint(e, hidden, inter, shards, seed, small=False):
    gen = seeded_gen(seed)
    u8_ = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)  # noqa: E731 (a one-line local function)
    return {
        "w13_weight": u8_(e, shards * inter, hidden // 2),
        "w13_weight_scale": _nvfp4_scales(gen, (e, shards * inter, hidden // 16), small),
        "w13_weight_scale_2": torch.rand(e, generator=gen) * 0.01 + 1e-3,
        "w2_weight": u8_(e, hidden, inter // 2),
        "w2_weight_scale": _nvfp4_scales(gen, (e, hidden, inter // 16), small),
        "w2_weight_scale_2": torch.rand(e, generator=gen) * 0.01 + 1e-3,
    }


def _moe_cfg(e, hidden, inter, act_and_mul=True):
    from wcache.core import MoeShape

    shape = MoeShape(
        num_experts=e,
        global_num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        backend="MARLIN",
        experts="MarlinExperts",
        is_act_and_mul=act_and_mul,
    )
    spec = QuantSpec(
        "modelopt_fp4", num_bits=4, group_size=16, layer_kind="moe", kernel="marlin_moe"
    )
    return LayerConfig(spec, 0, 0, params_dtype="bfloat16", name="experts", moe=shape)


@pytest.mark.parametrize(
    "e,hidden,inter,act_and_mul,small",
    [
        (3, 128, 64, True, False),
        (2, 256, 96, True, True),  # intermediate padded to 128 (hidden % 128 == 0: tile 64)
        (2, 192, 64, True, False),  # hidden % 128 != 0: intermediate padded to 128
        (2, 128, 32, False, True),  # non-gated experts, padded
    ],
)
def test_nvfp4_marlin_moe_stages_equal_vllm(monkeypatch, e, hidden, inter, act_and_mul, small):
    """marlin_fp4.repack_moe_weights + process_moe_scales == vLLM's
    prepare_nvfp4_moe_layer_for_marlin (gptq_marlin_repack swapped for its pure
    reference), intermediate padding and one rescale per projection included."""
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "gptq_marlin_repack", _vllm_repack_reference)
    shards = 2 if act_and_mul else 1
    t = _moe_checkpoint(e, hidden, inter, shards, seed=e * hidden + inter, small=small)
    layer = types.SimpleNamespace(
        num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        params_dtype=torch.bfloat16,
    )
    w13, s13, g13, w2, s2, g2 = mfp4.prepare_nvfp4_moe_layer_for_marlin(
        layer,
        t["w13_weight"],
        t["w13_weight_scale"],
        t["w13_weight_scale_2"],
        t["w2_weight"],
        t["w2_weight_scale"],
        t["w2_weight_scale_2"],
        is_act_and_mul=act_and_mul,
    )
    config = _moe_cfg(e, hidden, inter, act_and_mul)
    out = dict(MF4.repack_moe_weights(t, config, H200, {}).tensors)
    out.update(MF4.process_moe_scales(t, config, H200, {}).tensors)
    expected = {
        "w13_weight": w13,
        "w13_weight_scale": s13,
        "w13_weight_scale_2": g13,
        "w2_weight": w2,
        "w2_weight_scale": s2,
        "w2_weight_scale_2": g2,
    }
    for name, value in expected.items():
        got = out[name]
        assert (value.dtype, tuple(value.shape)) == (got.dtype, tuple(got.shape)), name
        assert torch.equal(
            u8(value) if value.dtype.itemsize == 1 else value,
            u8(got) if got.dtype.itemsize == 1 else got,
        ), name


def test_nvfp4_marlin_stages_accept_meta_tensors():
    """The NVFP4 Marlin stages give vLLM's shapes on meta tensors (no values read)."""
    c = cfg("modelopt_fp4", 80, 100, 4, 16)  # padded to (Kp, Np) = (128, 128)
    meta = {
        "weight": torch.empty(100, 40, dtype=torch.uint8, device="meta"),
        "weight_scale": torch.empty(100, 5, dtype=torch.float8_e4m3fn, device="meta"),
        "weight_global_scale": torch.empty((), device="meta"),
    }
    w = MF4.repack_weight(meta, c, H200, {}).tensors["weight"]
    s = MF4.process_scales(meta, c, H200, {}).tensors
    assert (w.device.type, tuple(w.shape), w.dtype) == ("meta", (8, 256), torch.int32)
    assert tuple(s["weight_scale"].shape) == (8, 128)
    assert s["weight_scale"].dtype == torch.float8_e4m3fn
    moe = {k: v.to("meta") for k, v in _moe_checkpoint(2, 256, 96, 2, seed=1).items()}
    mc = _moe_cfg(2, 256, 96)
    out = dict(MF4.repack_moe_weights(moe, mc, H200, {}).tensors)
    out.update(MF4.process_moe_scales(moe, mc, H200, {}).tensors)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "w13_weight": (2, 16, 512),
        "w2_weight": (2, 8, 512),
        "w13_weight_scale": (2, 16, 256),
        "w2_weight_scale": (2, 8, 256),
        "w13_weight_scale_2": (2,),
        "w2_weight_scale_2": (2,),
    }


#: Bad inputs of the marlin_fp4 stages and the exact error each raises.
BAD_INPUTS = [
    (
        lambda: MF4.fp4_marlin_repack(torch.zeros(64, 64, dtype=torch.uint8), 64, 64, 64, 128),
        MF4.MarlinFp4LayoutError,
        r"\[64, 32\] uint8",
    ),
    (
        lambda: MF4.nvfp4_moe_padded_intermediate(96, 64),
        MF4.MarlinFp4LayoutError,
        "hidden_size = 96 unsupported",
    ),
    (
        lambda: MF4.nvfp4_marlin_process_global_scale(torch.ones(()), torch.float32),
        MF4.MarlinFp4LayoutError,
        "float16 or bfloat16",
    ),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_inputs_raise_exact_errors(call, error, message):
    """Each bad input raises its wcache error class (a ValueError) with an actionable message."""
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, ValueError) and info.value.code
