"""The tiny architecture registry and its serialized FP8 MoE variants are what vLLM
serves and loads: registry facts, config validity, tensor names, dtypes and scale
shapes against vLLM's own expert mapping."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from wcache.errors import FixtureError
from wcache.testing import fixtures as fx
from wcache.testing import moe_fixtures as mf
from wcache.testing import tiny_models as tm

#: Issue 47: at least this many architectures vLLM serves.
MIN_ARCHS = 25


def _vllm_text_archs() -> set[str]:
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    return set(_TEXT_GENERATION_MODELS)


def test_registry_has_every_family_and_enough_architectures():
    """At least 25 architectures, every family present, names unique."""
    families = {a.family for a in tm.ARCHS.values()}
    assert len(tm.ARCHS) >= MIN_ARCHS
    assert {"dense", "moe", "mla", "multimodal"} <= families
    assert len({a.name for a in tm.ARCHS.values()}) == len(tm.ARCHS)


def test_multimodal_entries_are_vllm_multimodal_models():
    """Each multimodal entry names a class in vLLM's multimodal registry."""
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS

    names = [a.vllm_arch for a in tm.ARCHS.values() if a.family == "multimodal"]
    assert names and set(names) <= set(_MULTIMODAL_MODELS)


def test_llava_builds_offline_with_its_processor(monkeypatch):
    """The LLaVA fixture holds a processor transformers loads offline; its <image> token
    is the last id of the tokenizer and inside the text model's vocabulary, and a 32x32
    image becomes 16 image tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tm.build_arch("llava")
    config = json.loads((path / "config.json").read_text())
    processor = AutoProcessor.from_pretrained(path)
    image_id = config["image_token_index"]
    assert image_id == len(processor.tokenizer) - 1 < config["text_config"]["vocab_size"] + 1
    assert len(processor.tokenizer) == config["text_config"]["vocab_size"]
    ids = processor(text=tm.LLAVA_IMAGE_TOKEN, images=Image.new("RGB", (32, 32)))["input_ids"][0]
    assert tm.IMAGE_TOKENS == sum(int(i == image_id) for i in ids)


def test_gemma3_builds_offline_with_what_vllms_processor_reads(monkeypatch):
    """The Gemma 3 fixture's processor loads offline; the config's boi/image/eoi indices
    are the tokenizer's named tokens; a <start_of_image> becomes 4 soft tokens between
    boi and eoi; the newline runs vLLM's processor looks up are single tokens; and the
    pan-and-scan values vLLM reads at its dummy profile are set."""
    from PIL import Image
    from transformers import AutoProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tm.build_arch("gemma3")
    config = json.loads((path / "config.json").read_text())
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    assert (config["boi_token_index"], config["image_token_index"], config["eoi_token_index"]) == (
        tok.boi_token_id,
        tok.image_token_id,
        tok.eoi_token_id,
    )
    assert len(tok) == config["text_config"]["vocab_size"]
    vocab = tok.get_vocab()
    runs = [vocab["\n" * n] for n in range(1, tm.GEMMA3_NEWLINE_RUNS + 1)]
    assert len(set(runs)) == tm.GEMMA3_NEWLINE_RUNS
    placeholder = tm.IMAGE_PLACEHOLDERS["gemma3"]
    ids = list(processor(text=placeholder, images=Image.new("RGB", (32, 32)))["input_ids"][0])
    soft = [i for i, t in enumerate(ids) if t == tok.image_token_id]
    assert len(soft) == tm.GEMMA3_TOKENS_PER_IMAGE == config["mm_tokens_per_image"]
    assert (ids[soft[0] - 1], ids[soft[-1] + 1]) == (tok.boi_token_id, tok.eoi_token_id)
    assert processor.image_processor.pan_and_scan_max_num_crops == 4
    assert processor.image_processor.do_pan_and_scan is False


def test_every_multimodal_entry_has_an_image_placeholder():
    """The sweep's image prompt needs each multimodal entry's placeholder text."""
    names = {n for n, a in tm.ARCHS.items() if a.family == "multimodal"}
    assert names == set(tm.IMAGE_PLACEHOLDERS) and len(names) >= 2


def test_backend_matches_vllm_registry():
    """'native' entries are in vLLM's text registry; 'transformers' ones are not (vLLM
    runs them on its Transformers modeling backend)."""
    text = _vllm_text_archs()
    for a in tm.ARCHS.values():
        if a.family == "multimodal":
            continue
        assert (a.vllm_arch in text) == (a.backend == "native"), a.name


@pytest.mark.parametrize("name", [n for n, a in tm.ARCHS.items() if a.family != "multimodal"])
def test_config_is_valid_and_tiny(name):
    """Each entry's transformers config builds, has 2 layers and 64-wide heads (MLA:
    DeepSeek's own 128/64/128 head dimensions), and takes SmolLM2's vocabulary."""
    from transformers import AutoConfig

    a = tm.ARCHS[name]
    config = AutoConfig.for_model(a.model_type, **tm.config_kwargs(a, {"vocab_size": 49152}))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if a.family == "mla":
        dims = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
        assert dims == (128, 64, 128)
        head_dim = config.hidden_size // heads
    assert (config.num_hidden_layers, head_dim, config.vocab_size) == (2, tm.HEAD_DIM, 49152)
    assert config.hidden_size <= 256


def _fa_mla_prefill_dimensions() -> set[tuple[int, int, int]]:
    """The (qk_nope, qk_rope, v) head dimensions vLLM's FlashAttention MLA prefill
    lists, read from the installed vLLM's source (the module imports CUDA-only names,
    so it is parsed, not imported)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    src = Path(spec.origin).parent / "v1/attention/backends/mla/prefill/flash_attn.py"
    fn = next(
        n
        for n in ast.walk(ast.parse(src.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "supports_mla_dimensions"
    )
    keys = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {
        tuple(next(k.value.value for k in call.keywords if k.arg == key) for key in keys)
        for call in ast.walk(fn)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "MLADimensions"
    }


def test_mla_head_dimensions_are_ones_vllm_cuda_prefill_takes():
    """Every MLA entry's head dimensions are on vLLM's FlashAttention MLA prefill list
    (on sm90 vLLM's only CUDA MLA prefill; 64/64/64 was refused on the H200)."""
    supported = _fa_mla_prefill_dimensions()
    assert (128, 64, 128) in supported and (64, 64, 64) not in supported
    for a in tm.ARCHS.values():
        if a.family == "mla":
            c = a.overrides
            assert (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) in supported


def test_moe_shapes_exercise_padding():
    """An expert width not a multiple of 128, an expert count not a power of two, and a
    shared expert are all in the registry."""
    from transformers import AutoConfig

    configs = {
        n: AutoConfig.for_model(a.model_type, **a.overrides)
        for n, a in tm.ARCHS.items()
        if a.family == "moe"
    }
    widths = {getattr(c, "moe_intermediate_size", c.intermediate_size) for c in configs.values()}
    counts = {getattr(c, "num_experts", None) or c.num_local_experts for c in configs.values()}
    assert any(w % 128 for w in widths)
    assert any(n & (n - 1) for n in counts)
    assert configs["qwen2_moe"].shared_expert_intermediate_size > 0


def test_build_writes_the_declared_architecture():
    """A built checkpoint declares the registry's vLLM class, SmolLM2's vocabulary and
    carries a tokenizer."""
    path = tm.build_arch("qwen3")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == 49152
    assert (path / "tokenizer.json").is_file()
    assert tm.is_built(path, tm.ARCHS["qwen3"], "bf16")


def test_a_tiny_build_cut_short_is_not_built(tmp_path):
    """The tiny builders stamp their files' sizes as the SmolLM2 fixtures do: a copy of
    a built folder whose weights were cut short afterwards is not built, and says why."""
    copy = tmp_path / "qwen3"
    shutil.copytree(tm.build_arch("qwen3"), copy)
    assert tm.is_built(copy, tm.ARCHS["qwen3"], "bf16")
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert not tm.is_built(copy, tm.ARCHS["qwen3"], "bf16")
    assert "model.safetensors is" in fx.unbuilt_reason(copy, tm._stamp(tm.ARCHS["qwen3"], "bf16"))


# --------------------------------------------------------------------------- FP8 MoE (pure)


def _moe_state(experts: int = 2, hidden: int = 256, inter: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731 (a one-line local function)
    p = "model.layers.0"
    state = {
        f"{p}.mlp.gate.weight": w(experts, hidden),
        f"{p}.self_attn.q_proj.weight": w(hidden, hidden),
        f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for e in range(experts):
        state[f"{p}.mlp.experts.{e}.gate_proj.weight"] = w(inter, hidden)
        state[f"{p}.mlp.experts.{e}.up_proj.weight"] = w(inter, hidden)
        state[f"{p}.mlp.experts.{e}.down_proj.weight"] = w(hidden, inter)
    return state


def _amax(state):
    return {n[: -len(".weight")]: 1.0 for n, t in state.items() if mf.is_moe_quantized(n, t)}


#: format -> (suffix -> (dtype, per-tensor shape of gate_proj [128, 256])).
EXPECTED = {
    "fp8": {"weight": (torch.float8_e4m3fn, (128, 256)), "weight_scale": (torch.float32, ())},
    "fp8_static": {
        "weight": (torch.float8_e4m3fn, (128, 256)),
        "weight_scale": (torch.float32, ()),
        "input_scale": (torch.float32, ()),
    },
    "fp8_block": {
        "weight": (torch.float8_e4m3fn, (128, 256)),
        "weight_scale_inv": (torch.float32, (1, 2)),
    },
    "ct_w8a8_fp8": {
        "weight": (torch.float8_e4m3fn, (128, 256)),
        "weight_scale": (torch.bfloat16, (128, 1)),
    },
    "ct_w8a8_fp8_static": {
        "weight": (torch.float8_e4m3fn, (128, 256)),
        "weight_scale": (torch.bfloat16, (1,)),
        "input_scale": (torch.float32, (1,)),
    },
}


@pytest.mark.parametrize("fmt", mf.FP8_FORMATS)
def test_expert_tensors_have_vllm_names_dtypes_and_scale_shapes(fmt):
    """Each expert projection becomes the format's tensors with vLLM's dtypes and
    per-expert scale shapes; routers and norms stay bf16 and untouched."""
    state = _moe_state()
    out = mf.convert_moe_state_dict(state, fmt, _amax(state))
    prefix = "model.layers.0.mlp.experts.1.gate_proj"
    got = {
        n[len(prefix) + 1 :]: (t.dtype, tuple(t.shape))
        for n, t in out.items()
        if n.startswith(prefix + ".")
    }
    assert got == EXPECTED[fmt]
    assert torch.equal(
        out["model.layers.0.mlp.gate.weight"], state["model.layers.0.mlp.gate.weight"]
    )
    assert "model.layers.0.mlp.gate.weight_scale" not in out


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "ct_w8a8_fp8"])
def test_dequantized_experts_are_close_to_bf16(fmt):
    """weight x scale (broadcast per tensor, tile or channel) is within FP8's rounding of
    the bf16 weight."""
    state = _moe_state()
    out = mf.convert_moe_state_dict(state, fmt)
    name = "model.layers.0.mlp.experts.0.down_proj"
    w = out[f"{name}.weight"].to(torch.float32)
    if fmt == "fp8_block":
        s = out[f"{name}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        s = out[f"{name}.weight_scale"].to(torch.float32)
    ref = state[f"{name}.weight"].to(torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of the value, plus the scale
    assert torch.allclose(w * s, ref, rtol=2**-4, atol=float(ref.abs().max()) * 2**-6)


@pytest.mark.parametrize(
    "bad, fmt, match",
    [
        (
            {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(96, 128)},
            "fp8_block",
            "multiples of 128",
        ),
        ({"x": torch.ones(2)}, "int3", "unknown MoE fixture format"),
        (
            {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(128, 128)},
            "fp8_static",
            "static activation scales",
        ),
    ],
)
def test_bad_inputs_raise_fixture_error(bad, fmt, match):
    """Block dims that do not tile, an unknown format, a static format without amax."""
    with pytest.raises(FixtureError, match=match):
        mf.convert_moe_state_dict(bad, fmt)


def test_fp8_config_ignores_every_router():
    """vLLM's FP8 config names each layer's router (they stay bf16)."""
    config = mf.moe_quantization_config("fp8_block", mf.ignored_modules(list(_moe_state())))
    assert config == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "ignored_layers": ["model.layers.0.mlp.gate"],
        "weight_block_size": [128, 128],
    }


# --------------------------------------------------------------------------- vs vLLM's loader


#: Parameters vLLM's MoE method registers per format (vLLM 0.33 Fp8MoEMethod and
#: CompressedTensorsW8A8Fp8MoEMethod ``create_weights``), and the shape each checkpoint
#: shard must have to be copied into its slice, from (E, N = moe_intermediate, K = hidden).
def _vllm_params(fmt: str, n: int, k: int) -> dict[str, dict[str, tuple[int, ...]]]:
    b = mf.FP8_BLOCK
    shard = {
        "fp8": {"weight_scale": ()},
        "fp8_static": {"weight_scale": (), "input_scale": ()},
        "fp8_block": {"weight_scale_inv": None},
        "ct_w8a8_fp8": {"weight_scale": None},
        "ct_w8a8_fp8_static": {"weight_scale": (1,), "input_scale": (1,)},
    }[fmt]
    w13 = {"weight": (n, k), **shard}
    w2 = {"weight": (k, n), **shard}
    if fmt == "fp8_block":
        w13["weight_scale_inv"], w2["weight_scale_inv"] = (n // b, k // b), (k // b, n // b)
    if fmt == "ct_w8a8_fp8":
        w13["weight_scale"], w2["weight_scale"] = (n, 1), (k, 1)
    return {"w13_": w13, "w2_": w2}


@pytest.mark.parametrize(
    "base, fmt",
    [
        (b, f)
        for b, fs in mf.MOE_BASES.items()
        if b.startswith("qwen3")
        for f in fs
        if f in mf.FP8_FORMATS
    ],
)
def test_built_checkpoint_maps_onto_vllm_expert_params(base, fmt):
    """Every expert tensor of the built checkpoint maps, through vLLM's own
    build_expert_params_mapping, onto a parameter the format's MoE method registers,
    with the shard shape that parameter's slice takes; every expert is complete."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    path = mf.build_moe(base, fmt)
    config = json.loads((path / "config.json").read_text())
    e, n, k = config["num_local_experts"], config["moe_intermediate_size"], config["hidden_size"]
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", e)
    want = _vllm_params(fmt, n, k)
    from safetensors import safe_open

    seen: dict[tuple[int, str], set[str]] = {}
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in f.keys():
            if ".experts." not in name:
                continue
            hit = [(p, eid, shard) for p, ckpt, eid, shard in mapping if ckpt in name]
            assert len(hit) == 1, name
            param_prefix, eid, shard = hit[0]
            suffix = name.rsplit(".", 1)[1]
            group = "w2_" if param_prefix.endswith("w2_") else "w13_"
            assert suffix in want[group], (name, group, suffix)
            assert tuple(f.get_slice(name).get_shape()) == want[group][suffix], name
            seen.setdefault((eid, shard), set()).add(suffix)
    assert len(seen) == 3 * e
    assert all(s == set(want["w2_" if sh == "w2" else "w13_"]) for (_, sh), s in seen.items())
    qc = config["quantization_config"]
    assert (qc.get("activation_scheme") == "static") == (fmt == "fp8_static") or qc[
        "quant_method"
    ] == "compressed-tensors"
    assert re.fullmatch(r"tiny-qwen3-moe(-128)?-[a-z0-9-]+", path.name)
