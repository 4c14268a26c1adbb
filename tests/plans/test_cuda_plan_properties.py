"""Properties of every CUDA-layout plan (Marlin, CUTLASS FP8, MXFP8, NVFP4, Machete,
CUTLASS INT8), checked on CPU: every stage is pure, replaying the restore stages twice
equals once, and every CUDA plan is registered and resolves on its target (refused on
CPU). What is particular to one plan module is in tests/plans/test_<module>.py; the
contracts against vLLM's own layers are rows of tests/plans/test_cuda_contracts.py.

Layers are plain ``nn.Module`` objects holding checkpoint-format tensors (vLLM's
``create_weights`` needs CUDA kernels); "export" clones ``Prepared.tensors`` into a
fresh module, which ``restore_(..., strict=True)`` then finishes
(tests/helpers/cuda_cases.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import moe_cases
from tests.helpers.cuda_cases import (
    B200,
    CPU,
    H200,
    MACHETE_EXTRA,
    PROCESSED_WEIGHT_DIMS,
    assert_stages_pure,
    attr_paths,
    cuda_config,
    export,
    fp8_bits,
    int_checkpoint,
    make_module,
    nvfp4_linear_checkpoint,
    nvfp4_marlin_moe_config,
    nvfp4_moe_checkpoint,
    seeded_generator,
    target_for,
)
from wcache.core import (
    LayerConfig,
    NoPlan,
    Plan,
    QuantSpec,
)
from wcache.plans import cutlass_int8 as cutlass_int8_plans
from wcache.plans import fp8 as fp8_plans
from wcache.plans import machete as machete_plans
from wcache.plans import marlin as marlin_plans
from wcache.plans import mxfp8 as mxfp8_plans
from wcache.plans import nvfp4 as nvfp4_plans
from wcache.plans import unquantized as unquantized_plans
from wcache.plans.registry import all_plans, plan_for
from wcache.shell import prepare_, restore_, snapshot


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


def test_all_cuda_plans_covered():
    """Every CUDA-only plan (``plan.devices == ("cuda",)``) is in the registry table above
    or, for fused MoE, in tests/helpers/moe_cases.py's strategies (none untested)."""
    mine = {p.id for p in all_plans() if p.devices == ("cuda",)}
    assert mine == {plan.id for _, plan, _ in REGISTRY_CASES} | (
        mine & set(moe_cases.PLAN_STRATEGIES)
    )
