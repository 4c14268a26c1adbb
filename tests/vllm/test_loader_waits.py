"""Every wait of the engine-side loader is bounded by its ``connect_timeout_s``, and
the fallback's timing line counts the whole load phase (in-process, SmolLM2 on
CPU, a fake daemon that answers ``hello`` and then stalls; no engine start)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from tests.helpers.stalled_daemon import stalled_daemon as fake_stalled_daemon
from wcache.store import paths

pytestmark = pytest.mark.slow

#: The engine's connect_timeout_s in these tests (seconds).
CONNECT_TIMEOUT_S = 1.0
#: Slack on a loaded 2-core machine (seconds), far below the 60 s a stalled reply
#: used to wait.
SLACK_S = 5.0


@pytest.fixture
def stalled_daemon(vllm_cfg, sock_dir):
    """A fake daemon on this engine's socket: answers hello, then never answers again."""
    from wcache.vllm.key import device_id, parallel_layout

    path = paths.socket_path(
        sock_dir, device_id(torch.device("cpu"), vllm_cfg.model_config, parallel_layout(), "")
    )
    with fake_stalled_daemon(path):
        yield sock_dir


def test_stalled_daemon_costs_at_most_connect_timeout_and_timing_counts_it(
    vllm_cfg, stalled_daemon, tmp_path
):
    """With a daemon that stalls after hello, the loader falls back to disk after about
    connect_timeout_s, and the fallback timing line counts the wait plus the disk load."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.loader import WcacheModelLoader

    timing = tmp_path / "timing.jsonl"
    load_config = dataclasses.replace(
        vllm_cfg.load_config,
        load_format="wcache",
        model_loader_extra_config={
            "socket_dir": stalled_daemon,
            "fallback": True,
            "connect_timeout_s": CONNECT_TIMEOUT_S,
            "timing_file": str(timing),
        },
    )
    vllm_cfg.compilation_config.static_forward_context.clear()
    t0 = time.perf_counter()
    with set_current_vllm_config(vllm_cfg):
        model = WcacheModelLoader(load_config).load_model(vllm_cfg, vllm_cfg.model_config)
    took = time.perf_counter() - t0
    (record,) = [json.loads(line) for line in timing.read_text().splitlines()]
    assert ("fallback", "daemon-missing") == (record["phase"], record["reason"])
    assert CONNECT_TIMEOUT_S * 0.9 <= record["before_fallback_s"] < CONNECT_TIMEOUT_S + SLACK_S
    assert record["disk_s"] > 0
    assert record["seconds"] == pytest.approx(
        record["before_fallback_s"] + record["disk_s"], abs=0.01
    )
    assert record["seconds"] <= took
    assert [] == [n for n, p in model.named_parameters() if p.device.type == "meta"]
