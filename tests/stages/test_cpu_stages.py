"""CPU stage families (common, awq, gptq, compressed_tensors, cpu_wna16, onednn,
kv_cache): bit-exact against the vLLM functions they mirror, pure, replayable
where tagged so, and shape-correct on meta tensors."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec, Stage, StageOut, Tag, Target
from wcache.stages import (
    awq,
    common,
    compressed_tensors,
    cpu_gemm,
    cpu_wna16,
    gptq,
    kv_cache,
    onednn,
)

vllm = pytest.importorskip("vllm")
import vllm._custom_ops  # noqa: E402, F811 (registers torch.ops._C; after the importorskip)
from vllm.model_executor.layers.quantization.utils import quant_utils as qu  # noqa: E402 (after pytest.importorskip)
from vllm.scalar_type import scalar_types  # noqa: E402 (after pytest.importorskip)

from tests.helpers import vllm_layers  # noqa: E402  (one gloo world per session)
from wcache.vllm.probe import host_target  # noqa: E402 (after pytest.importorskip)


@pytest.fixture(scope="module", autouse=True)
def _vllm_world():
    """vLLM parameters need a tensor-parallel group; set up a 1-rank world once."""
    vllm_layers.ensure_vllm()


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
NO_W4A8_OPS = f"vLLM's {LIBRARY} has no torch.ops._C." + next(
    (op for op in cpu_wna16.W4A8_OPS if HOST.kernel(f"op.{op}") != "present"), ""
)
NO_CONVERT_WEIGHT_PACKED = f"vLLM's {LIBRARY} has no torch.ops._C.convert_weight_packed"
BF16 = torch.bfloat16
#: A dtype vLLM's dispatch gives to oneDNN on this host (bf16 unless oneDNN refuses
#: it here, as on AVX2-only hosts; fp32 is oneDNN everywhere vLLM-CPU runs on x86).
ONEDNN_DTYPE = BF16 if HOST.kernel("unquantized_gemm[bfloat16]") == "onednn" else torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int32(seed: int, shape) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, tuple(shape), dtype=torch.int32, generator=_gen(seed))


def _module(**tensors: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in tensors.items():
        m.register_parameter(k, torch.nn.Parameter(v.clone(), requires_grad=False))
    return m


def _run(st_: Stage, tensors, config, target=NON_AMX, recorded=None) -> StageOut:
    return st_(
        types.MappingProxyType(dict(tensors)),
        config,
        target,
        types.MappingProxyType(dict(recorded or {})),
    )


def _cfg(method="awq", k=128, n=64, g=32, dtype="bfloat16", **kw) -> LayerConfig:
    return LayerConfig(QuantSpec(method, num_bits=4, group_size=g, **kw), k, n, dtype)


# sizes: size_k and size_n multiples of 32 (CPUWNA16), groups dividing size_k
shapes = st.tuples(
    st.integers(1, 6).map(lambda i: 32 * i),
    st.integers(1, 4).map(lambda i: 32 * i),
    st.sampled_from([-1, 32]),
    st.integers(0, 2**16),
)


# --------------------------------------------------------------------------- common


def test_require_op_raises_when_missing():
    """A native op that is not registered raises OpUnavailable (a WcacheError)."""
    with pytest.raises(common.OpUnavailable, match="not registered"):
        common.require_op("_C", "no_such_op_wcache")
    assert common.require_op("_C", "onednn_mm") is torch.ops._C.onednn_mm


# --------------------------------------------------------------------------- AWQ


@given(shapes)
def test_awq_stage_matches_vllm_conversion(shape):
    """awq.convert_to_standard equals vLLM's _convert_awq_to_standard_format on a layer."""
    from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format

    k, n, g, seed = shape
    groups = 1 if g == -1 else k // g
    qweight, qzeros = _int32(seed, (k, n // 8)), _int32(seed + 1, (groups, n // 8))
    ref = _module(qweight=qweight, qzeros=qzeros)
    _convert_awq_to_standard_format(ref, "qweight", "qzeros", 4)
    cfg = _cfg(k=k, n=n, g=g)
    out = _run(awq.convert_to_standard, {"qweight": qweight, "qzeros": qzeros}, cfg).tensors
    assert torch.equal(ref.qweight.data, out["qweight"])
    assert torch.equal(ref.qzeros.data, out["qzeros"])


@given(shapes)
def test_awq_convert_to_standard_gives_gptq_pack(shape):
    """AWQ-packed quantized weights become exactly gptq_pack of the same values."""
    k, n, g, seed = shape
    w = torch.randn(k, n, generator=_gen(seed))
    _, q_w, _, _ = qu.quantize_weights(w, scalar_types.uint4, g, zero_points=True)
    awq_packed = qu.awq_pack(q_w, 4, k, n)
    qzeros = torch.zeros(1 if g == -1 else k // g, n // 8, dtype=torch.int32)
    out = _run(
        awq.convert_to_standard, {"qweight": awq_packed, "qzeros": qzeros}, _cfg(k=k, n=n, g=g)
    )
    assert torch.equal(qu.gptq_pack(q_w, 4, k, n), out.tensors["qweight"])


# --------------------------------------------------------------------------- CPUWNA16


def _vllm_cpu_kernel(k, n, g, zero_points, act=BF16):
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


@given(shapes)
def test_cpu_wna16_repack_matches_vllm(shape):
    """cpu_wna16.repack equals CPUWNA16LinearKernel._process_gptq_weights_w4a16, and
    set_isa_hint equals the hint it sets on this host."""
    k, n, g, seed = shape
    qweight = _int32(seed, (k // 8, n))
    scales = torch.rand(1 if g == -1 else k // g, n, generator=_gen(seed)).to(BF16)
    ref = _module(qweight=qweight, scales=scales)
    _vllm_cpu_kernel(k, n, g, False)._process_gptq_weights_w4a16(ref)
    cfg = _cfg("gptq", k=k, n=n, g=g)
    out = _run(cpu_wna16.repack("qweight"), {"qweight": qweight}, cfg, HOST_W4A16)
    assert torch.equal(ref.qweight.data, out.tensors["qweight"])
    hint = _run(cpu_wna16.set_isa_hint("scales"), {"scales": scales}, cfg, HOST_W4A16)
    assert hint.attrs == {"isa_hint": ref.isa_hint} == hint.record


#: shapes the w4a8 layout's op can block (size_k a multiple of min(group, 128)).
w4a8_shapes = st.tuples(
    st.sampled_from([32, 64, 128, 256, 384]),
    st.integers(1, 4).map(lambda i: 32 * i),
    st.sampled_from([-1, 32]),
    st.integers(0, 2**16),
    st.booleans(),
    st.booleans(),
)


@pytest.mark.skipif(not HAS_W4A8_OPS, reason=NO_W4A8_OPS)
@settings(max_examples=20)
@given(w4a8_shapes)
def test_cpu_wna16_repack_w4a8_matches_vllm(shape):
    """cpu_wna16.repack_w4a8 (and cast_bias_to_float32) equal
    CPUWNA16LinearKernel._process_gptq_weights_w4a8 bit for bit, with and without zero
    points (symmetric: vLLM's fake all-8 zero points), and the meta run gives the
    real shapes and dtypes."""
    k, n, g, seed, zero_points, bias = shape
    groups = 1 if g == -1 else k // g
    qweight = _int32(seed, (k // 8, n))
    scales = torch.rand(groups, n, generator=_gen(seed)).to(BF16)
    qzeros = _int32(seed + 1, (groups, n // 8))
    b = torch.randn(n, generator=_gen(seed + 2)).to(BF16)
    tensors = {"qweight": qweight, "scales": scales, "qzeros": qzeros}
    ref = _module(**tensors, **({"bias": b} if bias else {}))
    if not bias:
        ref.bias = None
    _vllm_cpu_kernel(k, n, g, zero_points)._process_gptq_weights_w4a8(ref)
    cfg = _cfg("awq" if zero_points else "gptq", k=k, n=n, g=g, zero_point=zero_points)
    stage_ = cpu_wna16.repack_w4a8("qweight", "scales", "qzeros")
    out = _run(stage_, tensors, cfg, AMX).tensors
    for name in ("qweight", "scales", "qzeros"):
        assert torch.equal(getattr(ref, name).data, out[name]), name
        assert getattr(ref, name).dtype == out[name].dtype, name
    cast = _run(cpu_wna16.cast_bias_to_float32, {"bias": b} if bias else {}, cfg, AMX).tensors
    assert torch.equal(ref.bias.data, cast["bias"]) if bias else {} == dict(cast)
    meta = _run(stage_, {k_: v.to("meta") for k_, v in tensors.items()}, cfg, AMX).tensors
    assert {k_: (v.shape, v.dtype) for k_, v in out.items()} == {
        k_: (v.shape, v.dtype) for k_, v in meta.items()
    }


def test_repack_w4a8_refuses_w4a16_target():
    """repack_w4a8 refuses a target that selects the w4a16 layout (no AMX/RISC-V)."""
    tensors = {
        "qweight": torch.zeros(16, 64, dtype=torch.int32),
        "scales": torch.ones(4, 64, dtype=BF16),
    }
    with pytest.raises(common.StageInputError, match="w4a16"):
        _run(cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"), tensors, _cfg("gptq"), NON_AMX)


@pytest.mark.skipif(not HAS_W4A8_OPS, reason=NO_W4A8_OPS)
def test_w4a8_op_fails_where_the_plan_refuses():
    """Where can_implement_w4a8 refuses a shape (size_k 192, channelwise: not a
    multiple of the op's 128-row block), vLLM's own op fails too: the refusal is
    vLLM's limit, not wcache's."""
    k, n = 192, 32
    cfg = LayerConfig(
        QuantSpec("awq", num_bits=4, group_size=-1, zero_point=True), k, n, "bfloat16"
    )
    assert "cannot block size_k 192" in cpu_wna16.can_implement_w4a8(cfg, AMX)
    with pytest.raises(RuntimeError, match="invalid"):
        torch.ops._C.convert_weight_packed_scale_zp(
            torch.zeros(k, n // 8, dtype=torch.int32),
            torch.zeros(1, n // 8, dtype=torch.int32),
            torch.ones(1, n, dtype=BF16),
            0,
        )


@pytest.mark.parametrize(
    "isa,dtype,expected",
    [
        ((), BF16, "vec"),
        (("avx512", "avx512_bf16"), BF16, "vec"),
        (("amx",), BF16, "amx"),
        (("amx",), torch.float16, "vec"),
        (("riscv",), torch.float16, "rvv"),
        (("power",), BF16, "vsx"),
        (("power",), torch.float32, "vec"),
    ],
)
def test_isa_hint_table(isa, dtype, expected):
    """isa_hint follows vLLM's _get_isa_hint, from the Target only."""
    assert expected == cpu_wna16.isa_hint_for(dtype, Target("cpu", isa=frozenset(isa)))


@pytest.mark.parametrize(
    "isa,env,dtype,expected",
    [
        ((), (), BF16, False),
        (("amx",), (), BF16, True),
        (("amx",), (("VLLM_CPU_INT4_W4A8", "0"),), BF16, False),
        (("amx",), (), torch.float16, False),
        (("riscv",), (), BF16, True),
        (("avx512_bf16",), (("VLLM_CPU_INT4_W4A8", "1"),), BF16, False),
    ],
)
def test_use_w4a8_table(isa, env, dtype, expected):
    """use_w4a8 follows vLLM's expression with the env value taken from the Target."""
    assert expected == cpu_wna16.use_w4a8_for(dtype, Target("cpu", isa=frozenset(isa), env=env))


def test_use_w4a8_matches_vllm_on_this_host():
    """On this host (env pinned to vLLM's default) the Target gives vLLM's own value."""
    ref = _module(
        qweight=torch.zeros(16, 64, dtype=torch.int32),
        scales=torch.ones(4, 64, dtype=BF16),
        qzeros=torch.zeros(4, 8, dtype=torch.int32),
    )
    ref.qweight.input_dim = ref.qweight.packed_dim = 0
    ref.scales.output_dim = 1
    ref.bias = None
    _vllm_cpu_kernel(128, 64, 32, False).process_weights_after_loading(ref)
    assert ref.use_w4a8 == cpu_wna16.use_w4a8_for(BF16, HOST)
    if ref.use_w4a8:  # w4a8 replaces the emptied slot by its fake, blocked zero points
        assert ref.qzeros.dtype == torch.int8 and "qzeros" in ref._parameters
    else:
        assert ref.qzeros is None and "qzeros" in ref._parameters


def test_repack_refuses_w4a8_target():
    """The repack stage refuses a target that selects the w4a8 layout."""
    with pytest.raises(common.StageInputError, match="w4a8"):
        _run(
            cpu_wna16.repack("qweight"),
            {"qweight": torch.zeros(16, 64, dtype=torch.int32)},
            _cfg("gptq"),
            Target("cpu", isa={"amx"}),
        )


def test_gptq_and_ct_zero_point_stages():
    """gptq.drop_zero_points drops qzeros (TRANSFORM) and gptq.clear_zero_points leaves the
    None slot (METADATA); CT clears the attribute of a symmetric layer only."""
    out = _run(gptq.drop_zero_points, {"qzeros": torch.zeros(1, 1, dtype=torch.int32)}, _cfg())
    assert (("qzeros",), {}) == (out.drop, dict(out.attrs))
    out = _run(gptq.clear_zero_points, {}, _cfg())
    assert ((), {"qzeros": None}) == (out.drop, dict(out.attrs))
    out = _run(compressed_tensors.clear_zero_point, {}, _cfg("ct_w4a16"))
    assert {"weight_zero_point": None} == dict(out.attrs) and out.drop == ()
    out = _run(compressed_tensors.clear_zero_point, {}, _cfg("ct_w4a16", zero_point=True))
    assert {} == dict(out.attrs) and out.drop == ()


@given(shapes)
def test_ct_transposes_match_vllm(shape):
    """compressed-tensors transposes and the CPU repack equal vLLM's kernel on CT layout."""
    k, n, g, seed = shape
    groups = 1 if g == -1 else k // g
    w = _int32(seed, (n, k // 8))
    s = torch.rand(n, groups, generator=_gen(seed)).to(BF16)
    zp = _int32(seed + 1, (n // 8, groups))
    ref = _module(qweight=w, scales=s, qzeros=zp)
    ref.qweight.input_dim = ref.qweight.packed_dim = 1
    ref.scales.output_dim = 0
    ref.qzeros.output_dim = 0
    ref.bias = None
    with pytest.MonkeyPatch.context() as mp:  # the w4a16 layout on any host
        mp.setenv(cpu_wna16.W4A8_ENV, "0")
        _vllm_cpu_kernel(k, n, g, True).process_weights_after_loading(ref)
    cfg = _cfg("ct_w4a16", k=k, n=n, g=g, zero_point=True)
    tw = _run(compressed_tensors.transpose_weight, {"weight_packed": w}, cfg)
    ts = _run(compressed_tensors.transpose_scales, {"weight_scale": s}, cfg)
    tz = _run(cpu_wna16.transpose_zero_points("qzeros"), {"qzeros": zp}, cfg)
    rp = _run(cpu_wna16.repack("w"), {"w": tw.tensors["weight_packed"]}, cfg, HOST_W4A16)
    assert torch.equal(ref.qweight.data, rp.tensors["w"])
    assert torch.equal(ref.scales.data, ts.tensors["weight_scale"])
    assert torch.equal(ref.qzeros.data, tz.tensors["qzeros"])


# --------------------------------------------------------------------------- oneDNN


@given(
    widths=st.lists(st.integers(1, 4).map(lambda i: 16 * i), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_convert_scale_to_channelwise_matches_vllm(widths, seed):
    """onednn.convert_scale_to_channelwise equals vLLM's convert_to_channelwise."""
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

    scale = torch.rand(len(widths), generator=_gen(seed))
    cfg = LayerConfig(
        QuantSpec("ct_w8a8_int8", strategy="tensor"),
        64,
        sum(widths),
        extra={"logical_widths": tuple(widths)},
    )
    out = _run(onednn.convert_scale_to_channelwise, {"weight_scale": scale}, cfg)
    assert torch.equal(convert_to_channelwise(scale, widths), out.tensors["weight_scale"])


def test_onednn_prepack_weight_matches_vllm_dispatch():
    """onednn.prepack_weight gives a cpu_linear bit-identical to vLLM's oneDNN dispatch,
    releases the linear weight and keeps an embedding's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    # K = 48 is no multiple of the SGL tile: oneDNN on AMX hosts too
    w = torch.randn(96, 48, generator=_gen(0)).to(ONEDNN_DTYPE)
    ref = _module(weight=w)
    dispatch_cpu_unquantized_gemm(ref, remove_weight=True)
    x = torch.randn(5, 48, generator=_gen(1)).to(ONEDNN_DTYPE)
    bias = torch.randn(96, generator=_gen(2)).to(ONEDNN_DTYPE)
    out = _run(onednn.prepack_weight, {"weight": w}, _cfg("unquantized"))
    assert out.release == ("weight",)
    assert torch.equal(ref.cpu_linear(x, None, bias), out.attrs["cpu_linear"](x, None, bias))
    emb_cfg = LayerConfig(QuantSpec("unquantized", layer_kind="embedding"), 48, 96)
    assert _run(onednn.prepack_weight, {"weight": w}, emb_cfg).release == ()
    meta = _run(onednn.prepack_weight, {"weight": w.to("meta")}, _cfg("unquantized"))
    assert meta.attrs["cpu_linear"] is torch.nn.functional.linear and meta.release == ()


@pytest.mark.parametrize(
    "n,k,dtype,isa,expected",
    [
        (96, 64, BF16, (), False),
        (96, 64, BF16, ("amx",), True),
        (4096, 4096, BF16, ("amx",), False),
        (8, 40, BF16, ("amx",), True),
        (96, 40, BF16, ("amx",), False),
        (4096, 4096, torch.int8, ("amx",), True),
        (4096, 4096, torch.float32, ("amx",), False),
    ],
)
def test_sgl_selected_table(n, k, dtype, isa, expected):
    """sgl_selected applies vLLM's check_cpu_sgl_kernel shape rule to the Target's
    probed SGL decision (made by vLLM on AMX hosts only)."""
    assert expected == onednn.sgl_selected(n, k, dtype, vllm_layers.synthetic_target(isa))


@pytest.mark.parametrize(
    "n,k,dtype",
    [
        (96, 64, BF16),
        (8, 40, BF16),
        (96, 40, BF16),
        (4096, 4096, BF16),
        (96, 64, torch.float16),
        (4096, 4096, torch.int8),
        (96, 40, torch.int8),
    ],
)
def test_sgl_shape_rule_equals_vllms_check_on_amx(n, k, dtype, monkeypatch):
    """cpu_gemm.sgl_shape is vLLM's check_cpu_sgl_kernel when the host has AMX."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True)
    assert check_cpu_sgl_kernel(n, k, dtype) == cpu_gemm.sgl_shape(n, k, dtype)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_bind_torch_linear_equals_vllms_fallback(dtype):
    """cpu_gemm.bind_torch_linear: vLLM's F.linear branch, weight kept, same output."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    w = torch.randn(96, 48, generator=_gen(0)).to(dtype)  # K = 48: never SGL-shaped
    ref = _module(weight=w)
    ref.bias = None
    with pytest.MonkeyPatch.context() as mp:  # force vLLM's fallback branch on any host
        mp.setattr(vllm._custom_ops, "_supports_onednn", False)
        dispatch_cpu_unquantized_gemm(ref, remove_weight=True)
    assert tuple(ref.weight.shape) == (96, 48)  # vLLM keeps the weight
    out = _run(cpu_gemm.bind_torch_linear, {"weight": w}, _cfg("unquantized"))
    x = torch.randn(5, 48, generator=_gen(1)).to(dtype)
    bias = torch.randn(96, generator=_gen(2)).to(dtype)
    assert (out.release, out.tensors, out.drop) == ((), {}, ())
    assert torch.equal(ref.cpu_linear(x, ref.weight, bias), out.attrs["cpu_linear"](x, w, bias))
    meta = _run(cpu_gemm.bind_torch_linear, {"weight": w.to("meta")}, _cfg("unquantized"))
    assert meta.attrs["cpu_linear"] is torch.nn.functional.linear


def test_probe_decisions_are_what_vllm_does_here():
    """Each probed unquantized GEMM decision is the branch vLLM's dispatch takes on
    this host for a real layer of that dtype, and the op flags are torch.ops._C's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from wcache.stages.cpu_gemm import gemm_decision
    from wcache.vllm import probe

    for dtype in (BF16, torch.float16, torch.float32):
        for n, k in ((64, 96), (64, 48)):  # SGL-shaped (taken on AMX hosts), and not
            layer = _module(weight=torch.randn(n, k, generator=_gen(3)).to(dtype))
            layer.bias = None
            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
            prepacked = layer.weight.numel() == 0  # oneDNN and SGL release the weight
            decided = HOST.kernel(gemm_decision(dtype, cpu_gemm.sgl_shape(n, k, dtype)))
            assert decided in ("onednn", "sgl", "torch_linear"), (dtype, decided)
            assert (decided != "torch_linear") == prepacked, (dtype, n, k, decided)
            assert decided == probe._branch_of(layer.cpu_linear), (dtype, n, k)
            assert decided == probe.unquantized_gemm_kernel(n, k, dtype)
    for op in probe.PROBED_OPS:
        expected = "present" if hasattr(torch.ops._C, op) else "absent"
        assert expected == HOST.kernel(f"op.{op}")


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize(
    "dtype",
    [
        "auto",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "bfloat16",
    ],
)
def test_kv_cache_dtype_predicates_match_vllm(dtype):
    """is_quantized_kv_cache / uses_per_token_head_scales equal vLLM's functions."""
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    assert is_quantized_kv_cache(dtype) == kv_cache.is_quantized_kv_cache(dtype)
    assert kv_cache_uses_per_token_head_scales(dtype) == kv_cache.uses_per_token_head_scales(dtype)


# --------------------------------------------------------------------------- properties


def _inputs(name: str, k: int, n: int, g: int, seed: int):
    """(stage, tensors, config) for every CPU stage, drawn from one shape."""
    groups = 1 if g == -1 else k // g
    gen = _gen(seed)
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
            {"qweight": _int32(seed, (k, n // 8)), "qzeros": _int32(seed + 1, (groups, n // 8))},
            _cfg(k=k, n=n, g=g),
        ),
        "gptq.drop_zero_points": (
            gptq.drop_zero_points,
            {"qzeros": _int32(seed, (groups, n // 8))},
            _cfg("gptq"),
        ),
        "compressed_tensors.transpose_weight": (
            compressed_tensors.transpose_weight,
            {"weight_packed": _int32(seed, (n, k // 8))},
            _cfg("ct_w4a16"),
        ),
        "compressed_tensors.transpose_scales": (
            compressed_tensors.transpose_scales,
            {"weight_scale": scales.t().contiguous()},
            _cfg("ct_w4a16"),
        ),
        "compressed_tensors.clear_zero_point": (
            compressed_tensors.clear_zero_point,
            {},
            _cfg("ct_w4a16"),
        ),
        "cpu_wna16.transpose_zero_points": (
            cpu_wna16.transpose_zero_points("qzeros"),
            {"qzeros": _int32(seed, (n // 8, groups))},
            _cfg(),
        ),
        "cpu_wna16.set_isa_hint": (cpu_wna16.set_isa_hint("scales"), {"scales": scales}, _cfg()),
        "cpu_wna16.set_use_w4a8": (cpu_wna16.set_use_w4a8, {}, _cfg()),
        "cpu_wna16.repack": (
            cpu_wna16.repack("qweight"),
            {"qweight": _int32(seed, (k // 8, n))},
            _cfg(),
        ),
        "cpu_wna16.repack_w4a8": (
            cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"),
            {
                "qweight": _int32(seed, (k // 8, n)),
                "scales": scales,
                "qzeros": _int32(seed + 1, (groups, n // 8)),
            },
            _cfg(k=k, n=n, g=g, zero_point=True),
        ),
        "cpu_wna16.cast_bias_to_float32": (
            cpu_wna16.cast_bias_to_float32,
            {"bias": torch.randn(n, generator=gen).to(BF16)},
            _cfg(),
        ),
        "onednn.prepack_weight": (
            onednn.prepack_weight,
            {"weight": torch.randn(n, k, generator=gen).to(ONEDNN_DTYPE)},
            _cfg("unquantized"),
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
    out = _run(stage_, tensors, cfg, STAGE_TARGETS.get(name, NON_AMX))
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
    first, second = _run(stage_, tensors, cfg), _run(stage_, tensors, cfg)
    assert dict(first.record) == dict(second.record)
    assert first.release == second.release and first.drop == second.drop
    for key, value in first.attrs.items():
        other = second.attrs[key]
        if isinstance(value, onednn.OneDNNLinear):  # activations in the prepacked weight's dtype
            x = torch.randn(3, 64, generator=_gen(9)).to(tensors["weight"].dtype)
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
    real = _run(stage_, tensors, cfg, target)
    meta = _run(stage_, {k: v.to("meta") for k, v in tensors.items()}, cfg, target)
    assert {k: (tuple(v.shape), v.dtype) for k, v in real.tensors.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in meta.tensors.items()
    }
    assert real.drop == meta.drop


@pytest.mark.skipif(
    HOST.kernel("op.convert_weight_packed") != "present",
    reason=NO_CONVERT_WEIGHT_PACKED,
)
@pytest.mark.parametrize(
    "strategy,widths,bias",
    [("tensor", (32, 64), True), ("channel", (64,), False), ("tensor", (96,), False)],
)
def test_sgl_int8_stages_match_vllm(strategy, widths, bias, monkeypatch):
    """The SGL W8A8 INT8 stages (packed weight, per-channel scales, bias_fp32) equal
    CPUInt8ScaledMMLinearKernel.process_weights_for_sgl bit for bit (AMX reported
    present in-process; vLLM's SGL ops run on this ISA without it)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vllm_layers.ct_w8a8_int8_linear(64, widths, strategy, True, True, BF16, bias)
    ref = case.new_layer()
    case.vllm_process(ref)
    assert ref.scheme.kernel.linear_method.__name__ == "_apply_weights_sgl"
    raw = case.new_layer()
    cfg = case.config
    w = _run(cpu_gemm.pack_sgl_int8_weight, {"weight": raw.weight.data}, cfg).tensors["weight"]
    assert torch.equal(ref.weight.data, w) and ref.weight.dtype == w.dtype
    s_out = _run(
        cpu_gemm.convert_int8_scale_to_channelwise, {"weight_scale": raw.weight_scale.data}, cfg
    ).tensors
    assert torch.equal(ref.weight_scale.data, s_out.get("weight_scale", raw.weight_scale.data))
    b = _run(cpu_gemm.copy_bias_to_float32, {"bias": raw.bias.data} if bias else {}, cfg).tensors
    assert (
        torch.equal(ref.bias_fp32.data, b["bias_fp32"])
        if bias
        else not hasattr(ref, "bias_fp32") and {} == dict(b)
    )


def test_sgl_int8_n_not_multiple_of_32_fails_in_vllm_too(monkeypatch):
    """An int8 weight with N % 32 != 0 (vLLM's check_cpu_sgl_kernel accepts N % 16):
    vLLM's own SGL post-load fails, and so does the wcache stage, naming the rule."""
    if HOST.kernel("op.convert_weight_packed") != "present":
        pytest.skip(NO_CONVERT_WEIGHT_PACKED)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vllm_layers.ct_w8a8_int8_linear(64, (48,), "tensor", True, True, BF16)
    with pytest.raises(RuntimeError, match="BLOCK_N"):
        case.vllm_process(case.new_layer())
    with pytest.raises(common.StageInputError, match="multiple of 32"):
        _run(cpu_gemm.pack_sgl_int8_weight, {"weight": case.new_layer().weight.data}, case.config)
