"""Checkpoint content fingerprint: content-sensitive, cached by stat, streamable."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from wcache.store import CacheKey, StoreError, checkpoint_digest, checkpoint_key_fields
from wcache.store import fingerprint as fp


def _write_checkpoint(d, value: float) -> None:
    os.makedirs(d, exist_ok=True)
    w = torch.zeros(16, 16)
    w[3, 5] = value
    save_file(
        {"model.layers.0.weight": w, "model.norm.weight": torch.ones(16)},
        os.path.join(d, "model.safetensors"),
    )
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

    def boom(fd, size, path):
        raise AssertionError(f"hashed {path} again")

    monkeypatch.setattr(fp, "_hash_fd", boom)
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
    with open(path, "rb") as f:
        assert f.read() == data
    cache.save()
    monkeypatch.setattr(
        fp, "_hash_fd", lambda fd, size, p: (_ for _ in ()).throw(AssertionError("rehashed"))
    )
    assert digest == fp.digest_file(path, fp.DigestCache(str(tmp_path / "cache.json")))


def test_a_save_drops_entries_of_files_gone_or_changed(tmp_path):
    """The cache file keeps only entries that can still hit: a removed file's and a
    rewritten file's old entry go at the next save (it only grew: break14 #6)."""
    files = {n: tmp_path / n for n in ("kept", "removed", "rewritten", "new")}
    for f in files.values():
        f.write_bytes(b"weights")
    path = str(tmp_path / "cache.json")
    first = fp.DigestCache(path)
    for n in ("kept", "removed", "rewritten"):
        fp.digest_file(str(files[n]), first)
    first.save()
    files["removed"].unlink()
    files["rewritten"].write_bytes(b"other weights")
    second = fp.DigestCache(path)
    fp.digest_file(str(files["new"]), second)
    second.save()
    kept = fp.DigestCache(path)._entries
    assert sorted(kept) == sorted(os.path.realpath(files[n]) for n in ("kept", "new"))


def test_a_junk_entry_does_not_break_a_save(tmp_path):
    """A cache file holding keys that are not paths (a NUL byte: os.stat raises
    ValueError) or entries of the wrong shape: the next save drops them (a junk key
    failed every save with "embedded null byte": break15 #2)."""
    import json

    path = tmp_path / "cache.json"
    junk = {"/a\x00b": [1, 2, 3, 4, 5, "d"], str(tmp_path / "x"): "not a list"}
    path.write_text(json.dumps({"algorithm": fp.DIGEST_ALGORITHM, "files": junk}))
    (tmp_path / "w").write_bytes(b"weights")
    cache = fp.DigestCache(str(path))
    fp.digest_file(str(tmp_path / "w"), cache)
    cache.save()
    assert list(fp.DigestCache(str(path))._entries) == [os.path.realpath(tmp_path / "w")]


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


def test_file_truncated_mid_hash_is_checkpoint_changed(tmp_path, monkeypatch):
    """A shard that shrinks between two reads of the hash is a CheckpointChanged
    (code checkpoint-changed) naming the file, not a crash or a digest."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    shard = d / "model.safetensors"
    monkeypatch.setattr(fp, "CHUNK_BYTES", 256)
    real_read = fp._read_chunk
    calls = []

    def read_then_truncate(fd, buf, offset):
        n = real_read(fd, buf, offset)
        if not calls:
            os.truncate(shard, 300)  # another process rewrites the shard meanwhile
        calls.append(n)
        return n

    monkeypatch.setattr(fp, "_read_chunk", read_then_truncate)
    with pytest.raises(StoreError, match="model.safetensors shrank") as err:
        fp.digest_file(str(shard))
    assert "checkpoint-changed" == err.value.code


def test_vanished_file_is_checkpoint_changed(tmp_path):
    """A file that disappears before it is hashed is a CheckpointChanged naming it."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    with pytest.raises(StoreError, match="vanished") as err:
        fp.digest_file(str(d / "gone.safetensors"))
    assert "checkpoint-changed" == err.value.code


# Big enough that hashing takes far longer than the truncating thread's delay
# (sparse, so it costs no disk); the delay lets the hash start first.
TRUNCATE_FILE_BYTES = 2 << 30
TRUNCATE_DELAY_S = 0.05


def test_truncation_during_hash_never_kills_the_process(tmp_path):
    """A file truncated while it is hashed gives a clear error in a process that survives
    (with an mmap-based hash, the process dies of SIGBUS)."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.truncate(TRUNCATE_FILE_BYTES)
    code = textwrap.dedent(f"""
        import os, threading, time
        from wcache.store import StoreError
        from wcache.store.fingerprint import digest_file
        def cut():
            time.sleep({TRUNCATE_DELAY_S})
            os.truncate({str(path)!r}, 4096)
        threading.Thread(target=cut).start()
        try:
            digest_file({str(path)!r})
            print("NO-ERROR")
        except StoreError as e:
            print("CODE", e.code)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (0, "CODE checkpoint-changed") == (proc.returncode, proc.stdout.strip()), proc.stderr


def test_swapped_shard_after_stats_is_refused(tmp_path):
    """An atomic rename of another shard over the stat-ed one (same size, other bytes)
    is refused by verify_checkpoint_unchanged, naming the shard."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    before = fp.checkpoint_stats(str(d))
    fp.verify_checkpoint_unchanged(str(d), before)  # unchanged: no error
    _write_checkpoint(tmp_path / "b", 2.0)
    os.replace(tmp_path / "b" / "model.safetensors", d / "model.safetensors")
    with pytest.raises(StoreError, match=r"model\.safetensors") as err:
        fp.verify_checkpoint_unchanged(str(d), before)
    assert "checkpoint-changed" == err.value.code


def test_swapped_directory_after_stats_is_refused(tmp_path):
    """Renaming a whole other checkpoint directory into place is refused too."""
    d = tmp_path / "m"
    _write_checkpoint(d, 1.0)
    before = fp.checkpoint_stats(str(d))
    _write_checkpoint(tmp_path / "b", 1.0)  # identical bytes, other files
    os.rename(d, tmp_path / "old")
    os.rename(tmp_path / "b", d)
    with pytest.raises(StoreError, match="changed while it was loaded") as err:
        fp.verify_checkpoint_unchanged(str(d), before)
    assert "checkpoint-changed" == err.value.code
