"""The fixture builder's real-model registry: each model has its own folders and stamp,
and an unknown model is refused by name (no build, no GGUF read)."""

from __future__ import annotations

import json

import pytest

from wcache.testing import fixtures as fx


def test_gemma3_folders_have_their_own_prefix(tmp_path):
    """Gemma 3's fixture folders are named gemma-3-270m-<format>, beside SmolLM2's."""
    assert fx.fixture_path("ct_w8a8_int8", tmp_path, model="gemma3") == (
        tmp_path / "gemma-3-270m-ct-w8a8-int8"
    )
    assert fx.fixture_path("bf16", tmp_path) == tmp_path / "smollm2-135m-instruct-bf16"


def test_stamp_names_the_models_gguf(tmp_path):
    """A folder stamped for SmolLM2 is not a built Gemma 3 fixture (and the reverse)."""
    path = tmp_path / "x"
    path.mkdir()
    (path / fx.STAMP_FILE).write_text(json.dumps(fx._stamp("bf16", fx.SMOLLM2)))
    assert fx._is_built(path, "bf16", fx.SMOLLM2)
    assert not fx._is_built(path, "bf16", fx.GEMMA3)
    assert fx._stamp("bf16", fx.GEMMA3)["source"] == "gemma-3-270m-q4_k_m.gguf"


def test_unknown_model_is_refused_by_name(tmp_path):
    """build/fixture_path with an unknown model raise FixtureError naming the choices."""
    with pytest.raises(fx.FixtureError, match="unknown fixture model 'phi'.*gemma3"):
        fx.build("bf16", tmp_path, model="phi")
