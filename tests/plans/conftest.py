"""Fixtures of the plan tests: vLLM's platform simulated as CUDA at a capability, for
one test (tests.helpers.cuda_contracts), and the forward context MoE layers register in."""

from __future__ import annotations

import types

import pytest

from tests.helpers import cuda_contracts as CC
from tests.helpers import vllm_layers as VL


@pytest.fixture
def simulated_cuda(monkeypatch):
    """vLLM's platform as CUDA sm90 (the H200) with reference ops, for one test only."""
    CC.simulate_cuda(monkeypatch, CC.SIM_CAPABILITY)


@pytest.fixture
def simulated_sm100(monkeypatch):
    """vLLM's platform as CUDA sm100 (Blackwell), where vLLM picks its CUTLASS NVFP4
    kernels, for one test only."""
    CC.simulate_cuda(monkeypatch, CC.SM100_CAPABILITY)


@pytest.fixture
def simulated_sm80(monkeypatch):
    """vLLM's platform as CUDA sm80 (no FP8 tensor cores) for one test only."""
    CC.simulate_cuda(monkeypatch, CC.SM80_CAPABILITY)


@pytest.fixture
def own_forward_context(monkeypatch):
    """The layers a test builds register in a forward context of their own."""
    VL.ensure_vllm()
    monkeypatch.setattr(VL._STATE["cfg"].compilation_config, "static_forward_context", {})


@pytest.fixture
def simulated_cuda_moe(monkeypatch, own_forward_context):
    """Simulated sm90 for vLLM's fused-MoE layers: FP8 supported, a MoE model type."""
    from vllm.platforms import current_platform

    CC.simulate_cuda(monkeypatch, CC.SIM_CAPABILITY)
    # CudaPlatform.supports_fp8 (capability >= 8.9); TritonExperts' FP8 schemes read it
    monkeypatch.setattr(current_platform, "supports_fp8", lambda: True)
    # vLLM 0.33's FP8 MoE oracle asks the model type whether to drop DeepGEMM
    model_config = VL._STATE["cfg"].model_config
    monkeypatch.setattr(
        model_config, "hf_text_config", types.SimpleNamespace(model_type="qwen3_moe"), raising=False
    )


@pytest.fixture
def marlin_moe_backend(monkeypatch, simulated_cuda_moe):
    """vLLM's ``moe_backend="marlin"`` (``kernel_config.moe_backend``) for the layers
    this test builds."""
    monkeypatch.setattr(VL._STATE["cfg"].kernel_config, "moe_backend", "marlin")
