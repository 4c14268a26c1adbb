"""`wcache serve` on a damaged checkpoint: one line `wcache serve: error [code]: <file>:
<what>` with the fix, no traceback (unless --verbose); and the header checks of
wcache.checkpoint on a table of bad files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wcache import cli
from wcache.checkpoint import check_checkpoint_dir, check_safetensors
from wcache.errors import CheckpointCorrupt, ConfigInvalid, LoadFailed

REPO = str(Path(__file__).resolve().parents[1])
#: Bytes of the real checkpoint kept in the truncated copy: the header and a little data.
TRUNCATED_BYTES = 1 << 20
#: A refusal before any vLLM work returns within this (seconds; the CLI imports torch).
FAST_EXIT_S = 60.0


def _serve(model: Path, *extra: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "wcache.cli",
            "serve",
            "--model",
            str(model),
            "--no-progress",
            "--dtype",
            "bfloat16",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _our_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("wcache serve:")]


@pytest.fixture(scope="module")
def real_checkpoint() -> Path:
    from wcache.testing.fixtures import build

    return Path(build("bf16"))


def _copy(real: Path, dst: Path, link_weights: bool) -> Path:
    dst.mkdir()
    for f in real.iterdir():
        if f.name == "model.safetensors":
            if link_weights:
                (dst / f.name).symlink_to(f)
            else:
                with open(f, "rb") as src, open(dst / f.name, "wb") as out:
                    out.write(src.read(TRUNCATED_BYTES))
        else:
            shutil.copy(f, dst / f.name)
    return dst


def test_truncated_safetensors_is_one_line_naming_the_file(real_checkpoint, tmp_path, sock_dir):
    """A truncated model.safetensors: exit 1, one line [checkpoint-corrupt] naming the file, the fix, no traceback."""
    model = _copy(real_checkpoint, tmp_path / "ckpt", link_weights=False)
    proc = _serve(model, "--socket-dir", sock_dir, timeout=FAST_EXIT_S)
    assert 1 == proc.returncode
    (line,) = _our_lines(proc.stderr)
    assert line.startswith(
        f"wcache serve: error [checkpoint-corrupt]: {model / 'model.safetensors'}: "
    )
    assert "truncated" in line and "download or copy the checkpoint again" in line
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [] == os.listdir(sock_dir)  # nothing left behind


def test_config_that_is_not_json_is_one_line_naming_the_file(real_checkpoint, tmp_path, sock_dir):
    """config.json cut mid-object: exit 1, one line [config-invalid] naming the file and position, no traceback."""
    model = _copy(real_checkpoint, tmp_path / "ckpt", link_weights=True)
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    proc = _serve(model, "--socket-dir", sock_dir, timeout=FAST_EXIT_S)
    assert 1 == proc.returncode
    (line,) = _our_lines(proc.stderr)
    assert line.startswith(
        f"wcache serve: error [config-invalid]: {model / 'config.json'}: not valid JSON ("
    )
    assert "line 1 column" in line and "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_config_vllm_refuses_is_one_line_and_verbose_shows_the_traceback(
    real_checkpoint, tmp_path, sock_dir
):
    """Valid JSON vLLM refuses (7 heads for 576 dims): one [config-invalid] line naming config.json
    and vLLM's reason; with --verbose the traceback is printed too."""
    model = _copy(real_checkpoint, tmp_path / "ckpt", link_weights=True)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 7}))
    proc = _serve(model, "--socket-dir", sock_dir, "--verbose")
    assert 1 == proc.returncode
    (line,) = _our_lines(proc.stderr)
    assert line.startswith(f"wcache serve: error [config-invalid]: {model / 'config.json'} ")
    assert "not a multiple of the number of attention heads (7)" in line
    assert "Traceback (most recent call last)" in proc.stderr


def test_unclassified_load_error_is_one_line(monkeypatch, capsys, real_checkpoint):
    """Anything else the load raises becomes [load-failed] naming the checkpoint and the error's last line."""
    import wcache.daemon.serve as serve

    def boom(args, rest):
        raise OSError("first line\nNo space left on device")

    monkeypatch.setattr(serve, "main", boom)
    assert 1 == cli.main(["serve", "--model", str(real_checkpoint)])
    err = capsys.readouterr().err
    assert (
        f"wcache serve: error [{LoadFailed.code}]: {real_checkpoint}: OSError: No space left "
        f"on device (run with --verbose for the traceback)\n"
    ) == err


def test_a_long_load_error_is_clipped(monkeypatch, capsys, real_checkpoint):
    """vLLM's "No MXFP4 MoE backend supports ..." is one ~2,000-character line: the
    [load-failed] line keeps its start and says where the whole of it is (break14 #3)."""
    import wcache.daemon.serve as serve

    reason = "No MXFP4 MoE backend supports the deployment configuration: " + "x" * 2000

    def boom(args, rest):
        raise NotImplementedError(reason)

    monkeypatch.setattr(serve, "main", boom)
    assert 1 == cli.main(["serve", "--model", str(real_checkpoint)])
    err = capsys.readouterr().err
    assert "NotImplementedError: No MXFP4 MoE backend supports the deployment" in err
    assert "characters more; --verbose prints it whole) (run with --verbose" in err
    assert len(err) < cli.LOAD_REASON_CHARS + 400


def _valid(path: Path) -> Path:
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3)}, str(path))
    return path


#: (name, file bytes from a valid file's bytes, error class, fragment)
BAD_FILES = [
    ("empty", lambda b: b"", CheckpointCorrupt, "shorter than the 8-byte header length"),
    ("short", lambda b: b[:5], CheckpointCorrupt, "shorter than the 8-byte header length"),
    (
        "huge header",
        lambda b: (10**12).to_bytes(8, "little") + b[8:],
        CheckpointCorrupt,
        "does not fit",
    ),
    ("cut header", lambda b: b[:20], CheckpointCorrupt, "does not fit"),
    (
        "header not json",
        lambda b: (4).to_bytes(8, "little") + b"{{{{",
        CheckpointCorrupt,
        "header is not valid JSON",
    ),
    (
        "header a list",
        lambda b: (2).to_bytes(8, "little") + b"[]",
        CheckpointCorrupt,
        "not a JSON object",
    ),
    (
        "no offsets",
        lambda b: (14).to_bytes(8, "little") + b'{"a": {"x":1}}',
        CheckpointCorrupt,
        "no valid data_offsets",
    ),
    (
        "bad offsets",
        lambda b: (28).to_bytes(8, "little") + b'{"a": {"data_offsets": [5]}}',
        CheckpointCorrupt,
        "no valid data_offsets",
    ),
    ("truncated data", lambda b: b[:-4], CheckpointCorrupt, "truncated"),
]


@pytest.mark.parametrize("name,mangle,error,fragment", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_safetensors_files_are_refused(tmp_path, name, mangle, error, fragment):
    """Each damaged safetensors file raises its error naming the file and the damage."""
    good = _valid(tmp_path / "good.safetensors")
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(mangle(good.read_bytes()))
    with pytest.raises(error) as info:
        check_safetensors(str(bad))
    assert str(info.value).startswith(f"{bad}: ") and fragment in str(info.value)


def test_valid_checkpoint_dir_passes_and_missing_config_is_named(tmp_path):
    """A dir with a JSON-object config and a complete safetensors file passes; without config.json it is config-invalid."""
    _valid(tmp_path / "model.safetensors")
    with pytest.raises(ConfigInvalid, match=r"config\.json: missing"):
        check_checkpoint_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert check_checkpoint_dir(str(tmp_path)) is None


def test_config_vllm_refuses_through_pydantic_names_vllms_reason(monkeypatch, tmp_path):
    """A refusal vLLM raises as a pydantic ValidationError (its config classes are pydantic
    dataclasses: max_model_len over the model's, an unknown --quantization) names vLLM's
    reason, not the error's last line (pydantic's 'For further information visit URL')."""
    import pydantic

    from wcache.vllm import build

    @pydantic.dataclasses.dataclass
    class ModelConfig:
        max_model_len: int

        @pydantic.model_validator(mode="after")
        def _check(self):
            raise ValueError(
                f"User-specified max_model_len ({self.max_model_len}) is greater\n"
                "than the derived max_model_len (2048)."
            )

    def refuse(*_a, **_k):
        ModelConfig(max_model_len=100000)

    monkeypatch.setattr(build, "engine_config", refuse)
    with pytest.raises(ConfigInvalid) as info:
        build.checked_engine_config(str(tmp_path), ["--max-model-len", "100000"])
    text = str(info.value)
    assert "vLLM refused it: ValidationError: Value error, User-specified max_model_len " in text
    assert "(100000) is greater than the derived max_model_len (2048)." in text
    assert "errors.pydantic.dev" not in text
    assert build.refusal_reason(RuntimeError("Traceback\n  ...\nthe reason")) == "the reason"


def test_a_long_refusal_is_clipped_and_says_where_the_rest_is(monkeypatch, tmp_path):
    """vLLM's refusal of an unknown architecture lists every supported one (a
    12,000-character error line: break14 #7): the message keeps its start and says how
    much was cut and where the whole error is, per command."""
    from wcache.vllm import build

    names = ", ".join(f"Arch{i}ForCausalLM" for i in range(600))
    unsupported = (
        "Model architectures ['FooForCausalLM'] are not supported for now. "
        f"Supported architectures: dict_keys([{names}])"
    )

    def refuse(*_a, **_k):
        raise ValueError(unsupported)

    monkeypatch.setattr(build, "engine_config", refuse)
    for prog, where in [
        ("wcache serve", "`wcache serve --verbose` logs the whole error"),
        ("wcache verify", "vLLM's own engine start with these arguments shows the whole error"),
    ]:
        with pytest.raises(ConfigInvalid) as info:
            build.checked_engine_config(str(tmp_path), [], prog=prog)
        text = str(info.value)
        assert "['FooForCausalLM'] are not supported for now" in text
        assert f"characters more; {where}); fix the config or the arguments" in text
        assert len(text) < build.REASON_CHARS + 400, len(text)


class _Quant:
    def __init__(self, layer_kind: str):
        self.layer_kind = layer_kind


class _Config:
    def __init__(self, layer_kind: str):
        self.quant = _Quant(layer_kind)


class _Planned:
    def __init__(self, name: str, module: torch.nn.Module, layer_kind: str):
        self.name, self.module, self.config = name, module, _Config(layer_kind)


class _TinyMoe(torch.nn.Module):
    """An embedding, a tied head, an MoE layer and an attention layer's KV scale."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.head = torch.nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight
        self.experts = torch.nn.Module()
        self.experts.w13_weight = torch.nn.Parameter(torch.empty(3, 4, 2))
        self.experts.w2_weight = torch.nn.Parameter(torch.empty(3, 2, 2))
        self.attn = torch.nn.Module()
        self.attn.k_scale = torch.nn.Parameter(torch.ones(()))

    def load_weights(self, weights):
        return {name for name, _ in weights}


def test_planned_weights_the_checkpoint_did_not_fill_are_named():
    """On an unquantized model every parameter of a planned linear, embedding or MoE
    layer must be among those load_weights reports (vLLM's own check exempts those
    modules, so a missing one kept torch.empty's bytes and was served); a tied head
    counts with its embedding, an attention layer's KV scale, a quantized model (vLLM
    checks it) and a model that reports nothing are not checked."""
    from wcache.vllm.build import unloaded_planned_weights
    from wcache.vllm.compat import loaded_weight_names

    model = _TinyMoe()
    planned = [
        _Planned("embed", model.embed, "embedding"),
        _Planned("head", model.head, "linear"),
        _Planned("experts", model.experts, "moe"),
        _Planned("attn", model.attn, "attention"),
    ]
    with loaded_weight_names(model) as calls:
        model.load_weights([("embed.weight", None), ("experts.w2_weight", None)])
    assert calls == [{"embed.weight", "experts.w2_weight"}]
    assert "load_weights" not in vars(model)  # the recorder is gone again
    with contextlib.suppress(RuntimeError), loaded_weight_names(model):
        raise RuntimeError("inside the scope")
    assert "load_weights" not in vars(model)  # also after a raise
    loaded = calls[0]
    assert unloaded_planned_weights(model, planned, loaded, None) == ["experts.w13_weight"]
    assert unloaded_planned_weights(model, planned, loaded | {"experts.w13_weight"}, None) == []
    assert unloaded_planned_weights(model, planned, loaded, "awq") == []
    assert unloaded_planned_weights(model, planned, None, None) == []


@pytest.mark.slow
def test_moe_config_without_expert_tensors_is_refused(tmp_path, sock_dir):
    """A MoE checkpoint whose config.json names experts its safetensors file lacks: one
    [checkpoint-corrupt] line naming the experts' weights, exit 1, nothing served. It
    was served (vLLM's loader leaves the experts torch.empty and says nothing)."""
    from safetensors.torch import load_file

    from wcache.testing.tiny_models import build_arch

    src = build_arch("qwen3_moe")
    model = tmp_path / "no-experts"
    shutil.copytree(src, model)
    state = load_file(str(src / "model.safetensors"))
    kept = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    assert len(kept) < len(state)
    save_file(kept, str(model / "model.safetensors"), metadata={"format": "pt"})
    # a daemon that serves it would run until killed: a refusal comes in under a minute
    proc = _serve(
        model, "--socket-dir", sock_dir, "--enforce-eager", "--max-model-len", "512", timeout=180
    )
    assert 1 == proc.returncode, proc.stderr[-2000:]
    (line,) = _our_lines(proc.stderr)
    assert line.startswith(f"wcache serve: error [checkpoint-corrupt]: {model}: 4 weight(s) ")
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in line
    assert "wcache: ready" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_model_no_engine_can_restore_is_refused_before_its_load(sock_dir):
    """BLOOM reads its ALiBi slopes' values while vLLM builds it, so no engine can
    build it on the meta device to restore it (every one falls back, [meta-build]).
    `wcache serve` built it for real and served it; it now builds it on meta first, as
    the engines do, and refuses: one [meta-build] line naming the architecture and the
    fix, exit 1, no weight loaded, nothing served."""
    from wcache.testing.tiny_models import build_arch

    model = build_arch("bloom")
    proc = _serve(
        model, "--socket-dir", sock_dir, "--enforce-eager", "--max-model-len", "512", timeout=180
    )
    assert 1 == proc.returncode, proc.stderr[-2000:]
    (line,) = _our_lines(proc.stderr)
    assert line.startswith("wcache serve: error [meta-build]: vLLM's BloomForCausalLM")
    assert "Fix: run vLLM on this model from disk (load_format='auto')" in line
    assert "wcache: ready" not in proc.stderr + proc.stdout
    assert "wcache: loading weights" not in proc.stderr + proc.stdout
