"""On the H200 machine: does vLLM's FlashAttention 3 library load next to the machine's torch,
and does its varlen kernel compute attention? For a bundle built with WCACHE_GPU_FA=1.

    source tools/gpu/env.sh && python3 tools/gpu/check-fa.py

Prints FA3's availability (vLLM's own flags and reason), then runs one causal varlen
attention with DeepSeek's MLA prefill shapes (q/k head 192 = qk_nope 128 + qk_rope 64,
v head 128, two sequences) through ``flash_attn_varlen_func(fa_version=3)`` and compares it
with torch's scaled_dot_product_attention in fp32. Exit 0: loaded and within tolerance;
1: not loadable (the reason printed); 2: wrong result.

Source: vllm/vllm_flash_attn/flash_attn_interface.py (FA3_AVAILABLE, flash_attn_varlen_func),
vllm/v1/attention/backends/mla/prefill/flash_attn.py (no V padding for FA3 on sm90).
"""

from __future__ import annotations

import sys

import torch

#: MLA prefill head dimensions of DeepSeek-V2/V3 (and the tiny fixtures): q/k 128 + 64, v 128.
QK_HEAD_DIM, V_HEAD_DIM = 128 + 64, 128
HEADS = 2
#: Two sequences of different lengths (a varlen batch), one not a multiple of the tile.
SEQ_LENS = (37, 64)
#: bf16 attention against an fp32 reference: bf16 has 8 mantissa bits (~4e-3 relative),
#: outputs are averages of unit-scale values; 2e-2 absolute leaves room for accumulation.
ATOL = 2e-2


def main() -> int:
    from vllm.vllm_flash_attn import flash_attn_interface as fi  # noqa: PLC0415

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    print(f"FA3_AVAILABLE={fi.FA3_AVAILABLE} reason={fi.FA3_UNAVAILABLE_REASON!r}")
    print(f"FA2_AVAILABLE={fi.FA2_AVAILABLE} (left out of the bundle: expected False)")
    if not fi.is_fa_version_supported(3):
        print(f"FA3 not usable: {fi.fa_version_unsupported_reason(3)}")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(SEQ_LENS)
    q, k = (
        torch.randn(total, HEADS, QK_HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(2)
    )
    v = torch.randn(total, HEADS, V_HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    cu = torch.tensor([0, SEQ_LENS[0], total], device="cuda", dtype=torch.int32)
    out = fi.flash_attn_varlen_func(
        q, k, v, max(SEQ_LENS), cu, max(SEQ_LENS), cu_seqlens_k=cu, causal=True, fa_version=3
    )
    worst = 0.0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).float() for t in (q, k, v)), is_causal=True
        ).transpose(0, 1)
        worst = max(worst, (out[start:end].float() - ref).abs().max().item())
    print(f"FA3 varlen vs SDPA (fp32): max abs diff {worst:.3e} (tolerance {ATOL})")
    return 0 if worst <= ATOL else 2


if __name__ == "__main__":
    sys.exit(main())
