"""CUDA-layout plans (Marlin, CUTLASS FP8, MXFP8, NVFP4) checked on CPU.

Layers are plain ``nn.Module`` objects holding checkpoint-format tensors (vLLM's
``create_weights`` needs CUDA kernels). "Export" clones ``Prepared.tensors`` into a
fresh module, which ``restore_(..., strict=True)`` then finishes; the restore
invariant compares :func:`wcache.shell.snapshot` and the reference forward of
``tests/helpers/reference_kernels.py`` with an ordinary load.
"""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import moe_cases
from tests.helpers import reference_kernels as R
from tests.helpers.cuda_cases import (
    B200,
    CPU,
    H200,
    MACHETE_EXTRA,
    assert_restore_invariant,
    assert_stages_pure,
    attr_paths,
    cuda_config,
    export,
    fp8_bits,
    fp8_cases,
    int_checkpoint,
    make_module,
    marlin_int_cases,
    nvfp4_linear_checkpoint,
    nvfp4_marlin_moe_config,
    nvfp4_moe_checkpoint,
    roundtrip,
    seeded_generator,
    target_for,
)
from wcache.core import (
    LayerConfig,
    NoPlan,
    Plan,
    PlanInvalid,
    QuantSpec,
    RecordedMismatch,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
)
from wcache.plans import cutlass_int8 as cutlass_int8_plans
from wcache.plans import fp8 as fp8_plans
from wcache.plans import machete as machete_plans
from wcache.plans import marlin as marlin_plans
from wcache.plans import mxfp8 as mxfp8_plans
from wcache.plans import nvfp4 as nvfp4_plans
from wcache.plans import unquantized as unquantized_plans
from wcache.plans.registry import all_plans, plan_for
from wcache.shell import load_, prepare_, restore_, snapshot
from wcache.stages import nvfp4 as F4
from wcache.testing.plans import UncheckedPlan, unregistered_stage

# --------------------------------------------------------------------------- invariant


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from([(100, 80), (128, 256), (64, 64)]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_nvfp4_marlin_linear_restore_invariant(nk, bias, seed):
    """NVFP4 linear on Marlin: restore(export(prepare)) == load (every tensor's bytes,
    ``is_w4a16_nvfp4``), the checkpoint untouched, every stage pure, a second restore
    a no-op; only ``is_w4a16_nvfp4`` is replayed (everything else is exported)."""
    n, k = nk
    cfg = cuda_config("modelopt_fp4", k, n, bits=4, g=16, kernel="marlin", bias=bias)
    tensors = nvfp4_linear_checkpoint(n, k, seed, bias)
    plan = plan_for(cfg, target=H200).plan
    assert plan is nvfp4_plans.MARLIN_LINEAR
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, H200)
    assert snapshot(loaded, attr_paths(plan)) == snapshot(restored, attr_paths(plan))
    assert_stages_pure(plan, tensors, cfg, H200)
    assert set(prepared.tensors) == {
        "weight",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
        "input_global_scale_inv",
        "alpha",
    } | ({"bias"} if bias else set())
    assert [s.name for s in plan.stages if s.replayable] == [
        "nvfp4.validate_loaded",
        "nvfp4.set_is_w4a16_nvfp4",
    ]


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(2, 128, 96), (1, 192, 64), (3, 64, 32)]), st.integers(0, 2**16))
def test_nvfp4_marlin_moe_restore_invariant(dims, seed):
    """NVFP4 fused MoE on Marlin: restore == load (incl. the input scales' empty slots
    and the recorded backend), every stage pure; the input scales are not exported."""
    e, hidden, inter = dims
    cfg = nvfp4_marlin_moe_config(e, hidden, inter)
    tensors = nvfp4_moe_checkpoint(e, hidden, inter, seed)
    plan = plan_for(cfg, target=H200).plan
    assert plan is nvfp4_plans.MARLIN_MOE
    loaded, restored, prepared = roundtrip(plan, tensors, cfg, H200)
    # the synthetic restored module has no placeholder parameters, so its empty slots
    # are plain attributes (a vLLM-built layer keeps them as parameter slots: the
    # contract test tests/plans/test_cuda_contracts.py, row modelopt_fp4/marlin_moe)
    slots = {"w13_input_scale": ("param", None), "w2_input_scale": ("param", None)}
    paths = attr_paths(plan)
    assert snapshot(loaded, paths) == {**snapshot(restored, paths), **slots}
    assert restored.w13_input_scale is None and restored.w2_input_scale is None
    assert "w13_input_scale" not in prepared.tensors
    assert prepared.recorded  # the backend and experts class vLLM resolved
    assert_stages_pure(plan, tensors, cfg, H200)


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
    tail = torch.cat([vals[cfg.size_k :].reshape(-1), vals[:, cfg.size_n :].reshape(-1)])
    assert torch.equal(tail, torch.zeros_like(tail))  # padded tails are zero


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
        tail = loaded.weight[:, cfg.size_n :].view(torch.uint8)
        assert torch.equal(tail, torch.zeros_like(tail))
        if loaded.weight_scale.numel() > 1:
            pad = loaded.weight_scale.reshape(-1)[cfg.size_n :]
            assert torch.equal(pad, torch.ones_like(pad))


@settings(max_examples=10)
@given(
    st.sampled_from([32, 100, 128, 160]),
    st.sampled_from([64, 96, 256]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_nvfp4_linear_restore_invariant(n, k, bias, seed):
    """NVFP4 linear on CUTLASS: restore == load; swizzled+padded forward equals the
    checkpoint dequantization (weight_scale_2 max) bit for bit, for K/16 % 4 != 0 too."""
    cfg = cuda_config("modelopt_fp4", k, n, bits=4, g=16, kernel="cutlass", bias=bias)
    tensors = nvfp4_linear_checkpoint(n, k, seed, bias)
    plan, loaded, _, x, out = assert_restore_invariant(cfg, tensors, seed)
    w = (
        R.e2m1_decode(tensors["weight"])
        * tensors["weight_scale"].float().repeat_interleave(16, dim=1)
        * tensors["weight_scale_2"].max()
    )
    assert torch.equal(R._matmul(x, w.t(), tensors.get("bias")), out)
    assert torch.equal(loaded.alpha, tensors["input_scale"].max() * tensors["weight_scale_2"].max())
    assert not hasattr(loaded, "weight_scale_2") and not hasattr(loaded, "input_scale")


@settings(max_examples=8)
@given(
    st.sampled_from([1, 2, 3]),
    st.sampled_from([64, 128]),
    st.sampled_from([64, 128]),
    st.integers(0, 2**16),
)
def test_nvfp4_moe_restore_invariant(e, hidden, inter, seed):
    """NVFP4 fused MoE on CUTLASS experts: restore == load; the fused scale_2 equals
    scale_2[:, 0] * max(a13) exactly; the checkpoint is not modified (no in-place fuse)."""
    cfg = cuda_config(
        "modelopt_fp4", hidden, 2 * inter, bits=4, g=16, kind="moe", kernel="cutlass_moe"
    )
    tensors = nvfp4_moe_checkpoint(e, hidden, inter, seed)
    plan, loaded, restored, x, out = assert_restore_invariant(cfg, tensors, seed)
    expect = tensors["w13_weight_scale_2"][:, 0] * tensors["w13_input_scale"].max(dim=1).values
    assert torch.equal(loaded.w13_weight_scale_2, expect)
    assert restored.moe_hidden_dim == hidden and restored.moe_num_experts == e
    assert out.shape == (e, 3, hidden)


def test_cutlass_restore_with_recorded_width_mismatch_raises():
    """A restore whose LayerConfig.size_n differs from the daemon's recorded width raises."""
    cfg = cuda_config("fp8_per_channel", 64, 100, kernel="cutlass")
    plan = plan_for(cfg, target=H200).plan
    tensors = {"weight": torch.randn(100, 64).to(torch.bfloat16)}
    prepared = prepare_(make_module(tensors), plan.bind(cfg, H200))
    with pytest.raises(RecordedMismatch):
        restore_(export(prepared), plan.bind(evolve(cfg, size_n=112), H200), prepared.recorded)


# --------------------------------------------------------------------------- purity, replay


def _plan_cases():
    cases = []
    for k_, n_ in ((128, 96),):
        for method, bits, zp in (
            ("awq", 4, True),
            ("gptq", 8, False),
            ("ct_w4a16", 4, True),
            ("ct_w4a16", 4, False),
        ):
            cfg = cuda_config(method, k_, n_, bits=bits, g=64, zp=zp, kernel="marlin", bias=True)
            cases.append((cfg, int_checkpoint(method, k_, n_, 64, bits, zp, True, 1)))
    w = (torch.randn(100, 64) * 0.05).to(torch.bfloat16)
    for m, kern, strat in (
        ("fp8_per_tensor", "cutlass", None),
        ("fp8_per_channel", "cutlass", None),
        ("fp8_per_block", "cutlass_block", "block"),
        ("mxfp8", "marlin", None),
    ):
        cases.append((cuda_config(m, 64, 100, kernel=kern, strategy=strat), {"weight": w}))
    g = seeded_generator(3)
    ser = {
        "weight": fp8_bits(g, (100, 64)),
        "weight_scale": torch.tensor([0.01, 0.02]),
        "input_scale": torch.tensor([0.7, 0.9]),
    }
    lw = (("logical_widths", (50, 50)),)
    for m, kern in (
        ("ct_w8a8_fp8", "cutlass"),
        ("fp8", "cutlass"),
        ("ct_w8a8_fp8", "fp8_marlin"),
        ("fp8", "fp8_marlin"),
    ):
        cases.append(
            (cuda_config(m, 64, 100, strategy="tensor", static=True, kernel=kern, extra=lw), ser)
        )
    cases.append(
        (
            cuda_config("fp8", 64, 100, strategy="block", kernel="cutlass_block"),
            {"weight": ser["weight"], "weight_scale_inv": torch.tensor([[0.01]])},
        )
    )
    cases.append(
        (
            cuda_config("modelopt_fp4", 96, 100, bits=4, g=16, kernel="cutlass"),
            nvfp4_linear_checkpoint(100, 96, 4),
        )
    )
    cases.append(
        (
            cuda_config("modelopt_fp4", 64, 128, bits=4, g=16, kind="moe", kernel="cutlass_moe"),
            nvfp4_moe_checkpoint(2, 64, 64, 5),
        )
    )
    cases.append(
        (
            cuda_config("modelopt_fp4", 80, 100, bits=4, g=16, kernel="marlin", bias=True),
            nvfp4_linear_checkpoint(100, 80, 6, bias=True),
        )
    )
    cases.append((nvfp4_marlin_moe_config(2, 128, 96), nvfp4_moe_checkpoint(2, 128, 96, 7)))
    return cases


PLAN_CASES = _plan_cases()


@pytest.mark.parametrize("cfg,tensors", PLAN_CASES, ids=lambda v: getattr(v, "name", None))
def test_every_stage_is_pure(cfg, tensors):
    """Every stage of every CUDA plan leaves its input tensors' values and version
    counters unchanged (run stage by stage through a full load)."""
    assert_stages_pure(plan_for(cfg, target=target_for(cfg)).plan, tensors, cfg, target_for(cfg))


@pytest.mark.parametrize("cfg,tensors", PLAN_CASES, ids=lambda v: getattr(v, "name", None))
def test_replayable_stages_twice_equals_once(cfg, tensors):
    """Replaying a plan's METADATA/ALLOCATE/DERIVE/VALIDATE stages twice on a restored
    layer gives the same snapshot as once, and the same recorded values."""
    plan = plan_for(cfg, target=target_for(cfg)).plan
    prepared = prepare_(
        make_module({k: v.clone() for k, v in tensors.items()}), plan.bind(cfg, target_for(cfg))
    )
    once = export(prepared)
    restore_(
        once, plan.bind(cfg, target_for(cfg)), prepared.recorded, strict=True, drops=prepared.drops
    )
    twice = export(prepared)
    restore_(
        twice, plan.bind(cfg, target_for(cfg)), prepared.recorded, strict=True, drops=prepared.drops
    )
    state2 = restore_(twice, plan.bind(cfg, target_for(cfg)), prepared.recorded, strict=True)
    paths = attr_paths(plan)
    assert snapshot(once, paths) == snapshot(twice, paths)
    assert {k: dict(v) for k, v in state2.recorded.items()} == prepared.recorded


# --------------------------------------------------------------------------- the bug class


def _moe_case():
    cfg = cuda_config("modelopt_fp4", 64, 128, bits=4, g=16, kind="moe", kernel="cutlass_moe")
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
    plan = UncheckedPlan(
        "modelopt_fp4",
        "cutlass_moe",
        tuple(bad if s.name == bad.name else s for s in nvfp4_plans.MOE.stages),
        checkpoint=nvfp4_plans.MOE.checkpoint,
    )
    restored = export(prepared)
    before = restored.w13_weight_scale_2.clone()
    with pytest.raises(RestoreWroteSharedTensor):
        restore_(restored, plan.bind(cfg, B200), prepared.recorded, strict=True)
    assert torch.equal(restored.w13_weight_scale_2, before)


def test_vllm_style_in_place_fuse_on_restore_is_caught():
    """vLLM's form (``w13_weight_scale_2.mul_(w13_input_scale)``, declared as writing
    nothing) passes the build rules but the restore guard catches the in-place write."""

    @unregistered_stage(
        "nvfp4.fuse_moe_activation_scale",
        Tag.METADATA,
        reads=("w13_weight_scale_2", "w13_input_scale"),
        source="CutlassExpertsFp4 (vLLM)",
    )
    def in_place(t, c, tg, r):
        t["w13_weight_scale_2"].mul_(t["w13_input_scale"])
        return StageOut()

    cfg, tensors = _moe_case()
    prepared = prepare_(make_module(tensors), nvfp4_plans.MOE.bind(cfg, B200))
    plan = Plan(
        "modelopt_fp4",
        "cutlass_moe",
        tuple(in_place if s.name == in_place.name else s for s in nvfp4_plans.MOE.stages),
        checkpoint=nvfp4_plans.MOE.checkpoint,
    )
    with pytest.raises(RestoreWroteSharedTensor, match="w13_weight_scale_2"):
        restore_(export(prepared), plan.bind(cfg, B200), prepared.recorded, strict=True)


@pytest.mark.parametrize(
    "method,n", [("fp8_per_tensor", 100), ("fp8_per_channel", 100), ("fp8", 96)]
)
def test_cutlass_restore_without_logical_width_fails_invariant(method, n):
    """Without the METADATA stage (vLLM 0.32's pre-processed branch), the restored layer
    lacks the logical width: snapshots differ and the forward fails like vLLM's assert;
    mixing daemon and engine plans is refused."""
    k = 64
    if method == "fp8":
        tensors = {
            "weight": fp8_bits(seeded_generator(1), (n, k)),
            "weight_scale": torch.tensor([0.01]),
        }
        cfg = cuda_config("fp8", k, n, strategy="tensor", kernel="cutlass")
    else:
        tensors = {"weight": torch.randn(n, k).to(torch.bfloat16)}
        cfg = cuda_config(method, k, n, kernel="cutlass")
    full = plan_for(cfg, target=H200).plan
    lacking = evolve(
        full, stages=tuple(s for s in full.stages if s.name != "cutlass.set_logical_output_size")
    )
    loaded, restored_ok, _ = roundtrip(full, tensors, cfg, H200)
    _, restored_bad, prepared_bad = roundtrip(lacking, tensors, cfg, H200)
    paths = attr_paths(full)
    assert snapshot(loaded, paths) == snapshot(restored_ok, paths)
    assert snapshot(loaded, paths) != snapshot(restored_bad, paths)
    x = torch.randn(2, k).to(torch.bfloat16)
    R.cutlass_fp8_forward(loaded, cfg, x)
    with pytest.raises(R.MissingLogicalWidth):
        R.cutlass_fp8_forward(restored_bad, cfg, x)
    prepared_full = prepare_(
        make_module({k_: v.clone() for k_, v in tensors.items()}), full.bind(cfg, H200)
    )
    with pytest.raises(RecordedMismatch):
        restore_(export(prepared_full), lacking.bind(cfg, H200), prepared_full.recorded)


# --------------------------------------------------------------------------- registry


#: The LayerConfig extra the adapter passes where vLLM 0.33's compressed-tensors FP8
#: post-load sets ``layer.processed_weight_dims``.
PROCESSED_WEIGHT_DIMS = (("processed_weight_dims", (0, 1)),)

REGISTRY_CASES = [
    (cuda_config("awq", 128, 128, bits=4, g=64, zp=True, kernel="marlin"), marlin_plans.AWQ, H200),
    (cuda_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"), marlin_plans.GPTQ, H200),
    (cuda_config("gptq", 128, 128, bits=8, g=-1, kernel="marlin"), marlin_plans.GPTQ, H200),
    (
        cuda_config("ct_w4a16", 128, 128, bits=4, g=64, zp=True, kernel="marlin"),
        marlin_plans.CT_W4A16,
        H200,
    ),
    (
        cuda_config("ct_w8a8_fp8", 64, 64, strategy="channel", kernel="cutlass"),
        fp8_plans.CT_CUTLASS,
        H200,
    ),
    (
        cuda_config("ct_w8a8_fp8", 64, 64, strategy="tensor", kernel="fp8_marlin"),
        fp8_plans.CT_MARLIN,
        H200,
    ),
    (
        cuda_config(
            "ct_w8a8_fp8", 64, 64, strategy="channel", kernel="cutlass", extra=PROCESSED_WEIGHT_DIMS
        ),
        fp8_plans.CT_CUTLASS_V2,
        H200,
    ),
    (
        cuda_config(
            "ct_w8a8_fp8",
            64,
            64,
            strategy="tensor",
            kernel="fp8_marlin",
            extra=PROCESSED_WEIGHT_DIMS,
        ),
        fp8_plans.CT_MARLIN_V2,
        H200,
    ),
    (cuda_config("fp8_per_tensor", 64, 64, kernel="cutlass"), fp8_plans.PER_TENSOR, H200),
    (cuda_config("fp8_per_channel", 64, 64, kernel="cutlass"), fp8_plans.PER_CHANNEL, H200),
    (
        cuda_config("fp8_per_block", 64, 64, strategy="block", kernel="cutlass_block"),
        fp8_plans.PER_BLOCK,
        H200,
    ),
    (
        cuda_config("fp8", 64, 64, strategy="tensor", kernel="cutlass"),
        fp8_plans.SERIALIZED_CUTLASS,
        H200,
    ),
    (
        cuda_config("fp8", 64, 64, strategy="block", kernel="cutlass_block"),
        fp8_plans.SERIALIZED_BLOCK,
        H200,
    ),
    (
        cuda_config("fp8", 64, 64, strategy="tensor", kernel="fp8_marlin"),
        fp8_plans.SERIALIZED_MARLIN,
        H200,
    ),
    (cuda_config("mxfp8", 64, 64, kernel="marlin"), mxfp8_plans.MARLIN, H200),
    (
        cuda_config("modelopt_mxfp8", 64, 64, bits=8, g=32, kernel="marlin"),
        mxfp8_plans.MODELOPT_MARLIN,
        H200,
    ),
    (cuda_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="cutlass"), nvfp4_plans.LINEAR, B200),
    (
        cuda_config("modelopt_fp4", 64, 64, bits=4, g=16, kind="moe", kernel="cutlass_moe"),
        nvfp4_plans.MOE,
        B200,
    ),
    (
        cuda_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="marlin"),
        nvfp4_plans.MARLIN_LINEAR,
        H200,
    ),
    (nvfp4_marlin_moe_config(2, 128, 64), nvfp4_plans.MARLIN_MOE, H200),
    (
        cuda_config("awq", 128, 128, bits=4, g=64, zp=True, kernel="machete", extra=MACHETE_EXTRA),
        machete_plans.AWQ,
        H200,
    ),
    (
        cuda_config("gptq", 128, 128, bits=4, g=64, kernel="machete", extra=MACHETE_EXTRA),
        machete_plans.GPTQ,
        H200,
    ),
    (
        cuda_config("ct_w4a16", 128, 128, bits=4, g=64, kernel="machete", extra=MACHETE_EXTRA),
        machete_plans.CT_W4A16,
        H200,
    ),
    (
        cuda_config("ct_w8a8_int8", 64, 64, bits=8, strategy="channel", kernel="cutlass_int8"),
        cutlass_int8_plans.W8A8_INT8,
        H200,
    ),
    (
        LayerConfig(QuantSpec("unquantized", kernel="none"), 128, 128),
        unquantized_plans.NONE_CUDA,
        H200,
    ),
]


@pytest.mark.parametrize(
    "cfg,plan,target",
    REGISTRY_CASES,
    ids=lambda v: getattr(v, "id", None) if isinstance(v, Plan) else None,
)
def test_plan_registered_and_resolves(cfg, plan, target):
    """Each CUDA plan is in all_plans() and plan_for(spec with kernel, config, cuda target)
    resolves to it; on CPU the same spec is refused with a reason."""
    assert plan in all_plans()
    assert plan_for(cfg, target=target).plan is plan
    with pytest.raises(NoPlan):
        plan_for(cfg, target=CPU).plan


@pytest.mark.parametrize(
    "v1,v2",
    [
        (fp8_plans.CT_CUTLASS, fp8_plans.CT_CUTLASS_V2),
        (fp8_plans.CT_MARLIN, fp8_plans.CT_MARLIN_V2),
    ],
    ids=["cutlass", "fp8_marlin"],
)
def test_ct_fp8_v2_is_v1_plus_processed_weight_dims(v1, v2):
    """The vLLM 0.33 plan (@2) is the 0.32 plan (@1) plus one METADATA stage that sets
    ``processed_weight_dims = (0, 1)``: same tensors and bytes, and restore replays the
    attribute (it is not exported)."""
    from wcache.stages import fp8 as F8

    assert [s for s in v2.stages if s is not F8.set_processed_weight_dims] == list(v1.stages)
    assert Tag.METADATA == F8.set_processed_weight_dims.tag
    kernel = v1.kernel
    cfg = evolve(
        cuda_config("ct_w8a8_fp8", 128, 64, strategy="channel", kernel=kernel),
        extra=(("logical_widths", (64,)),) + PROCESSED_WEIGHT_DIMS,
    )
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "weight": fp8_bits(gen, (64, 128)),
        "weight_scale": torch.rand(64, 1, generator=gen) * 0.01 + 1e-4,
    }

    def layer():
        mod = torch.nn.Module()
        for name, t in tensors.items():
            mod.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
        return mod

    old_layer, new_layer = layer(), layer()
    load_(old_layer, v1.bind(evolve(cfg, extra=cfg.extra[:1]), H200))
    load_(new_layer, v2.bind(cfg, H200))
    assert (0, 1) == new_layer.processed_weight_dims
    assert not hasattr(old_layer, "processed_weight_dims")
    assert snapshot(old_layer) == snapshot(new_layer)
    prepared = prepare_(layer(), v2.bind(cfg, H200))
    assert "processed_weight_dims" not in prepared.tensors


def test_ct_fp8_plan_version_follows_the_layer_config():
    """Without the extra the 0.32 plan resolves, with it the 0.33 plan; a bad value is
    refused by the stage with the layer named."""
    from wcache.stages import fp8 as F8

    cfg = cuda_config("ct_w8a8_fp8", 64, 64, strategy="channel", kernel="cutlass")
    assert plan_for(cfg, target=H200).plan is fp8_plans.CT_CUTLASS
    assert (
        plan_for(evolve(cfg, extra=PROCESSED_WEIGHT_DIMS), target=H200).plan
        is fp8_plans.CT_CUTLASS_V2
    )
    with pytest.raises(F8.Fp8LayoutError, match="ct_w8a8_fp8.layer.*processed_weight_dims"):
        F8.set_processed_weight_dims.fn(
            {}, evolve(cfg, extra=(("processed_weight_dims", (0,)),)), H200, {}
        )


def test_plain_spec_without_kernel_gets_marlin_and_machete_only_when_named():
    """wcache does not re-derive vLLM's kernel choice: a plain spec without a kernel
    resolves Marlin on sm90 (the Machete plan names its reason), and kernel='machete'
    (what the adapter records when vLLM picked Machete) resolves the Machete plan."""
    cfg = evolve(cuda_config("gptq", 128, 128, bits=4, g=64), quant=QuantSpec("gptq", 4, 64))
    assert plan_for(cfg, target=H200).plan is marlin_plans.GPTQ
    named = evolve(cfg, quant=evolve(cfg.quant, kernel="machete"), extra=MACHETE_EXTRA)
    assert plan_for(named, target=H200).plan is machete_plans.GPTQ
    with pytest.raises(NoPlan, match="MacheteLinearKernel"):
        plan_for(evolve(named, extra=()), target=H200).plan
    with pytest.raises(NoPlan, match="sm90"):
        plan_for(named, target=Target("cuda", (10, 0))).plan


def test_all_cuda_plans_covered():
    """Every CUDA-only plan (``plan.devices == ("cuda",)``) is in the registry table above
    or, for fused MoE, in tests/helpers/moe_cases.py's strategies (none untested)."""
    mine = {p.id for p in all_plans() if p.devices == ("cuda",)}
    assert mine == {plan.id for _, plan, _ in REGISTRY_CASES} | (
        mine & set(moe_cases.PLAN_STRATEGIES)
    )


@pytest.mark.parametrize(
    "cfg,target,reason",
    [
        (
            cuda_config("fp8", 64, 64, strategy="block", kernel="fp8_marlin"),
            H200,
            "Marlin block FP8",
        ),
        (
            cuda_config("ct_w8a8_fp8", 64, 64, strategy="block", kernel="fp8_marlin"),
            H200,
            "Marlin block FP8",
        ),
        (
            cuda_config("awq", 128, 128, bits=4, g=64, zp=True, kind="moe", kernel="marlin"),
            H200,
            "fused-MoE",
        ),
        (
            cuda_config("gptq", 128, 128, bits=4, g=64, kind="moe", kernel="marlin"),
            H200,
            "fused-MoE",
        ),
        (
            evolve(
                cuda_config("gptq", 128, 128, bits=4, g=64),
                quant=QuantSpec(
                    "gptq",
                    num_bits=4,
                    group_size=64,
                    kernel="marlin",
                    options=(("marlin_input_dtype", "int8"),),
                ),
            ),
            H200,
            "int8 activations",
        ),
        (
            evolve(
                cuda_config("ct_w4a16", 128, 128, bits=4, g=64),
                quant=QuantSpec(
                    "ct_w4a16",
                    num_bits=4,
                    group_size=64,
                    kernel="marlin",
                    options=(("marlin_input_dtype", "fp8"),),
                ),
            ),
            H200,
            "fp8 activations",
        ),
        (
            cuda_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"),
            Target("cuda", (9, 0), env=(("VLLM_MARLIN_INPUT_DTYPE", "fp8"),)),
            "fp8 activations",
        ),
        (
            cuda_config("fp8_per_tensor", 64, 64, kernel="cutlass"),
            Target("cuda", (8, 0)),
            "compute capability >= 8.9",
        ),
        (cuda_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="cutlass"), H200, "Blackwell"),
        (
            cuda_config("modelopt_fp4", 64, 64, bits=4, g=16, kernel="marlin"),
            Target("cuda", (7, 0)),
            "compute capability >= 7.5",
        ),
        (
            evolve(
                nvfp4_marlin_moe_config(2, 128, 64),
                moe=evolve(nvfp4_marlin_moe_config(2, 128, 64).moe, backend="HUMMING"),
            ),
            H200,
            "resolved backend HUMMING",
        ),
        (nvfp4_marlin_moe_config(2, 96, 64), H200, "hidden_size = 96 unsupported"),
        (cuda_config("gptq", 128, 128, bits=4, g=64, kernel="marlin"), CPU, "CUDA kernel"),
        (
            cuda_config(
                "gptq", 128, 128, bits=4, g=64, zp=True, kernel="machete", extra=MACHETE_EXTRA
            ),
            H200,
            "asymmetric GPTQ",
        ),
        (
            cuda_config("ct_w8a8_int8", 64, 64, bits=8, strategy="group", kernel="cutlass_int8"),
            H200,
            "tensor/channel",
        ),
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Unsupported combinations raise NoPlan whose message names the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan


@pytest.mark.parametrize(
    "dims", [5, (0,), (0, 1, 2), "01", (0.7, 1.2), (0, 0), (True, False)], ids=repr
)
def test_malformed_processed_weight_dims_is_refused_by_plan_and_stage(dims):
    """A processed_weight_dims that is not a pair of the dims 0 and 1 selects no plan (the
    reason names it) and the stage raises Fp8LayoutError, never a bare TypeError or a coercion."""
    from wcache.stages import fp8 as F8

    cfg = cuda_config(
        "ct_w8a8_fp8",
        64,
        64,
        strategy="channel",
        kernel="cutlass",
        extra=(("processed_weight_dims", dims),),
    )
    with pytest.raises(NoPlan, match="processed_weight_dims"):
        plan_for(cfg, target=H200).plan
    with pytest.raises(F8.Fp8LayoutError, match="pair of ints"):
        F8.set_processed_weight_dims.fn({}, cfg, H200, {})
