"""wcache/stages/machete.py: the scale permutation and the zero-point fold equal vLLM's
``MacheteLinearKernel`` transforms (vLLM's own ``unpack_quantized_values_into_int32``
as the reference), symmetric weights fold nothing, the prepack gives vLLM's fake
(contiguous, same shape) on meta tensors, and without the recorded kernel types or
vLLM's CUDA op it refuses with the fix. The prepack's bytes need the CUDA op: the
contract rows of tests/plans/test_cuda_contracts.py (a stand-in) and the H200 tier
cover them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.cuda_cases import H200, MACHETE_EXTRA, cuda_config, seeded_generator
from wcache.stages import machete as MA
from wcache.stages.common import OpUnavailable, StageInputError

#: Values per int32 word at 4 bits (the pack factor pf = 32 / bits).
PACK_FACTOR_4BIT = 8


def _cfg(zp: bool = True, extra=MACHETE_EXTRA, k: int = 128, n: int = 128, g: int = 64):
    return cuda_config("awq", k, n, bits=4, g=g, zp=zp, kernel="machete", extra=extra)


@given(st.sampled_from([(128, 128, 64), (256, 128, 128), (128, 256, -1)]), st.integers(0, 2**16))
def test_permute_and_fold_equal_vllms_transforms(shape, seed):
    """Scales ``[N, K/G]`` -> ``[K/G, N]`` contiguous; standard-packed zero points
    ``[N/pf, K/G]`` -> ``-scale * zp`` ``[K/G, N]`` in the scales' dtype: equal to vLLM's
    transform_w_s / transform_w_zp (unpack_quantized_values_into_int32, then
    ``-1.0 * w_s * zp``)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    k, n, g = shape
    groups = 1 if g == -1 else k // g
    gen = seeded_generator(seed)
    scales_nk = (torch.rand(n, groups, generator=gen) + 0.01).to(torch.bfloat16)
    zp_packed = torch.randint(
        -(2**31), 2**31 - 1, (n // PACK_FACTOR_4BIT, groups), generator=gen, dtype=torch.int32
    )
    cfg = _cfg(k=k, n=n, g=g)
    scales = MA.permute_scales_stage(w_s="scales")({"scales": scales_nk}, cfg, H200, {})
    w_s = scales.tensors["scales"]
    assert torch.equal(scales_nk.t(), w_s) and w_s.is_contiguous()
    folded = MA.fold_zero_points_stage(w_zp="qzeros", w_s="scales")(
        {"qzeros": zp_packed, "scales": w_s}, cfg, H200, {}
    )
    unpacked = unpack_quantized_values_into_int32(zp_packed.t(), scalar_types.uint4, packed_dim=1)
    expected = (-1.0 * w_s * unpacked.to(w_s.dtype)).contiguous()
    got = folded.tensors["qzeros"]
    assert (expected.dtype, expected.shape) == (got.dtype, got.shape)
    assert torch.equal(expected, got)


def test_symmetric_weights_fold_no_zero_points():
    """Without zero points (zero_point false, or no tensor) the fold returns nothing."""
    stage_ = MA.fold_zero_points_stage(w_zp="qzeros", w_s="scales")
    scales = torch.ones(2, 128, dtype=torch.bfloat16)
    out = stage_({"scales": scales}, _cfg(zp=False), H200, {})
    assert {} == dict(out.tensors)


def test_prepack_on_meta_is_vllms_fake():
    """On meta tensors the prepack gives a contiguous tensor of the input's shape and dtype
    (vLLM's fake for machete_prepack_B), from a column-major view too."""
    w = torch.empty(128, 16, dtype=torch.int32, device="meta").t()  # [16, 128], strides (1, 16)
    out = MA.machete_prepack(w, _cfg())
    assert ("meta", (16, 128), torch.int32) == (out.device.type, tuple(out.shape), out.dtype)
    assert out.is_contiguous()


def test_prepack_without_the_recorded_kernel_types_is_refused():
    """A layer config without machete_b_type_id / machete_act_type raises StageInputError
    naming the layer and the keys the adapter records."""
    with pytest.raises(
        StageInputError, match="layer 'awq.layer'.*machete_b_type_id/machete_act_type"
    ):
        MA.machete_prepack(torch.zeros(16, 128, dtype=torch.int32), _cfg(extra=()))


def test_prepack_without_vllms_cuda_op_is_refused(monkeypatch):
    """Where vLLM's ``_C`` has no machete_prepack_B (vLLM's CPU build: this process's
    ``_C`` namespace stood in by an empty one, since the contract tests register a
    stand-in op for the whole process), the prepack raises OpUnavailable naming the op,
    never a bare AttributeError."""
    import types

    monkeypatch.setattr(torch.ops, "_C", types.SimpleNamespace())
    with pytest.raises(OpUnavailable, match=r"torch.ops._C.machete_prepack_B is not registered"):
        MA.machete_prepack(torch.zeros(16, 128, dtype=torch.int32), _cfg())
