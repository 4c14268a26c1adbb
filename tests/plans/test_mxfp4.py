"""wcache/plans/mxfp4.py: MXFP4 fused MoE (and GPT-OSS's) on Marlin against vLLM's own
RoutedExperts on simulated sm90; the backends without a plan are refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vllm_layers as VL
from wcache.core import NoPlan, Target
from wcache.plans.registry import plan_for

pytest.importorskip("vllm")

from tests.helpers.moe_contracts import H200, moe_contract, moe_layer


def _fill_mxfp4(layer, seed: int) -> None:
    """Canonical MXFP4 checkpoint values: random E2M1 byte pairs, E8M0 codes near 2**0."""
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(layer.named_parameters())):
            g = torch.Generator().manual_seed(seed + i)
            if name.endswith("weight_scale"):
                value = torch.randint(120, 134, tuple(p.shape), generator=g).to(p.dtype)
            elif p.dtype == torch.uint8:
                value = torch.randint(0, 256, tuple(p.shape), generator=g, dtype=torch.uint8)
            else:
                value = torch.randn(tuple(p.shape), generator=g).to(p.dtype)
            p.data.copy_(value)


@pytest.mark.parametrize("hidden,inter", [(256, 128), (512, 256)])
def test_mxfp4_moe_marlin_sm90(simulated_cuda_moe, hidden, inter):
    """Mxfp4MoEMethod (canonical ``quant_method: mxfp4``) on sm90 without FlashInfer or
    Humming resolves MARLIN: vLLM's prepare_moe_mxfp4_layer_for_marlin (reference
    4-bit repack per expert, E8M0 scales permuted and reordered) vs wcache's
    ``mxfp4_moe/marlin`` load and restore, MoE kernel objects included."""
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config

    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, Mxfp4Config(), meta=meta),
        lambda layer: _fill_mxfp4(layer, 5),
        H200,
        "mxfp4_moe/marlin@1",
    )
    assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
    assert restored.w13_weight_scale.dtype == torch.float8_e8m0fnu
    assert tuple(restored.w2_weight.shape) == (4, inter // 16, 2 * hidden)


def test_mxfp4_moe_marlin_with_int8_activations_is_refused():
    """``VLLM_MARLIN_INPUT_DTYPE=int8`` (8-bit Marlin activations, another layout) is
    refused by the MXFP4 Marlin plan before any weight is read, naming the variable."""
    from tests.helpers import moe_cases as mc

    cfg = mc.moe_config(
        "mxfp4_moe",
        "marlin",
        experts=2,
        hidden=256,
        inter=128,
        backend="MARLIN",
        experts_cls="MarlinExperts",
    )
    assert plan_for(cfg, target=H200).id == "mxfp4_moe/marlin@1"
    int8 = Target("cuda", (9, 0), env=(("VLLM_MARLIN_INPUT_DTYPE", "int8"),))
    with pytest.raises(NoPlan, match="VLLM_MARLIN_INPUT_DTYPE=int8"):
        plan_for(cfg, target=int8)


def test_gpt_oss_mxfp4_on_triton_kernels_is_refused_by_name():
    """GPT-OSS MXFP4 on vLLM's triton_kernels backend (its sm90 default) is refused by
    plan_for before any weight is read, naming the swizzle into non-Parameter objects
    and the two ways out (--moe-backend marlin, or no wcache)."""
    from tests.helpers import moe_cases as mc

    for backend in ("TRITON", "TRITON_UNFUSED"):
        cfg = mc.moe_config(
            "gpt_oss_mxfp4",
            backend.lower(),
            experts=2,
            hidden=256,
            inter=128,
            backend=backend,
            experts_cls="OAITritonExperts",
            num_bits=4,
        )
        with pytest.raises(NoPlan, match="GPT-OSS MXFP4") as err:
            plan_for(cfg, target=H200)
        for words in ("PrecisionConfig", "--moe-backend marlin", "load_format='auto'"):
            assert words in str(err.value)


def test_gpt_oss_mxfp4_moe_marlin_sm90(marlin_moe_backend, monkeypatch):
    """GptOssMxfp4MoEMethod with ``moe_backend="marlin"`` resolves MARLIN, whose post-load
    is the canonical prepare_moe_mxfp4_layer_for_marlin (biases included): vLLM's vs
    wcache's ``gpt_oss_mxfp4/marlin`` load and restore, and the restored layer's MoE
    kernel objects (GPT-OSS's SwiGLU quant config) equal vLLM's."""
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    # the GPT-OSS oracle reads the user's MoE activation override from the model config
    model_config = VL._STATE["cfg"].model_config
    monkeypatch.setattr(model_config, "quantization_config", None, raising=False)
    hidden, inter = 256, 128
    config, vllm_layer, restored = moe_contract(
        lambda meta=False: moe_layer(hidden, inter, GptOssMxfp4Config(), meta, has_bias=True),
        lambda layer: _fill_mxfp4(layer, 9),
        H200,
        "gpt_oss_mxfp4/marlin@1",
    )
    assert (config.moe.backend, config.moe.experts) == ("MARLIN", "MarlinExperts")
    assert config.moe.has_bias and restored.w13_bias.dtype == torch.bfloat16
