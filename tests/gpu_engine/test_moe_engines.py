"""Fused MoE restored by a real vLLM CUDA engine (H200): issue 42's gpu tier rows.

One case per (tiny MoE architecture, checkpoint format, online quantization, compiled):
the four-load acceptance and ``wcache verify``
(:func:`wcache.testing.engine_acceptance.run_case`) on tiny random-weight MoE checkpoints
built offline by :mod:`wcache.testing.tiny_models` (bf16) and
:mod:`wcache.testing.moe_fixtures` (serialized FP8 made by wcache's own quantizers).
``restored`` cases are what vLLM 0.33 resolves on sm90 by default and wcache plans
(``wcache plans``: ``unquantized_moe/triton``, ``fp8_moe_block/triton``,
``fp8_moe_tensor/triton``, ``fp8_per_tensor_moe/triton``, ``ct_w8a8_fp8_moe_channel`` and
``ct_w8a8_fp8_moe_tensor`` on ``vllm_cutlass`` or ``triton``, ``modelopt_fp4/marlin_moe``;
issue 46: ``awq_moe/marlin``, ``gptq_moe/marlin``, ``ct_w4a16_moe/marlin``); ``result``
cases pass on any
honest outcome (restored, refused by name before serving, not runnable in vLLM) and fail
on a mismatch or a crash. Every row is recorded (``record_result``) with the plans each
load used.

Run on the H200: ``bash tools/gpu/run-tier.sh -k moe`` (docs/gpu.md); the Marlin MoE rows
alone: ``-k "moe and (awq or gptq or w4a16)"``.
"""

from __future__ import annotations

import pytest

from wcache.testing.engine_acceptance import EngineCase, record_result, run_case

PROMPTS = ("The capital of France is", "Water boils at a temperature of")
#: Random weights: greedy text is noise, so a few tokens decide equality as well as many.
MAX_TOKENS = 8

#: (architecture of wcache.testing.tiny_models, checkpoint format, vLLM --quantization,
#: torch.compile + CUDA graphs, expect, note[, vLLM --moe-backend])
MOE_CASES = (
    ("qwen3_moe", "bf16", None, False, "restored", "6 experts of 96: padding shapes"),
    ("mixtral", "bf16", None, False, "restored", "8 experts"),
    ("qwen2_moe", "bf16", None, False, "restored", "12 experts + a shared expert"),
    ("olmoe", "bf16", None, False, "restored", ""),
    ("qwen3_moe", "bf16", "fp8", False, "restored", "online FP8 MoE"),
    ("qwen3_moe_128", "fp8_block", None, False, "restored", "serialized block 128x128"),
    ("qwen3_moe", "fp8", None, False, "restored", "serialized per-tensor, dynamic"),
    ("qwen3_moe", "fp8_static", None, False, "restored", "serialized per-tensor, static"),
    ("qwen3_moe", "bf16", None, True, "restored", "torch.compile + CUDA graphs"),
    ("qwen3_moe_128", "fp8_block", None, True, "restored", "torch.compile + CUDA graphs"),
    # ModelOpt NVFP4 in nvidia/Qwen3-30B-A3B-NVFP4's layout (2 layers): vLLM 0.33 on sm90
    # runs the experts on MARLIN (modelopt_fp4/marlin_moe) and the attention
    # projections on MarlinNvFp4LinearKernel (modelopt_fp4/marlin)
    ("qwen3_moe_128", "nvfp4", None, False, "restored", "ModelOpt NVFP4 on Marlin (MoE+linear)"),
    ("qwen3_moe_128", "nvfp4", None, True, "restored", "NVFP4 Marlin, torch.compile + graphs"),
    # int4 on Marlin MoE (issue 46): vLLM resolves MARLIN / MarlinExperts on sm90; G = 32
    # on qwen3_moe and mixtral (experts of 96: Marlin pads the intermediate to 128), G = -1
    # (channel) on qwen3_moe_128 (hidden 256, experts of 128, no padding)
    ("qwen3_moe", "awq", None, False, "restored", "AWQ int4 G32 on Marlin MoE, padded"),
    ("mixtral", "awq", None, False, "restored", "AWQ int4 G32 on Marlin MoE, 8 experts"),
    ("qwen3_moe", "gptq", None, False, "restored", "GPTQ sym int4 G32 on Marlin MoE"),
    ("qwen3_moe", "ct_w4a16", None, False, "restored", "CT W4A16 group 32 on Marlin MoE"),
    ("qwen3_moe_128", "ct_w4a16_channel", None, False, "restored", "CT W4A16 channel"),
    ("qwen3_moe", "awq", None, True, "restored", "Marlin MoE, torch.compile + CUDA graphs"),
    ("qwen3_moe", "gptq", None, True, "restored", "Marlin MoE, torch.compile + CUDA graphs"),
    ("qwen3_moe", "ct_w4a16", None, True, "restored", "CT W4A16 Marlin MoE, compiled"),
    ("qwen3_moe_128", "gptq_asym", None, False, "result", "vLLM refuses sym=False: not-runnable"),
    ("qwen3_moe_128", "gptq_act_order", None, False, "result", "vLLM refuses desc_act"),
    ("qwen3_moe", "ct_w8a8_fp8", None, False, "restored", "compressed-tensors, channel"),
    ("qwen3_moe", "ct_w8a8_fp8_static", None, False, "restored", "compressed-tensors, tensor"),
    ("granitemoe", "bf16", None, False, "restored", ""),
    ("gpt_oss", "bf16", None, False, "restored", "bf16 GPT-OSS: expert biases, swigluoai, sinks"),
    # issue 46: Marlin MoE as vLLM 0.33 picks it on sm90 (canonical MXFP4 by default,
    # FP8 with --moe-backend marlin), and GPT-OSS MXFP4 refused by name
    ("qwen3_moe_128", "mxfp4", None, False, "restored", "canonical MXFP4 on Marlin"),
    ("qwen3_moe_128", "mxfp4", None, True, "restored", "MXFP4 Marlin, compiled"),
    ("qwen3_moe", "fp8", None, False, "restored", "per-tensor FP8 on Marlin, I 96->128", "marlin"),
    ("qwen3_moe", "fp8", None, True, "restored", "per-tensor FP8 on Marlin, compiled", "marlin"),
    ("qwen3_moe_128", "fp8_block", None, False, "restored", "block FP8 on Marlin", "marlin"),
    ("qwen3_moe_128", "fp8_block", None, True, "restored", "block FP8 Marlin, compiled", "marlin"),
    ("gpt_oss", "mxfp4", None, False, "result", "triton_kernels: disk fails on H200; refused"),
    ("gpt_oss", "mxfp4", None, False, "restored", "GPT-OSS MXFP4 on Marlin", "marlin"),
    ("gpt_oss", "mxfp4", None, True, "restored", "GPT-OSS MXFP4 Marlin, compiled", "marlin"),
    ("qwen3_moe_128", "mxfp8", None, False, "result", "ModelOpt MXFP8 MoE: no MoE plan"),
)


def _case_id(
    arch: str, fmt: str, quantization: str | None, compiled: bool, moe_backend: str | None = None
) -> str:
    parts = ["moe", arch, fmt] + ([f"q-{quantization}"] if quantization else [])
    parts += [f"b-{moe_backend}"] if moe_backend else []
    return "-".join(parts + (["compiled"] if compiled else []))


#: Every case as 7 fields (``moe_backend`` None where the row leaves it out).
_ROWS = tuple((*c, None)[:7] for c in MOE_CASES)


@pytest.mark.parametrize(
    "arch, fmt, quantization, compiled, expect, note, moe_backend",
    _ROWS,
    ids=[_case_id(*c[:4], c[6]) for c in _ROWS],
)
def test_moe_four_loads(arch, fmt, quantization, compiled, expect, note, moe_backend):
    """The MoE case's four loads on the real engine give the disk load's tokens (and
    verify passes), or, for an exploratory case, an honest refusal/not-runnable."""
    from wcache.testing.arch_sweep import checkpoint

    case = EngineCase(
        _case_id(arch, fmt, quantization, compiled, moe_backend),
        fmt,
        quantization=quantization,
        expect=expect,
        note=note,
        compile=compiled,
        moe_backend=moe_backend,
    )
    row = run_case(case, checkpoint(arch, fmt, None), prompts=PROMPTS, max_tokens=MAX_TOKENS)
    record_result({**row, "arch": arch})
    allowed = {"restored"} if expect == "restored" else {"restored", "refused", "not-runnable"}
    assert row["outcome"] in allowed, f"{case.id}: {row['outcome']}: {row.get('reason')}"
