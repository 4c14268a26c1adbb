"""Issue 11 in-process: the daemon's key describes the bytes it loaded and every
weight-shaping engine argument, install checks shapes, hashing errors follow the
fallback rule, and a duplicated lm_head is restored tied (no engine start)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from tests.helpers.vllm_loader import meta_model
from wcache.core import Target
from wcache.daemon.process import ENGINE_ARGS

pytestmark = pytest.mark.slow

ROPE_OVERRIDE = {
    "rope_scaling": {"rope_type": "yarn", "factor": 4},
    "max_position_embeddings": 131072,
}
#: A parallel layout of one rank, for keys built without vLLM's world.
ONE_RANK = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0}


def _config(path, *extra):
    from wcache.vllm.build import engine_config

    return engine_config(str(path), [*ENGINE_ARGS, *extra])


@pytest.fixture(autouse=True)
def forget_meta_ropes():
    """vLLM caches rotary embeddings process-wide; drop those a meta-device build of
    a test added, so a later real load in this process does not reuse them."""
    from vllm.model_executor.layers import rotary_embedding

    before = set(rotary_embedding._ROPE_DICT)
    yield
    for k in set(rotary_embedding._ROPE_DICT) - before:
        del rotary_embedding._ROPE_DICT[k]


@pytest.fixture
def private_caches(tmp_path, monkeypatch):
    """A cold digest cache and a private daemon registry for one test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


def _copy_checkpoint(tmp_path, name="ckpt"):
    from wcache.testing.fixtures import build

    return shutil.copytree(build("bf16"), tmp_path / name)


def test_rope_override_is_a_key_mismatch_naming_hf_overrides(vllm_cfg, tmp_path, sock_dir):
    """A daemon without hf_overrides and an engine with the yarn rope override share a
    socket, and the daemon refuses the engine naming model_config.hf_overrides."""
    from wcache.store import DaemonServer, Export, KeyMismatch, attach
    from wcache.vllm.key import build_key, device_id

    with_override = _config(
        vllm_cfg.model_config.model, "--hf-overrides", json.dumps(ROPE_OVERRIDE)
    )
    target = Target.detect("cpu", env={})
    daemon_key = build_key(vllm_cfg.model_config, ONE_RANK, [], target)
    engine_key = build_key(with_override.model_config, ONE_RANK, [], target)
    dev = device_id(torch.device("cpu"), vllm_cfg.model_config, ONE_RANK)
    assert dev == device_id(torch.device("cpu"), with_override.model_config, ONE_RANK)
    export = Export(tensors={"w": torch.zeros(4)}, kinds={"w": "param"})
    with (
        DaemonServer(export, daemon_key, socket_dir=sock_dir, device_id=dev),
        pytest.raises(KeyMismatch, match="hf_overrides") as err,
    ):
        attach(engine_key, socket_dir=sock_dir, device_id=dev)
    assert "model_config.hf_overrides" in err.value.fields
    assert "model_config.hf_config" in err.value.fields
    assert "key-mismatch" == err.value.code


def test_key_ignores_the_checkpoint_path(vllm_cfg, tmp_path, private_caches):
    """A byte-identical copy of the checkpoint at another path has the same key."""
    from wcache.vllm.key import build_key

    copy = _copy_checkpoint(tmp_path)
    target = Target.detect("cpu", env={})
    assert build_key(vllm_cfg.model_config, ONE_RANK, [], target) == build_key(
        _config(copy).model_config, ONE_RANK, [], target
    )


def _cos_sin_cache_name(model) -> str:
    return next(
        n
        for n, _ in model.named_buffers(remove_duplicate=False)
        if n.endswith("rotary_emb.cos_sin_cache")
    )


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_wrong_shape_or_dtype_buffer_is_model_mismatch(vllm_cfg, change):
    """A daemon buffer whose shape or dtype differs from the engine's meta model (a
    131072-row rope cache for a 8192-position engine) is model-mismatch naming it,
    and the model is left untouched."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import ModelMismatch, install_tensors_

    with set_current_vllm_config(vllm_cfg):
        model = meta_model(vllm_cfg)
    name = _cos_sin_cache_name(model)
    mine = dict(model.named_buffers(remove_duplicate=False))[name]
    shape = (131072, mine.shape[1]) if change == "shape" else tuple(mine.shape)
    dtype = mine.dtype if change == "shape" else torch.float64
    wrong = {
        name: torch.zeros(shape, dtype=dtype),
        "model.norm.weight": torch.ones(576, dtype=dtype),
    }
    with pytest.raises(ModelMismatch, match=name.replace(".", r"\.")) as err:
        install_tensors_(model, wrong, {name: "buffer", "model.norm.weight": "param"}, {}, {}, [])
    assert "model-mismatch" == err.value.code
    assert dict(model.named_buffers(remove_duplicate=False))[name] is mine  # nothing installed


def test_checkpoint_swapped_during_load_is_refused(vllm_cfg, tmp_path, private_caches):
    """Replacing the shard by another checkpoint's (atomic rename) after the daemon read
    it is refused with checkpoint-changed instead of exporting A's bytes under B's key."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from wcache.store import CheckpointChanged
    from wcache.testing.fixtures import build_variant
    from wcache.vllm.build import build_export

    a = _copy_checkpoint(tmp_path, "a")
    b = build_variant(a, tmp_path / "b")
    cfg = _config(a)
    real_load = DefaultModelLoader.load_weights

    def load_then_swap(self, model, model_config):
        real_load(self, model, model_config)
        (b / "model.safetensors").rename(a / "model.safetensors")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DefaultModelLoader, "load_weights", load_then_swap)
        with (
            set_current_vllm_config(cfg),
            pytest.raises(CheckpointChanged, match="model.safetensors") as err,
        ):
            build_export(cfg, progress=False)
    assert "checkpoint-changed" == err.value.code


@pytest.mark.parametrize("fallback", [True, False])
def test_shard_truncated_while_hashed_follows_the_fallback_rule(
    vllm_cfg, tmp_path, private_caches, fallback, sock_dir
):
    """A shard that shrinks while the engine hashes it: fallback=true loads from disk
    logging reason checkpoint-changed; fallback=false raises RestoreFailed with it."""
    from vllm.config import set_current_vllm_config

    import wcache.vllm.loader as loader_mod
    from wcache.store import fingerprint as fp

    ckpt = _copy_checkpoint(tmp_path)
    cfg = _config(ckpt)
    shard = ckpt / "model.safetensors"
    real_read = fp._read_chunk if hasattr(fp, "_read_chunk") else None
    shard_ino = shard.stat().st_ino

    def read_then_truncate(fd, buf, offset):
        n = real_read(fd, buf, offset)
        if os.fstat(fd).st_ino == shard_ino and shard.stat().st_size > offset + n:
            os.truncate(shard, 0)  # a trainer rewriting the shard in place
        return n

    timing = tmp_path / "timing.jsonl"
    load_config = dataclasses.replace(
        cfg.load_config,
        load_format="wcache",
        model_loader_extra_config={
            "fallback": fallback,
            "socket_dir": sock_dir,
            "timing_file": str(timing),
        },
    )
    sentinel = torch.nn.Linear(1, 1)

    class StubDisk:
        def load_model(self, *args, **kwargs):
            return sentinel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp, "_read_chunk", read_then_truncate, raising=False)
        mp.setattr(loader_mod.WcacheModelLoader, "_disk_loader", lambda self: StubDisk())
        with set_current_vllm_config(cfg):
            loader = loader_mod.WcacheModelLoader(load_config)
            if fallback:
                assert loader.load_model(cfg, cfg.model_config) is sentinel
                record = json.loads(timing.read_text().splitlines()[-1])
                assert ("fallback", "checkpoint-changed") == (record["phase"], record["reason"])
            else:
                with pytest.raises(loader_mod.RestoreFailed, match="checkpoint-changed") as err:
                    loader.load_model(cfg, cfg.model_config)
                assert "checkpoint-changed" == err.value.code


def test_duplicated_lm_head_is_restored_tied(vllm_cfg, tmp_path, private_caches, sock_dir):
    """A checkpoint that stores lm_head.weight beside the embedding with
    tie_word_embeddings=true: vLLM's disk load ties them, and so does the daemon's
    export and the engine's restore (one tensor object, one storage)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import wcache.vllm.loader as loader_mod
    from wcache.store import DaemonServer
    from wcache.testing.fixtures import build, build_with_lm_head
    from wcache.vllm.build import build_export
    from wcache.vllm.key import device_id, parallel_layout

    ckpt = build_with_lm_head(build("bf16"), tmp_path / "dup")
    cfg = _config(ckpt)
    assert cfg.model_config.word_embeddings_untied_by_checkpoint
    with set_current_vllm_config(cfg):
        disk = DefaultModelLoader(cfg.load_config).load_model(cfg, cfg.model_config)
    assert disk.lm_head.weight is disk.model.embed_tokens.weight  # vLLM's disk load re-ties
    del disk
    cfg = _config(ckpt)
    with set_current_vllm_config(cfg):
        export, key = build_export(cfg, progress=False)
    assert "model.embed_tokens.weight" == export.aliases.get("lm_head.weight")
    dev = device_id(torch.device("cpu"), cfg.model_config, parallel_layout())
    load_config = dataclasses.replace(
        cfg.load_config,
        load_format="wcache",
        model_loader_extra_config={"fallback": False, "socket_dir": sock_dir},
    )
    cfg = _config(ckpt)
    with (
        DaemonServer(export, key, socket_dir=sock_dir, device_id=dev),
        set_current_vllm_config(cfg),
    ):
        del export
        model = loader_mod.WcacheModelLoader(load_config).load_model(cfg, cfg.model_config)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model._wcache_attachment.close()


def _engine_key_and_device(cfg, load_config, loader_mod):
    """The key and device id the engine's loader computes for ``cfg`` (one load against
    no daemon, its disk fallback stubbed)."""
    seen = {}
    real_key, real_dev = loader_mod.build_key, loader_mod.device_id

    def spy_key(*args, **kwargs):
        seen["key"] = real_key(*args, **kwargs)
        seen["key_args"] = (args, kwargs)
        return seen["key"]

    def spy_dev(*args, **kwargs):
        seen["device"] = real_dev(*args, **kwargs)
        return seen["device"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader_mod, "build_key", spy_key)
        mp.setattr(loader_mod, "device_id", spy_dev)
        loader_mod.WcacheModelLoader(load_config).load_model(cfg, cfg.model_config)
    return seen


@pytest.mark.parametrize("daemon_vllm", ["0.33.0", "0.31.0"])
@pytest.mark.parametrize("fallback", [True, False])
def test_engine_and_daemon_of_other_vllm_releases_refuse_each_other(
    vllm_cfg, tmp_path, private_caches, fallback, daemon_vllm, sock_dir
):
    """A daemon whose key was built under another vLLM release (everything else equal)
    refuses this engine with key-mismatch naming both vLLM versions; the engine
    follows the fallback rule: fallback=true loads from disk logging key-mismatch,
    fallback=false raises RestoreFailed with both versions in the message."""
    from vllm.config import set_current_vllm_config

    import wcache.vllm.loader as loader_mod
    from wcache.store import DaemonServer, Export
    from wcache.vllm import compat
    from wcache.vllm import key as key_mod

    ckpt = _copy_checkpoint(tmp_path)
    cfg = _config(ckpt)
    timing = tmp_path / "timing.jsonl"
    load_config = dataclasses.replace(
        cfg.load_config,
        load_format="wcache",
        model_loader_extra_config={
            "fallback": True,
            "socket_dir": sock_dir,
            "timing_file": str(timing),
        },
    )
    sentinel = torch.nn.Linear(1, 1)

    class StubDisk:
        def load_model(self, *args, **kwargs):
            return sentinel

    engine_vllm = compat.vllm_version()
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(cfg):
        mp.setattr(loader_mod.WcacheModelLoader, "_disk_loader", lambda self: StubDisk())
        seen = _engine_key_and_device(cfg, load_config, loader_mod)
        args, kwargs = seen["key_args"]
        with pytest.MonkeyPatch.context() as other_release:
            other_release.setattr(compat, "vllm_version", lambda: daemon_vllm)
            other_release.setattr(compat.releases, "vllm_version", lambda: daemon_vllm)
            daemon_key = key_mod.build_key(*args, **kwargs)
        assert ["versions"] == seen["key"].diff(daemon_key)
        export = Export(tensors={"w": torch.zeros(4)}, kinds={"w": "param"})
        with DaemonServer(export, daemon_key, socket_dir=sock_dir, device_id=seen["device"]):
            opts = dict(load_config.model_loader_extra_config, fallback=fallback)
            loader = loader_mod.WcacheModelLoader(
                dataclasses.replace(load_config, model_loader_extra_config=opts)
            )
            both = f"vLLM {engine_vllm} (engine) vs {daemon_vllm} (daemon)"
            if fallback:
                assert loader.load_model(cfg, cfg.model_config) is sentinel
                record = json.loads(timing.read_text().splitlines()[-1])
                assert ("fallback", "key-mismatch") == (record["phase"], record["reason"])
            else:
                with pytest.raises(loader_mod.RestoreFailed) as err:
                    loader.load_model(cfg, cfg.model_config)
                assert "key-mismatch" == err.value.code
                assert both in str(err.value)
                assert f'versions.vllm: engine="{engine_vllm}" daemon="{daemon_vllm}"' in str(
                    err.value
                )
