"""wcache/plans/attention.py: the MLA attention (DeepSeek-V2/V3) ``mla_attention/absorb``
plan against vLLM's own ``MLAAttention.process_weights_after_loading``, run on CPU
tensors of the same layer, and the branches it does not reproduce refused by name. The
stages are tested directly in tests/stages/test_attention.py and test_mla.py; the
``attention/default`` plan's inputs are drawn by tests/plans/test_registry.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vllm_layers as vl
from wcache.core import NoPlan, Tag
from wcache.plans import attention as attn_plans
from wcache.plans import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot
from wcache.stages import mla

#: DeepSeek-V2 per-rank shapes, tiny: N heads, P = qk_nope, V = v_head, L = kv_lora_rank.
N, P, V, L = vl.MLA_HEADS, vl.MLA_NOPE, vl.MLA_V, vl.MLA_LORA
#: Attributes vLLM's post-load sets besides the tensors (host floats and copies).
HOST_ATTRS = (
    "_q_scale_float",
    "_k_scale_float",
    "_v_scale_float",
    "_prob_scale_float",
    "_k_scale_cpu",
    "_v_scale_cpu",
)


def _weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N * (P + V), L, generator=gen).to(torch.bfloat16)


def _bound(layer, target_device: str = "cpu"):
    from wcache.core import Target
    from wcache.vllm.adapter import layer_config

    # the adapter runs outside the model's default dtype (float32 here): the model dtype
    # comes from kv_b_proj.params_dtype
    config = layer_config(layer.quant_method, layer, None, name="mla_attn")
    assert "bfloat16" == config.params_dtype
    target = Target(device_type=target_device)
    return plan_for(config, target=target).plan.bind(config, target)


def _vllm_loaded(weight: torch.Tensor):
    from vllm.model_executor.layers.attention import MLAAttention

    layer = vl.mla_layer(weight)
    MLAAttention.process_weights_after_loading(layer, torch.bfloat16)
    return layer


@pytest.fixture(scope="module", autouse=True)
def _vllm_world():
    vl.ensure_vllm()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.shape, a.stride(), a.dtype, a.storage_offset()) == (
        b.shape,
        b.stride(),
        b.dtype,
        b.storage_offset(),
    )
    assert torch.equal(a, b)


def test_load_equals_vllms_postload():
    """The plan's load gives vLLM's W_UV [N, L, V] / W_UK_T [N, P, L]: equal values,
    shapes, strides and offsets, Parameters aliasing kv_b_proj.weight as vLLM's do;
    default scales, host floats and copies equal."""
    ours = vl.mla_layer(_weight())
    bound = _bound(ours)
    assert "mla_attention/absorb@1" == bound.plan.id
    load_(ours, bound)
    theirs = _vllm_loaded(_weight())
    for name in mla.ABSORBED:
        got, want = getattr(ours, name), getattr(theirs, name)
        assert isinstance(got, torch.nn.Parameter) and isinstance(want, torch.nn.Parameter)
        assert name in dict(ours.named_parameters(recurse=False))
        _same_view(got, want)
        assert (
            got.untyped_storage().data_ptr() == ours.kv_b_proj.weight.untyped_storage().data_ptr()
        )
        assert (
            want.untyped_storage().data_ptr()
            == theirs.kv_b_proj.weight.untyped_storage().data_ptr()
        )
    assert (N, L, V) == tuple(ours.W_UV.shape) and (N, P, L) == tuple(ours.W_UK_T.shape)
    for name in attn_plans.a.SCALE_BUFFERS:
        assert torch.equal(getattr(theirs, name), getattr(ours, name))
        assert 1.0 == float(getattr(ours, name))
    assert snapshot(theirs, HOST_ATTRS) == snapshot(ours, HOST_ATTRS)


def test_restore_of_export_equals_load_and_views_the_mapped_weight():
    """The daemon's prepare exports no W_UV / W_UK_T (DERIVE: no bytes); a restore over
    the exported kv_b_proj.weight and scales builds them as views of the mapped weight,
    equal to vLLM's load, and writes nothing shared."""
    daemon = vl.mla_layer(_weight(1))
    bound = _bound(daemon)
    prepared = prepare_(daemon, bound)
    assert not hasattr(daemon, "W_UV") and "W_UV" not in prepared.tensors
    assert set(attn_plans.a.SCALE_BUFFERS) == set(prepared.tensors)
    # the engine: a fresh layer holding copies of what the daemon exported (the "mapping")
    engine = vl.mla_layer(daemon.kv_b_proj.weight.detach().clone())
    for name in attn_plans.a.SCALE_BUFFERS:
        engine.register_buffer(name, getattr(daemon, name).clone())
    mapped = engine.kv_b_proj.weight
    restore_(engine, _bound(engine), prepared.recorded, strict=True)
    theirs = _vllm_loaded(_weight(1))
    for name in mla.ABSORBED:
        _same_view(getattr(engine, name), getattr(theirs, name))
        assert (
            getattr(engine, name).untyped_storage().data_ptr()
            == mapped.untyped_storage().data_ptr()
        )
    assert engine.kv_b_proj.weight is mapped
    assert snapshot(theirs, HOST_ATTRS) == snapshot(engine, HOST_ATTRS)


def test_plan_tags():
    """W_UV / W_UK_T are DERIVE (views, replayed on restore, never exported); the scale
    fill is the one TRANSFORM; kv_b_proj.weight is read, never written."""
    plan = attn_plans.MLA_ABSORB
    tags = {s.name: s.tag for s in plan.stages}
    assert Tag.DERIVE == tags["mla.select_absorbed_weights"]
    assert [Tag.TRANSFORM] == [t for n, t in tags.items() if t is Tag.TRANSFORM]
    assert all(mla.KV_B_PROJ_WEIGHT not in s.writes for s in plan.stages)
    assert mla.KV_B_PROJ_WEIGHT in plan.checkpoint


def _refusal(layer, device="cuda") -> str:
    with pytest.raises(NoPlan) as err:
        _bound(layer, device)
    return str(err.value)


def test_amx_backend_is_refused_by_name():
    """vLLM-CPU's AMX_MLA (packs private W_UK/W_UV, empties kv_b_proj.weight) is refused
    naming the backend and the fix (CPU_MLA)."""
    layer = vl.mla_layer(_weight(), backend="AMX_MLA")
    layer.is_amx_bmm_enabled = True
    reason = _refusal(layer, "cpu")
    assert "AMX_MLA" in reason and "--attention-backend CPU_MLA" in reason


def test_cpu_mla_backend_gets_the_plan():
    """vLLM-CPU's reference CPU_MLA backend (no impl post-load) gets the absorb plan."""
    assert "mla_attention/absorb@1" == _bound(vl.mla_layer(_weight(), "CPU_MLA"), "cpu").plan.id


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda m: setattr(m, "dcp_q_replicate", True), "DCP query replication"),
        (lambda m: setattr(m, "is_aiter_triton_fp8_bmm_enabled", True), "aiter"),
        (
            lambda m: setattr(m.kv_b_proj, "quant_method", type("Fp8LinearMethod", (), {})()),
            "kv_b_proj is quantized (Fp8LinearMethod)",
        ),
        (
            lambda m: setattr(
                m.kv_b_proj, "weight", torch.nn.Parameter(_weight().float(), requires_grad=False)
            ),
            "kv_b_proj is float32 but the model dtype is bfloat16",
        ),
    ],
)
def test_unplanned_branches_are_refused_by_name(change, needle):
    """Each branch of vLLM's MLA post-load the plan does not reproduce is refused,
    naming it."""
    layer = vl.mla_layer(_weight())
    change(layer)
    assert needle in _refusal(layer)
