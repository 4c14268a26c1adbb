"""The fixture builder's real-model registry: each model has its own folders and stamp,
and an unknown model is refused by name (no build, no GGUF read). Its cache on fake
folders (the GGUF conversion stubbed): a file cut short since the build is rebuilt,
published folders are readable by all, a killed builder's leftovers are removed; and
its command line's argument errors."""

from __future__ import annotations

import json
import logging
import os
import stat

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
    path = _fake_folder(tmp_path / "x")
    fx._write_stamp(path, "bf16", fx.SMOLLM2)
    assert fx._is_built(path, "bf16", fx.SMOLLM2)
    assert not fx._is_built(path, "bf16", fx.GEMMA3)
    assert fx._stamp("bf16", fx.GEMMA3)["source"] == "gemma-3-270m-q4_k_m.gguf"


#: A fake fixture's files (name: bytes), as the stubbed GGUF conversion writes them.
FAKE_FILES = {fx.WEIGHTS_FILE: b"\x00" * 64, fx.CONFIG_FILE: b"{}", "tokenizer/vocab.json": b"{}"}


def _fake_folder(path):
    """``path`` holding :data:`FAKE_FILES`; returns it."""
    for name, body in FAKE_FILES.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(body)
    return path


def test_a_file_cut_short_or_deleted_since_the_build_fails_the_stamp_check(tmp_path):
    """The stamp records each file's size: a weights file cut short, a file deleted (in a
    subfolder too) or a stamp without sizes (an older builder's) is not built, and the
    reason names the file and both sizes."""
    path = _fake_folder(tmp_path / "x")
    fx._write_stamp(path, "bf16")
    assert fx._unbuilt_reason(path, "bf16") is None
    os.truncate(path / fx.WEIGHTS_FILE, 10)
    assert fx._unbuilt_reason(path, "bf16") == f"{fx.WEIGHTS_FILE} is 10 bytes, 64 when built"
    os.truncate(path / fx.WEIGHTS_FILE, 64)
    (path / "tokenizer/vocab.json").unlink()
    assert fx._unbuilt_reason(path, "bf16") == "tokenizer/vocab.json is missing, 2 when built"
    (path / fx.STAMP_FILE).write_text(json.dumps(fx._stamp("bf16")))
    assert "records no file sizes" in fx._unbuilt_reason(path, "bf16")


def test_a_stamp_recording_no_weights_file_is_not_built(tmp_path):
    """A stamp whose ``files`` names no safetensors file (``{}``: a hand-edited stamp, or
    one written over an emptied folder) is not a build, even though nothing it names
    changed."""
    path = tmp_path / "x"
    path.mkdir()
    fx._write_stamp(path, "bf16")
    assert "records no weights file" in fx._unbuilt_reason(path, "bf16")
    _fake_folder(path)
    (path / fx.STAMP_FILE).write_text(json.dumps({**fx._stamp("bf16"), "files": {}}))
    assert "records no weights file" in fx._unbuilt_reason(path, "bf16")


def test_build_rebuilds_a_fixture_whose_weights_were_cut_short(tmp_path, monkeypatch, caplog):
    """build() reuses an intact fixture, and rebuilds one whose model.safetensors was
    truncated afterwards, logging why (the GGUF conversion stubbed: no real build)."""
    builds = []
    monkeypatch.setattr(fx, "_build_bf16", lambda tmp, src: builds.append(_fake_folder(tmp)))
    final = fx.build("bf16", tmp_path)
    assert (1, fx.build("bf16", tmp_path)) == (len(builds), final)
    os.truncate(final / fx.WEIGHTS_FILE, 10)
    with caplog.at_level(logging.WARNING, logger=fx.__name__):
        assert final == fx.build("bf16", tmp_path)
    assert 2 == len(builds)
    assert 64 == (final / fx.WEIGHTS_FILE).stat().st_size
    assert f"{fx.WEIGHTS_FILE} is 10 bytes, 64 when built" in caplog.text


def test_published_fixture_folders_are_readable_by_all(tmp_path, monkeypatch):
    """build() and atomic_folder() publish 0755 folders and 0644 files, not mkdtemp's
    owner-only 0700 folder and safetensors' owner-only 0600 weights."""

    def as_safetensors_writes(tmp):
        _fake_folder(tmp)
        (tmp / fx.WEIGHTS_FILE).chmod(0o600)  # safetensors' save_file: owner only
        (tmp / "tokenizer").chmod(0o700)

    monkeypatch.setattr(fx, "_build_bf16", lambda tmp, src: as_safetensors_writes(tmp))
    built = fx.build("bf16", tmp_path)
    with fx.atomic_folder(tmp_path / "other") as tmp:
        as_safetensors_writes(tmp)
    modes = [stat.S_IMODE(p.stat().st_mode) for p in (built, tmp_path / "other")]
    assert [fx.FOLDER_MODE, fx.FOLDER_MODE] == modes == [0o755, 0o755]
    for folder in (built, tmp_path / "other"):  # files too: safetensors writes 0600
        inside = {
            p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in folder.rglob("*")
        }
        assert inside[fx.WEIGHTS_FILE] == 0o644
        assert set(inside.values()) == {0o644, 0o755}, inside


def test_the_lock_holder_removes_what_killed_builders_left(tmp_path, caplog):
    """Holding build_lock(final), the .<name>.tmp-* and .stale-* folders beside final (a
    builder killed with SIGKILL) are removed; other fixtures' folders are kept."""
    final = tmp_path / "smollm2-135m-instruct-awq"
    left = [tmp_path / f".{final.name}.tmp-k1", tmp_path / f".{final.name}.stale-42"]
    kept = [tmp_path / f".{final.name}-x.tmp-k2", tmp_path / ".smollm2-135m-instruct-bf16.tmp-k3"]
    for folder in left + kept:
        folder.mkdir()
        _fake_folder(folder)
    with caplog.at_level(logging.WARNING, logger=fx.__name__), fx.build_lock(final):
        remaining = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert sorted(p.name for p in kept) == remaining
    assert all(f"removing {p}" in caplog.text for p in left)


def test_leftovers_that_are_not_folders_are_removed_too(tmp_path):
    """A file or a link named like a killed build's folder does not stop the build."""
    final = tmp_path / "smollm2-135m-instruct-awq"
    (tmp_path / f".{final.name}.tmp-file").write_text("x")
    (tmp_path / f".{final.name}.stale-link").symlink_to(tmp_path / "elsewhere")
    with fx.build_lock(final):
        left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert [] == left


def test_a_folder_replaced_while_checked_is_not_built(tmp_path, monkeypatch):
    """A file gone between listing and stat (another builder swapping the folder in)
    makes the check say not built, so build() waits on the lock; it never raises."""
    path = _fake_folder(tmp_path / "x")
    fx._write_stamp(path, "bf16")

    def swapped(folder):
        raise FileNotFoundError(2, "No such file or directory", str(folder / fx.WEIGHTS_FILE))

    monkeypatch.setattr(fx, "_file_sizes", swapped)
    assert "changed while checked" in fx._unbuilt_reason(path, "bf16")
    assert not fx._is_built(path, "bf16")


def test_cli_refuses_an_empty_format_list(capsys):
    """`--formats ,` names no format: an argument error (exit status 2), not a silent 0."""
    with pytest.raises(SystemExit) as info:
        fx.main(["--formats", ","])
    assert 2 == info.value.code
    assert "--formats ',' names no format; choose from bf16," in capsys.readouterr().err


def test_unknown_model_is_refused_by_name(tmp_path):
    """build/fixture_path with an unknown model raise FixtureError naming the choices."""
    with pytest.raises(fx.FixtureError, match="unknown fixture model 'phi'.*gemma3"):
        fx.build("bf16", tmp_path, model="phi")


class _Tokenizer:
    """The part of a transformers tokenizer check_tokenizer reads: a vocabulary, and an
    encoding that keeps words whole (``split=False``, each after a space spelled with
    ``mark``) or cuts them into characters, as transformers 5.17's Gemma 3 GGUF
    conversion did; BOS first when ``bos``."""

    bos_token_id = 2

    def __init__(
        self, vocab: dict[str, int], split: bool = False, bos: bool = True, mark: str = "\u2581"
    ):
        self.vocab, self.split, self.bos, self.mark = dict(vocab), split, bos, mark
        self.pieces: dict[str, int] = {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def _piece(self, piece: str) -> int:
        return self.vocab.get(piece) or self.pieces.setdefault(piece, 1000 + len(self.pieces))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = []
        for word in text.split(" "):
            if not word:
                continue
            spelled = self.mark + word if text.startswith(" ") or ids else word
            ids += [self._piece(c) for c in spelled] if self.split else [self._piece(spelled)]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.bos else []) + ids}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        names = {v: k for k, v in {**self.vocab, **self.pieces}.items()}
        return [names[i] for i in ids]


VOCAB = {"\u2581capital": 5279, "\u2581France": 7001, "\u2581": 236743, "c": 236755}


def test_tokenizer_check_passes_a_tokenizer_that_keeps_words_whole():
    """A vocabulary's whole words encode to themselves, BOS first: the check passes."""
    fx.check_tokenizer(_Tokenizer(VOCAB), "good", add_bos=True)
    fx.check_tokenizer(_Tokenizer({"\u0120capital": 6}, bos=False, mark="\u0120"), "byte-level")


def test_tokenizer_check_refuses_a_split_vocabulary_word_naming_the_fix(monkeypatch):
    """transformers 5.17's Gemma 3 tokenizer split " capital" into characters although
    the vocabulary holds ``▁capital``: refused, naming the pieces and the version to
    install (on the GPU image the model then generated noise, 2026-12-05); where the
    installed release is already that new, the message does not ask to install it."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(
        fx.FixtureError, match=r"splits ' capital' into \['▁', 'c'.*transformers>=5\.18"
    ):
        fx.check_tokenizer(_Tokenizer(VOCAB, split=True), "gemma (converted)")
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    with pytest.raises(fx.FixtureError, match=r"transformers 5\.19\.0 converted") as err:
        fx.check_tokenizer(_Tokenizer(VOCAB, split=True), "gemma (converted)")
    assert "install" not in str(err.value)


def test_tokenizer_check_refuses_a_missing_bos_and_an_uncheckable_vocabulary():
    """A model that needs BOS gets it from the saved tokenizer, or the build fails; a
    vocabulary holding none of the probe words cannot be checked, and says so."""
    with pytest.raises(fx.FixtureError, match="does not prepend BOS"):
        fx.check_tokenizer(_Tokenizer(VOCAB, bos=False), "no-bos", add_bos=True)
    with pytest.raises(fx.FixtureError, match="cannot be checked.*TOKENIZER_PROBE_WORDS"):
        fx.check_tokenizer(_Tokenizer({"\u2581Paris": 9}), "other")
