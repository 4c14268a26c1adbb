"""Multi-head latent attention (DeepSeek-V2/V3): ``W_UK_T`` and ``W_UV`` from ``kv_b_proj``.

vLLM's ``MLAAttention.process_weights_after_loading`` (the deferred attention
post-load, after every quant method's) splits the up-projection ``kv_b_proj``
(``[N * (P + V), L]``: ``N`` heads, ``P`` = ``qk_nope_head_dim``, ``V`` =
``v_head_dim``, ``L`` = ``kv_lora_rank``) into the two absorbed matrices the
decode path multiplies by (``W_UK_T`` ``[N, P, L]`` for the query, ``W_UV``
``[N, L, V]`` for the output) and registers them as parameters of the MLA layer.
It then sets the default KV-cache scales like every attention layer
(:mod:`wcache.stages.attention`).

For an unquantized ``kv_b_proj`` whose dtype is the model's, vLLM's
``get_and_maybe_dequant_weights`` returns the weight itself (``weight.to(dtype)`` is
a no-op), so ``W_UK_T`` and ``W_UV`` are *views* of ``kv_b_proj.weight``: no new
bytes. Here that is a DERIVE stage: a restore builds the two views over the mapped
``kv_b_proj.weight`` (zero-copy, process-local Parameter objects), exactly the
aliasing vLLM's load leaves. A quantized ``kv_b_proj`` (dequantized into new
bytes) has no plan yet.

The layer reads its child's tensor under the dotted name ``kv_b_proj.weight``
(``MLAAttention`` registers ``kv_b_proj`` as a submodule; :mod:`wcache.shell`
reads a dotted read from the child and never writes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage

#: The child weight the stage reads (``MLAAttention.kv_b_proj``'s own parameter).
KV_B_PROJ_WEIGHT = "kv_b_proj.weight"
#: The parameters vLLM registers on the MLA layer.
ABSORBED = ("W_UV", "W_UK_T")
#: LayerConfig extras the stage reads (set by the vLLM adapter from the MLA layer).
SHAPE_KEYS = ("kv_lora_rank", "num_heads", "qk_nope_head_dim", "v_head_dim")

_SOURCE = (
    "vllm/model_executor/layers/attention/mla_attention.py::MLAAttention."
    "process_weights_after_loading (else branch) and split_kv_b_proj"
)


def absorbed_views(
    weight: torch.Tensor, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UV, W_UK_T)`` as views of ``kv_b_proj``'s weight, vLLM's arithmetic.

    Args:
        weight: ``kv_b_proj.weight``, ``[N * (P + V), L]`` (``[out, in]``), any dtype
            (meta included).
        kv_lora_rank: ``L``. num_heads: ``N`` (per tensor-parallel rank).
        qk_nope_head_dim: ``P``. v_head_dim: ``V``.

    Returns:
        ``W_UV`` ``[N, L, V]`` and ``W_UK_T`` ``[N, P, L]``, views of ``weight`` (same
        storage, non-contiguous strides).

    Raises:
        ValueError: ``weight`` is not ``[N * (P + V), L]``.

    Source: vllm/model_executor/layers/attention/mla_attention.py::split_kv_b_proj,
    MLAAttention.process_weights_after_loading.
    """
    expected = (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"kv_b_proj weight {tuple(weight.shape)} is not [N*(P+V), L] = {expected} "
            f"(kv_lora_rank={kv_lora_rank}, num_heads={num_heads}, "
            f"qk_nope_head_dim={qk_nope_head_dim}, v_head_dim={v_head_dim})"
        )
    # [L, N*(P+V)] -> [L, N, P+V] -> W_UK [L, N, P], W_UV [L, N, V]
    latent = weight.T.view(kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim)
    w_uk, w_uv = latent.split([qk_nope_head_dim, v_head_dim], dim=-1)
    # (L, N, V) -> (N, L, V); (L, N, P) -> (N, P, L)
    return w_uv.transpose(0, 1), w_uk.permute(1, 2, 0)


@stage(
    "mla.select_absorbed_weights",
    Tag.DERIVE,
    reads=(KV_B_PROJ_WEIGHT,),
    attrs=ABSORBED,
    source=_SOURCE,
)
def select_absorbed_weights(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """``W_UV`` ``[N, L, V]`` and ``W_UK_T`` ``[N, P, L]``: Parameters (no grad) that
    are views of ``kv_b_proj.weight`` (its dtype), registered on the MLA layer as vLLM's
    ``replace_parameter`` does. No bytes are copied or written; a restore builds them
    over the mapped weight.

    Raises:
        ValueError: the weight's shape does not match the layer's MLA dimensions.
    """
    dims = {k: int(config.get(k)) for k in SHAPE_KEYS}
    w_uv, w_uk_t = absorbed_views(tensors[KV_B_PROJ_WEIGHT].detach(), **dims)
    return StageOut(
        attrs={
            "W_UV": torch.nn.Parameter(w_uv, requires_grad=False),
            "W_UK_T": torch.nn.Parameter(w_uk_t, requires_grad=False),
        }
    )
