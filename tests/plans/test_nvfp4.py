"""wcache/plans/nvfp4.py: the NVFP4 plans (CUTLASS linear and MoE on Blackwell, Marlin
linear and MoE elsewhere) checked on CPU: restore(export(prepare)) == load and the
reference forward equals the checkpoint's dequantization; the activation-scale fuse
mis-tagged as replayable is refused at build or caught by the restore guard; the
refusals name their reasons, and a W4A16 NVFP4 checkpoint has no plan. The contracts
against vLLM's own layers are rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import reference_kernels as R
from tests.helpers.cuda_cases import (
    B200,
    H200,
    assert_restore_invariant,
    assert_stages_pure,
    attr_paths,
    cuda_config,
    export,
    make_module,
    nvfp4_linear_checkpoint,
    nvfp4_marlin_moe_config,
    nvfp4_moe_checkpoint,
    roundtrip,
)
from wcache.core import (
    NoPlan,
    Plan,
    PlanInvalid,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
)
from wcache.plans import nvfp4 as nvfp4_plans
from wcache.plans.registry import plan_for
from wcache.shell import prepare_, restore_, snapshot
from wcache.stages import nvfp4 as F4
from wcache.testing.plans import UncheckedPlan, unregistered_stage

pytest.importorskip("vllm")

from tests.helpers.cuda_contracts import nvfp4_layer

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


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "cfg,target,reason",
    [
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
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Unsupported NVFP4 capabilities, MoE backends and shapes raise NoPlan naming the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan


def test_nvfp4_w4a16_linear_on_sm90_is_refused(simulated_cuda):
    """A W4A16 NVFP4 checkpoint (``modelopt_fp4_w4a16``) has no plan anywhere: the
    adapter's config is refused by plan_for naming why (before any weight is read)."""
    from wcache.core import NoPlan
    from wcache.vllm.adapter import layer_config

    layer = nvfp4_layer((64, 64), 128, w4a16=True)
    config = layer_config(layer.quant_method, layer, H200, name="layer")
    with pytest.raises(NoPlan, match="no plan for method 'modelopt_fp4_w4a16'"):
        plan_for(config, target=H200)
