"""Checkpoint content fingerprint: content-sensitive, cached by stat, streamable."""

import os

import pytest
import torch
from safetensors.torch import save_file

from wcache.store import CacheKey, StoreError, checkpoint_digest, checkpoint_key_fields
from wcache.store import fingerprint as fp


def _write_checkpoint(d, value: float) -> None:
    os.makedirs(d, exist_ok=True)
    w = torch.zeros(16, 16)
    w[3, 5] = value
    save_file({"model.layers.0.weight": w, "model.norm.weight": torch.ones(16)},
              os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"]}')


def test_one_value_change_changes_the_digest(tmp_path):
    """Same tensor names and shapes, one value different: file digest and key differ in 'checkpoint'."""
    a, b = tmp_path / "a", tmp_path / "b"
    _write_checkpoint(a, 1.0)
    _write_checkpoint(b, 2.0)
    cache = str(tmp_path / "cache.json")
    da, db = checkpoint_digest(str(a), cache), checkpoint_digest(str(b), cache)
    assert ["config.json", "model.safetensors"] == sorted(da)
    assert da["config.json"] == db["config.json"]
    assert da["model.safetensors"] != db["model.safetensors"]
    ka = CacheKey({**checkpoint_key_fields(str(a), cache), "dtype": "bf16"})
    kb = CacheKey({**checkpoint_key_fields(str(b), cache), "dtype": "bf16"})
    assert ["checkpoint"] == ka.diff(kb)


def test_second_call_only_stats(tmp_path, monkeypatch):
    """A second call with unchanged files hashes nothing (answers from the stat-keyed cache)."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    cache = str(tmp_path / "cache.json")
    first = checkpoint_digest(str(d), cache)

    def boom(path):
        raise AssertionError(f"hashed {path} again")

    monkeypatch.setattr(fp, "_hash_path", boom)
    assert first == checkpoint_digest(str(d), cache)


def test_rewritten_file_with_restored_mtime_is_hashed_again(tmp_path):
    """A file rewritten in place with its old mtime put back is rehashed (ctime moved) and gets its new digest."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    cache = str(tmp_path / "cache.json")
    path = d / "model.safetensors"
    before = checkpoint_digest(str(d), cache)["model.safetensors"]
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte different
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = checkpoint_digest(str(d), cache)["model.safetensors"]
    assert before != after
    assert fp._hash_path(str(path)) == after


def test_streaming_digest_equals_file_digest_and_fills_cache(tmp_path, monkeypatch):
    """read_file_digest returns the bytes and the same digest as digest_file, and caches it for the next stat-only check."""
    d = tmp_path / "m"
    _write_checkpoint(d, 3.0)
    path = str(d / "model.safetensors")
    cache = fp.DigestCache(str(tmp_path / "cache.json"))
    data, digest = fp.read_file_digest(path, cache)
    assert open(path, "rb").read() == data
    cache.save()
    monkeypatch.setattr(fp, "_hash_path", lambda p: (_ for _ in ()).throw(AssertionError("rehashed")))
    assert digest == fp.digest_file(path, fp.DigestCache(str(tmp_path / "cache.json")))


def test_non_sequential_read_records_no_digest(tmp_path):
    """A reader that seeks around cannot vouch for the bytes: it records no digest."""
    d = tmp_path / "m"
    _write_checkpoint(d, 3.0)
    with fp.DigestingReader(str(d / "model.safetensors")) as f:
        f.seek(100)
        f.read()
    assert f.digest is None


def test_missing_weights_is_an_error(tmp_path):
    """A dir without any weight file is refused (a config alone is not a checkpoint)."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StoreError, match="no weight file"):
        checkpoint_digest(str(tmp_path), str(tmp_path / "c.json"))


def test_hidden_dirs_skipped_and_nested_files_found(tmp_path):
    """Nested weight files are found; hidden dirs (.cache, .git) are skipped."""
    _write_checkpoint(tmp_path / "sub", 1.0)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.safetensors").write_bytes(b"junk")
    assert ["sub/config.json", "sub/model.safetensors"] == fp.checkpoint_files(str(tmp_path))
