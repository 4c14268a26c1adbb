"""wcache/plans/unquantized.py: which unquantized plan (oneDNN, torch linear, AMX SGL,
the CUDA no-op) each target's recorded GEMM decision selects, the refusals with their
reasons, the SGL plan against vLLM's AMX dispatch (linear layers and embeddings), and
the CUDA plan's empty load. The properties every CPU plan shares are in
tests/plans/test_cpu_plan_properties.py."""

from __future__ import annotations

import pytest
import torch

from wcache.core import QuantSpec, Target
from wcache.plans import plan_for
from wcache.shell import snapshot

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import AMX, AVX2, AVX512, BF16, HOST, HOST_LIBRARY, dict_diff
from tests.helpers.cpu_plans import (
    assert_refused,
    assert_resolves,
    exported_layer,
    forward,
    load_synced_,
    restore_synced_,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


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
    ],
)
def test_plan_for_resolves(spec, config_kw, target, plan_id):
    """plan_for picks the unquantized plan for the GEMM decisions the Target records."""
    assert_resolves(spec, config_kw, target, plan_id)


@pytest.mark.parametrize(
    "spec,size,target,message",
    [
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
    ],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """Unsupported unquantized kernels, ISAs and targets raise NoPlan with the reason."""
    assert_refused(spec, size, target, message)


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
    load_synced_(loaded, plan.bind(case.config, amx))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    assert torch.equal(forward(case, expected), forward(case, loaded))
    engine, prepared = exported_layer(case, plan, target=amx)
    shared = prepared.tensors["weight"]
    restore_synced_(
        engine, plan.bind(case.config, amx), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert torch.equal(forward(case, loaded), forward(case, engine))
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
    load_synced_(loaded, plan.bind(case.config, AMX))
    assert {} == dict_diff(snapshot(expected, case.attr_paths), snapshot(loaded, case.attr_paths))
    assert torch.equal(forward(case, expected), forward(case, loaded))
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(4)).to(BF16)
    assert torch.equal(expected.cpu_linear(x, None, None), loaded.cpu_linear(x, None, None))
    engine, prepared = exported_layer(case, plan, target=AMX)
    assert torch.equal(prepared.tensors["weight"], expected.weight.data)  # exported unpacked
    restore_synced_(
        engine, plan.bind(case.config, AMX), prepared.recorded, strict=True, drops=prepared.drops
    )
    assert {} == dict_diff(snapshot(loaded, case.attr_paths), snapshot(engine, case.attr_paths))
    assert torch.equal(loaded.cpu_linear(x, None, None), engine.cpu_linear(x, None, None))
    assert tuple(engine.weight.shape) == tuple(expected.weight.shape)  # kept for the lookup


def test_cuda_unquantized_plan_is_a_noop():
    """The CUDA unquantized plan runs no stage: load leaves the layer unchanged."""
    case = vl.unquantized_linear(64, 96)
    plan = plan_for(case.config, target=Target("cuda", (9, 0))).plan
    layer = case.new_layer()
    before = snapshot(layer)
    load_synced_(layer, plan.bind(case.config, Target("cuda", (9, 0))))
    assert ("none", ()) == (plan.kernel, plan.stages)
    assert before == snapshot(layer)
