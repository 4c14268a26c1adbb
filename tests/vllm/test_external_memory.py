"""Issue 12 item 1: the loader tells vLLM's GPU worker how many weight bytes live in
the daemon (``get_external_weight_memory``), and vLLM's own memory check
(``vllm.v1.worker.utils.request_memory``) then admits an engine it refuses without
it. In-process, with vLLM's config objects and a daemon on a private socket."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = pytest.mark.slow

#: The simulated card holds the daemon's arena as this fraction of its memory:
#: above 1 - gpu_memory_utilization (0.1), where vLLM refuses an engine that does
#: not know the weights are external.
ARENA_FRACTION_OF_CARD = 0.2
#: vLLM's default gpu_memory_utilization.
UTILIZATION = 0.9


def _loader(cfg, **extra):
    from wcache.vllm.loader import WcacheModelLoader

    return WcacheModelLoader(
        dataclasses.replace(cfg.load_config, load_format="wcache", model_loader_extra_config=extra)
    )


def _daemon_key(cfg, plans=("attention:x@1",), **override):
    from wcache.store import CacheKey
    from wcache.vllm.key import build_key, parallel_layout
    from wcache.vllm.probe import host_target

    key = build_key(
        cfg.model_config, parallel_layout(), list(plans), host_target(torch.device("cpu"))
    )
    return CacheKey({**key.fields, **override}) if override else key


def _serve(cfg, key, sock_dir):
    from wcache.store import DaemonServer, Export
    from wcache.vllm.key import device_id, parallel_layout

    export = Export(tensors={"w": torch.zeros(3, 1000)}, kinds={"w": "param"})
    dev = device_id(torch.device("cpu"), cfg.model_config, parallel_layout())
    return DaemonServer(export, key, socket_dir=sock_dir, device_id=dev)


def test_no_daemon_counts_zero(vllm_cfg, tmp_path, sock_dir):
    """Without a daemon the load falls back to disk: 0 external bytes."""
    assert 0 == _loader(vllm_cfg, socket_dir=sock_dir).get_external_weight_memory(vllm_cfg)


def test_matching_daemon_counts_its_arena(vllm_cfg, tmp_path, sock_dir):
    """A daemon whose key matches (plans aside, which need the model) counts its arena
    in zero_copy mode and nothing in copy mode."""
    with _serve(vllm_cfg, _daemon_key(vllm_cfg), sock_dir) as server:
        assert server.nbytes >= 3 * 1000 * 4
        got = _loader(vllm_cfg, socket_dir=sock_dir).get_external_weight_memory(vllm_cfg)
        assert server.nbytes == got
        assert 0 == _loader(vllm_cfg, socket_dir=sock_dir, mode="copy").get_external_weight_memory(
            vllm_cfg
        )


def test_daemon_of_another_configuration_counts_zero(vllm_cfg, tmp_path, sock_dir):
    """A daemon on this rank's socket whose key differs (another dtype) will be refused
    at load, so nothing is external."""
    with _serve(vllm_cfg, _daemon_key(vllm_cfg, dtype="torch.float16"), sock_dir):
        assert 0 == _loader(vllm_cfg, socket_dir=sock_dir).get_external_weight_memory(vllm_cfg)


def test_vllm_request_memory_admits_the_engine_with_the_daemons_bytes(vllm_cfg, tmp_path, sock_dir):
    """vLLM's own request_memory on a card where the daemon holds 20%: without the hook
    (0 bytes) it refuses at utilization 0.9; with the hook's answer it grants the
    budget minus the arena."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    with _serve(vllm_cfg, _daemon_key(vllm_cfg), sock_dir) as server:
        external = _loader(vllm_cfg, socket_dir=sock_dir).get_external_weight_memory(vllm_cfg)
    total = int(server.nbytes / ARENA_FRACTION_OF_CARD)
    snapshot = MemorySnapshot(
        total_memory=total, free_memory=total - server.nbytes, device="cpu", auto_measure=False
    )
    cache_config = CacheConfig(gpu_memory_utilization=UTILIZATION)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(snapshot, cache_config, 0)
    assert math.ceil(total * UTILIZATION) - server.nbytes == request_memory(
        snapshot, cache_config, external
    )


@pytest.mark.parametrize("freeze", [True, False])
def test_gc_heap_frozen_before_the_load_unless_turned_off(vllm_cfg, tmp_path, freeze, sock_dir):
    """vLLM calls get_external_weight_memory right before its timed load phase: with
    ``freeze_gc`` (the default) the worker's gc heap is frozen there (the phase's
    three full collections then skip it); ``freeze_gc=false`` leaves gc alone."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        extra = {"socket_dir": sock_dir}
        if not freeze:
            extra["freeze_gc"] = "false"  # as vllm serve's command line passes it
        assert 0 == _loader(vllm_cfg, **extra).get_external_weight_memory(vllm_cfg)
        assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()
