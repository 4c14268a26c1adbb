"""wcache/plans/kv_cache.py: the KV-cache scales plans (vLLM's and compressed-tensors')
resolve for an attention layer on CPU and CUDA and refuse other devices, and a cache
with ``v_scale`` but no ``k_scale`` is refused as vLLM refuses it. The properties every CPU plan shares (load == vLLM, restore == load, replay) are in
tests/plans/test_cpu_plan_properties.py."""

from __future__ import annotations

import pytest

from wcache.core import QuantSpec, Target

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import AVX512, HOST
from tests.helpers.cpu_plans import assert_refused, assert_resolves, host_plan, load_synced_

#: A CUDA target (the H200, sm90): the scales plans are device-independent.
H200 = Target("cuda", (9, 0))

pytestmark = pytest.mark.usefixtures("vllm_world")


@pytest.mark.parametrize(
    "spec,config_kw,target,plan_id",
    [
        (QuantSpec("kv_cache", layer_kind="attention"), {}, AVX512, "kv_cache/scales@1"),
        (QuantSpec("kv_cache", layer_kind="attention"), {}, H200, "kv_cache/scales@1"),
        (QuantSpec("ct_kv_cache", layer_kind="attention"), {}, AVX512, "ct_kv_cache/scales@1"),
        (QuantSpec("ct_kv_cache", layer_kind="attention"), {}, H200, "ct_kv_cache/scales@1"),
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for gives an attention layer's KV-cache scales (vLLM's or compressed-tensors')
    their scales plan, on CPU and CUDA alike."""
    assert_resolves(spec, config_kw, target, plan_id)


@pytest.mark.parametrize("method", ["kv_cache", "ct_kv_cache"])
def test_a_target_neither_cpu_nor_cuda_is_refused(method):
    """Both scales plans refuse a target that is neither CPU nor CUDA (no FNUZ fp8 path),
    naming the device."""
    spec = QuantSpec(method, layer_kind="attention")
    assert_refused(spec, (256, 128), Target("rocm"), "needs a CPU or CUDA target.*'rocm'")


def test_kv_cache_only_v_scale_raises():
    """A quantized KV cache with v_scale but no k_scale raises StageInputError (vLLM asserts)."""
    from wcache.stages.common import StageInputError

    case = vl.kv_cache_layer("fp8", -1.0, 0.5, -1.0, -1.0)
    with pytest.raises(AssertionError):
        case.vllm_process(case.new_layer())
    plan = host_plan(case)
    with pytest.raises(StageInputError, match="k_scale"):
        load_synced_(case.new_layer(), plan.bind(case.config, HOST))
