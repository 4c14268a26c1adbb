"""wcache/plans/fp8.py: every FP8 plan's restore(export(prepare)) == load on CPU (the
CUTLASS padding and logical width, which a restore without its METADATA stage lacks),
the compressed-tensors @1/@2 plans and vLLM 0.33's ``processed_weight_dims``, the
refusals with their reasons; the online FP8 daemon load path and what the restored
layer carries (vLLM's attributes, nothing more; everything ``wcache verify`` reads),
the padded-N per-channel case, the refusal of an already-quantized weight, and online
FP8 at TP > 1. The per-plan contracts against vLLM's layers are rows of
tests/plans/test_cuda_contracts.py."""

from __future__ import annotations

import types

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings

from tests.helpers import reference_kernels as R
from tests.helpers import vllm_layers as VL
from tests.helpers.cuda_cases import (
    FP8_KINDS,
    H200,
    PROCESSED_WEIGHT_DIMS,
    assert_restore_invariant,
    attr_paths,
    cuda_config,
    export,
    fp8_bits,
    fp8_cases,
    make_module,
    roundtrip,
    seeded_generator,
)
from wcache.core import (
    LayerConfig,
    NoPlan,
    QuantSpec,
    RecordedMismatch,
    Tag,
    Target,
)
from wcache.plans import fp8 as fp8_plans
from wcache.plans.registry import plan_for
from wcache.shell import load_, prepare_, restore_, snapshot

pytest.importorskip("vllm")

from tests.helpers.cuda_contracts import (
    FP8_BLOCK_ATTRS,
    FP8_CUTLASS_ATTRS,
    ONLINE_FP8_PLANS,
    adapter_plan,
    assert_equal,
    diff,
    online_fp8_contract,
    online_fp8_layer,
    online_fp8_vllm_and_restored,
)

# --------------------------------------------------------------------------- on CPU


@settings(max_examples=25)
@given(fp8_cases(FP8_KINDS))
def test_fp8_restore_invariant(case):
    """Every FP8 plan: restore == load (snapshot incl. logical width, forward); the
    CUTLASS layout pads N and K to 16 (zero weight, unit scale) and keeps the width.
    (The MXFP8 plans: tests/plans/test_mxfp8.py.)"""
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


def test_cutlass_restore_with_recorded_width_mismatch_raises():
    """A restore whose LayerConfig.size_n differs from the daemon's recorded width raises."""
    cfg = cuda_config("fp8_per_channel", 64, 100, kernel="cutlass")
    plan = plan_for(cfg, target=H200).plan
    tensors = {"weight": torch.randn(100, 64).to(torch.bfloat16)}
    prepared = prepare_(make_module(tensors), plan.bind(cfg, H200))
    with pytest.raises(RecordedMismatch):
        restore_(export(prepared), plan.bind(evolve(cfg, size_n=112), H200), prepared.recorded)


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
            cuda_config("fp8_per_tensor", 64, 64, kernel="cutlass"),
            Target("cuda", (8, 0)),
            "compute capability >= 8.9",
        ),
    ],
)
def test_refused_cases_raise_noplan_with_reason(cfg, target, reason):
    """Block FP8 on Marlin and CUTLASS FP8 below sm89 raise NoPlan naming the reason."""
    with pytest.raises(NoPlan, match=reason):
        plan_for(cfg, target=target).plan


# --------------------------------------------------------------------------- simulated CUDA


@pytest.mark.parametrize("name", sorted(ONLINE_FP8_PLANS))
def test_online_fp8_daemon_load_path(simulated_cuda, name):
    """The daemon's load path for online FP8: vLLM's layerwise weight loader runs (as
    in ``wcache serve``) under the daemon's deferral, so ``plan.prepare`` gets the
    checkpoint's bf16 weight, and the restored layer equals vLLM's own online load.
    Without the deferral vLLM quantizes while loading and prepare quantizes FP8 bytes
    again (the daemon crash seen on the H200 with vLLM 0.32)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    from wcache.vllm.build import load_checkpoint_

    size_k, size_n = 256, 128
    cls = getattr(online, name)
    weight = (torch.randn(size_n, size_k, generator=torch.Generator().manual_seed(7)) * 0.05).to(
        torch.bfloat16
    )
    vllm_layer = online_fp8_layer(cls, size_k, size_n)
    config, plan = adapter_plan(vllm_layer, ONLINE_FP8_PLANS[name])
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.weight.weight_loader(vllm_layer.weight, weight.clone())

    daemon = online_fp8_layer(cls, size_k, size_n)
    assert daemon.weight.device.type == "meta"  # vLLM materializes it while loading

    class Loader:  # vLLM's DefaultModelLoader.load_weights: each tensor through its loader
        @staticmethod
        def load_weights(model, model_config):
            model.weight.weight_loader(model.weight, weight.clone())

    with VL.vllm_context("cpu", torch.bfloat16):
        load_checkpoint_(Loader, daemon, types.SimpleNamespace(dtype=torch.bfloat16))
    # what vLLM's loader handed over: the checkpoint bytes, not FP8
    assert daemon.weight.dtype == torch.bfloat16
    assert torch.equal(daemon.weight.data, weight)
    assert not getattr(daemon, "_already_called_process_weights_after_loading", False)
    # the patch is scoped: a later load quantizes as vLLM does
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise._layerwise_process.__name__ == "_layerwise_process"

    prepared = prepare_(daemon, plan.bind(config, H200))
    restored = online_fp8_layer(cls, size_k, size_n, meta=True)
    VL.install_exported_(restored, VL.export_clone(prepared), prepared.buffers)
    restore_(
        restored, plan.bind(config, H200), prepared.recorded, strict=True, drops=prepared.drops
    )
    from wcache.vllm.adapter import sync_kernel_state_

    sync_kernel_state_(restored)
    attrs = FP8_BLOCK_ATTRS if "Block" in name else FP8_CUTLASS_ATTRS
    assert_equal(vllm_layer, restored, attrs)


@pytest.mark.parametrize("name", ["Fp8PerTensorOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod"])
def test_restored_fp8_layer_has_vllms_attributes_and_no_more(simulated_cuda, name):
    """Every attribute the plan declares reads the same on the restored layer as on
    vLLM's own (what ``wcache verify`` compares): the CUTLASS output width lives on
    vLLM's kernel object only. Before the fix the restored layer also carried
    ``logical_output_size`` (verify failed for every CUTLASS FP8 format on the H200)."""
    vllm_layer, plan, restored = online_fp8_vllm_and_restored(name, 256, 128, seed=3)
    declared = sorted({a for s in plan.stages for a in s.attrs}) + list(FP8_CUTLASS_ATTRS)
    assert_equal(vllm_layer, restored, tuple(declared))


@pytest.mark.parametrize("name", sorted(ONLINE_FP8_PLANS))
def test_restored_online_fp8_layer_equals_vllms_in_everything_verify_reads(simulated_cuda, name):
    """``wcache verify``'s own per-module state (tensors and every attribute, kernel
    objects opened up) reads the same on the restored layer as on vLLM's online load.
    Before the fix the restored layer lacked vLLM's
    ``_already_called_process_weights_after_loading`` flag (verify failed for every
    online FP8 scheme on the H200)."""
    from wcache.vllm.compat import POSTLOAD_DONE_ATTR
    from wcache.vllm.verify import module_state

    vllm_layer, _, restored = online_fp8_vllm_and_restored(name, 256, 128, seed=5)
    assert getattr(restored, POSTLOAD_DONE_ATTR) is True
    assert {} == diff(module_state(vllm_layer), module_state(restored))


def test_fp8_per_channel_online_cutlass_padded_n(simulated_cuda, monkeypatch):
    """Fp8PtpcOnlineLinearMethod with N % 16 != 0: vLLM 0.32's CUTLASS post-load raises
    (it sets ``weight_loader`` on the padded weight twice), and with that second
    ``set_weight_attrs`` made idempotent; vLLM 0.33 as it is: its padded weight and
    1.0-padded ``[N16, 1]`` scale equal wcache's load and restore."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    size_k, size_n = 64, 100
    if VL.cutlass_pad_n_raises():
        from vllm.model_executor.kernels.linear.scaled_mm import cutlass
        from vllm.model_executor.utils import set_weight_attrs

        layer = online_fp8_layer(online.Fp8PtpcOnlineLinearMethod, size_k, size_n)
        with (
            VL.vllm_context("cpu", torch.bfloat16),
            pytest.raises(AssertionError, match="Overwriting existing tensor attribute"),
        ):
            layer.weight.weight_loader(
                layer.weight, torch.zeros(size_n, size_k, dtype=torch.bfloat16)
            )

        def set_new_weight_attrs(weight, attrs):
            set_weight_attrs(weight, {k: v for k, v in attrs.items() if not hasattr(weight, k)})

        monkeypatch.setattr(cutlass, "set_weight_attrs", set_new_weight_attrs)
    layer = online_fp8_contract("Fp8PtpcOnlineLinearMethod", size_k, size_n, FP8_CUTLASS_ATTRS)
    padded_n = -(-size_n // 16) * 16
    assert tuple(layer.weight_scale.shape) == (padded_n, 1)
    assert torch.equal(layer.weight_scale[size_n:], torch.ones(padded_n - size_n, 1))


def test_daemon_refuses_an_already_quantized_online_weight_naming_layer_plan_and_state():
    """A daemon handed vLLM's processed layer (float8 weight) instead of the checkpoint's
    bf16 one refuses before serving: PrepareFailed (code prepare-failed) names the
    layer, the plan, the dtype found and the layer's tensors; never a crash in torch
    (``aminmax`` on float8) or bytes that differ from an ordinary load."""
    from wcache.errors import PrepareFailed
    from wcache.vllm.build import prepare_layers_
    from wcache.vllm.model import PlannedLayer

    config = LayerConfig(
        QuantSpec("fp8_per_tensor", 8, kernel="cutlass"),
        64,
        32,
        "bfloat16",
        name="model.layers.0.mlp.down_proj",
    )
    layer = torch.nn.Module()
    layer.register_parameter(
        "weight",
        torch.nn.Parameter(torch.zeros(64, 32).to(torch.float8_e4m3fn), requires_grad=False),
    )
    planned = [
        PlannedLayer(
            "model.layers.0.mlp.down_proj", layer, config, plan_for(config, target=H200).plan
        )
    ]
    with pytest.raises(PrepareFailed) as info:
        prepare_layers_(planned, H200)
    message = str(info.value)
    assert info.value.code == "prepare-failed"
    for part in (
        "model.layers.0.mlp.down_proj",
        "fp8_per_tensor/cutlass@1",
        "float8_e4m3fn [64, 32]",
        "weight float8_e4m3fn [64, 32]",
    ):
        assert part in message


# --------------------------------------------------------------------------- TP


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
