"""wcache/stages/onednn.py: oneDNN prepacks, scale conversions and the SGL choice
equal vLLM-CPU's dispatch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.core import LayerConfig, QuantSpec
from wcache.stages import (
    onednn,
)

vllm = pytest.importorskip("vllm")


from tests.helpers import vllm_layers  # noqa: E402  (one gloo world per session)
from tests.helpers.cpu_stage_inputs import (  # noqa: E402
    BF16,
    ONEDNN_DTYPE,
    layer_cfg,
    module_of,
    run_stage,
    seeded_gen,
)

pytestmark = pytest.mark.usefixtures("vllm_world")


@given(
    widths=st.lists(st.integers(1, 4).map(lambda i: 16 * i), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_convert_scale_to_channelwise_matches_vllm(widths, seed):
    """onednn.convert_scale_to_channelwise equals vLLM's convert_to_channelwise."""
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise

    scale = torch.rand(len(widths), generator=seeded_gen(seed))
    cfg = LayerConfig(
        QuantSpec("ct_w8a8_int8", strategy="tensor"),
        64,
        sum(widths),
        extra={"logical_widths": tuple(widths)},
    )
    out = run_stage(onednn.convert_scale_to_channelwise, {"weight_scale": scale}, cfg)
    assert torch.equal(convert_to_channelwise(scale, widths), out.tensors["weight_scale"])


def test_onednn_prepack_weight_matches_vllm_dispatch():
    """onednn.prepack_weight gives a cpu_linear bit-identical to vLLM's oneDNN dispatch,
    releases the linear weight and keeps an embedding's."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    # K = 48 is no multiple of the SGL tile: oneDNN on AMX hosts too
    w = torch.randn(96, 48, generator=seeded_gen(0)).to(ONEDNN_DTYPE)
    ref = module_of(weight=w)
    dispatch_cpu_unquantized_gemm(ref, remove_weight=True)
    x = torch.randn(5, 48, generator=seeded_gen(1)).to(ONEDNN_DTYPE)
    bias = torch.randn(96, generator=seeded_gen(2)).to(ONEDNN_DTYPE)
    out = run_stage(onednn.prepack_weight, {"weight": w}, layer_cfg("unquantized"))
    assert out.release == ("weight",)
    assert torch.equal(ref.cpu_linear(x, None, bias), out.attrs["cpu_linear"](x, None, bias))
    emb_cfg = LayerConfig(QuantSpec("unquantized", layer_kind="embedding"), 48, 96)
    assert run_stage(onednn.prepack_weight, {"weight": w}, emb_cfg).release == ()
    meta = run_stage(onednn.prepack_weight, {"weight": w.to("meta")}, layer_cfg("unquantized"))
    assert meta.attrs["cpu_linear"] is torch.nn.functional.linear and meta.release == ()


@pytest.mark.parametrize(
    "n,k,dtype,isa,expected",
    [
        (96, 64, BF16, (), False),
        (96, 64, BF16, ("amx",), True),
        (4096, 4096, BF16, ("amx",), False),
        (8, 40, BF16, ("amx",), True),
        (96, 40, BF16, ("amx",), False),
        (4096, 4096, torch.int8, ("amx",), True),
        (4096, 4096, torch.float32, ("amx",), False),
    ],
)
def test_sgl_selected_table(n, k, dtype, isa, expected):
    """sgl_selected applies vLLM's check_cpu_sgl_kernel shape rule to the Target's
    probed SGL decision (made by vLLM on AMX hosts only)."""
    assert expected == onednn.sgl_selected(n, k, dtype, vllm_layers.synthetic_target(isa))
