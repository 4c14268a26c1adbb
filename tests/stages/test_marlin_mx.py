"""Issue 46: the Marlin MoE layouts of :mod:`wcache.stages.marlin_mx` (FP8 tensor and
block, canonical MXFP4) and the serialized MXFP8 linear plan, on CPU.

Each MoE plan: restore(export(prepare)) == load on drawn checkpoints (tensors,
strides, bytes), every stage pure, replaying restore twice == once; and the Marlin
layout decodes back to the checkpoint: per expert, the un-repacked values are the
checkpoint's bytes (requantized to the max scale for per-tensor FP8) with the padded
tail zero, and the un-permuted scales are the checkpoint's (the FP8 exponent bias
divided out; the E8M0 reorder undone). vLLM's own functions are checked against the
same plans in tests/plans/test_fused_moe.py.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import moe_cases as mc
from tests.helpers import reference_kernels as R
from tests.helpers.cuda_cases import (
    assert_restore_invariant,
    assert_stages_pure,
    attr_paths,
    cuda_config,
    fp8_bits,
    roundtrip,
)
from wcache.plans.registry import plan_for
from wcache.shell import restore_, snapshot
from wcache.stages import marlin as M
from wcache.stages import marlin_mx as MX
from wcache.stages.moe import requantize_w13_to_max_scale

#: bf16 FP8-Marlin scales carry ``2 ** 120`` (``fp8_exponent_bias(bfloat16)``).
BF16_FP8_BIAS = 2.0**120
#: Hypothesis budget per MoE plan: each draw repacks up to 8 experts on 2 cores.
MOE_EXAMPLES = 8
_SETTINGS = settings(
    max_examples=MOE_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _invariant(cfg, tensors, target):
    """(plan, loaded, restored): restore == load, stages pure, replay twice == once."""
    plan = plan_for(cfg, target=target).plan
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, target)
    paths = attr_paths(plan)
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    assert_stages_pure(plan, tensors, cfg, target)
    restore_(restored, plan.bind(cfg, target), prepared.recorded, strict=True)
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    return plan, loaded, restored


def _unrepack_experts(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``[E, Kp/16, Np*bits/2]`` Marlin -> ``[E, Kp, Np]`` values (int32)."""
    return torch.stack([R.marlin_unrepack(q[e], bits) for e in range(q.shape[0])])


def _fp8_bytes_kn(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` float8 -> ``[E, K, N]`` its bytes as int32."""
    return w.view(torch.uint8).to(torch.int32).transpose(1, 2)


@_SETTINGS
@given(st.one_of(mc.fp8_tensor_marlin(), mc.fp8_block_marlin()))
def test_fp8_marlin_moe_restore_and_decode(case):
    """FP8 MoE on Marlin (tensor, block): restore == load, and each expert's Marlin
    weight decodes to the checkpoint's FP8 bytes (per tensor: w1/w3 requantized to the
    max scale first), zero in the padded intermediate; the scales decode to the
    checkpoint's (expanded to channels or K-groups) times the exponent bias."""
    cfg, tensors, target = case
    plan, loaded, _ = _invariant(cfg, tensors, target)
    moe = cfg.moe
    n, h = moe.intermediate_size_per_partition, moe.hidden_size
    padded = MX.marlin_moe_padded_intermediate(n, MX.fp8_block_group_size(cfg))
    block = plan.kernel == "marlin" and cfg.quant.method == "fp8_moe_block"
    w13 = tensors["w13_weight"]
    if not block:
        w13, _ = requantize_w13_to_max_scale(w13, tensors["w13_weight_scale"], n)
    got13 = _unrepack_experts(loaded.w13_weight, 8)  # [E, H, 2Ip]
    want13 = _fp8_bytes_kn(w13)  # [E, H, 2I]
    got13 = got13.reshape(moe.num_experts, h, 2, padded)
    assert torch.equal(got13[..., :n], want13.reshape(moe.num_experts, h, 2, n))
    assert not got13[..., n:].any()
    got2 = _unrepack_experts(loaded.w2_weight, 8)  # [E, Ip, H]
    assert torch.equal(got2[:, :n], _fp8_bytes_kn(tensors["w2_weight"]))
    assert not got2[:, n:].any()
    if block:
        scale = loaded.w2_weight_scale_inv  # [E, Ip/128, H]
        groups = padded // mc.BLOCK
        s = torch.stack([R.marlin_unpermute_scales(x, padded, h, mc.BLOCK) for x in scale])
        want = tensors["w2_weight_scale_inv"].permute(0, 2, 1).repeat_interleave(mc.BLOCK, 2)
        assert s.shape == (moe.num_experts, groups, h)
        assert torch.equal(s.float() / BF16_FP8_BIAS, want[..., :h].to(torch.bfloat16).float())
    else:
        scale = loaded.w2_weight_scale  # [E, 1, H]
        s = torch.stack([R.marlin_unpermute_scales(x, padded, h, -1) for x in scale])
        want = tensors["w2_weight_scale"].to(torch.bfloat16).float().view(-1, 1, 1).expand(-1, 1, h)
        assert torch.equal(s.float() / BF16_FP8_BIAS, want)


@_SETTINGS
@given(st.one_of(mc.mxfp4_marlin(), mc.mxfp4_marlin("gpt_oss_mxfp4")))
def test_mxfp4_marlin_moe_restore_and_decode(case):
    """Canonical MXFP4 MoE on Marlin: restore == load, each expert's Marlin weight decodes
    to the checkpoint's E2M1 nibbles, the E8M0 scales to the checkpoint's codes, the
    bias to the checkpoint's rows."""
    cfg, tensors, target = case
    _, loaded, _ = _invariant(cfg, tensors, target)
    moe = cfg.moe
    for proj, (size_n, size_k) in (
        ("w13", (2 * moe.intermediate_size_per_partition, moe.hidden_size)),
        ("w2", (moe.hidden_size, moe.intermediate_size_per_partition)),
    ):
        vals = _unrepack_experts(getattr(loaded, f"{proj}_weight"), 4)  # [E, K, N]
        packed = tensors[f"{proj}_weight"]  # [E, N, K/2]
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(
            moe.num_experts, size_n, size_k
        )
        assert torch.equal(vals, nibbles.to(torch.int32).transpose(1, 2))
        scale = getattr(loaded, f"{proj}_weight_scale")  # [E, K/32, N] e8m0
        reorder = list(M.MXFP8_SCALE_REORDER)
        codes = scale.view(torch.uint8).reshape(-1, 4)
        inverse = torch.empty_like(codes)
        inverse[:, reorder] = codes
        codes = inverse.reshape(scale.shape)
        s = torch.stack([R.marlin_unpermute_scales(x, size_k, size_n, 32) for x in codes])
        assert torch.equal(s, tensors[f"{proj}_weight_scale"].transpose(1, 2))
        if cfg.moe.has_bias:
            bias = getattr(loaded, f"{proj}_bias")
            rows = torch.stack([R.marlin_unpermute_bias(b) for b in bias])
            assert torch.equal(rows, tensors[f"{proj}_bias"])


@settings(max_examples=10, deadline=None)
@given(
    st.sampled_from([48, 100, 256]),
    st.sampled_from([64, 96, 256]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_modelopt_mxfp8_marlin_forward_equals_the_checkpoints(n, k, bias, seed):
    """Serialized MXFP8 on Marlin: the reference Marlin GEMM over the repacked weight and
    permuted E8M0 scales equals the checkpoint's dequantized GEMM bit for bit (N, K off
    Marlin's tiles included: padding sliced away)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "weight": fp8_bits(g, (n, k)),
        "weight_scale": torch.randint(120, 134, (n, k // 32), generator=g).to(torch.uint8),
    }
    if bias:
        tensors["bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    cfg = cuda_config("modelopt_mxfp8", k, n, bits=8, g=32, kernel="marlin", bias=bias)
    plan, _, _, x, out = assert_restore_invariant(cfg, tensors, seed)
    assert plan.id == "modelopt_mxfp8/marlin@1"
    w = R.mxfp8_checkpoint_weight(tensors["weight"], tensors["weight_scale"])
    assert torch.equal(out, R._matmul(x, w.t(), tensors.get("bias")))
