"""CUDA-layout plans (Marlin, CUTLASS FP8, MXFP8, NVFP4) checked on CPU.

Layers are plain ``nn.Module`` objects holding checkpoint-format tensors (vLLM's
``create_weights`` needs CUDA kernels). "Export" clones ``Prepared.tensors`` into a
fresh module, which ``restore_(..., strict=True)`` then finishes; the restore
invariant compares :func:`wcache.shell.snapshot` and the reference forward of
``tests/reference_kernels.py`` with an ordinary load.
"""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_kernels as R
from wcache.core import (
    LayerConfig, NoPlan, Plan, PlanInvalid, QuantSpec, RecordedMismatch,
    RestoreWroteSharedTensor, StageOut, Tag, Target,
)
from wcache.plans import cutlass_int8 as cutlass_int8_plans
from wcache.plans import fp8 as fp8_plans
from wcache.plans import machete as machete_plans
from wcache.plans import marlin as marlin_plans
from wcache.plans import mxfp8 as mxfp8_plans
from wcache.plans import nvfp4 as nvfp4_plans
from wcache.plans.registry import all_plans, plan_for
from wcache.shell import load_, prepare_, restore_, snapshot, state_from_module
from wcache.stages import marlin as M
from wcache.stages import nvfp4 as F4
from wcache.testing.plans import UncheckedPlan, unregistered_stage

H200 = Target("cuda", (9, 0))
B200 = Target("cuda", (10, 0))
CPU = Target("cpu", None, frozenset({"avx512"}))
#: AWQ packs column j*8+AWQ_PACK_ORDER[i] into nibble i of word j.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
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
    restore_(restored, plan.bind(config, target), prepared.recorded, strict=True,
             drops=prepared.drops)
    return loaded, restored, prepared


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ints(g, shape, bits):
    return torch.randint(0, 2 ** bits, shape, generator=g, dtype=torch.int32)


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


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    k, n = q.shape
    return M.pack_int32(q.reshape(k, n // 8, 8)[:, :, list(AWQ_PACK_ORDER)].reshape(k, n), 4)


def int_checkpoint(method, k, n, g, bits, zero_point, bias, seed):
    gen = _gen(seed)
    groups = k // g if g > 0 else 1
    q = _ints(gen, (k, n), bits)
    s = _scales(gen, (groups, n))
    zp = _ints(gen, (groups, n), bits)
    t: dict[str, torch.Tensor] = {}
    if method == "awq":
        t = {"qweight": awq_pack(q), "qzeros": awq_pack(zp), "scales": s}
    elif method == "gptq":
        t = {"qweight": M.pack_int32(q.t().contiguous(), bits).t().contiguous(),
             "qzeros": M.pack_int32(zp, bits), "scales": s}
    else:
        t = {"weight_packed": M.pack_int32(q.t().contiguous(), bits),
             "weight_scale": s.t().contiguous(),
             "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if zero_point:
            t["weight_zero_point"] = M.pack_int32(zp, bits).t().contiguous()
    if bias:
        t["bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    return t


def _config(method, k, n, *, bits=16, g=-1, zp=False, strategy=None, static=False,
            kind="linear", kernel=None, extra=(), bias=False):
    return LayerConfig(QuantSpec(method, num_bits=bits, group_size=g, zero_point=zp,
                                 strategy=strategy, static_input=static, layer_kind=kind,
                                 kernel=kernel),
                       size_k=k, size_n=n, has_bias=bias, name=f"{method}.layer", extra=extra)


# --------------------------------------------------------------------------- strategies


@st.composite
def marlin_int_cases(draw):
    method = draw(st.sampled_from(["awq", "gptq", "ct_w4a16"]))
    bits = 4 if method == "awq" else draw(st.sampled_from([4, 8]))
    zp = True if method == "awq" else (draw(st.booleans()) if method == "ct_w4a16" else False)
    g = draw(st.sampled_from([-1, 32, 64, 128]))
    k = draw(st.sampled_from([128, 192, 256])) if g in (-1, 32, 64) else draw(st.sampled_from([128, 256]))
    n = draw(st.sampled_from([64, 96, 128, 200 if bits == 8 else 160]))
    n = n if n % 8 == 0 else 64
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    cfg = _config(method, k, n, bits=bits, g=g, zp=zp, kernel="marlin", bias=bias)
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
    cfg = _config(method, k, n, bits=bits, g=g, zp=zp, kernel="machete", bias=bias,
                  extra=MACHETE_EXTRA)
    return cfg, int_checkpoint(method, k, n, g, bits, zp, bias, draw(st.integers(0, 2 ** 16)))


@st.composite
def cutlass_int8_cases(draw):
    """CT W8A8 INT8 checkpoints: tensor/channel scales, fused or not, static/dynamic,
    symmetric/asymmetric activations."""
    widths = draw(st.sampled_from([(64,), (32, 16, 16), (48, 16)]))
    strategy = draw(st.sampled_from(["tensor", "channel"]))
    static, symmetric = draw(st.booleans()), draw(st.booleans())
    k, seed = draw(st.sampled_from([32, 64, 96])), draw(st.integers(0, 2 ** 16))
    g = _gen(seed)
    n = sum(widths)
    t = {"weight": torch.randint(-128, 128, (n, k), generator=g).to(torch.int8),
         "weight_scale": (torch.rand((n, 1) if strategy == "channel" else (len(widths),),
                                     generator=g) * 0.01 + 1e-3)}
    if static:
        t["input_scale"] = torch.rand(1, generator=g) * 0.1 + 0.01
        if not symmetric:
            t["input_zero_point"] = torch.randint(-20, 20, (1,), generator=g).to(torch.int8)
    cfg = LayerConfig(QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy=strategy,
                                static_input=static, input_symmetric=symmetric,
                                kernel="cutlass_int8"),
                      size_k=k, size_n=n, name="ct_w8a8_int8.layer",
                      extra=(("logical_widths", widths),))
    return cfg, t


@st.composite
def fp8_cases(draw):
    """Every FP8/MXFP8 plan with a checkpoint drawn for it (N, K not multiples of 16)."""
    which = draw(st.sampled_from(["fp8_per_tensor", "fp8_per_channel", "fp8_per_block",
                                  "ct_tensor", "ct_channel", "fp8_serialized",
                                  "fp8_block_serialized", "ct_marlin", "fp8_marlin", "mxfp8"]))
    n = draw(st.sampled_from([48, 100, 130, 256]))
    k = draw(st.sampled_from([64, 96, 200])) if which != "mxfp8" else draw(st.sampled_from([64, 96, 256]))
    seed = draw(st.integers(0, 2 ** 16))
    bias = draw(st.booleans())
    g = _gen(seed)
    dense = {"weight": (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)}
    extra = ()
    if which == "fp8_per_tensor":
        cfg, t = _config("fp8_per_tensor", k, n, kernel="cutlass"), dense
    elif which == "fp8_per_channel":
        cfg, t = _config("fp8_per_channel", k, n, kernel="cutlass"), dense
    elif which == "fp8_per_block":
        cfg, t = _config("fp8_per_block", k, n, kernel="cutlass_block", strategy="block"), dense
    elif which == "mxfp8":
        cfg, t = _config("mxfp8", k, n, kernel="marlin"), dense
    elif which == "fp8_block_serialized":
        t = {"weight": fp8_bits(g, (n, k)),
             "weight_scale_inv": torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01}
        cfg = _config("fp8", k, n, strategy="block", kernel="cutlass_block")
    else:
        channel = which == "ct_channel"
        half = n // 2
        extra = (("logical_widths", (half, n - half)),)
        scale = (torch.rand(n, 1, generator=g) * 0.01 + 1e-4) if channel else \
            (torch.rand(2, generator=g) * 0.01 + 1e-4)
        static = draw(st.booleans()) and not channel
        t = {"weight": fp8_bits(g, (n, k)), "weight_scale": scale}
        if static:
            t["input_scale"] = torch.rand(2, generator=g) + 0.5
        method = "fp8" if which in ("fp8_serialized", "fp8_marlin") else "ct_w8a8_fp8"
        kernel = "fp8_marlin" if which in ("ct_marlin", "fp8_marlin") else "cutlass"
        cfg = _config(method, k, n, strategy="channel" if channel else "tensor",
                      static=static, kernel=kernel, extra=extra)
    if bias:
        t = dict(t, bias=torch.randn(n, generator=g).to(torch.bfloat16))
        cfg = evolve(cfg, has_bias=True)
    return cfg, t


def nvfp4_linear_checkpoint(n, k, seed, bias=False):
    g = _gen(seed)
    t = {"weight": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8),
         "weight_scale": fp8_bits(g, (n, k // 16), positive=True, max_bits=FP8_SCALE_MAX_BITS),
         "weight_scale_2": torch.rand(2, generator=g) * 0.01 + 1e-3,
         "input_scale": torch.rand(2, generator=g) + 0.5}
    if bias:
        t["bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    return t


def nvfp4_moe_checkpoint(e, hidden, inter, seed):
    g = _gen(seed)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731
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


_FORWARD = {
    "marlin": lambda cfg: R.marlin_int_forward,
    "cutlass": lambda cfg: R.cutlass_fp8_forward,
    "cutlass_block": lambda cfg: R.block_fp8_forward,
    "fp8_marlin": lambda cfg: R.fp8_marlin_forward,
}


def forward_for(plan: Plan, cfg: LayerConfig):
    if plan.method == "mxfp8":
        return R.mxfp8_marlin_forward
    if plan.method == "modelopt_fp4":
        return R.nvfp4_linear_forward if plan.kernel == "cutlass" else R.nvfp4_moe_forward
    return _FORWARD[plan.kernel](cfg)


def assert_restore_invariant(cfg: LayerConfig, tensors: dict, seed: int = 0):
    """restore(export(prepare(x))) == load(x): snapshot and reference forward, bit for bit;
    the checkpoint tensors are untouched by all three runs; every stage is pure on this
    draw; replaying restore a second time changes nothing."""
    target = _target(cfg)
    plan = plan_for(cfg, target=target).plan
    before = {k: v.clone() for k, v in tensors.items()}
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, target)
    paths = attr_paths(plan)
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    for k, v in tensors.items():
        assert torch.equal(before[k].view(torch.uint8) if v.dtype.itemsize == 1 else before[k],
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v)
    assert_stages_pure(plan, tensors, cfg, target)
    restore_(restored, plan.bind(cfg, target), prepared.recorded,
             strict=True)      # replay twice == once
    assert snapshot(loaded, paths) == snapshot(restored, paths)
    fwd = forward_for(plan, cfg)
    if plan.method == "modelopt_fp4" and plan.kernel == "cutlass_moe":
        x = torch.randn(3, tensors["w2_weight"].shape[1], generator=_gen(seed)).to(torch.bfloat16)
    else:
        x = torch.randn(3, cfg.size_k, generator=_gen(seed)).to(torch.bfloat16)
    out_loaded, out_restored = fwd(loaded, cfg, x), fwd(restored, cfg, x)
    assert torch.equal(out_loaded, out_restored)
    return plan, loaded, restored, x, out_loaded


# --------------------------------------------------------------------------- invariant


@settings(max_examples=20)
@given(marlin_int_cases())
def test_marlin_int_restore_invariant_and_checkpoint_forward(case):
    """AWQ/GPTQ/CT-W4A16 Marlin: restore == load, and the Marlin-layout forward equals
    the checkpoint's dequantized forward bit for bit (padding sliced away)."""
    cfg, tensors = case
    plan, loaded, _, x, out = assert_restore_invariant(cfg, tensors)
    assert plan.kernel == "marlin"
    assert torch.equal(R.int_checkpoint_forward(tensors, cfg, x), out)
    w_name = "weight_packed" if cfg.quant.method == "ct_w4a16" else "qweight"
    vals = R.marlin_unrepack(getattr(loaded, w_name), cfg.quant.num_bits)
    tail = torch.cat([vals[cfg.size_k:].reshape(-1), vals[:, cfg.size_n:].reshape(-1)])
    assert torch.equal(tail, torch.zeros_like(tail))                  # padded tails are zero


@settings(max_examples=25)
@given(fp8_cases())
def test_fp8_restore_invariant(case):
    """Every FP8/MXFP8 plan: restore == load (snapshot incl. logical width, forward)."""
    cfg, tensors = case
    plan, loaded, _, x, out = assert_restore_invariant(cfg, tensors)
    assert out.shape == (3, cfg.size_n)
    if plan.kernel == "cutlass":
        assert loaded.logical_output_size == cfg.size_n
        assert loaded.weight.shape[0] % 16 == 0 and loaded.weight.shape[1] % 16 == 0
        assert loaded.weight.stride() == (1, loaded.weight.shape[0])
        tail = loaded.weight[:, cfg.size_n:].view(torch.uint8)
        assert torch.equal(tail, torch.zeros_like(tail))
        if loaded.weight_scale.numel() > 1:
            pad = loaded.weight_scale.reshape(-1)[cfg.size_n:]
            assert torch.equal(pad, torch.ones_like(pad))


@settings(max_examples=10)
@given(st.sampled_from([32, 100, 128, 160]), st.sampled_from([64, 96, 256]), st.booleans(),
       st.integers(0, 2 ** 16))
def test_nvfp4_linear_restore_invariant(n, k, bias, seed):
    """NVFP4 linear on CUTLASS: restore == load; swizzled+padded forward equals the
    checkpoint dequantization (weight_scale_2 max) bit for bit, for K/16 % 4 != 0 too."""
    cfg = _config("modelopt_fp4", k, n, bits=4, g=16, kernel="cutlass", bias=bias)
    tensors = nvfp4_linear_checkpoint(n, k, seed, bias)
    plan, loaded, _, x, out = assert_restore_invariant(cfg, tensors, seed)
    w = R.e2m1_decode(tensors["weight"]) * tensors["weight_scale"].float().repeat_interleave(
        16, dim=1) * tensors["weight_scale_2"].max()
    assert torch.equal(R._matmul(x, w.t(), tensors.get("bias")), out)
    assert torch.equal(loaded.alpha, tensors["input_scale"].max() * tensors["weight_scale_2"].max())
    assert not hasattr(loaded, "weight_scale_2") and not hasattr(loaded, "input_scale")


@settings(max_examples=8)
@given(st.sampled_from([1, 2, 3]), st.sampled_from([64, 128]), st.sampled_from([64, 128]),
       st.integers(0, 2 ** 16))
def test_nvfp4_moe_restore_invariant(e, hidden, inter, seed):
    """NVFP4 fused MoE on CUTLASS experts: restore == load; the fused scale_2 equals
    scale_2[:, 0] * max(a13) exactly; the checkpoint is not modified (no in-place fuse)."""
    cfg = _config("modelopt_fp4", hidden, 2 * inter, bits=4, g=16, kind="moe",
                  kernel="cutlass_moe")
    tensors = nvfp4_moe_checkpoint(e, hidden, inter, seed)
    plan, loaded, restored, x, out = assert_restore_invariant(cfg, tensors, seed)
    expect = tensors["w13_weight_scale_2"][:, 0] * tensors["w13_input_scale"].max(dim=1).values
    assert torch.equal(loaded.w13_weight_scale_2, expect)
    assert restored.moe_hidden_dim == hidden and restored.moe_num_experts == e
    assert out.shape == (e, 3, hidden)


def test_cutlass_restore_with_recorded_width_mismatch_raises():
    """A restore whose LayerConfig.size_n differs from the daemon's recorded width raises."""
    cfg = _config("fp8_per_channel", 64, 100, kernel="cutlass")
    plan = plan_for(cfg, target=H200).plan
    tensors = {"weight": torch.randn(100, 64).to(torch.bfloat16)}
    prepared = prepare_(make_module(tensors), plan.bind(cfg, H200))
    with pytest.raises(RecordedMismatch):
        restore_(export(prepared), plan.bind(evolve(cfg, size_n=112), H200), prepared.recorded)


# --------------------------------------------------------------------------- purity, replay


def _plan_cases():
    cases = []
    for k_, n_ in ((128, 96),):
        for method, bits, zp in (("awq", 4, True), ("gptq", 8, False), ("ct_w4a16", 4, True),
                                 ("ct_w4a16", 4, False)):
            cfg = _config(method, k_, n_, bits=bits, g=64, zp=zp, kernel="marlin", bias=True)
            cases.append((cfg, int_checkpoint(method, k_, n_, 64, bits, zp, True, 1)))
    w = (torch.randn(100, 64) * 0.05).to(torch.bfloat16)
    for m, kern, strat in (("fp8_per_tensor", "cutlass", None), ("fp8_per_channel", "cutlass", None),
                           ("fp8_per_block", "cutlass_block", "block"), ("mxfp8", "marlin", None)):
        cases.append((_config(m, 64, 100, kernel=kern, strategy=strat), {"weight": w}))
    g = _gen(3)
    ser = {"weight": fp8_bits(g, (100, 64)), "weight_scale": torch.tensor([0.01, 0.02]),
           "input_scale": torch.tensor([0.7, 0.9])}
    lw = (("logical_widths", (50, 50)),)
    for m, kern in (("ct_w8a8_fp8", "cutlass"), ("fp8", "cutlass"), ("ct_w8a8_fp8", "fp8_marlin"),
                    ("fp8", "fp8_marlin")):
        cases.append((_config(m, 64, 100, strategy="tensor", static=True, kernel=kern,
                              extra=lw), ser))
    cases.append((_config("fp8", 64, 100, strategy="block", kernel="cutlass_block"),
                  {"weight": ser["weight"], "weight_scale_inv": torch.tensor([[0.01]])}))
    cases.append((_config("modelopt_fp4", 96, 100, bits=4, g=16, kernel="cutlass"),
                  nvfp4_linear_checkpoint(100, 96, 4)))
    cases.append((_config("modelopt_fp4", 64, 128, bits=4, g=16, kind="moe",
                          kernel="cutlass_moe"), nvfp4_moe_checkpoint(2, 64, 64, 5)))
    return cases


PLAN_CASES = _plan_cases()
MY_KERNELS = {"marlin", "cutlass", "fp8_marlin", "cutlass_block", "cutlass_moe", "machete",
              "cutlass_int8"}
#: What the adapter records of a MacheteLinearKernel (here vLLM 0.32's uint4b8 id).
MACHETE_EXTRA = (("machete_act_type", "bfloat16"), ("machete_b_type_id", 1125899907892224))


def _target(cfg):
    return B200 if cfg.quant.method == "modelopt_fp4" else H200


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
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
            assert _same(state.tensors[k], val), (st_.name, k)
        one = UncheckedPlan(plan.method, plan.kernel, (st_,), checkpoint=frozenset(state.tensors))
        state = one.run(state, cfg, target, frozenset({st_.tag}), check_purity=True)


@pytest.mark.parametrize("cfg,tensors", PLAN_CASES, ids=lambda v: getattr(v, "name", None))
def test_every_stage_is_pure(cfg, tensors):
    """Every stage of every CUDA plan leaves its input tensors' values and version
    counters unchanged (run stage by stage through a full load)."""
    assert_stages_pure(plan_for(cfg, target=_target(cfg)).plan, tensors, cfg, _target(cfg))


@pytest.mark.parametrize("cfg,tensors", PLAN_CASES, ids=lambda v: getattr(v, "name", None))
def test_replayable_stages_twice_equals_once(cfg, tensors):
    """Replaying a plan's METADATA/ALLOCATE/DERIVE/VALIDATE stages twice on a restored
    layer gives the same snapshot as once, and the same recorded values."""
    plan = plan_for(cfg, target=_target(cfg)).plan
    prepared = prepare_(make_module({k: v.clone() for k, v in tensors.items()}),
                        plan.bind(cfg, _target(cfg)))
    once = export(prepared)
    restore_(once, plan.bind(cfg, _target(cfg)), prepared.recorded, strict=True,
             drops=prepared.drops)
    twice = export(prepared)
    restore_(twice, plan.bind(cfg, _target(cfg)), prepared.recorded, strict=True,
             drops=prepared.drops)
    state2 = restore_(twice, plan.bind(cfg, _target(cfg)), prepared.recorded, strict=True)
    paths = attr_paths(plan)
    assert snapshot(once, paths) == snapshot(twice, paths)
    assert {k: dict(v) for k, v in state2.recorded.items()} == prepared.recorded


# --------------------------------------------------------------------------- the bug class


def _moe_case():
    cfg = _config("modelopt_fp4", 64, 128, bits=4, g=16, kind="moe", kernel="cutlass_moe")
    return cfg, nvfp4_moe_checkpoint(2, 64, 64, 9)


@pytest.mark.parametrize("tag", [Tag.METADATA, Tag.ALLOCATE])
def test_mistagged_activation_scale_fuse_is_rejected_at_build(tag):
    """The NVFP4 activation-scale fuse tagged replayable (METADATA/ALLOCATE) is a PlanInvalid."""
    bad = evolve(F4.fuse_moe_activation_scale, tag=tag)
    stages = tuple(bad if s.name == bad.name else s for s in nvfp4_plans.MOE.stages)
    with pytest.raises(PlanInvalid, match="nvfp4.fuse_moe_activation_scale"):
        Plan("modelopt_fp4", "cutlass_moe", stages, checkpoint=nvfp4_plans.MOE.checkpoint)


def test_mistagged_activation_scale_fuse_replay_is_caught_by_guard():
    """Forced past the build rules (ALLOCATE), replaying the fuse on restore raises
    RestoreWroteSharedTensor instead of squaring the activation scale."""
    cfg, tensors = _moe_case()
    prepared = prepare_(make_module(tensors), nvfp4_plans.MOE.bind(cfg, B200))
    bad = evolve(F4.fuse_moe_activation_scale, tag=Tag.ALLOCATE)
    plan = UncheckedPlan("modelopt_fp4", "cutlass_moe",
                         tuple(bad if s.name == bad.name else s for s in nvfp4_plans.MOE.stages),
                         checkpoint=nvfp4_plans.MOE.checkpoint)
    restored = export(prepared)
    before = restored.w13_weight_scale_2.clone()
    with pytest.raises(RestoreWroteSharedTensor):
        restore_(restored, plan.bind(cfg, B200), prepared.recorded, strict=True)
    assert torch.equal(restored.w13_weight_scale_2, before)


def test_vllm_style_in_place_fuse_on_restore_is_caught():
    """vLLM's form (``w13_weight_scale_2.mul_(w13_input_scale)``, declared as writing
    nothing) passes the build rules but the restore guard catches the in-place write."""

    @unregistered_stage("nvfp4.fuse_moe_activation_scale", Tag.METADATA,
                        reads=("w13_weight_scale_2", "w13_input_scale"),
                        source="CutlassExpertsFp4 (vLLM)")
    def in_place(t, c, tg, r):
        t["w13_weight_scale_2"].mul_(t["w13_input_scale"])
        return StageOut()

    cfg, tensors = _moe_case()
    prepared = prepare_(make_module(tensors), nvfp4_plans.MOE.bind(cfg, B200))
    plan = Plan("modelopt_fp4", "cutlass_moe",
                tuple(in_place if s.name == in_place.name else s for s in nvfp4_plans.MOE.stages),
                checkpoint=nvfp4_plans.MOE.checkpoint)
    with pytest.raises(RestoreWroteSharedTensor, match="w13_weight_scale_2"):
        restore_(export(prepared), plan.bind(cfg, B200), prepared.recorded, strict=True)


@pytest.mark.parametrize("method,n", [("fp8_per_tensor", 100), ("fp8_per_channel", 100),
                                      ("fp8", 96)])
def test_cutlass_restore_without_logical_width_fails_invariant(method, n):
    """Without the METADATA stage (vLLM 0.32's pre-processed branch), the restored layer
    lacks the logical width: snapshots differ and the forward fails like vLLM's assert;
    mixing daemon and engine plans is refused."""
    k = 64
    if method == "fp8":
        tensors = {"weight": fp8_bits(_gen(1), (n, k)), "weight_scale": torch.tensor([0.01])}
        cfg = _config("fp8", k, n, strategy="tensor", kernel="cutlass")
    else:
        tensors = {"weight": torch.randn(n, k).to(torch.bfloat16)}
        cfg = _config(method, k, n, kernel="cutlass")
    full = plan_for(cfg, target=H200).plan
    lacking = evolve(full, stages=tuple(s for s in full.stages
                                        if s.name != "cutlass.set_logical_output_size"))
    loaded, restored_ok, _ = roundtrip(full, tensors, cfg, H200)
    _, restored_bad, prepared_bad = roundtrip(lacking, tensors, cfg, H200)
    paths = attr_paths(full)
    assert snapshot(loaded, paths) == snapshot(restored_ok, paths)
    assert snapshot(loaded, paths) != snapshot(restored_bad, paths)
    x = torch.randn(2, k).to(torch.bfloat16)
    R.cutlass_fp8_forward(loaded, cfg, x)
    with pytest.raises(R.MissingLogicalWidth):
        R.cutlass_fp8_forward(restored_bad, cfg, x)
    prepared_full = prepare_(make_module({k_: v.clone() for k_, v in tensors.items()}),
                             full.bind(cfg, H200))
    with pytest.raises(RecordedMismatch):
        restore_(export(prepared_full), lacking.bind(cfg, H200), prepared_full.recorded)


# --------------------------------------------------------------------------- registry


REGISTRY_CASES = [
    (_config("awq", 128, 128, bits=4, g=64, zp=True, kernel="marlin"), marlin_plans.AWQ, H200),
    (_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"), marlin_plans.GPTQ, H200),
    (_config("gptq", 128, 128, bits=8, g=-1, kernel="marlin"), marlin_plans.GPTQ, H200),
    (_config("ct_w4a16", 128, 128, bits=4, g=64, zp=True, kernel="marlin"),
     marlin_plans.CT_W4A16, H200),
    (_config("ct_w8a8_fp8", 64, 64, strategy="channel", kernel="cutlass"), fp8_plans.CT_CUTLASS, H200),
    (_config("ct_w8a8_fp8", 64, 64, strategy="tensor", kernel="fp8_marlin"), fp8_plans.CT_MARLIN, H200),
    (_config("fp8_per_tensor", 64, 64, kernel="cutlass"), fp8_plans.PER_TENSOR, H200),
    (_config("fp8_per_channel", 64, 64, kernel="cutlass"), fp8_plans.PER_CHANNEL, H200),
    (_config("fp8_per_block", 64, 64, strategy="block", kernel="cutlass_block"),
     fp8_plans.PER_BLOCK, H200),
    (_config("fp8", 64, 64, strategy="tensor", kernel="cutlass"), fp8_plans.SERIALIZED_CUTLASS, H200),
    (_config("fp8", 64, 64, strategy="block", kernel="cutlass_block"),
     fp8_plans.SERIALIZED_BLOCK, H200),
    (_config("fp8", 64, 64, strategy="tensor", kernel="fp8_marlin"),
     fp8_plans.SERIALIZED_MARLIN, H200),
    (_config("mxfp8", 64, 64, kernel="marlin"), mxfp8_plans.MARLIN, H200),
    (_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="cutlass"), nvfp4_plans.LINEAR, B200),
    (_config("modelopt_fp4", 64, 64, bits=4, g=16, kind="moe", kernel="cutlass_moe"),
     nvfp4_plans.MOE, B200),
    (_config("awq", 128, 128, bits=4, g=64, zp=True, kernel="machete", extra=MACHETE_EXTRA),
     machete_plans.AWQ, H200),
    (_config("gptq", 128, 128, bits=4, g=64, kernel="machete", extra=MACHETE_EXTRA),
     machete_plans.GPTQ, H200),
    (_config("ct_w4a16", 128, 128, bits=4, g=64, kernel="machete", extra=MACHETE_EXTRA),
     machete_plans.CT_W4A16, H200),
    (_config("ct_w8a8_int8", 64, 64, bits=8, strategy="channel", kernel="cutlass_int8"),
     cutlass_int8_plans.W8A8_INT8, H200),
]


@pytest.mark.parametrize("cfg,plan,target", REGISTRY_CASES,
                         ids=lambda v: getattr(v, "id", None) if isinstance(v, Plan) else None)
def test_plan_registered_and_resolves(cfg, plan, target):
    """Each CUDA plan is in all_plans() and plan_for(spec with kernel, config, cuda target)
    resolves to it; on CPU the same spec is refused with a reason."""
    assert plan in all_plans()
    assert plan_for(cfg, target=target).plan is plan
    with pytest.raises(NoPlan):
        plan_for(cfg, target=CPU).plan


def test_plain_spec_without_kernel_gets_marlin_and_machete_only_when_named():
    """wcache does not re-derive vLLM's kernel choice: a plain spec without a kernel
    resolves Marlin on sm90 (the Machete plan names its reason), and kernel='machete'
    (what the adapter records when vLLM picked Machete) resolves the Machete plan."""
    cfg = evolve(_config("gptq", 128, 128, bits=4, g=64), quant=QuantSpec("gptq", 4, 64))
    assert plan_for(cfg, target=H200).plan is marlin_plans.GPTQ
    named = evolve(cfg, quant=evolve(cfg.quant, kernel="machete"), extra=MACHETE_EXTRA)
    assert plan_for(named, target=H200).plan is machete_plans.GPTQ
    with pytest.raises(NoPlan, match="MacheteLinearKernel"):
        plan_for(evolve(named, extra=()), target=H200).plan
    with pytest.raises(NoPlan, match="sm90"):
        plan_for(named, target=Target("cuda", (10, 0))).plan


def test_all_cuda_plans_covered():
    """Every plan with a CUDA kernel id is in the registry table above (none untested)."""
    mine = {p.id for p in all_plans() if p.kernel in MY_KERNELS}
    assert mine == {plan.id for _, plan, _ in REGISTRY_CASES}


@pytest.mark.parametrize("cfg,target,reason", [
    (_config("fp8", 64, 64, strategy="block", kernel="fp8_marlin"), H200, "Marlin block FP8"),
    (_config("ct_w8a8_fp8", 64, 64, strategy="block", kernel="fp8_marlin"), H200,
     "Marlin block FP8"),
    (_config("awq", 128, 128, bits=4, g=64, zp=True, kind="moe", kernel="marlin"), H200,
     "fused-MoE"),
    (_config("gptq", 128, 128, bits=4, g=64, kind="moe", kernel="marlin"), H200, "fused-MoE"),
    (evolve(_config("gptq", 128, 128, bits=4, g=64),
            quant=QuantSpec("gptq", num_bits=4, group_size=64, kernel="marlin",
                            options=(("marlin_input_dtype", "int8"),))), H200, "int8 activations"),
    (evolve(_config("ct_w4a16", 128, 128, bits=4, g=64),
            quant=QuantSpec("ct_w4a16", num_bits=4, group_size=64, kernel="marlin",
                            options=(("marlin_input_dtype", "fp8"),))), H200, "fp8 activations"),
    (_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"),
     Target("cuda", (9, 0), env=(("VLLM_MARLIN_INPUT_DTYPE", "fp8"),)), "fp8 activations"),
    (_config("fp8_per_tensor", 64, 64, kernel="cutlass"), Target("cuda", (8, 0)),
     "compute capability >= 8.9"),
    (_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="cutlass"), H200, "Blackwell"),
    (_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"), CPU, "CUDA kernel"),
    (_config("gptq", 128, 128, bits=4, g=64, zp=True, kernel="machete", extra=MACHETE_EXTRA),
     H200, "asymmetric GPTQ"),
    (_config("ct_w8a8_int8", 64, 64, bits=8, strategy="group", kernel="cutlass_int8"), H200,
     "tensor/channel"),
])
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Unsupported combinations raise NoPlan whose message names the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan
