"""Fused-MoE layer configs, checkpoints and hypothesis strategies (issue 42).

Checkpoint tensors are what vLLM's weight loader leaves in a ``RoutedExperts`` layer
before post-load: ``w13_weight [E, 2I, H]`` (gate rows then up rows), ``w2_weight
[E, H, I]``; FP8 adds per-expert scales (per tensor: ``w13_weight_scale [E, 2]``,
``w2_weight_scale [E]``; per block 128: ``w13_weight_scale_inv [E, 2I/128, H/128]``).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from wcache.core import LayerConfig, MoeShape, QuantSpec, Target

H200 = Target("cuda", (9, 0))
#: A CPU target (the MoE plans read the experts class from the config, not the host).
CPU = Target("cpu", None, frozenset({"avx512", "avx512_bf16"}))
#: Scale of the random bf16 expert weights (values of a small random model).
WEIGHT_STD = 0.05
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Block FP8's block edge (vLLM's weight_block_size [128, 128]).
BLOCK = 128


def moe_config(
    method: str,
    kernel: str,
    *,
    experts: int,
    hidden: int,
    inter: int,
    backend: str,
    experts_cls: str,
    strategy: str | None = None,
    static: bool = False,
    bias: bool = False,
    tp: int = 1,
    num_bits: int | None = None,
    extra: dict | None = None,
) -> LayerConfig:
    """A fused-MoE LayerConfig as the adapter builds it for vLLM's RoutedExperts
    (``extra``: the adapter's extras, e.g. ``weight_block_size``)."""
    shape = MoeShape(
        num_experts=experts,
        global_num_experts=experts,
        hidden_size=hidden,
        intermediate_size_per_partition=inter,
        backend=backend,
        experts=experts_cls,
        has_bias=bias,
    )
    spec = QuantSpec(
        method,
        num_bits=num_bits or (16 if method == "unquantized_moe" else 8),
        strategy=strategy,
        static_input=static,
        layer_kind="moe",
        kernel=kernel,
    )
    return LayerConfig(
        spec,
        0,
        0,
        has_bias=bias,
        name=f"{method}.experts",
        moe=shape,
        extra={"moe_tp_size": tp, **(extra or {})},
    )


def bf16_experts(
    e: int, hidden: int, inter: int, seed: int, bias: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "w13_weight": (torch.randn(e, 2 * inter, hidden, generator=g) * WEIGHT_STD).to(
            torch.bfloat16
        ),
        "w2_weight": (torch.randn(e, hidden, inter, generator=g) * WEIGHT_STD).to(torch.bfloat16),
    }
    if bias:
        out["w13_bias"] = (torch.randn(e, 2 * inter, generator=g) * WEIGHT_STD).to(torch.bfloat16)
        out["w2_bias"] = (torch.randn(e, hidden, generator=g) * WEIGHT_STD).to(torch.bfloat16)
    return out


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_tensor_experts(
    e: int, hidden: int, inter: int, seed: int, static: bool = False
) -> dict[str, torch.Tensor]:
    """A serialized per-tensor FP8 MoE checkpoint: w1 and w3 with their own scale."""
    w = bf16_experts(e, hidden, inter, seed)
    w13 = w["w13_weight"].float().view(e, 2, inter, hidden)
    s13 = w13.abs().amax(dim=(2, 3)) / FP8_MAX  # [E, 2]
    s2 = w["w2_weight"].float().abs().amax(dim=(1, 2)) / FP8_MAX  # [E]
    out = {
        "w13_weight": _fp8(w13, s13.view(e, 2, 1, 1)).view(e, 2 * inter, hidden),
        "w13_weight_scale": s13,
        "w2_weight": _fp8(w["w2_weight"], s2.view(e, 1, 1)),
        "w2_weight_scale": s2,
    }
    if static:
        g = torch.Generator().manual_seed(seed + 1)
        out["w13_input_scale"] = torch.rand(e, generator=g) + 0.5
        out["w2_input_scale"] = torch.rand(e, generator=g) + 0.5
    return out


def fp8_block_experts(e: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    """A serialized block-FP8 (128x128) MoE checkpoint (scales all the block maxima)."""
    w = bf16_experts(e, hidden, inter, seed)
    out = {}
    for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        x = w[f"{name}_weight"].float()
        nb, kb = -(-rows // BLOCK), -(-cols // BLOCK)
        pad = torch.nn.functional.pad(x, (0, kb * BLOCK - cols, 0, nb * BLOCK - rows))
        amax = pad.view(e, nb, BLOCK, kb, BLOCK).abs().amax(dim=(2, 4)).clamp_min(1e-4)
        scale = amax / FP8_MAX
        full = scale.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :rows, :cols]
        out[f"{name}_weight"] = _fp8(x, full)
        out[f"{name}_weight_scale_inv"] = scale
    return out


_SIZES = dict(
    e=st.sampled_from([1, 3, 8]),
    hidden=st.sampled_from([128, 256]),
    inter=st.sampled_from([64, 96, 128]),
)


@st.composite
def unquantized_triton(draw):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    bias = draw(st.booleans())
    cfg = moe_config(
        "unquantized_moe",
        "triton",
        experts=e,
        hidden=h,
        inter=i,
        backend="TRITON",
        experts_cls="TritonExperts",
        bias=bias,
    )
    return cfg, bf16_experts(e, h, i, draw(st.integers(0, 2**16)), bias), H200


@st.composite
def unquantized_cpu(draw, experts_cls: str = "CPUUnquantizedExperts"):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    kernel = {"CPUUnquantizedExperts": "cpu_vec", "X86CPUUnquantizedExperts": "cpu_amx"}
    cfg = moe_config(
        "unquantized_moe",
        kernel[experts_cls],
        experts=e,
        hidden=h,
        inter=i,
        backend="CPU",
        experts_cls=experts_cls,
    )
    return cfg, bf16_experts(e, h, i, draw(st.integers(0, 2**16))), CPU


@st.composite
def fp8_tensor_triton(draw):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    static = draw(st.booleans())
    cfg = moe_config(
        "fp8_moe_tensor",
        "triton",
        experts=e,
        hidden=h,
        inter=i,
        backend="TRITON",
        experts_cls="TritonExperts",
        strategy="tensor",
        static=static,
    )
    return cfg, fp8_tensor_experts(e, h, i, draw(st.integers(0, 2**16)), static), H200


@st.composite
def fp8_block_triton(draw):
    e, h = draw(_SIZES["e"]), draw(_SIZES["hidden"])
    i = draw(st.sampled_from([128, 256]))
    cfg = moe_config(
        "fp8_moe_block",
        "triton",
        experts=e,
        hidden=h,
        inter=i,
        backend="TRITON",
        experts_cls="TritonExperts",
        strategy="block",
    )
    return cfg, fp8_block_experts(e, h, i, draw(st.integers(0, 2**16))), H200


@st.composite
def fp8_online_triton(draw):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    cfg = moe_config(
        "fp8_per_tensor_moe",
        "triton",
        experts=e,
        hidden=h,
        inter=i,
        backend="TRITON",
        experts_cls="TritonExperts",
        strategy="tensor",
    )
    return cfg, bf16_experts(e, h, i, draw(st.integers(0, 2**16))), H200


def _rand_int32(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random int32 words (every packed nibble random)."""
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def marlin_int_experts(
    layout: str,
    e: int,
    hidden: int,
    inter: int,
    group: int,
    bits: int,
    seed: int,
    *,
    zero_points: bool = True,
    bias: str = "none",
) -> dict[str, torch.Tensor]:
    """A packed int MoE checkpoint as vLLM's loader leaves it (issue 46): ``gptq``
    (``w13_qweight [E, H/pf, 2I]``, ...), ``awq`` (``[E, H, 2I/8]``, AWQ order) or ``ct``
    (N-first ``w13_weight_packed [E, 2I, H/pf]``, ...); bf16 scales, random words;
    expert biases ``"none"`` (absent), ``"zero"`` (vLLM's unloaded zeros) or ``"random"``."""
    g = torch.Generator().manual_seed(seed)
    pf = 32 // bits
    ng13, ng2 = (hidden // group, inter // group) if group > 0 else (1, 1)

    def scales(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)

    if layout == "ct":
        out = {
            "w13_weight_packed": _rand_int32(g, e, 2 * inter, hidden // pf),
            "w2_weight_packed": _rand_int32(g, e, hidden, inter // pf),
            "w13_weight_scale": scales(e, 2 * inter, ng13),
            "w2_weight_scale": scales(e, hidden, ng2),
            "w13_weight_shape": torch.tensor([[2 * inter, hidden]] * e, dtype=torch.float32),
            "w2_weight_shape": torch.tensor([[hidden, inter]] * e, dtype=torch.float32),
        }
        if zero_points:
            out["w13_weight_zero_point"] = _rand_int32(g, e, 2 * inter // pf, ng13)
            out["w2_weight_zero_point"] = _rand_int32(g, e, hidden // pf, ng2)
    else:
        awq = layout == "awq"
        out = {
            "w13_qweight": _rand_int32(g, e, hidden, 2 * inter // pf)
            if awq
            else _rand_int32(g, e, hidden // pf, 2 * inter),
            "w2_qweight": _rand_int32(g, e, inter, hidden // pf)
            if awq
            else _rand_int32(g, e, inter // pf, hidden),
            "w13_scales": scales(e, ng13, 2 * inter),
            "w2_scales": scales(e, ng2, hidden),
            "w13_qzeros": _rand_int32(g, e, ng13, 2 * inter // pf),
            "w2_qzeros": _rand_int32(g, e, ng2, hidden // pf),
        }
    if bias != "none":
        make = torch.zeros if bias == "zero" else (lambda *s: torch.randn(s, generator=g))
        out["w13_bias"] = make(e, 2 * inter).to(torch.bfloat16)
        out["w2_bias"] = make(e, hidden).to(torch.bfloat16)
    return out


@st.composite
def marlin_int_moe(draw, method: str, layout: str):
    """``(config, checkpoint, H200)`` of an int Marlin MoE layer (backend MARLIN)."""
    e, h, i = draw(st.sampled_from([1, 3])), draw(_SIZES["hidden"]), draw(_SIZES["inter"])
    groups = [gs for gs in (32, 64, 128) if h % gs == 0 and i % gs == 0]
    group = draw(st.sampled_from(groups + ([] if layout == "awq" else [-1])))
    bits = 4 if layout == "awq" else draw(st.sampled_from([4, 8]))
    asym = layout == "awq" or (layout == "ct" and draw(st.booleans()))
    bias = draw(st.sampled_from(["zero", "random"])) if layout == "gptq" else "none"
    cfg = moe_config(
        method,
        "marlin",
        experts=e,
        hidden=h,
        inter=i,
        backend="MARLIN",
        experts_cls="MarlinExperts",
    )
    spec = QuantSpec(
        method, num_bits=bits, group_size=group, zero_point=asym, layer_kind="moe", kernel="marlin"
    )
    tensors = marlin_int_experts(
        layout, e, h, i, group, bits, draw(st.integers(0, 2**16)), zero_points=asym, bias=bias
    )
    return LayerConfig(spec, 0, 0, name=cfg.name, moe=cfg.moe, extra=cfg.extra), tensors, H200


def fp8_channel_experts(e: int, hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    """A compressed-tensors channel-wise FP8 MoE checkpoint: one scale per expert and
    output row (``w13_weight_scale [E, 2I, 1]``, ``w2_weight_scale [E, H, 1]`` fp32)."""
    w = bf16_experts(e, hidden, inter, seed)
    out = {}
    for name in ("w13", "w2"):
        x = w[f"{name}_weight"].float()
        scale = (x.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_min(1e-8)
        out[f"{name}_weight"] = _fp8(x, scale)
        out[f"{name}_weight_scale"] = scale
    return out


#: vLLM's resolved backend -> experts class for compressed-tensors W8A8 FP8 MoE on sm90.
CT_FP8_BACKENDS = {"VLLM_CUTLASS": "TritonOrCutlassExperts", "TRITON": "TritonExperts"}


@st.composite
def ct_fp8_channel(draw, backend: str):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    cfg = moe_config(
        "ct_w8a8_fp8_moe_channel",
        backend.lower(),
        experts=e,
        hidden=h,
        inter=i,
        backend=backend,
        experts_cls=CT_FP8_BACKENDS[backend],
        strategy="channel",
    )
    return cfg, fp8_channel_experts(e, h, i, draw(st.integers(0, 2**16))), H200


@st.composite
def ct_fp8_tensor(draw, backend: str):
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    static = draw(st.booleans())
    cfg = moe_config(
        "ct_w8a8_fp8_moe_tensor",
        backend.lower(),
        experts=e,
        hidden=h,
        inter=i,
        backend=backend,
        experts_cls=CT_FP8_BACKENDS[backend],
        strategy="tensor",
        static=static,
    )
    return cfg, fp8_tensor_experts(e, h, i, draw(st.integers(0, 2**16)), static), H200


@st.composite
def fp8_tensor_marlin(draw):
    """Per-tensor FP8 MoE on vLLM's MARLIN backend (I = 96 exercises the tile padding)."""
    e, h, i = (draw(_SIZES[k]) for k in ("e", "hidden", "inter"))
    cfg = moe_config(
        "fp8_moe_tensor",
        "marlin",
        experts=e,
        hidden=h,
        inter=i,
        backend="MARLIN",
        experts_cls="MarlinExperts",
        strategy="tensor",
    )
    return cfg, fp8_tensor_experts(e, h, i, draw(st.integers(0, 2**16))), H200


@st.composite
def fp8_block_marlin(draw):
    """Block FP8 (128x128) MoE on vLLM's MARLIN backend."""
    e, h = draw(_SIZES["e"]), draw(_SIZES["hidden"])
    i = draw(st.sampled_from([128, 256]))
    cfg = moe_config(
        "fp8_moe_block",
        "marlin",
        experts=e,
        hidden=h,
        inter=i,
        backend="MARLIN",
        experts_cls="MarlinExperts",
        strategy="block",
        extra={"weight_block_size": (BLOCK, BLOCK)},
    )
    return cfg, fp8_block_experts(e, h, i, draw(st.integers(0, 2**16))), H200


#: E8M0 codes drawn for MXFP4 scales: 2**-7 .. 2**6 around 1 (code 127).
MXFP4_SCALE_CODES = (120, 134)


def mxfp4_experts(
    e: int, hidden: int, inter: int, seed: int, bias: bool = False
) -> dict[str, torch.Tensor]:
    """A canonical MXFP4 MoE checkpoint: E2M1 byte pairs, E8M0 codes per 32 values."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    out = {
        "w13_weight": u8(e, 2 * inter, hidden // 2),
        "w13_weight_scale": u8(
            e, 2 * inter, hidden // 32, lo=MXFP4_SCALE_CODES[0], hi=MXFP4_SCALE_CODES[1]
        ),
        "w2_weight": u8(e, hidden, inter // 2),
        "w2_weight_scale": u8(
            e, hidden, inter // 32, lo=MXFP4_SCALE_CODES[0], hi=MXFP4_SCALE_CODES[1]
        ),
    }
    if bias:
        out["w13_bias"] = torch.randn(e, 2 * inter, generator=g).to(torch.bfloat16)
        out["w2_bias"] = torch.randn(e, hidden, generator=g).to(torch.bfloat16)
    return out


@st.composite
def mxfp4_marlin(draw, method: str = "mxfp4_moe"):
    """Canonical MXFP4 MoE on vLLM's MARLIN backend (vLLM rounds H to 256 and I to 128
    at creation, so the allocated sizes are those multiples)."""
    e = draw(_SIZES["e"])
    h, i = draw(st.sampled_from([256, 512])), draw(st.sampled_from([128, 256]))
    bias = draw(st.booleans())
    cfg = moe_config(
        method,
        "marlin",
        experts=e,
        hidden=h,
        inter=i,
        backend="MARLIN",
        experts_cls="MarlinExperts",
        bias=bias,
        num_bits=4,
    )
    return cfg, mxfp4_experts(e, h, i, draw(st.integers(0, 2**16)), bias), H200


#: plan id -> strategy of ``(config, checkpoint, target)`` (tests/plans/test_registry.py).
PLAN_STRATEGIES = {
    "awq_moe/marlin@1": marlin_int_moe("awq_moe", "awq"),
    "gptq_moe/marlin@1": marlin_int_moe("gptq_moe", "gptq"),
    "ct_w4a16_moe/marlin@1": marlin_int_moe("ct_w4a16_moe", "ct"),
    "unquantized_moe/triton@1": unquantized_triton(),
    "unquantized_moe/cpu_vec@1": unquantized_cpu("CPUUnquantizedExperts"),
    "unquantized_moe/cpu_amx@1": unquantized_cpu("X86CPUUnquantizedExperts"),
    "fp8_moe_tensor/triton@1": fp8_tensor_triton(),
    "fp8_moe_block/triton@1": fp8_block_triton(),
    "fp8_per_tensor_moe/triton@1": fp8_online_triton(),
    **{
        f"ct_w8a8_fp8_moe_{kind}/{backend.lower()}@1": strategy(backend)
        for backend in CT_FP8_BACKENDS
        for kind, strategy in (("channel", ct_fp8_channel), ("tensor", ct_fp8_tensor))
    },
    "fp8_moe_tensor/marlin@1": fp8_tensor_marlin(),
    "fp8_moe_block/marlin@1": fp8_block_marlin(),
    "mxfp4_moe/marlin@1": mxfp4_marlin(),
    "gpt_oss_mxfp4/marlin@1": mxfp4_marlin("gpt_oss_mxfp4"),
}
