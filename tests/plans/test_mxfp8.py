"""wcache/plans/mxfp8.py: the MXFP8 Marlin plans (online ``mxfp8`` and serialized
``modelopt_mxfp8``) checked on CPU: restore(export(prepare)) == load, the Marlin-layout
weight of a serialized checkpoint equals its dequantization, and a K the E8M0 blocks
cannot cover is refused with the reason. The contracts against vLLM's own layers are
rows of tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.helpers import reference_kernels as R
from tests.helpers.cuda_cases import (
    H200,
    MXFP8_KINDS,
    assert_restore_invariant,
    cuda_config,
    fp8_bits,
    fp8_cases,
    make_module,
    seeded_generator,
)
from wcache.core import NoPlan
from wcache.plans import mxfp8 as mxfp8_plans
from wcache.plans.registry import plan_for
from wcache.shell import load_


@settings(max_examples=10)
@given(fp8_cases(MXFP8_KINDS))
def test_mxfp8_restore_invariant(case):
    """Both MXFP8 plans: restore == load (snapshot, reference Marlin forward bit for bit)
    and the forward has the layer's logical width."""
    cfg, tensors = case
    plan, _, _, _, out = assert_restore_invariant(cfg, tensors)
    assert plan in (mxfp8_plans.MARLIN, mxfp8_plans.MODELOPT_MARLIN)
    assert out.shape == (3, cfg.size_n)


@pytest.mark.parametrize("n,k", [(48, 64), (100, 96), (130, 256)])
def test_modelopt_mxfp8_marlin_weight_is_the_checkpoints_dequantization(n, k):
    """The serialized plan's Marlin weight, un-repacked (the reference of vLLM's
    ``marlin_gemm``), equals the checkpoint's FP8 values times 2^(e8m0 - 127) per
    32-wide K block, transposed to ``[K, N]``: the repack and scale permutation lose
    nothing."""
    g = seeded_generator(n + k)
    tensors = {
        "weight": fp8_bits(g, (n, k)),
        "weight_scale": torch.randint(120, 134, (n, k // 32), generator=g).to(torch.uint8),
    }
    cfg = cuda_config("modelopt_mxfp8", k, n, bits=8, g=32, kernel="marlin")
    plan = plan_for(cfg, target=H200).plan
    assert plan is mxfp8_plans.MODELOPT_MARLIN
    layer = make_module({name: t.clone() for name, t in tensors.items()})
    load_(layer, plan.bind(cfg, H200))
    expected = R.mxfp8_checkpoint_weight(tensors["weight"], tensors["weight_scale"]).t()
    assert torch.equal(expected, R.mxfp8_marlin_weight(layer, cfg))


@pytest.mark.parametrize("method", ["mxfp8", "modelopt_mxfp8"])
def test_k_not_divisible_by_the_block_is_refused(method):
    """A size_k that is not a multiple of the 32-wide E8M0 block has no MXFP8 plan; the
    reason names the block and the size."""
    cfg = cuda_config(method, 48, 64, bits=8, g=32, kernel="marlin")
    with pytest.raises(NoPlan, match="MXFP8 needs size_k divisible by 32, got 48"):
        plan_for(cfg, target=H200).plan
