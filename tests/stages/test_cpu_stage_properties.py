"""Properties of every CPU stage (awq, gptq, compressed_tensors, cpu_wna16, onednn,
cpu_gemm, kv_cache): pure, replayable where tagged so, shape-correct on meta tensors.
The per-family equalities with vLLM are in test_<family>.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec, Tag
from wcache.stages import (
    awq,
    compressed_tensors,
    cpu_gemm,
    cpu_wna16,
    gptq,
    kv_cache,
    onednn,
)

vllm = pytest.importorskip("vllm")


from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    AMX,
    BF16,
    HAS_W4A8_OPS,
    HOST,
    NON_AMX,
    ONEDNN_DTYPE,
    int32,
    layer_cfg,
    run_stage,
    seeded_gen,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


def _inputs(name: str, k: int, n: int, g: int, seed: int):
    """(stage, tensors, config) for every CPU stage, drawn from one shape."""
    groups = 1 if g == -1 else k // g
    gen = seeded_gen(seed)
    scales = torch.rand(groups, n, generator=gen).to(BF16)
    w8 = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    dyn_asym = LayerConfig(
        QuantSpec("ct_w8a8_int8", strategy="channel", static_input=False, input_symmetric=False),
        k,
        n,
        "bfloat16",
    )
    static_asym = LayerConfig(
        QuantSpec("ct_w8a8_int8", strategy="tensor", static_input=True, input_symmetric=False),
        k,
        n,
        "bfloat16",
        extra={"logical_widths": (n // 2, n - n // 2)},
    )
    kv_cfg = LayerConfig(QuantSpec("kv_cache"), 0, 0, extra={"kv_cache_dtype": "fp8"})
    kv_tensors = {
        **{p: torch.tensor(float(i + 1) / 4) for i, p in enumerate(kv_cache.SCALE_PARAMS)},
        **{b: torch.tensor(1.0) for b in kv_cache.SCALE_BUFFERS},
    }
    table = {
        "awq.convert_to_standard": (
            awq.convert_to_standard,
            {"qweight": int32(seed, (k, n // 8)), "qzeros": int32(seed + 1, (groups, n // 8))},
            layer_cfg(k=k, n=n, g=g),
        ),
        "gptq.drop_zero_points": (
            gptq.drop_zero_points,
            {"qzeros": int32(seed, (groups, n // 8))},
            layer_cfg("gptq"),
        ),
        "compressed_tensors.transpose_weight": (
            compressed_tensors.transpose_weight,
            {"weight_packed": int32(seed, (n, k // 8))},
            layer_cfg("ct_w4a16"),
        ),
        "compressed_tensors.transpose_scales": (
            compressed_tensors.transpose_scales,
            {"weight_scale": scales.t().contiguous()},
            layer_cfg("ct_w4a16"),
        ),
        "compressed_tensors.clear_zero_point": (
            compressed_tensors.clear_zero_point,
            {},
            layer_cfg("ct_w4a16"),
        ),
        "cpu_wna16.transpose_zero_points": (
            cpu_wna16.transpose_zero_points("qzeros"),
            {"qzeros": int32(seed, (n // 8, groups))},
            layer_cfg(),
        ),
        "cpu_wna16.set_isa_hint": (
            cpu_wna16.set_isa_hint("scales"),
            {"scales": scales},
            layer_cfg(),
        ),
        "cpu_wna16.set_use_w4a8": (cpu_wna16.set_use_w4a8, {}, layer_cfg()),
        "cpu_wna16.repack": (
            cpu_wna16.repack("qweight"),
            {"qweight": int32(seed, (k // 8, n))},
            layer_cfg(),
        ),
        "cpu_wna16.repack_w4a8": (
            cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"),
            {
                "qweight": int32(seed, (k // 8, n)),
                "scales": scales,
                "qzeros": int32(seed + 1, (groups, n // 8)),
            },
            layer_cfg(k=k, n=n, g=g, zero_point=True),
        ),
        "cpu_wna16.cast_bias_to_float32": (
            cpu_wna16.cast_bias_to_float32,
            {"bias": torch.randn(n, generator=gen).to(BF16)},
            layer_cfg(),
        ),
        "onednn.prepack_weight": (
            onednn.prepack_weight,
            {"weight": torch.randn(n, k, generator=gen).to(ONEDNN_DTYPE)},
            layer_cfg("unquantized"),
        ),
        "onednn.convert_scale_to_channelwise": (
            onednn.convert_scale_to_channelwise,
            {"weight_scale": torch.rand(2, generator=gen)},
            static_asym,
        ),
        "onednn.fold_input_scale": (
            onednn.fold_input_scale,
            {
                "input_scale": torch.rand(1, generator=gen) + 0.01,
                "input_zero_point": torch.tensor([3], dtype=torch.int8),
            },
            static_asym,
        ),
        "onednn.compute_azp_adj": (
            onednn.compute_azp_adj,
            {"weight": w8, "weight_scale": torch.rand(n, 1, generator=gen)},
            dyn_asym,
        ),
        "onednn.prepack_scaled_weight": (
            onednn.prepack_scaled_weight,
            {"weight": w8, "weight_scale": torch.rand(n, 1, generator=gen)},
            dyn_asym,
        ),
        "cpu_gemm.pack_sgl_int8_weight": (
            cpu_gemm.pack_sgl_int8_weight,
            {
                "weight": torch.randint(-128, 128, (32 * max(n // 32, 1), k), generator=gen).to(
                    torch.int8
                )
            },
            static_asym,
        ),
        "cpu_gemm.convert_int8_scale_to_channelwise": (
            cpu_gemm.convert_int8_scale_to_channelwise,
            {"weight_scale": torch.rand(2, generator=gen)},
            static_asym,
        ),
        "cpu_gemm.copy_bias_to_float32": (
            cpu_gemm.copy_bias_to_float32,
            {"bias": torch.randn(n, generator=gen).to(BF16)},
            static_asym,
        ),
        "cpu_gemm.set_int8_sgl_method": (cpu_gemm.set_int8_sgl_method, {}, static_asym),
        "kv_cache.select_scales": (kv_cache.select_scales, kv_tensors, kv_cfg),
        "kv_cache.set_scale_floats": (kv_cache.set_scale_floats, kv_tensors, kv_cfg),
    }
    return table[name]


ALL_STAGES = (
    "awq.convert_to_standard",
    "gptq.drop_zero_points",
    "compressed_tensors.transpose_weight",
    "compressed_tensors.transpose_scales",
    "compressed_tensors.clear_zero_point",
    "cpu_wna16.transpose_zero_points",
    "cpu_wna16.set_isa_hint",
    "cpu_wna16.set_use_w4a8",
    "cpu_wna16.repack",
    *(("cpu_wna16.repack_w4a8",) if HAS_W4A8_OPS else ()),
    "cpu_wna16.cast_bias_to_float32",
    "onednn.prepack_weight",
    "onednn.convert_scale_to_channelwise",
    "onednn.fold_input_scale",
    "onednn.compute_azp_adj",
    "onednn.prepack_scaled_weight",
    *(
        ("cpu_gemm.pack_sgl_int8_weight",)
        if HOST.kernel("op.convert_weight_packed") == "present"
        else ()
    ),
    "cpu_gemm.convert_int8_scale_to_channelwise",
    "cpu_gemm.copy_bias_to_float32",
    "cpu_gemm.set_int8_sgl_method",
    "kv_cache.select_scales",
    "kv_cache.set_scale_floats",
)

#: stages that run only on a target other than NON_AMX (the w4a8 layout's).
STAGE_TARGETS = {"cpu_wna16.repack_w4a8": AMX}
small_shapes = st.tuples(
    st.integers(1, 3).map(lambda i: 32 * i),
    st.integers(1, 3).map(lambda i: 32 * i),
    st.sampled_from([-1, 32]),
    st.integers(0, 2**16),
)


@pytest.mark.parametrize("name", ALL_STAGES)
@settings(max_examples=10)
@given(shape=small_shapes)
def test_stage_is_pure(name, shape):
    """Every stage leaves its inputs' bytes and version counters unchanged and writes
    only what it declares."""
    stage_, tensors, cfg = _inputs(name, *shape)
    assert stage_.name == name
    before = {k: (v.clone(), v._version) for k, v in tensors.items()}
    out = run_stage(stage_, tensors, cfg, STAGE_TARGETS.get(name, NON_AMX))
    for k, (copy, version) in before.items():
        assert torch.equal(copy, tensors[k]) and version == tensors[k]._version, k
    assert set(out.tensors) | set(out.drop) <= set(stage_.writes) | set(stage_.attrs)
    assert set(out.attrs) <= set(stage_.attrs) | set(stage_.writes)
    assert stage_.source, f"{name} has no source"


REPLAYABLE = tuple(n for n in ALL_STAGES if _inputs(n, 32, 32, -1, 0)[0].replayable)


@pytest.mark.parametrize("name", REPLAYABLE)
def test_replayable_stage_twice_equals_once(name):
    """METADATA/DERIVE stages give the same attributes, records and behaviour twice."""
    stage_, tensors, cfg = _inputs(name, 64, 64, 32, 3)
    first, second = run_stage(stage_, tensors, cfg), run_stage(stage_, tensors, cfg)
    assert dict(first.record) == dict(second.record)
    assert first.release == second.release and first.drop == second.drop
    for key, value in first.attrs.items():
        other = second.attrs[key]
        if isinstance(value, onednn.OneDNNLinear):  # activations in the prepacked weight's dtype
            x = torch.randn(3, 64, generator=seeded_gen(9)).to(tensors["weight"].dtype)
            assert torch.equal(value(x, None, None), other(x, None, None))
        elif isinstance(value, onednn.CPUDNNLGEMMHandler):
            assert (value.k, value.n) == (other.k, other.n)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, other)
        else:
            assert value == other, key


TRANSFORMS = tuple(n for n in ALL_STAGES if _inputs(n, 32, 32, -1, 0)[0].tag is Tag.TRANSFORM)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transform_on_meta_gives_real_shapes(name):
    """TRANSFORM stages accept meta tensors and return the shapes and dtypes of a real run."""
    stage_, tensors, cfg = _inputs(name, 64, 96, 32, 5)
    target = STAGE_TARGETS.get(name, NON_AMX)
    real = run_stage(stage_, tensors, cfg, target)
    meta = run_stage(stage_, {k: v.to("meta") for k, v in tensors.items()}, cfg, target)
    assert {k: (tuple(v.shape), v.dtype) for k, v in real.tensors.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in meta.tensors.items()
    }
    assert real.drop == meta.drop
