"""Stages and plans on CUDA tensors (the H200 tier).

* Every registered plan, stage by stage, gives on CUDA tensors exactly the bytes,
  strides, attributes and recorded values of the same run on CPU tensors.
* The FP8 CUTLASS-layout plans (online per-tensor and per-channel, serialized FP8,
  compressed-tensors W8A8 FP8) run their forward through ``torch._scaled_mm`` on
  the padded ``[K16, N16]`` weight, sliced to the recorded logical width; the
  restored layer's output is bit-identical to the ordinarily loaded one for N
  not a multiple of 16.
* Marlin int4, FP8 Marlin, MXFP8 and NVFP4 layouts: restored vs loaded through
  the reference kernels of ``tests/reference_kernels.py``, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from attrs import evolve

from wcache.core import (
    LOAD_TAGS,
    PREPARE_TAGS,
    LayerConfig,
    LayerState,
    Plan,
    Target,
)
from wcache.plans import all_plans, hosts, plan_for
from wcache.shell import load_, prepare_, restore_, state_from_module
from wcache.testing.plans import UncheckedPlan

#: Plans run with a CUDA target of capability 10.0: every CUDA plan's minimum
#: (NVFP4 CUTLASS needs Blackwell); the stages are pure torch, so the H200 runs them.
CUDA_TARGET = Target("cuda", (10, 0))
#: The H200's target, for dry runs of this tier on CPU (conftest DRY_RUN).
H200_DRY_RUN_TARGET = Target("cuda", (9, 0))
#: (N, K) of the equality runs: aligned, and N not a multiple of 16 (CUTLASS pads,
#: Marlin pads to its tiles).
SHAPES = ((192, 256), (200, 256))
#: Tokens of the forward checks: not a multiple of 16 either.
TOKENS = 33
#: Relative Frobenius error allowed between the _scaled_mm forward (FP8
#: activations) and the reference forward (high-precision activations): FP8 e4m3
#: has a 3-bit mantissa, so per-element error is up to ~6%; norms average it down.
FP8_FORWARD_REL_TOL = 0.08
CUTLASS_ALIGNMENT = 16


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in logical order, on CPU (NaN-safe equality)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.cpu().view(torch.uint8) if flat.numel() else flat.cpu()


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.stride() == b.stride()
            and torch.equal(_bytes(a), _bytes(b))
        )
    return a == b


def _target_for(plan: Plan, config: LayerConfig) -> Target | None:
    # CPU plans need vLLM's kernel decisions, which a machine without vLLM cannot probe:
    # use the reference AVX512-BF16 host's (wcache.plans.hosts) for their stage math
    for target in (CUDA_TARGET, hosts.reference_target()):
        if plan.match(config, target) is None:
            return target
    return None


def _one_stage(
    plan: Plan, stage, state: LayerState, config: LayerConfig, target: Target
) -> LayerState:
    single = UncheckedPlan(
        method=plan.method, kernel=plan.kernel, stages=(stage,), checkpoint=frozenset(state.tensors)
    )
    return single.run(state, config, target, frozenset({stage.tag}), check_purity=True)


def _assert_states_equal(
    where: str, cpu: LayerState, gpu: LayerState, device: torch.device
) -> None:
    assert sorted(cpu.tensors) == sorted(gpu.tensors), where
    for name, t in cpu.tensors.items():
        g = gpu.tensors[name]
        assert device.type == g.device.type, f"{where}: {name} left the GPU"
        assert (tuple(t.shape), t.dtype, t.stride()) == (tuple(g.shape), g.dtype, g.stride()), (
            f"{where}: {name} layout differs"
        )
        assert torch.equal(_bytes(t), _bytes(g)), f"{where}: {name} bytes differ"
    assert sorted(cpu.attrs) == sorted(gpu.attrs), where
    for name, v in cpu.attrs.items():
        assert _same_value(v, gpu.attrs[name]), f"{where}: attribute {name} differs"
    assert dict(cpu.recorded) == dict(gpu.recorded), where
    assert cpu.drops == gpu.drops, where
    assert cpu.buffers == gpu.buffers, where


PLANS = all_plans()
#: How a stage's ``source`` names a vLLM CPU kernel op it calls.
VLLM_CPU_OP = "torch.ops._C."


@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.id)
def test_every_stage_on_cuda_gives_the_cpu_bytes(plan, n, k, checkpoints, cuda):
    """Each stage of the plan, run on CUDA tensors, returns the CPU run's tensors
    (bytes, shapes, strides, dtypes), attributes, records and drops."""
    make, module_with = checkpoints
    made = make(plan.method, n, k)
    if made is None:
        pytest.skip(f"no synthetic {plan.method} layer in the gpu tier (attention/KV/MoE)")
    config, tensors = made
    config = evolve(config, quant=evolve(config.quant, kernel=plan.kernel))
    target = _target_for(plan, config)
    if target is None:
        pytest.skip(f"{plan.id} matches no target for N={n}, K={k}")
    tags = LOAD_TAGS if target.device_type == "cuda" else PREPARE_TAGS  # CPU DERIVE needs vLLM ops
    cpu = state_from_module(module_with(tensors, "cpu"))
    gpu = state_from_module(module_with(tensors, cuda))
    steps = [s for s in plan.stages if s.tag in tags]
    cpu_ops = [s.name for s in steps if VLLM_CPU_OP in s.source]
    if cpu_ops:  # e.g. unquantized/sgl's convert_weight_packed: proven in tests/plans instead
        pytest.skip(
            f"{plan.id}: {', '.join(cpu_ops)} run vLLM's CPU kernel ops "
            f"({VLLM_CPU_OP}*), which have no CUDA implementation"
        )
    if not steps:
        pytest.skip(f"{plan.id}: nothing but CPU DERIVE stages (vLLM's CPU ops) or no stages")
    with torch.no_grad():
        for st in steps:
            cpu = _one_stage(plan, st, cpu, config, target)
            gpu = _one_stage(plan, st, gpu, config, target)
            _assert_states_equal(f"{plan.id} after {st.name}", cpu, gpu, cuda)


def _restored(
    plan: Plan, tensors: dict, config: LayerConfig, target: Target, device, module_with
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ordinarily loaded, restored) layers on ``device``; the restored one holds
    stride-preserving copies of the prepared tensors (the export) and replays
    ``plan.restore`` under the strict guard."""
    loaded = module_with(tensors, device)
    load_(loaded, plan.bind(config, target))
    daemon = module_with(tensors, device)
    prepared = prepare_(daemon, plan.bind(config, target))
    restored = torch.nn.Module()
    for name, t in prepared.tensors.items():
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        copy.copy_(t)
        if name in prepared.buffers:
            restored.register_buffer(name, copy)
        else:
            restored.register_parameter(name, torch.nn.Parameter(copy, requires_grad=False))
    restore_(
        restored, plan.bind(config, target), prepared.recorded, strict=True, drops=prepared.drops
    )
    return loaded, restored


CUTLASS_FP8 = (
    ("fp8_per_tensor", None),
    ("fp8_per_channel", None),
    ("fp8", "tensor"),
    ("ct_w8a8_fp8", "tensor"),
    ("ct_w8a8_fp8", "channel"),
)


def _round16(x: int) -> int:
    return -(-x // CUTLASS_ALIGNMENT) * CUTLASS_ALIGNMENT


@pytest.mark.parametrize("n,k", ((200, 256), (200, 248), (4104, 512)), ids=lambda v: str(v))
@pytest.mark.parametrize("method,strategy", CUTLASS_FP8, ids=lambda v: str(v))
def test_cutlass_fp8_scaled_mm_restored_equals_loaded(
    method, strategy, n, k, checkpoints, fp8_forward, cuda
):
    """torch._scaled_mm on the restored padded layer, sliced to the recorded width,
    gives bit for bit the ordinarily loaded layer's output, and that output is the
    layer's product (close to the high-precision reference)."""
    R = pytest.importorskip("tests.helpers.reference_kernels")
    make, module_with = checkpoints
    config, tensors = make(method, n, k, strategy=strategy)
    config = evolve(config, quant=evolve(config.quant, kernel="cutlass"))
    target = Target.detect(cuda) if cuda.type == "cuda" else H200_DRY_RUN_TARGET
    plan = plan_for(config, target=target).plan
    assert "cutlass" == plan.kernel
    with torch.no_grad():
        loaded, restored = _restored(plan, tensors, config, target, cuda, module_with)
        assert (_round16(k), _round16(n)) == tuple(restored.weight.shape)
        assert n == restored.logical_output_size
        x = torch.randn(
            TOKENS, k, generator=torch.Generator(cuda).manual_seed(1), device=cuda
        ).bfloat16()
        y_loaded = fp8_forward(loaded, x)
        y_restored = fp8_forward(restored, x)
        ref = R.cutlass_fp8_forward(restored, config, x).float()
    assert (TOKENS, n) == tuple(y_restored.shape)
    assert torch.equal(y_loaded, y_restored)
    rel = ((y_restored.float() - ref).norm() / ref.norm()).item()
    assert rel < FP8_FORWARD_REL_TOL, f"_scaled_mm forward is off the reference by {rel:.3f}"


def _reference_forward(plan: Plan):
    R = pytest.importorskip("tests.helpers.reference_kernels")
    return {
        ("awq", "marlin"): R.marlin_int_forward,
        ("gptq", "marlin"): R.marlin_int_forward,
        ("ct_w4a16", "marlin"): R.marlin_int_forward,
        ("fp8", "fp8_marlin"): R.fp8_marlin_forward,
        ("ct_w8a8_fp8", "fp8_marlin"): R.fp8_marlin_forward,
        ("mxfp8", "marlin"): R.mxfp8_marlin_forward,
        ("modelopt_fp4", "cutlass"): R.nvfp4_linear_forward,
        ("fp8_per_block", "cutlass_block"): R.block_fp8_forward,
        ("fp8", "cutlass_block"): R.block_fp8_forward,
    }.get((plan.method, plan.kernel))


REFERENCE_PLANS = [
    p
    for p in PLANS
    if p.kernel in ("marlin", "fp8_marlin", "cutlass_block")
    or (p.method, p.kernel) == ("modelopt_fp4", "cutlass")
]


@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("plan", REFERENCE_PLANS, ids=lambda p: p.id)
def test_reference_kernel_restored_equals_loaded(plan, n, k, checkpoints, cuda):
    """Marlin int4 / FP8 Marlin / MXFP8 / block FP8 / NVFP4 on CUDA: the reference
    kernel's output of the restored layer equals the loaded layer's, bit for bit."""
    forward = _reference_forward(plan)
    if forward is None:
        pytest.skip(f"no reference kernel for {plan.id}")
    make, module_with = checkpoints
    strategy = "block" if plan.kernel == "cutlass_block" else None
    made = make(plan.method, n, k, strategy=strategy)
    config, tensors = made
    config = evolve(config, quant=evolve(config.quant, kernel=plan.kernel))
    target = _target_for(plan, config)
    if target is None or target.device_type != "cuda":
        pytest.skip(f"{plan.id} does not match N={n}, K={k}")
    with torch.no_grad():
        loaded, restored = _restored(plan, tensors, config, target, cuda, module_with)
        x = torch.randn(TOKENS, k, generator=torch.Generator(cuda).manual_seed(2), device=cuda).to(
            config.dtype
        )
        y_loaded = forward(loaded, config, x)
        y_restored = forward(restored, config, x)
    assert (TOKENS, n) == tuple(y_restored.shape)
    assert torch.isfinite(y_restored.float()).all()
    assert torch.equal(y_loaded, y_restored)


#: (E, K, N, bits) of the Marlin MoE repack comparison: N = 2 * 128 (a padded gate/up
#: pair of experts of 96, G = 32) and K = 128 (the tier's hidden size); 8-bit GPTQ too.
MARLIN_MOE_REPACKS = ((3, 128, 256, 4), (2, 256, 128, 8))


@pytest.mark.parametrize("e,k,n,bits", MARLIN_MOE_REPACKS, ids=lambda v: str(v))
@pytest.mark.parametrize("awq", (False, True), ids=("gptq", "awq"))
def test_marlin_moe_repack_equals_vllms_cuda_op(awq, e, k, n, bits, cuda):
    """wcache's Marlin MoE repacks (pure torch, on the GPU) give exactly the bytes of
    vLLM's CUDA ops ``gptq_marlin_moe_repack`` / ``awq_marlin_moe_repack``."""
    from wcache.stages import marlin_moe as mm

    if awq and bits != 4:
        pytest.skip("AWQ is 4-bit only")
    ops = pytest.importorskip("vllm._custom_ops")
    if cuda.type != "cuda" or not hasattr(torch.ops._C, "gptq_marlin_repack"):
        pytest.skip("vLLM's CUDA kernels are not loaded (torch.ops._C.gptq_marlin_repack)")
    pf = 32 // bits
    shape = (e, k, n // pf) if awq else (e, k // pf, n)
    g = torch.Generator().manual_seed(e + k + n)
    q = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64)
    q = q.to(torch.int32).to(cuda)
    with torch.no_grad():
        if awq:
            mine, vllms = (
                mm.moe_awq_marlin_repack(q, k, n, bits),
                ops.awq_marlin_moe_repack(q, k, n, bits),
            )
        else:
            mine, vllms = (
                mm.moe_marlin_repack(q, k, n, bits),
                ops.gptq_marlin_moe_repack(q, k, n, bits),
            )
    assert (tuple(vllms.shape), vllms.dtype) == (tuple(mine.shape), mine.dtype)
    assert torch.equal(mine, vllms)


#: (plan id, checkpoint layout, group, bits, zero points) of the Marlin MoE CPU/CUDA runs:
#: the tier's qwen3_moe geometry (hidden 128, experts of 96, padded to 128).
MARLIN_MOE_CASES = (
    ("awq_moe/marlin@1", "awq", 32, 4, True),
    ("gptq_moe/marlin@1", "gptq", 32, 4, True),
    ("gptq_moe/marlin@1", "gptq", -1, 8, True),
    ("ct_w4a16_moe/marlin@1", "ct", 32, 4, False),
    ("ct_w4a16_moe/marlin@1", "ct", -1, 4, True),
)


@pytest.mark.parametrize("plan_id,layout,group,bits,zp", MARLIN_MOE_CASES, ids=str)
def test_marlin_moe_load_on_cuda_gives_the_cpu_bytes(plan_id, layout, group, bits, zp, cuda):
    """A Marlin MoE plan's whole load on CUDA tensors gives the CPU run's tensors (bytes,
    shapes, strides), attributes and records."""
    from tests.helpers import moe_cases as mc

    method = plan_id.split("/")[0]
    cfg = mc.moe_config(
        method,
        "marlin",
        experts=3,
        hidden=128,
        inter=96,
        backend="MARLIN",
        experts_cls="MarlinExperts",
    )
    cfg = evolve(cfg, quant=evolve(cfg.quant, num_bits=bits, group_size=group, zero_point=zp))
    if layout == "gptq":  # symmetric GPTQ still carries (unused) zero points
        cfg = evolve(cfg, quant=evolve(cfg.quant, zero_point=False))
    bias = "random" if layout == "gptq" else "none"
    tensors = mc.marlin_int_experts(layout, 3, 128, 96, group, bits, 11, zero_points=zp, bias=bias)
    target = H200_DRY_RUN_TARGET
    bound = plan_for(cfg, target=target)
    assert plan_id == bound.id
    with torch.no_grad():
        on_cpu = bound.run(LayerState(tensors=tensors), LOAD_TAGS)
        on_gpu = bound.run(
            LayerState(tensors={k: v.to(cuda) for k, v in tensors.items()}), LOAD_TAGS
        )
    _assert_states_equal(plan_id, on_cpu, on_gpu, cuda)
