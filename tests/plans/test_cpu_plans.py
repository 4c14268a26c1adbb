"""CPU plans (unquantized, AWQ, GPTQ, compressed-tensors W4A16 / W8A8 INT8, KV-cache
scales) on real vLLM 0.32 layers: ``plan.load`` equals vLLM's own post-load
(tensors, attributes, ``apply`` output bit for bit), ``restore(export(prepare(x)))``
equals ``load(x)``, the guard catches mis-tagged stages, and bad inputs raise the
documented errors."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.core import (
    PREPARE_TAGS,
    LayerConfig,
    NoPlan,
    Plan,
    PlanInvalid,
    QuantSpec,
    RecordedMismatch,
    RestoreIncomplete,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
)
from wcache.core.decisions import gemm_decision
from wcache.plans import all_plans, plan_for
from wcache.shell import load_, prepare_, restore_, snapshot, state_from_module
from wcache.stages import cpu_gemm, cpu_wna16
from wcache.testing.plans import UncheckedPlan, unregistered_stage

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import (
    AMX,
    AMX_W4A8_OFF,
    AVX2,
    AVX512,
    BF16,
    CPU_PLAN_IDS,
    FAMILIES,
    HOST,
    HOST_LIBRARY,
    HOST_W4A16,
    dict_diff,
)
from wcache.vllm import probe
from wcache.vllm.compat import sync_kernel_state_


def _load_(layer, bound) -> None:
    """:func:`wcache.shell.load_`, then the kernel state bound onto vLLM's kernel
    objects (:func:`wcache.vllm.compat.sync_kernel_state_`), as the engine does."""
    load_(layer, bound)
    sync_kernel_state_(layer)


def _restore_(layer, bound, recorded, **kwargs):
    """:func:`wcache.shell.restore_`, then :func:`sync_kernel_state_` (as the
    engine's ``wcache.vllm.model.restore_layers_`` does)."""
    state = restore_(layer, bound, recorded, **kwargs)
    sync_kernel_state_(layer)
    return state


@pytest.fixture(scope="module", autouse=True)
def _vllm_world():
    """One 1-rank gloo world and vLLM config for the whole module."""
    vl.ensure_vllm()


def _forward(case: vl.Case, layer) -> torch.Tensor | None:
    if case.apply is None:
        return None
    with vl.vllm_context():
        return case.apply(layer, case.activations())


#: The NoPlan reason for a layer whose vLLM kernel cannot run on this host at all
#: (its op is missing from the loaded kernel library): skipped, not failed.
VLLM_CANNOT_RUN = "vLLM itself cannot run this layer here"


def _host_plan(case: vl.Case) -> Plan:
    """The plan for ``case`` on this host; skips when vLLM itself cannot run it here."""
    try:
        return plan_for(case.config, target=HOST).plan
    except NoPlan as exc:
        if VLLM_CANNOT_RUN in str(exc):
            pytest.skip(f"{HOST_LIBRARY}: {exc}")
        raise


def _exported_layer(case: vl.Case, plan: Plan, seed: int = 0, target: Target | None = None):
    """prepare on a daemon-side layer; install fresh clones on a meta-built one."""
    daemon = case.new_layer(seed=seed)
    prepared = prepare_(daemon, plan.bind(case.config, target or HOST))
    engine = case.new_layer("meta", seed=None)
    vl.install_exported_(engine, vl.export_clone(prepared), prepared.buffers)
    return engine, prepared


# --------------------------------------------------------------------------- load == vLLM


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8)
@given(data=st.data())
def test_load_matches_vllm(family, data):
    """plan.load gives vLLM's tensors, attributes and bit-identical apply output."""
    case = data.draw(FAMILIES[family])
    plan = _host_plan(case)
    expected, actual = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    _load_(actual, plan.bind(case.config, HOST))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(actual, case.attr_paths))
    if case.apply is not None:
        assert torch.equal(_forward(case, expected), _forward(case, actual))


@pytest.mark.parametrize("family", ["awq", "gptq", "ct_w4a16"])
@settings(max_examples=8)
@given(data=st.data())
def test_load_matches_vllm_tensors_where_the_host_cannot_apply(family, data):
    """Where this host's vLLM kernel library lacks ``cpu_gemm_wna16`` (an AVX2-only host,
    where the test above skips these families), plan.load for an AVX512 target still
    gives vLLM's post-load tensors and attributes (values, shapes, strides): vLLM's
    post-load is plain torch here; only ``apply`` needs the kernel. (A host with the op
    is left to the test above: there vLLM's post-load asks the host for AMX itself.)"""
    case = data.draw(FAMILIES[family])
    if cpu_gemm.missing_op_reason(HOST, ("cpu_gemm_wna16",), "CPUWNA16LinearKernel") is None:
        pytest.skip(f"{HOST_LIBRARY} has cpu_gemm_wna16: test_load_matches_vllm covers it")
    plan = plan_for(case.config, target=AVX512).plan
    expected, actual = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    _load_(actual, plan.bind(case.config, AVX512))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(actual, case.attr_paths))


# --------------------------------------------------------------------------- restore invariant


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8)
@given(data=st.data())
def test_restore_of_export_equals_load(family, data):
    """restore(export(prepare(x))) == load(x): tensors, attributes, apply output."""
    case = data.draw(FAMILIES[family])
    plan = _host_plan(case)
    loaded = case.new_layer()
    _load_(loaded, plan.bind(case.config, HOST))
    engine, prepared = _exported_layer(case, plan)
    _restore_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    meta_left = [k for k, v in state_from_module(engine).tensors.items() if v.device.type == "meta"]
    assert [] == meta_left
    if case.apply is not None:
        assert torch.equal(_forward(case, loaded), _forward(case, engine))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=5)
@given(data=st.data())
def test_prepare_and_load_are_pure(family, data):
    """Running a plan's stages never writes the layer's checkpoint tensors in place."""
    case = data.draw(FAMILIES[family])
    plan = _host_plan(case)
    layer = case.new_layer()
    state = state_from_module(layer)
    before = {k: (v.detach().clone(), v._version) for k, v in state.tensors.items()}
    for tags in (PREPARE_TAGS, frozenset(Tag)):
        plan.run(state, case.config, HOST, tags, check_purity=True)
        for k, (copy, version) in before.items():
            assert torch.equal(copy, state.tensors[k]) and version == state.tensors[k]._version


@pytest.mark.parametrize("family", ["awq", "ct_w4a16", "embedding", "kv_cache"])
def test_restore_twice_equals_once(family):
    """Replaying the restore stages a second time changes nothing observable (plans
    whose DERIVE releases the source weight can only be restored once, as in vLLM)."""
    case = {
        "awq": vl.awq_linear(128, 64, 32),
        "ct_w4a16": vl.ct_w4a16_linear(128, 64, 32, False),
        "embedding": vl.unquantized_embedding(100, 64),
        "kv_cache": vl.kv_cache_layer("fp8", 0.5, 0.25, -1.0, 2.0),
    }[family]
    plan = _host_plan(case)
    engine, prepared = _exported_layer(case, plan)
    _restore_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    once = snapshot(engine, case.attr_paths)
    out_once = _forward(case, engine)
    _restore_(
        engine, plan.bind(case.config, HOST), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(once, snapshot(engine, case.attr_paths))
    if out_once is not None:
        assert torch.equal(out_once, _forward(case, engine))


# --------------------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    "spec,config_kw,target,plan_id",
    [
        (QuantSpec("unquantized"), {}, AVX512, "unquantized/onednn@1"),
        (QuantSpec("unquantized", layer_kind="embedding"), {}, AVX512, "unquantized/onednn@1"),
        (
            QuantSpec("unquantized"),
            {"params_dtype": "float16"},
            AVX512,
            "unquantized/torch_linear@1",
        ),
        (QuantSpec("unquantized"), {}, AVX2, "unquantized/torch_linear@1"),
        (QuantSpec("unquantized"), {"params_dtype": "float32"}, AVX2, "unquantized/onednn@1"),
        (QuantSpec("unquantized"), {}, AMX, "unquantized/sgl@1"),  # 256x128 bf16: SGL-shaped
        (QuantSpec("unquantized", layer_kind="embedding"), {}, AMX, "unquantized/sgl@1"),
        (QuantSpec("unquantized"), {"size_n": 4096, "size_k": 4096}, AMX, "unquantized/onednn@1"),
        (QuantSpec("unquantized", kernel="torch_linear"), {}, AVX512, "unquantized/torch_linear@1"),
        (QuantSpec("unquantized"), {}, Target("cuda", (9, 0)), "unquantized/none@1"),
        (
            QuantSpec("awq", num_bits=4, group_size=128, zero_point=True),
            {},
            AVX512,
            "awq/cpu_wna16@1",
        ),
        (
            QuantSpec("awq", num_bits=4, group_size=128, zero_point=True),
            {},
            AMX_W4A8_OFF,
            "awq/cpu_wna16@1",
        ),
        (QuantSpec("gptq", num_bits=4, group_size=128), {}, AVX512, "gptq/cpu_wna16@1"),
        (QuantSpec("ct_w4a16", num_bits=4, group_size=64), {}, AVX512, "ct_w4a16/cpu_wna16@1"),
        (
            QuantSpec("ct_w4a16", num_bits=4, group_size=64, zero_point=True),
            {"params_dtype": "float16"},
            AMX,
            "ct_w4a16/cpu_wna16@1",
        ),  # fp16 activations: w4a16
        # AMX / RISC-V with bf16 activations and VLLM_CPU_INT4_W4A8 on: the w4a8 layout
        (
            QuantSpec("awq", num_bits=4, group_size=64, zero_point=True),
            {},
            AMX,
            "awq/cpu_wna16_w4a8@1",
        ),
        (
            QuantSpec("gptq", num_bits=4),
            {},
            vl.synthetic_target(("riscv",)),
            "gptq/cpu_wna16_w4a8@1",
        ),
        (
            QuantSpec("ct_w4a16", num_bits=4, group_size=32),
            {},
            vl.synthetic_target(("amx",), env={"VLLM_CPU_INT4_W4A8": "1"}),
            "ct_w4a16/cpu_wna16_w4a8@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="channel"),
            {},
            AVX512,
            "ct_w8a8_int8/onednn@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="channel"),
            {},
            AVX2,
            "ct_w8a8_int8/onednn@1",
        ),
        # AMX, symmetric input, tile-aligned int8: vLLM's SGL int8 kernel
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor"),
            {"size_k": 64, "size_n": 96},
            AMX,
            "ct_w8a8_int8/sgl@1",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", kernel="sgl"),
            {"size_k": 64, "size_n": 96},
            AVX512,
            "ct_w8a8_int8/sgl@1",
        ),  # the adapter's answer
        (
            QuantSpec(
                "ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", input_symmetric=False
            ),
            {"size_k": 64, "size_n": 96},
            AMX,
            "ct_w8a8_int8/onednn@1",
        ),  # asymmetric input: oneDNN on AMX too
        (QuantSpec("kv_cache", layer_kind="attention"), {}, AVX512, "kv_cache/scales@1"),
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for picks the plan for the kernel decisions the Target records."""
    config = LayerConfig(
        spec, **{"size_k": 256, "size_n": 128, "params_dtype": "bfloat16", **config_kw}
    )
    assert plan_id == plan_for(spec, config, target=target).id


def test_plan_for_on_this_host_follows_vllms_decisions():
    """On this host, the unquantized plan is the branch vLLM's dispatch took, and the
    CPUWNA16 plans resolve exactly when vLLM's kernel library has cpu_gemm_wna16."""
    for dtype in ("bfloat16", "float16", "float32"):
        config = LayerConfig(QuantSpec("unquantized"), 256, 128, dtype)
        shaped = cpu_gemm.sgl_shape(128, 256, getattr(torch, dtype))
        assert (
            HOST.kernel(gemm_decision(getattr(torch, dtype), shaped))
            == plan_for(config, target=HOST).kernel
        )
    for n, k in ((128, 256), (64, 96), (8, 32)):  # general, SGL-shaped, N < 16
        config = LayerConfig(QuantSpec("unquantized"), k, n, "bfloat16")
        assert (
            probe.unquantized_gemm_kernel(n, k, torch.bfloat16)
            == plan_for(config, target=HOST).kernel
        )
    awq = LayerConfig(_awq_spec(), 256, 128)
    if HOST.kernel("op.cpu_gemm_wna16") == "present":
        layout = "cpu_wna16_w4a8" if cpu_wna16.use_w4a8_for(BF16, HOST) else "cpu_wna16"
        assert f"awq/{layout}@1" == plan_for(awq, target=HOST).id
    else:
        with pytest.raises(
            NoPlan, match=f"{HOST_LIBRARY} on this host has no torch.ops._C.cpu_gemm_wna16"
        ):
            plan_for(awq, target=HOST)


def _awq_spec():
    return QuantSpec("awq", num_bits=4, group_size=64, zero_point=True)


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
        (QuantSpec("gptq", num_bits=8, group_size=128), (256, 128), AVX512, "GPTQ int8 on CPU"),
        # vLLM's convert_weight_packed_scale_zp blocks K by min(group, 128): it fails itself
        (
            QuantSpec("awq", num_bits=4, group_size=-1, zero_point=True),
            (192, 128),
            AMX,
            "convert_weight_packed_scale_zp cannot block size_k 192",
        ),
        (
            _awq_spec(),
            (256, 128),
            vl.synthetic_target(
                ("amx", "avx512", "avx512_bf16"), **{"op.int4_scaled_mm_cpu": "absent"}
            ),
            r"no torch.ops._C.int4_scaled_mm_cpu \(CPUWNA16LinearKernel \(w4a8\)",
        ),
        (QuantSpec("mystery_quant"), (256, 128), AVX512, "no plan for method 'mystery_quant'"),
        (
            QuantSpec("awq", num_bits=4, group_size=64, zero_point=False),
            (256, 128),
            AVX512,
            "without zero points",
        ),
        (_awq_spec(), (256, 100), AVX512, "size_n % 32"),
        (
            _awq_spec(),
            (256, 128),
            AVX2,
            r"_C_AVX2 on this host has no torch.ops._C.cpu_gemm_wna16 \(CPUWNA16LinearKernel",
        ),
        (QuantSpec("gptq", num_bits=4, group_size=64), (256, 128), AVX2, "cpu_gemm_wna16"),
        (_awq_spec(), (256, 128), Target("cpu"), "records no vLLM kernel decisions"),
        (QuantSpec("unquantized"), (64, 96), Target("cpu"), "records no unquantized GEMM decision"),
        (QuantSpec("unquantized"), (64, 96), vl.synthetic_target(("power",)), "POWER"),
        (
            QuantSpec("unquantized", kernel="sgl"),
            (64, 96),
            AVX2,
            "_C_AVX2 on this host has no torch.ops._C.convert_weight_packed",
        ),
        (QuantSpec("unquantized", kernel="zentorch"), (64, 96), AVX512, "zentorch"),
        (
            QuantSpec("unquantized"),
            (64, 96),
            vl.synthetic_target(
                **{
                    "unquantized_gemm[bfloat16]": "zentorch",
                    "unquantized_gemm[bfloat16,sgl_shape]": "zentorch",
                }
            ),
            "zentorch_linear_unary",
        ),
        # vLLM's check_cpu_sgl_kernel takes int8 N % 16, its convert_weight_packed N % 32
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor"),
            (64, 48),
            AMX,
            "convert_weight_packed needs N % 32 == 0",
        ),
        (
            QuantSpec("ct_w8a8_int8", num_bits=8, act_bits=8, strategy="tensor", kernel="sgl"),
            (64, 96),
            AVX2,
            r"no torch.ops._C.convert_weight_packed, "
            r"torch.ops._C.int8_scaled_mm_with_quant",
        ),
        (
            QuantSpec("awq", num_bits=4, zero_point=True, kernel="machete"),
            (256, 128),
            AVX512,
            "Machete is a CUDA kernel; the target is cpu",
        ),
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """Unsupported methods, layouts, kernel decisions and targets raise NoPlan with the reason."""
    config = LayerConfig(spec, size[0], size[1], "bfloat16", name="model.layers.0.x")
    with pytest.raises(NoPlan, match=message):
        plan_for(spec, config, target=target)


def test_kv_cache_only_v_scale_raises():
    """A quantized KV cache with v_scale but no k_scale raises StageInputError (vLLM asserts)."""
    from wcache.stages.common import StageInputError

    case = vl.kv_cache_layer("fp8", -1.0, 0.5, -1.0, -1.0)
    with pytest.raises(AssertionError):
        case.vllm_process(case.new_layer())
    plan = _host_plan(case)
    with pytest.raises(StageInputError, match="k_scale"):
        _load_(case.new_layer(), plan.bind(case.config, HOST))


def test_restore_missing_tensor_raises_incomplete():
    """A restore whose export lacks a tensor the plan reads raises RestoreIncomplete
    (the w4a16 layout: its restore reads the scales for isa_hint)."""
    case = vl.gptq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan  # plain torch: runs on any host
    engine, prepared = _exported_layer(case, plan, target=AVX512)
    del engine._parameters["scales"]
    with pytest.raises(RestoreIncomplete, match="scales"):
        _restore_(
            engine,
            plan.bind(case.config, AVX512),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


@pytest.mark.parametrize(
    "target,stage_name,key,value",
    [
        (AVX512, "cpu_wna16.set_use_w4a8", "use_w4a8", True),
        (AVX512, "cpu_wna16.set_isa_hint", "isa_hint", "vsx"),  # no x86 host records vsx
        (AMX, "cpu_wna16.set_use_w4a8", "use_w4a8", False),
    ],
    ids=["w4a16-use_w4a8", "w4a16-isa_hint", "w4a8-use_w4a8"],
)
def test_restore_recorded_mismatch(target, stage_name, key, value):
    """A daemon record of use_w4a8/isa_hint that differs from the target's raises
    (both CPUWNA16 layouts; the w4a8 prepare needs vLLM's ``_C`` op)."""
    if target is AMX and HOST.kernel("op.convert_weight_packed_scale_zp") != "present":
        pytest.skip(f"vLLM's {HOST_LIBRARY} has no torch.ops._C.convert_weight_packed_scale_zp")
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=target).plan
    engine, prepared = _exported_layer(case, plan, target=target)
    recorded = {k: dict(v) for k, v in prepared.recorded.items()}
    assert recorded[stage_name][key] != value
    recorded[stage_name][key] = value
    with pytest.raises(RecordedMismatch, match=key):
        _restore_(
            engine, plan.bind(case.config, target), recorded, strict=True, drops=prepared.drops
        )


def test_restore_on_other_isa_raises_recorded_mismatch():
    """Bytes prepared on a non-AMX host restored on an AMX host (w4a8 off) raise
    RecordedMismatch on isa_hint ("vec" recorded, "amx" there)."""
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan
    engine, prepared = _exported_layer(case, plan, target=AVX512)
    with pytest.raises(RecordedMismatch, match="isa_hint"):
        _restore_(
            engine, plan.bind(case.config, AMX_W4A8_OFF), prepared.recorded, drops=prepared.drops
        )


def test_w4a16_bytes_on_a_w4a8_host_raise_recorded_mismatch():
    """w4a16 bytes (prepared for a non-AMX host) restored with the plan an AMX host
    resolves (w4a8 layout) raise RecordedMismatch: the record names set_isa_hint,
    which the w4a8 plan lacks, so the engine never reads w4a16 bytes as w4a8."""
    case = vl.awq_linear(128, 64, 32)
    plan = plan_for(case.config, target=AVX512).plan
    engine, prepared = _exported_layer(case, plan, target=AVX512)
    amx_plan = plan_for(case.config, target=AMX).plan
    assert "awq/cpu_wna16_w4a8@1" == amx_plan.id
    with pytest.raises(RecordedMismatch, match="cpu_wna16.set_isa_hint"):
        _restore_(engine, amx_plan.bind(case.config, AMX), prepared.recorded, drops=prepared.drops)


def test_recorded_values_for_unknown_stage_raise():
    """Records naming a stage the plan lacks mean daemon and engine differ: raise."""
    case = vl.gptq_linear(128, 64, 32)
    plan = _host_plan(case)
    engine, prepared = _exported_layer(case, plan)
    recorded = {**prepared.recorded, "marlin.repack": {"x": 1}}
    with pytest.raises(RecordedMismatch, match="marlin.repack"):
        _restore_(engine, plan.bind(case.config, HOST), recorded, drops=prepared.drops)


# --------------------------------------------------------------------------- guard


def _awq_plan(*stages_, unchecked=False) -> Plan:
    cls = UncheckedPlan if unchecked else Plan
    return cls(
        method="awq",
        kernel="cpu_wna16_test",
        stages=stages_,
        checkpoint={"qweight", "qzeros", "scales", "bias"},
    )


def _awq_stages():
    """The AWQ plan's w4a16 stages (resolved for an AVX512 host: the guard tests below
    run them without vLLM's GEMM, so they hold on hosts whose vLLM lacks cpu_gemm_wna16;
    they bind HOST_W4A16, where the w4a16 layout is vLLM's choice on any host)."""
    return list(plan_for(LayerConfig(_awq_spec(), 128, 64), target=AVX512).stages)


def test_transform_mistagged_metadata_is_invalid():
    """A TRANSFORM re-tagged METADATA (so restore would replay it) is refused at build."""
    stages_ = _awq_stages()
    stages_[0] = evolve(stages_[0], tag=Tag.METADATA)
    with pytest.raises(PlanInvalid, match="awq.convert_to_standard"):
        _awq_plan(*stages_)


def test_allocate_writing_exported_tensor_is_invalid_and_guarded():
    """An ALLOCATE stage writing an exported tensor is refused at build; forced through,
    restore raises RestoreWroteSharedTensor."""

    @unregistered_stage(
        "cpu_wna16.alloc_scales", Tag.ALLOCATE, reads=("scales",), writes=("scales",)
    )
    def bad(tensors, config, target, recorded):
        return StageOut(tensors={"scales": torch.ones_like(tensors["scales"])})

    with pytest.raises(PlanInvalid, match="alloc_scales"):
        _awq_plan(*_awq_stages(), bad)
    case = vl.awq_linear(128, 64, 32)
    plan = _awq_plan(*_awq_stages(), bad, unchecked=True)
    engine, prepared = _exported_layer(case, plan, target=HOST_W4A16)
    with pytest.raises(RestoreWroteSharedTensor, match="scales"):
        _restore_(
            engine,
            plan.bind(case.config, HOST_W4A16),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


@pytest.mark.parametrize("via_data", [False, True])
def test_metadata_writing_in_place_is_caught(via_data):
    """A METADATA stage that writes shared bytes in place fails the restore guard, by
    version counter or (through ``.data``, which hides it) by checksum."""

    @unregistered_stage("cpu_wna16.set_scales_in_place", Tag.METADATA, reads=("scales",))
    def sneaky(tensors, config, target, recorded):
        (tensors["scales"].data if via_data else tensors["scales"]).mul_(2)
        return StageOut()

    case = vl.awq_linear(128, 64, 32)
    plan = _awq_plan(*_awq_stages())
    engine, prepared = _exported_layer(case, plan, target=HOST_W4A16)
    bad_plan = _awq_plan(*_awq_stages(), sneaky)
    with pytest.raises(RestoreWroteSharedTensor, match="scales"):
        _restore_(
            engine,
            bad_plan.bind(case.config, HOST_W4A16),
            prepared.recorded,
            strict=True,
            drops=prepared.drops,
        )


def test_metadata_folded_into_transform_fails_invariant():
    """Folding set_isa_hint into the repack TRANSFORM passes load but the restored layer
    lacks isa_hint: the snapshots differ."""
    repack = cpu_wna16.repack("qweight")

    @unregistered_stage(
        "cpu_wna16.repack",
        Tag.TRANSFORM,
        reads=("qweight", "scales"),
        writes=("qweight",),
        attrs=("isa_hint",),
    )
    def folded(tensors, config, target, recorded):
        out = repack(tensors, config, target, recorded)
        return evolve(
            out, attrs={"isa_hint": cpu_wna16.isa_hint_for(tensors["scales"].dtype, target)}
        )

    stages_ = [
        s for s in _awq_stages() if s.name not in ("cpu_wna16.set_isa_hint", "cpu_wna16.repack")
    ] + [folded]
    plan = _awq_plan(*stages_)
    case = vl.awq_linear(128, 64, 32)
    loaded, expected = case.new_layer(), case.new_layer()
    _load_(loaded, plan.bind(case.config, HOST_W4A16))
    with pytest.MonkeyPatch.context() as mp:  # vLLM's w4a16 layout, as HOST_W4A16
        mp.setenv(cpu_wna16.W4A8_ENV, "0")
        case.vllm_process(expected)
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    engine, prepared = _exported_layer(case, plan, target=HOST_W4A16)
    _restore_(
        engine,
        plan.bind(case.config, HOST_W4A16),
        prepared.recorded,
        strict=True,
        drops=prepared.drops,
    )
    diff = dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert {"@isa_hint": (loaded.isa_hint, "<missing>")} == diff


# --------------------------------------------------------------------------- registry


def test_cpu_plans_registered_with_descriptions_and_sources():
    """Every CPU plan is registered, described, and each stage names its upstream source."""
    plans = {p.id: p for p in all_plans()}
    for plan_id in CPU_PLAN_IDS:
        plan = plans[plan_id]
        assert len(plan.description) > 40, plan_id
        assert all(s.source for s in plan.stages), plan_id
        assert f"`{plan_id}`" in plan.describe()


def test_cuda_unquantized_plan_is_a_noop():
    """The CUDA unquantized plan runs no stage: load leaves the layer unchanged."""
    case = vl.unquantized_linear(64, 96)
    plan = plan_for(case.config, target=Target("cuda", (9, 0))).plan
    layer = case.new_layer()
    before = snapshot(layer)
    _load_(layer, plan.bind(case.config, Target("cuda", (9, 0))))
    assert ("none", ()) == (plan.kernel, plan.stages)
    assert before == snapshot(layer)


# --------------------------------------------------------------------------- SGL (AMX)


@pytest.mark.parametrize(
    "size_k,size_n,dtype,bias",
    [
        # fp16 SGL needs AMX-FP16 silicon: vLLM's fp16 kernel aborts without it, so only bf16 here
        (64, 96, BF16, True),
        (64, 96, BF16, False),
        (40, 8, BF16, True),
        (32, 16, BF16, True),
    ],
)
def test_sgl_plan_equals_vllms_amx_dispatch(size_k, size_n, dtype, bias, monkeypatch):
    """Where vLLM picks its AMX SGL kernel (small tile-aligned weights), the sgl plan's
    load equals vLLM's dispatch (packed weight released, fp32 bias, forward bit for bit)
    and restore(export(prepare)) equals load, the closure holding the shared bytes.
    AMX is reported present in-process; vLLM's SGL ops run on this ISA without it."""
    if HOST.kernel("op.convert_weight_packed") != "present":
        pytest.skip(f"vLLM's {HOST_LIBRARY} has no torch.ops._C.convert_weight_packed")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vl.unquantized_linear(size_k, size_n, dtype, bias)
    amx = AMX
    plan = plan_for(case.config, target=amx).plan
    assert "unquantized/sgl@1" == plan.id
    expected, loaded = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    assert "sgl" == vl.probe_branch(expected)
    _load_(loaded, plan.bind(case.config, amx))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    assert torch.equal(_forward(case, expected), _forward(case, loaded))
    engine, prepared = _exported_layer(case, plan, target=amx)
    shared = prepared.tensors["weight"]
    _restore_(
        engine, plan.bind(case.config, amx), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert torch.equal(_forward(case, loaded), _forward(case, engine))
    assert engine.cpu_linear.packed_weight.data_ptr() != shared.data_ptr()  # engine's own copy
    assert engine.weight.numel() == 0


@pytest.mark.parametrize("vocab,dim", [(100, 64), (10, 32), (130, 32)])
def test_sgl_plan_equals_vllms_amx_embedding(vocab, dim, monkeypatch):
    """Where vLLM picks its AMX SGL kernel for an embedding / lm_head (small bf16
    vocabularies), the sgl plan keeps the unpacked weight for the lookup (exported as
    loaded, not transformed) and binds cpu_linear over a private packed copy: load
    equals vLLM's dispatch (lookup and lm_head matmul bit for bit) and restore equals
    load. AMX is reported present in-process, as in the linear test above."""
    if HOST.kernel("op.convert_weight_packed") != "present":
        pytest.skip(f"vLLM's {HOST_LIBRARY} has no torch.ops._C.convert_weight_packed")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    case = vl.unquantized_embedding(vocab, dim)
    plan = plan_for(case.config, target=AMX).plan
    assert "unquantized/sgl@1" == plan.id
    expected, loaded = case.new_layer(), case.new_layer()
    case.vllm_process(expected)
    assert "sgl" == vl.probe_branch(expected)
    _load_(loaded, plan.bind(case.config, AMX))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    assert torch.equal(_forward(case, expected), _forward(case, loaded))
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(4)).to(BF16)
    assert torch.equal(expected.cpu_linear(x, None, None), loaded.cpu_linear(x, None, None))
    engine, prepared = _exported_layer(case, plan, target=AMX)
    assert torch.equal(prepared.tensors["weight"], expected.weight.data)  # exported unpacked
    _restore_(
        engine, plan.bind(case.config, AMX), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert torch.equal(loaded.cpu_linear(x, None, None), engine.cpu_linear(x, None, None))
    assert tuple(engine.weight.shape) == tuple(expected.weight.shape)  # kept for the lookup
