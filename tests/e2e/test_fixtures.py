"""Checks of the SmolLM2-135M test fixtures (wcache.testing.fixtures).

Fast tests read the built checkpoints (built once into the fixtures cache; ~30 s
the first time) and compare packing with vLLM's own reference helpers. The
``slow`` test dequantizes every quantized layer and compares it with bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wcache.core import WcacheError
from wcache.testing import fixtures as fx

HIDDEN = 576
INTERMEDIATE = 1536
NUM_LAYERS = 30
KV_HEADS, HEAD_DIM = 3, 64
VOCAB = 49152
G = fx.GROUP_SIZE

#: (size_n, size_k) of each quantized linear of a decoder layer.
LINEAR_SHAPES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}

#: Every tensor a quantized linear has, as (shape, dtype), from its (size_n, size_k).
LAYOUTS = {
    "awq": lambda n, k: {
        "qweight": ((k, n // 8), torch.int32),
        "qzeros": ((k // G, n // 8), torch.int32),
        "scales": ((k // G, n), torch.float16),
    },
    "gptq": lambda n, k: {
        "qweight": ((k // 8, n), torch.int32),
        "qzeros": ((k // G, n // 8), torch.int32),
        "scales": ((k // G, n), torch.float16),
        "g_idx": ((k,), torch.int32),
    },
    "ct_w4a16": lambda n, k: {
        "weight_packed": ((n, k // 8), torch.int32),
        "weight_scale": ((n, k // G), torch.bfloat16),
        "weight_shape": ((2,), torch.int64),
    },
    "ct_w8a8_int8": lambda n, k: {
        "weight": ((n, k), torch.int8),
        "weight_scale": ((n, 1), torch.bfloat16),
    },
}

EXPECTED_QUANT_CONFIG = {
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    },
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True},
    "ct_w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    },
    "ct_w8a8_int8": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    },
}

#: GPTQ v1 qzeros word: the nibble 7 (zero 8, stored minus one) eight times.
GPTQ_QZERO_WORD = 0x77777777

#: Layers compared bit for bit with vLLM's reference quantizers: the first and
#: the last, covering K = 576 and K = 1536.
REFERENCE_PREFIXES = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    f"model.layers.{NUM_LAYERS - 1}.mlp.down_proj",
)

#: Relative Frobenius error of dequantized vs bf16 weights, worst layer. Measured
#: worst: awq 0.109, gptq 0.130, ct_w4a16 0.132, ct_w8a8_int8 0.012 (int4 RTN with
#: 64-element groups loses ~3.5 bits of a ~4.5-bit-wide distribution); the bounds
#: leave ~50% headroom and still fail on a wrong packing order (error ~1).
MAX_REL_ERROR = {"awq": 0.2, "gptq": 0.2, "ct_w4a16": 0.2, "ct_w8a8_int8": 0.02}
#: Element-wise: the error is at most one quantization step (half a step from
#: rounding, plus at most half a step of clipping at the range ends), plus the
#: rounding of the stored scale (fp16 or bf16: 2**-8 relative, times |q| <= 15
#: for uint4 with zero point, 8 for int4, 128 for int8).
MAX_STEP_ERROR = 1.0
SCALE_ROUNDING = 2.0**-8
MAX_Q = {"awq": 15, "gptq": 8, "ct_w4a16": 8, "ct_w8a8_int8": 128}


def _layer(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The local-name tensors of one module."""
    return {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}


@pytest.fixture(scope="session")
def paths() -> dict[str, Path]:
    try:
        return fx.build_all()
    except fx.FixtureError as exc:
        if exc.code == "fixture-missing":
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="session")
def states(paths) -> dict[str, dict[str, torch.Tensor]]:
    return {fmt: fx.load_state_dict(path) for fmt, path in paths.items()}


@pytest.fixture(scope="session")
def configs(paths) -> dict[str, dict]:
    return {fmt: json.loads((path / "config.json").read_text()) for fmt, path in paths.items()}


# --------------------------------------------------------------------------- bf16


def test_bf16_config_is_smollm2_with_tied_embeddings(configs):
    """The bf16 config is SmolLM2-135M's, tied, with no quantization_config."""
    cfg = configs["bf16"]
    expected = {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 9,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "model_type": "llama",
    }
    assert expected == {k: cfg[k] for k in expected}
    assert "quantization_config" not in cfg


def test_bf16_tensors_have_no_lm_head_and_are_bf16(states):
    """bf16 has 9 tensors per layer plus embed and norm, all bf16, no lm_head."""
    state = states["bf16"]
    assert "lm_head.weight" not in state
    assert NUM_LAYERS * 9 + 2 == len(state)
    assert {torch.bfloat16} == {t.dtype for t in state.values()}
    assert (VOCAB, HIDDEN) == tuple(state["model.embed_tokens.weight"].shape)


# --------------------------------------------------------------------------- every format


@pytest.mark.parametrize("fmt", fx.FORMATS)
def test_stamp_names_builder_version(paths, fmt):
    """Each fixture carries a stamp with this builder's version, its format and the
    size of each of its files."""
    stamp = json.loads((paths[fmt] / fx.STAMP_FILE).read_text())
    files = stamp.pop("files")
    assert {"builder_version": fx.BUILDER_VERSION, "format": fmt, "source": fx.GGUF_FILE} == stamp
    folder = paths[fmt]
    sizes = {
        f.relative_to(folder).as_posix(): f.stat().st_size
        for f in folder.rglob("*")
        if f.is_file() and f.name != fx.STAMP_FILE
    }
    assert fx.WEIGHTS_FILE in sizes and sizes == files


@pytest.mark.parametrize("fmt", fx.FORMATS)
def test_tokenizer_present_and_same_as_bf16(paths, fmt):
    """Every fixture has the tokenizer files and encodes the prompt like bf16."""
    from transformers import AutoTokenizer

    assert (paths[fmt] / "tokenizer.json").is_file()
    assert (paths[fmt] / "tokenizer_config.json").is_file()
    ids = AutoTokenizer.from_pretrained(paths[fmt])(fx.CHECK_PROMPT)["input_ids"]
    expected = AutoTokenizer.from_pretrained(paths["bf16"])(fx.CHECK_PROMPT)["input_ids"]
    assert expected == ids
    assert len(ids) > 1


@pytest.mark.parametrize("fmt", fx.QUANTIZED_FORMATS)
def test_quantization_config_fields(configs, fmt):
    """config.json carries the fields vLLM reads for the method."""
    qc = configs[fmt]["quantization_config"]
    expected = EXPECTED_QUANT_CONFIG[fmt]
    assert expected == {k: qc[k] for k in expected}
    rest = {k: v for k, v in configs[fmt].items() if k not in ("quantization_config", "dtype")}
    assert {k: v for k, v in configs["bf16"].items() if k != "dtype"} == rest
    assert str(fx.REST_DTYPE[fmt]).removeprefix("torch.") == configs[fmt]["dtype"]


def test_ct_w4a16_config_groups(configs):
    """W4A16: one group of int4 symmetric static group-64 weights, no activations."""
    groups = configs["ct_w4a16"]["quantization_config"]["config_groups"]
    assert ["group_0"] == list(groups)
    weights = groups["group_0"]["weights"]
    assert {
        "num_bits": 4,
        "type": "int",
        "strategy": "group",
        "group_size": 64,
        "symmetric": True,
        "dynamic": False,
    } == {
        k: weights[k]
        for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
    }
    assert groups["group_0"]["input_activations"] is None
    assert ["Linear"] == groups["group_0"]["targets"]


def test_ct_w8a8_int8_config_groups(configs):
    """W8A8 INT8: int8 channel static weights, int8 per-token dynamic activations."""
    group = configs["ct_w8a8_int8"]["quantization_config"]["config_groups"]["group_0"]
    keys = ("num_bits", "type", "strategy", "symmetric", "dynamic")
    assert {
        "num_bits": 8,
        "type": "int",
        "strategy": "channel",
        "symmetric": True,
        "dynamic": False,
    } == {k: group["weights"][k] for k in keys}
    assert {
        "num_bits": 8,
        "type": "int",
        "strategy": "token",
        "symmetric": True,
        "dynamic": True,
    } == {k: group["input_activations"][k] for k in keys}


@pytest.mark.parametrize("fmt", fx.QUANTIZED_FORMATS)
def test_tensor_names_dtypes_shapes(states, fmt):
    """Every tensor has exactly the expected name, shape and dtype."""
    rest = fx.REST_DTYPE[fmt]
    expected = {
        "model.embed_tokens.weight": ((VOCAB, HIDDEN), rest),
        "model.norm.weight": ((HIDDEN,), rest),
    }
    for i in range(NUM_LAYERS):
        expected[f"model.layers.{i}.input_layernorm.weight"] = ((HIDDEN,), rest)
        expected[f"model.layers.{i}.post_attention_layernorm.weight"] = ((HIDDEN,), rest)
        for linear, (n, k) in LINEAR_SHAPES.items():
            for name, spec in LAYOUTS[fmt](n, k).items():
                expected[f"model.layers.{i}.{linear}.{name}"] = spec
    actual = {name: (tuple(t.shape), t.dtype) for name, t in states[fmt].items()}
    assert expected == actual


def test_unquantized_tensors_equal_bf16_cast(states):
    """Embedding and norms of each format are the bf16 values cast to its dtype."""
    for fmt in fx.QUANTIZED_FORMATS:
        for name in (
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.layers.7.input_layernorm.weight",
        ):
            expected = states["bf16"][name].to(fx.REST_DTYPE[fmt])
            assert torch.equal(expected, states[fmt][name]), (fmt, name)


def test_ct_weight_shape_values(states):
    """W4A16 weight_shape holds the unpacked (size_n, size_k)."""
    for linear, (n, k) in LINEAR_SHAPES.items():
        shape = states["ct_w4a16"][f"model.layers.3.{linear}.weight_shape"]
        assert [n, k] == shape.tolist()


# --------------------------------------------------------------------------- vLLM references


@pytest.mark.parametrize("prefix", REFERENCE_PREFIXES)
def test_awq_equals_vllm_quantize_weights_and_awq_pack(states, prefix):
    """AWQ tensors equal vLLM's quantize_weights(uint4, zp) + awq_pack, bit for bit."""
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.scalar_type import scalar_types

    w = states["bf16"][prefix + ".weight"].float().t().contiguous()  # [K, N]
    size_k, size_n = w.shape
    _, w_q, w_s, w_zp = qu.quantize_weights(w, scalar_types.uint4, G, zero_points=True)
    layer = _layer(states["awq"], prefix)
    assert torch.equal(qu.awq_pack(w_q, 4, size_k, size_n), layer["qweight"])
    assert torch.equal(qu.awq_pack(w_zp, 4, size_k // G, size_n), layer["qzeros"])
    assert torch.equal(w_s.to(torch.float16), layer["scales"])


@pytest.mark.parametrize("prefix", REFERENCE_PREFIXES)
def test_gptq_equals_vllm_gptq_quantize_weights_and_pack(states, prefix):
    """GPTQ tensors equal vLLM's gptq_quantize_weights(uint4b8) + gptq_pack; v1 qzeros."""
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.scalar_type import scalar_types

    w = states["bf16"][prefix + ".weight"].float().t().contiguous()  # [K, N]
    size_k, size_n = w.shape
    _, w_q, w_s = qu.gptq_quantize_weights(w, scalar_types.uint4b8, G)
    layer = _layer(states["gptq"], prefix)
    assert torch.equal(qu.gptq_pack(w_q, 4, size_k, size_n), layer["qweight"])
    assert torch.equal(w_s.to(torch.float16), layer["scales"])
    expected_qzeros = torch.full((size_k // G, size_n // 8), GPTQ_QZERO_WORD, dtype=torch.int32)
    assert torch.equal(expected_qzeros, layer["qzeros"])
    assert torch.equal(torch.arange(size_k, dtype=torch.int32) // G, layer["g_idx"])


@pytest.mark.parametrize("prefix", REFERENCE_PREFIXES)
def test_ct_w4a16_packing_as_vllm_unpacks_it(states, prefix):
    """vLLM's uint4b8 unpack of weight_packed times the scales equals the
    compressed-tensors decompression, bit for bit."""
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.scalar_type import scalar_types

    layer = _layer(states["ct_w4a16"], prefix)
    q = (
        qu.unpack_quantized_values_into_int32(
            layer["weight_packed"], scalar_types.uint4b8, packed_dim=1
        )
        - scalar_types.uint4b8.bias
    )
    scale = layer["weight_scale"].repeat_interleave(G, dim=1)
    assert torch.equal((q.to(scale.dtype) * scale).float(), fx.dequantize_linear(layer, "ct_w4a16"))
    assert int(q.min()) >= -8 and int(q.max()) <= 7


def test_ct_w8a8_weight_is_round_of_weight_over_channel_scale(states):
    """W8A8 int8 weight = clamp(round(w / scale)) in float32, scale = max|w| / 127.5
    per row in bf16."""
    prefix = REFERENCE_PREFIXES[0]
    w = states["bf16"][prefix + ".weight"]
    layer = _layer(states["ct_w8a8_int8"], prefix)
    expected_scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).to(torch.bfloat16)
    assert torch.equal(expected_scale, layer["weight_scale"])
    expected_q = torch.round(w.float() / layer["weight_scale"].float()).clamp(-128, 127)
    assert torch.equal(expected_q.to(torch.int8), layer["weight"])


# --------------------------------------------------------------------------- pure core


def _tiny_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 128, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(64, 128, generator=gen) * 0.05).to(
            torch.bfloat16
        ),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(128, 64, generator=gen) * 0.05).to(
            torch.bfloat16
        ),
        "model.layers.0.input_layernorm.weight": torch.ones(128, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("fmt", fx.FORMATS)
def test_convert_state_dict_is_pure_and_deterministic(fmt):
    """convert_state_dict leaves its input untouched and gives equal output twice."""
    state = _tiny_state()
    before = {k: (v.clone(), v._version) for k, v in state.items()}
    once, twice = fx.convert_state_dict(state, fmt), fx.convert_state_dict(state, fmt)
    assert all(
        torch.equal(before[k][0], v) and before[k][1] == v._version for k, v in state.items()
    )
    assert list(once) == list(twice)
    assert all(torch.equal(once[k], twice[k]) for k in once)


def test_quantized_linear_names():
    """Only decoder q/k/v/o/gate/up/down weights are quantized."""
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.12.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ]
    assert [True, True, False, False, False, False] == [
        fx.is_quantized_linear_weight(n) for n in names
    ]
    assert (
        "model.layers.0.self_attn.q_proj",
        "model.layers.12.mlp.down_proj",
    ) == fx.quantized_linear_prefixes(names)


BAD_INPUTS = [
    (lambda: fx.convert_state_dict({}, "int3"), "fixture-build", "unknown fixture format"),
    (lambda: fx.fixture_path("int3"), "fixture-build", "unknown fixture format"),
    (lambda: fx.awq_quantize(torch.zeros(8, 96)), "fixture-build", "multiple of group_size=64"),
    (lambda: fx.gptq_quantize(torch.zeros(12, 64)), "fixture-build", "size_n of 8"),
    (lambda: fx.awq_quantize(torch.zeros(8, 64, dtype=torch.int32)), "fixture-build", "2-D float"),
    (lambda: fx.dequantize_linear({}, "bf16"), "fixture-build", "cannot dequantize"),
    (lambda: fx.ct_scheme("awq"), "fixture-build", "no compressed-tensors scheme"),
]


@pytest.mark.parametrize("call,code,text", BAD_INPUTS)
def test_bad_inputs_raise_fixture_error(call, code, text):
    """Each bad input raises FixtureError (a WcacheError and RuntimeError) with its code."""
    with pytest.raises(fx.FixtureError) as info:
        call()
    assert isinstance(info.value, WcacheError) and isinstance(info.value, RuntimeError)
    assert code == info.value.code
    assert text in str(info.value)


def test_fixture_path_follows_env(monkeypatch, tmp_path):
    """fixture_path uses $WCACHE_FIXTURES_DIR, and --out/out overrides it."""
    monkeypatch.setenv(fx.FIXTURES_ENV, str(tmp_path / "env"))
    assert tmp_path / "env" / "smollm2-135m-instruct-ct-w4a16" == fx.fixture_path("ct_w4a16")
    assert tmp_path / "o" / "smollm2-135m-instruct-awq" == fx.fixture_path("awq", tmp_path / "o")


def test_build_reuses_stamped_fixture(paths):
    """A second build() of a stamped fixture returns it without rewriting the weights."""
    weights = paths["gptq"] / fx.WEIGHTS_FILE
    mtime = weights.stat().st_mtime_ns
    assert paths["gptq"] == fx.build("gptq", paths["gptq"].parent)
    assert mtime == weights.stat().st_mtime_ns


def test_stale_stamp_is_not_built(tmp_path):
    """A folder whose stamp names another builder version counts as not built."""
    folder = tmp_path / "x"
    folder.mkdir()
    stale = dict(fx._stamp("awq"), builder_version=fx.BUILDER_VERSION - 1)
    (folder / fx.STAMP_FILE).write_text(json.dumps(stale))
    assert not fx._is_built(folder, "awq")
    (folder / fx.WEIGHTS_FILE).write_bytes(b"\x00" * 8)
    fx._write_stamp(folder, "awq")
    assert fx._is_built(folder, "awq")


# --------------------------------------------------------------------------- build_variant


def _tiny_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    save_file(
        fx.convert_state_dict(_tiny_state(), "awq"),
        folder / fx.WEIGHTS_FILE,
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.mark.parametrize(
    "change,index",
    [("model.layers.0.input_layernorm.weight", 0), ("model.layers.0.self_attn.q_proj.qweight", 37)],
)
def test_build_variant_changes_exactly_one_element(tmp_path, change, index):
    """The variant differs from its base in exactly one element of one tensor."""
    base = _tiny_checkpoint(tmp_path / "base")
    out = fx.build_variant(base, tmp_path / "variant", change=change, index=index)
    a, b = load_file(base / fx.WEIGHTS_FILE), load_file(out / fx.WEIGHTS_FILE)
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {
        k: (v.shape, v.dtype) for k, v in b.items()
    }
    assert [change] == [k for k in a if not torch.equal(a[k], b[k])]
    differing = (a[change].reshape(-1) != b[change].reshape(-1)).nonzero().flatten().tolist()
    assert [index] == differing
    assert (base / "config.json").read_text() == (out / "config.json").read_text()


def test_build_variant_default_on_real_fixture(paths, tmp_path):
    """build_variant's default changes model.norm.weight of a real fixture, nothing else."""
    out = fx.build_variant(paths["awq"], tmp_path / "awq-variant")
    a, b = fx.load_state_dict(paths["awq"]), fx.load_state_dict(out)
    assert ["model.norm.weight"] == [k for k in a if not torch.equal(a[k], b[k])]
    assert sorted(p.name for p in paths["awq"].iterdir()) == sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize(
    "change,index,text",
    [
        ("nope.weight", 0, "is not in"),
        ("model.layers.0.input_layernorm.weight", 128, "out of range"),
    ],
)
def test_build_variant_bad_inputs(tmp_path, change, index, text):
    """Unknown tensor or out-of-range index raise FixtureError('fixture-variant'), no output."""
    base = _tiny_checkpoint(tmp_path / "base")
    with pytest.raises(fx.FixtureError) as info:
        fx.build_variant(base, tmp_path / "variant", change=change, index=index)
    assert "fixture-variant" == info.value.code
    assert text in str(info.value)
    assert not (tmp_path / "variant").exists()
    assert ["base"] == sorted(p.name for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- slow


def _step(layer: dict[str, torch.Tensor], fmt: str, size_k: int) -> torch.Tensor:
    """The quantization step of every weight element, ``[size_n, size_k]`` float32."""
    if fmt in ("awq", "gptq"):
        return layer["scales"].float().repeat_interleave(G, dim=0).t()
    return (
        layer["weight_scale"]
        .float()
        .repeat_interleave(size_k // layer["weight_scale"].shape[1], dim=1)
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", fx.QUANTIZED_FORMATS)
def test_dequantized_layers_close_to_bf16(states, fmt):
    """Every dequantized layer is within one quantization step of the bf16 weight,
    element-wise, and within MAX_REL_ERROR overall."""
    base = states["bf16"]
    worst = 0.0
    for prefix in fx.quantized_linear_prefixes(base):
        w = base[prefix + ".weight"].float()
        layer = _layer(states[fmt], prefix)
        deq = fx.dequantize_linear(layer, fmt)
        step = _step(layer, fmt, w.shape[1])
        bound = step * (MAX_STEP_ERROR + SCALE_ROUNDING * MAX_Q[fmt])
        excess = ((deq - w).abs() - bound).max().item()
        assert excess <= 0, (prefix, excess)
        worst = max(worst, ((deq - w).norm() / w.norm()).item())
    assert worst < MAX_REL_ERROR[fmt]


def test_cli_rejects_unknown_format(capsys):
    """The command line refuses a format it cannot build (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        fx.main(["--formats", "bf16,int3"])
    assert 2 == info.value.code
    assert "unknown formats ['int3']" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_vllm_cpu_answers_paris_for_bf16(paths):
    """vLLM CPU loads the bf16 fixture and greedily answers ' Paris.' (one engine start)."""
    pytest.importorskip("vllm")
    result = fx.check("bf16", paths["bf16"])
    assert result["text"].startswith(" Paris.")
    assert "UnquantizedLinearMethod" == result["methods"]["self_attn.qkv_proj"]
