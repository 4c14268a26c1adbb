"""wcache/stages/cpu_wna16.py: vLLM-CPU's WNA16 repacks (w4a16, w4a8) and the
host decisions they record equal vLLM's, and refuse the other layout's target."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.stages import (
    common,
    cpu_wna16,
)

vllm = pytest.importorskip("vllm")


from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    AMX,
    BF16,
    HAS_W4A8_OPS,
    HOST,
    HOST_W4A16,
    LIBRARY,
    NON_AMX,
    int32,
    layer_cfg,
    module_of,
    run_stage,
    seeded_gen,
    shapes,
    vllm_cpu_kernel,
)

pytestmark = pytest.mark.usefixtures("vllm_world")
NO_W4A8_OPS = f"vLLM's {LIBRARY} has no torch.ops._C." + next(
    (op for op in cpu_wna16.W4A8_OPS if HOST.kernel(f"op.{op}") != "present"), ""
)


@given(shapes)
def test_cpu_wna16_repack_matches_vllm(shape):
    """cpu_wna16.repack equals CPUWNA16LinearKernel._process_gptq_weights_w4a16, and
    set_isa_hint equals the hint it sets on this host."""
    k, n, g, seed = shape
    qweight = int32(seed, (k // 8, n))
    scales = torch.rand(1 if g == -1 else k // g, n, generator=seeded_gen(seed)).to(BF16)
    ref = module_of(qweight=qweight, scales=scales)
    vllm_cpu_kernel(k, n, g, False)._process_gptq_weights_w4a16(ref)
    cfg = layer_cfg("gptq", k=k, n=n, g=g)
    out = run_stage(cpu_wna16.repack("qweight"), {"qweight": qweight}, cfg, HOST_W4A16)
    assert torch.equal(ref.qweight.data, out.tensors["qweight"])
    hint = run_stage(cpu_wna16.set_isa_hint("scales"), {"scales": scales}, cfg, HOST_W4A16)
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
    qweight = int32(seed, (k // 8, n))
    scales = torch.rand(groups, n, generator=seeded_gen(seed)).to(BF16)
    qzeros = int32(seed + 1, (groups, n // 8))
    b = torch.randn(n, generator=seeded_gen(seed + 2)).to(BF16)
    tensors = {"qweight": qweight, "scales": scales, "qzeros": qzeros}
    ref = module_of(**tensors, **({"bias": b} if bias else {}))
    if not bias:
        ref.bias = None
    vllm_cpu_kernel(k, n, g, zero_points)._process_gptq_weights_w4a8(ref)
    cfg = layer_cfg("awq" if zero_points else "gptq", k=k, n=n, g=g, zero_point=zero_points)
    stage_ = cpu_wna16.repack_w4a8("qweight", "scales", "qzeros")
    out = run_stage(stage_, tensors, cfg, AMX).tensors
    for name in ("qweight", "scales", "qzeros"):
        assert torch.equal(getattr(ref, name).data, out[name]), name
        assert getattr(ref, name).dtype == out[name].dtype, name
    cast = run_stage(cpu_wna16.cast_bias_to_float32, {"bias": b} if bias else {}, cfg, AMX).tensors
    assert torch.equal(ref.bias.data, cast["bias"]) if bias else {} == dict(cast)
    meta = run_stage(stage_, {k_: v.to("meta") for k_, v in tensors.items()}, cfg, AMX).tensors
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
        run_stage(
            cpu_wna16.repack_w4a8("qweight", "scales", "qzeros"),
            tensors,
            layer_cfg("gptq"),
            NON_AMX,
        )


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
    ref = module_of(
        qweight=torch.zeros(16, 64, dtype=torch.int32),
        scales=torch.ones(4, 64, dtype=BF16),
        qzeros=torch.zeros(4, 8, dtype=torch.int32),
    )
    ref.qweight.input_dim = ref.qweight.packed_dim = 0
    ref.scales.output_dim = 1
    ref.bias = None
    vllm_cpu_kernel(128, 64, 32, False).process_weights_after_loading(ref)
    assert ref.use_w4a8 == cpu_wna16.use_w4a8_for(BF16, HOST)
    if ref.use_w4a8:  # w4a8 replaces the emptied slot by its fake, blocked zero points
        assert ref.qzeros.dtype == torch.int8 and "qzeros" in ref._parameters
    else:
        assert ref.qzeros is None and "qzeros" in ref._parameters


def test_repack_refuses_w4a8_target():
    """The repack stage refuses a target that selects the w4a8 layout."""
    with pytest.raises(common.StageInputError, match="w4a8"):
        run_stage(
            cpu_wna16.repack("qweight"),
            {"qweight": torch.zeros(16, 64, dtype=torch.int32)},
            layer_cfg("gptq"),
            Target("cpu", isa={"amx"}),
        )
