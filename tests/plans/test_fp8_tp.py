"""Issue 12 item 4: online FP8 refuses tensor-parallel size > 1 with its reason
(vLLM all-reduces the amax over TP; the daemon quantizes one shard alone)."""

from __future__ import annotations

import pytest

from wcache.core import LayerConfig, NoPlan, QuantSpec, Target
from wcache.plans.registry import plan_for

H200 = Target("cuda", capability=(9, 0))


def _config(method: str, tp_size: int | None, strategy: str | None = None) -> LayerConfig:
    extra = () if tp_size is None else (("tp_size", tp_size),)
    return LayerConfig(QuantSpec(method, 8, strategy=strategy), 256, 512, "bfloat16", extra=extra)


@pytest.mark.parametrize(
    "method,expected",
    [
        ("fp8_per_tensor", "amax_for_tp_weight_quant"),
        ("fp8_per_channel", "amax_for_tp_weight_quant"),
        ("fp8_per_block", "128x128 blocks"),
    ],
)
@pytest.mark.parametrize("tp_size", [2, 8])
def test_online_fp8_refuses_tp_above_one(method, expected, tp_size):
    """Every online FP8 method at TP > 1 raises NoPlan naming the method, the size and why."""
    with pytest.raises(NoPlan) as err:
        plan_for(_config(method, tp_size), target=H200)
    message = str(err.value)
    assert f"online FP8 ({method}) with tensor-parallel size {tp_size} is not supported" in message
    assert expected in message
    assert "--tensor-parallel-size 1" in message
    assert "plan-missing" == err.value.code


@pytest.mark.parametrize(
    "method,plan_id",
    [
        ("fp8_per_tensor", "fp8_per_tensor/cutlass@1"),
        ("fp8_per_channel", "fp8_per_channel/cutlass@1"),
        ("fp8_per_block", "fp8_per_block/cutlass_block@1"),
    ],
)
@pytest.mark.parametrize("tp_size", [None, 1])
def test_online_fp8_at_tp_one_resolves(method, plan_id, tp_size):
    """TP = 1 (or no tp_size, the QuantSpec default) still resolves the online plan."""
    assert plan_id == plan_for(_config(method, tp_size), target=H200).id


@pytest.mark.parametrize(
    "method,strategy,plan_id",
    [
        ("fp8", None, "fp8/cutlass@1"),
        ("ct_w8a8_fp8", "channel", "ct_w8a8_fp8/cutlass@1"),
        ("fp8", "block", "fp8/cutlass_block@1"),
    ],
)
def test_serialized_fp8_at_tp_two_is_not_refused(method, strategy, plan_id):
    """Serialized FP8 (scales from the checkpoint, no amax) is unaffected by TP."""
    assert plan_id == plan_for(_config(method, 2, strategy), target=H200).id
