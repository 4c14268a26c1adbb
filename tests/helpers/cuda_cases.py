"""Checkpoint-format tensors, layer configs and hypothesis strategies for the
CUDA-layout plans (Marlin, Machete, CUTLASS INT8/FP8, NVFP4), shared by
tests/plans/test_cuda_plans.py and tests/plans/test_registry.py. CPU only, no vLLM; and the restore invariant and purity checks over them."""

from __future__ import annotations

import torch
from attrs import evolve
from hypothesis import strategies as st

from tests.helpers import reference_kernels as R
from wcache.core import LayerConfig, Plan, QuantSpec, StageOut, Target
from wcache.plans.registry import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot, state_from_module
from wcache.stages import packing as P
from wcache.testing.plans import UncheckedPlan

#: What the adapter records of a MacheteLinearKernel (here vLLM 0.32's uint4b8 id).
MACHETE_EXTRA = (("machete_act_type", "bfloat16"), ("machete_b_type_id", 1125899907892224))
#: The LayerConfig extra the adapter passes where vLLM 0.33's compressed-tensors FP8
#: post-load sets ``layer.processed_weight_dims``.
PROCESSED_WEIGHT_DIMS = (("processed_weight_dims", (0, 1)),)
H200 = Target("cuda", (9, 0))
B200 = Target("cuda", (10, 0))
CPU = Target("cpu", None, frozenset({"avx512"}))
#: float8_e4m3fn NaN bit patterns (S.1111.111); drawn fp8 bytes avoid them.
FP8_NAN_BITS = (0x7F, 0xFF)
#: Largest positive finite float8_e4m3fn byte below NaN, used to draw positive scales.
FP8_POS_MAX_BITS = 0x7E
#: Ceiling for drawn positive FP8 block scales: keeps products with 6.0 and global
#: scales far from overflow while still covering subnormals.
FP8_SCALE_MAX_BITS = 0x58


# --------------------------------------------------------------------------- builders


def make_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module holding ``tensors`` as frozen Parameters."""
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return m


def export(prepared) -> torch.nn.Module:
    """Clone the daemon's exported tensors into a fresh module (strides preserved)."""
    m = torch.nn.Module()
    for name, t in prepared.tensors.items():
        if name in prepared.buffers:
            m.register_buffer(name, t.clone())
        else:
            m.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


def attr_paths(plan: Plan) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a for s in plan.stages for a in s.attrs))


def roundtrip(plan: Plan, tensors: dict, config: LayerConfig, target: Target):
    """(loaded, restored, prepared) for one checkpoint."""
    loaded = make_module({k: v.clone() for k, v in tensors.items()})
    load_(loaded, plan.bind(config, target))
    daemon = make_module({k: v.clone() for k, v in tensors.items()})
    prepared = prepare_(daemon, plan.bind(config, target))
    restored = export(prepared)
    restore_(
        restored, plan.bind(config, target), prepared.recorded, strict=True, drops=prepared.drops
    )
    return loaded, restored, prepared


def seeded_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ints(g, shape, bits):
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.int32)


def _scales(g, shape, dtype=torch.bfloat16):
    return (torch.rand(shape, generator=g) * 0.02 + 0.001).to(dtype)


def fp8_bits(g, shape, positive=False, max_bits=FP8_POS_MAX_BITS) -> torch.Tensor:
    """Random finite float8_e4m3fn drawn as bit patterns."""
    if positive:
        b = torch.randint(1, max_bits + 1, shape, generator=g, dtype=torch.int32)
    else:
        b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
        for nan in FP8_NAN_BITS:
            b = torch.where(b == nan, torch.zeros_like(b), b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def int_checkpoint(method, k, n, g, bits, zero_point, bias, seed):
    gen = seeded_generator(seed)
    groups = k // g if g > 0 else 1
    q = _ints(gen, (k, n), bits)
    s = _scales(gen, (groups, n))
    zp = _ints(gen, (groups, n), bits)
    t: dict[str, torch.Tensor] = {}
    if method == "awq":
        t = {"qweight": P.pack_awq(q, 4), "qzeros": P.pack_awq(zp, 4), "scales": s}
    elif method == "gptq":
        t = {
            "qweight": P.pack_int32(q.t().contiguous(), bits, -1).t().contiguous(),
            "qzeros": P.pack_int32(zp, bits, -1),
            "scales": s,
        }
    else:
        t = {
            "weight_packed": P.pack_int32(q.t().contiguous(), bits, -1),
            "weight_scale": s.t().contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if zero_point:
            t["weight_zero_point"] = P.pack_int32(zp, bits, -1).t().contiguous()
    if bias:
        t["bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    return t


def cuda_config(
    method,
    k,
    n,
    *,
    bits=16,
    g=-1,
    zp=False,
    strategy=None,
    static=False,
    kind="linear",
    kernel=None,
    extra=(),
    bias=False,
):
    return LayerConfig(
        QuantSpec(
            method,
            num_bits=bits,
            group_size=g,
            zero_point=zp,
            strategy=strategy,
            static_input=static,
            layer_kind=kind,
            kernel=kernel,
        ),
        size_k=k,
        size_n=n,
        has_bias=bias,
        name=f"{method}.layer",
        extra=extra,
    )


# --------------------------------------------------------------------------- strategies


@st.composite
def marlin_int_cases(draw):
    method = draw(st.sampled_from(["awq", "gptq", "ct_w4a16"]))
    bits = 4 if method == "awq" else draw(st.sampled_from([4, 8]))
    zp = True if method == "awq" else (draw(st.booleans()) if method == "ct_w4a16" else False)
    g = draw(st.sampled_from([-1, 32, 64, 128]))
    k = (
        draw(st.sampled_from([128, 192, 256]))
        if g in (-1, 32, 64)
        else draw(st.sampled_from([128, 256]))
    )
    n = draw(st.sampled_from([64, 96, 128, 200 if bits == 8 else 160]))
    n = n if n % 8 == 0 else 64
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    cfg = cuda_config(method, k, n, bits=bits, g=g, zp=zp, kernel="marlin", bias=bias)
    return cfg, int_checkpoint(method, k, n, g, bits, zp, bias, seed)


@st.composite
def machete_int_cases(draw):
    """AWQ, GPTQ and CT W4A16 checkpoints on Machete's shapes (K % 64, N % 128)."""
    method = draw(st.sampled_from(["awq", "gptq", "ct_w4a16"]))
    bits = 4 if method != "gptq" else draw(st.sampled_from([4, 8]))
    zp = True if method == "awq" else (draw(st.booleans()) if method == "ct_w4a16" else False)
    g = draw(st.sampled_from([-1, 64, 128]))
    k, n = draw(st.sampled_from([128, 256])), draw(st.sampled_from([128, 256]))
    bias = draw(st.booleans())
    cfg = cuda_config(
        method, k, n, bits=bits, g=g, zp=zp, kernel="machete", bias=bias, extra=MACHETE_EXTRA
    )
    return cfg, int_checkpoint(method, k, n, g, bits, zp, bias, draw(st.integers(0, 2**16)))


@st.composite
def cutlass_int8_cases(draw):
    """CT W8A8 INT8 checkpoints: tensor/channel scales, fused or not, static/dynamic,
    symmetric/asymmetric activations."""
    widths = draw(st.sampled_from([(64,), (32, 16, 16), (48, 16)]))
    strategy = draw(st.sampled_from(["tensor", "channel"]))
    static, symmetric = draw(st.booleans()), draw(st.booleans())
    k, seed = draw(st.sampled_from([32, 64, 96])), draw(st.integers(0, 2**16))
    g = seeded_generator(seed)
    n = sum(widths)
    t = {
        "weight": torch.randint(-128, 128, (n, k), generator=g).to(torch.int8),
        "weight_scale": (
            torch.rand((n, 1) if strategy == "channel" else (len(widths),), generator=g) * 0.01
            + 1e-3
        ),
    }
    if static:
        t["input_scale"] = torch.rand(1, generator=g) * 0.1 + 0.01
        if not symmetric:
            t["input_zero_point"] = torch.randint(-20, 20, (1,), generator=g).to(torch.int8)
    cfg = LayerConfig(
        QuantSpec(
            "ct_w8a8_int8",
            num_bits=8,
            act_bits=8,
            strategy=strategy,
            static_input=static,
            input_symmetric=symmetric,
            kernel="cutlass_int8",
        ),
        size_k=k,
        size_n=n,
        name="ct_w8a8_int8.layer",
        extra=(("logical_widths", widths),),
    )
    return cfg, t


#: The checkpoint kinds :func:`fp8_cases` draws for the FP8 plans (wcache/plans/fp8.py).
FP8_KINDS = (
    "fp8_per_tensor",
    "fp8_per_channel",
    "fp8_per_block",
    "ct_tensor",
    "ct_channel",
    "fp8_serialized",
    "fp8_block_serialized",
    "ct_marlin",
    "fp8_marlin",
)
#: ... and for the MXFP8 plans (wcache/plans/mxfp8.py).
MXFP8_KINDS = ("mxfp8", "modelopt_mxfp8")


@st.composite
def fp8_cases(draw, kinds: tuple[str, ...] = FP8_KINDS + MXFP8_KINDS):
    """An FP8/MXFP8 plan of ``kinds`` (default: every one) with a checkpoint drawn for
    it (N, K not multiples of 16)."""
    which = draw(st.sampled_from(kinds))
    n = draw(st.sampled_from([48, 100, 130, 256]))
    k = (
        draw(st.sampled_from([64, 96, 200]))
        if which not in ("mxfp8", "modelopt_mxfp8")
        else draw(st.sampled_from([64, 96, 256]))
    )
    seed = draw(st.integers(0, 2**16))
    bias = draw(st.booleans())
    g = seeded_generator(seed)
    dense = {"weight": (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)}
    extra = ()
    if which == "fp8_per_tensor":
        cfg, t = cuda_config("fp8_per_tensor", k, n, kernel="cutlass"), dense
    elif which == "fp8_per_channel":
        cfg, t = cuda_config("fp8_per_channel", k, n, kernel="cutlass"), dense
    elif which == "fp8_per_block":
        cfg, t = cuda_config("fp8_per_block", k, n, kernel="cutlass_block", strategy="block"), dense
    elif which == "mxfp8":
        cfg, t = cuda_config("mxfp8", k, n, kernel="marlin"), dense
    elif which == "modelopt_mxfp8":
        t = {
            "weight": fp8_bits(g, (n, k)),
            "weight_scale": torch.randint(120, 134, (n, k // 32), generator=g).to(torch.uint8),
        }
        cfg = cuda_config("modelopt_mxfp8", k, n, bits=8, g=32, kernel="marlin")
    elif which == "fp8_block_serialized":
        t = {
            "weight": fp8_bits(g, (n, k)),
            "weight_scale_inv": torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01,
        }
        cfg = cuda_config("fp8", k, n, strategy="block", kernel="cutlass_block")
    else:
        channel = which == "ct_channel"
        half = n // 2
        extra = (("logical_widths", (half, n - half)),)
        scale = (
            (torch.rand(n, 1, generator=g) * 0.01 + 1e-4)
            if channel
            else (torch.rand(2, generator=g) * 0.01 + 1e-4)
        )
        static = draw(st.booleans()) and not channel
        t = {"weight": fp8_bits(g, (n, k)), "weight_scale": scale}
        if static:
            t["input_scale"] = torch.rand(2, generator=g) + 0.5
        method = "fp8" if which in ("fp8_serialized", "fp8_marlin") else "ct_w8a8_fp8"
        if method == "ct_w8a8_fp8" and draw(st.booleans()):  # vLLM 0.33's layer attribute
            extra = (*extra, ("processed_weight_dims", (0, 1)))
        kernel = "fp8_marlin" if which in ("ct_marlin", "fp8_marlin") else "cutlass"
        cfg = cuda_config(
            method,
            k,
            n,
            strategy="channel" if channel else "tensor",
            static=static,
            kernel=kernel,
            extra=extra,
        )
    if bias:
        t = dict(t, bias=torch.randn(n, generator=g).to(torch.bfloat16))
        cfg = evolve(cfg, has_bias=True)
    return cfg, t


def nvfp4_linear_checkpoint(n, k, seed, bias=False):
    g = seeded_generator(seed)
    t = {
        "weight": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(
            torch.uint8
        ),
        "weight_scale": fp8_bits(g, (n, k // 16), positive=True, max_bits=FP8_SCALE_MAX_BITS),
        "weight_scale_2": torch.rand(2, generator=g) * 0.01 + 1e-3,
        "input_scale": torch.rand(2, generator=g) + 0.5,
    }
    if bias:
        t["bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    return t


def nvfp4_marlin_moe_config(e, hidden, inter):
    """A ModelOpt NVFP4 fused-MoE LayerConfig as the adapter builds it on sm90 (vLLM's
    oracle resolved MARLIN / MarlinExperts)."""
    from wcache.core import MoeShape

    shape = MoeShape(
        num_experts=e,
        global_num_experts=e,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        backend="MARLIN",
        experts="MarlinExperts",
    )
    return LayerConfig(
        QuantSpec("modelopt_fp4", num_bits=4, group_size=16, layer_kind="moe", kernel="marlin_moe"),
        0,
        0,
        params_dtype="bfloat16",
        name="modelopt_fp4.experts",
        moe=shape,
    )


def nvfp4_moe_checkpoint(e, hidden, inter, seed):
    g = seeded_generator(seed)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731 (a one-line local function)
    return {
        "w13_weight": u8(e, 2 * inter, hidden // 2),
        "w13_weight_scale": fp8_bits(g, (e, 2 * inter, hidden // 16), True, FP8_SCALE_MAX_BITS),
        "w13_weight_scale_2": (torch.rand(e, 1, generator=g) * 0.01 + 1e-3).repeat(1, 2),
        "w13_input_scale": torch.rand(e, 2, generator=g) + 0.5,
        "w2_weight": u8(e, hidden, inter // 2),
        "w2_weight_scale": fp8_bits(g, (e, hidden, inter // 16), True, FP8_SCALE_MAX_BITS),
        "w2_weight_scale_2": torch.rand(e, generator=g) * 0.01 + 1e-3,
        "w2_input_scale": torch.rand(e, generator=g) + 0.5,
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.itemsize == 1 and a.dtype not in (torch.uint8, torch.int8):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def assert_stages_pure(plan: Plan, tensors: dict, cfg: LayerConfig, target: Target) -> None:
    """Run ``plan`` stage by stage; no stage changes its inputs' values or version counters."""
    state = state_from_module(make_module({k: v.clone() for k, v in tensors.items()}))
    for st_ in plan.stages:
        before = {k: (v.clone(), v._version) for k, v in state.tensors.items()}
        out = st_(dict(state.tensors), cfg, target, {})
        assert isinstance(out, StageOut)
        for k, (val, ver) in before.items():
            assert state.tensors[k]._version == ver, (st_.name, k)
            assert same_bytes(state.tensors[k], val), (st_.name, k)
        one = UncheckedPlan(plan.method, plan.kernel, (st_,), checkpoint=frozenset(state.tensors))
        state = one.run(state, cfg, target, frozenset({st_.tag}), check_purity=True)


#: The NVFP4 kernels vLLM picks only on Blackwell (their plans resolve on sm100 only).
_SM100_KERNELS = ("cutlass", "cutlass_moe")


def target_for(cfg: LayerConfig) -> Target:
    """The target a CUDA case's plan resolves on: sm100 for the Blackwell-only NVFP4 kernels."""
    sm100 = cfg.quant.method == "modelopt_fp4" and cfg.quant.kernel in _SM100_KERNELS
    return B200 if sm100 else H200


_FORWARD = {
    "marlin": lambda cfg: R.marlin_int_forward,
    "cutlass": lambda cfg: R.cutlass_fp8_forward,
    "cutlass_block": lambda cfg: R.block_fp8_forward,
    "fp8_marlin": lambda cfg: R.fp8_marlin_forward,
}


def forward_for(plan: Plan, cfg: LayerConfig):
    """The reference forward of ``plan``'s kernel (tests.helpers.reference_kernels)."""
    if plan.method in ("mxfp8", "modelopt_mxfp8"):
        return R.mxfp8_marlin_forward
    if plan.method == "modelopt_fp4":
        return R.nvfp4_linear_forward if plan.kernel == "cutlass" else R.nvfp4_moe_forward
    return _FORWARD[plan.kernel](cfg)


def assert_restore_invariant(cfg: LayerConfig, tensors: dict, seed: int = 0):
    """restore(export(prepare(x))) == load(x): snapshot and reference forward, bit for bit;
    the checkpoint tensors are untouched by all three runs; every stage is pure on this
    draw; replaying restore a second time changes nothing."""
    target = target_for(cfg)
    plan = plan_for(cfg, target=target).plan
    before = {k: v.clone() for k, v in tensors.items()}
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, target)
    paths = attr_paths(plan)
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    for k, v in tensors.items():
        assert torch.equal(
            before[k].view(torch.uint8) if v.dtype.itemsize == 1 else before[k],
            v.view(torch.uint8) if v.dtype.itemsize == 1 else v,
        )
    assert_stages_pure(plan, tensors, cfg, target)
    restore_(
        restored, plan.bind(cfg, target), prepared.recorded, strict=True
    )  # replay twice == once
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    fwd = forward_for(plan, cfg)
    if plan.method == "modelopt_fp4" and plan.kernel == "cutlass_moe":
        x = torch.randn(3, tensors["w2_weight"].shape[1], generator=seeded_generator(seed)).to(
            torch.bfloat16
        )
    else:
        x = torch.randn(3, cfg.size_k, generator=seeded_generator(seed)).to(torch.bfloat16)
    out_loaded, out_restored = fwd(loaded, cfg, x), fwd(restored, cfg, x)
    assert torch.equal(out_loaded, out_restored)
    return plan, loaded, restored, x, out_loaded
