"""The fused-MoE contract tests' machinery (tests/plans/test_fused_moe.py,
test_marlin_moe.py, test_mxfp4.py): vLLM's RoutedExperts builder, checkpoint fillers,
and vLLM's post-load compared with wcache's load and restore. vLLM is imported inside
the functions."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import param_contracts as PC
from tests.helpers import vllm_layers as VL
from wcache.core import Target
from wcache.plans.registry import plan_for
from wcache.shell import load_, snapshot

H200 = Target("cuda", (9, 0))
IDS = itertools.count(1000)

#: What vLLM's MoE ``apply`` reads besides the layer's tensors.
MOE_ATTRS = ("quant_method.moe_kernel", "quant_method.moe_kernel.fused_experts")

#: The layer name differs between the layers a test builds (vLLM registers each by name).
NAMES = ("~layer_name",)


def moe_layer(
    hidden: int,
    inter: int,
    quant_config=None,
    meta: bool = False,
    experts: int = 4,
    **gpt_oss,
):
    """vLLM's RoutedExperts (FusedMoEFactory, TP 1); ``gpt_oss``: GPT-OSS's extra
    arguments (``has_bias``, ``activation``)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    with VL.vllm_context("meta" if meta else "cpu", torch.bfloat16):
        moe = FusedMoEFactory(
            num_experts=experts,
            top_k=2,
            hidden_size=hidden,
            intermediate_size=inter,
            params_dtype=torch.bfloat16,
            quant_config=quant_config,
            prefix=f"model.layers.{next(IDS)}.mlp.experts",
            **gpt_oss,
        )
    return moe.routed_experts


def moe_state(module) -> dict:
    from wcache.vllm.verify import module_state

    return {k: v for k, v in module_state(module).items() if k not in NAMES}


def moe_contract(build, fill, target: Target, expected_plan: str, vllm_fill=None):
    """vLLM's post-load vs wcache load and restore on fresh vLLM-built layers.

    Args:
        fill: writes the checkpoint into a built layer, as the daemon's load does.
        vllm_fill: the same for vLLM's own layer where its load differs (online
            quantization runs vLLM's post-load while loading); default ``fill``.
    """
    from wcache.vllm.adapter import layer_config, sync_kernel_state_

    vllm_layer = build()
    config = layer_config(vllm_layer.quant_method, vllm_layer, target, name="experts")
    bound = plan_for(config, target=target)
    assert bound.id == expected_plan
    (vllm_fill or fill)(vllm_layer)
    with VL.vllm_context("cpu", torch.bfloat16):
        vllm_layer.quant_method.process_weights_after_loading(vllm_layer)
        loaded = build()
        fill(loaded)
        load_(loaded, bound)
        sync_kernel_state_(loaded)
        # the daemon's record and the engine's install, as a restored engine does them
        restored = PC.engine_restore(bound.plan, config, build, fill, target)
    for label, side in (("load", loaded), ("restore", restored)):
        changed = diff(snapshot(vllm_layer, MOE_ATTRS), snapshot(side, MOE_ATTRS))
        assert {} == {k: (label, *v) for k, v in changed.items()}
        assert {} == diff(moe_state(vllm_layer), moe_state(side))
    # issue 44 item 6: the parameters' class, requires_grad and attributes
    params = PC.parameter_diff(vllm_layer, restored)
    assert {} == params, params  # a helper: pytest does not rewrite its asserts
    return config, vllm_layer, restored


def diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def require_cpu_moe_ops() -> None:
    """Skip where vLLM's CPU kernels are not loaded (a vLLM Python tree without its
    ``_C``, as the 0.33 contract run uses): vLLM's CPU MoE post-load cannot run."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C where the build has it)

    if not hasattr(torch.ops._C, "prepack_moe_weight"):
        pytest.skip("this vLLM has no CPU kernels (torch.ops._C.prepack_moe_weight)")
