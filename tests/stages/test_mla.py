"""wcache/stages/mla.py: ``W_UV`` / ``W_UK_T`` are views of ``kv_b_proj.weight`` that
equal a per-head slicing of it (the absorbed matrices of vLLM's MLA decode path), the
stage registers them as frozen Parameters over the same storage, meta weights give
meta views, and a wrong weight shape is refused naming both shapes. vLLM's own
post-load is compared in tests/plans/test_attention.py."""

from __future__ import annotations

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.stages import mla

#: Small per-rank MLA shapes: N heads, P = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank.
N, P, V, L = 3, 4, 5, 6
#: absorbed_views' dimension arguments in its order (kv_lora_rank, heads, P, V).
DIMS = (L, N, P, V)


def _weight(seed: int = 0) -> torch.Tensor:
    """A ``kv_b_proj.weight`` ``[N * (P + V), L]`` bf16 of distinct values."""
    return torch.randn(N * (P + V), L, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16
    )


def test_absorbed_views_equal_the_per_head_slices():
    """For every head h, rows [h*(P+V), h*(P+V)+P) of the weight are W_UK_T[h]
    ``[P, L]`` and the next V rows W_UV[h]'s transpose ``[L, V]``: values, shapes and
    dtype, and both share the weight's storage (no copy)."""
    weight = _weight()
    w_uv, w_uk_t = mla.absorbed_views(weight, *DIMS)
    assert ((N, L, V), (N, P, L)) == (tuple(w_uv.shape), tuple(w_uk_t.shape))
    for h in range(N):
        rows = weight[h * (P + V) : (h + 1) * (P + V)]
        assert torch.equal(rows[:P], w_uk_t[h])
        assert torch.equal(rows[P:].t(), w_uv[h])
    storage = weight.untyped_storage().data_ptr()
    assert {storage} == {t.untyped_storage().data_ptr() for t in (w_uv, w_uk_t)}
    assert {torch.bfloat16} == {w_uv.dtype, w_uk_t.dtype}


def test_stage_registers_frozen_parameters_over_the_weight():
    """select_absorbed_weights returns W_UV / W_UK_T as Parameters without grad, views of
    the ``kv_b_proj.weight`` it read (the dimensions from the layer config's extras)."""
    weight = _weight(1)
    config = LayerConfig(
        QuantSpec("mla_attention", layer_kind="attention"),
        0,
        0,
        extra=dict(zip(mla.SHAPE_KEYS, (L, N, P, V))),
    )
    out = mla.select_absorbed_weights.fn({mla.KV_B_PROJ_WEIGHT: weight}, config, Target("cpu"), {})
    assert set(mla.ABSORBED) == set(out.attrs) and {} == dict(out.tensors)
    expected = dict(zip(mla.ABSORBED, mla.absorbed_views(weight, *DIMS)))
    for name, param in out.attrs.items():
        assert isinstance(param, torch.nn.Parameter) and not param.requires_grad
        assert torch.equal(expected[name], param)
        assert param.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


def test_meta_layer_gets_meta_views():
    """On a meta weight (plans are checked without data) the stage gives meta views of
    the right shapes."""
    uv, uk_t = mla.absorbed_views(torch.empty(N * (P + V), L, device="meta"), *DIMS)
    assert ((N, L, V), (N, P, L)) == (tuple(uv.shape), tuple(uk_t.shape))
    assert "meta" == uv.device.type


def test_wrong_kv_b_proj_shape_raises():
    """A kv_b_proj that is not [N*(P+V), L] is a ValueError naming both shapes."""
    with pytest.raises(ValueError, match=r"\(256, 256\) is not \[N\*\(P\+V\), L\]"):
        mla.absorbed_views(torch.empty(256, 256), *DIMS)
