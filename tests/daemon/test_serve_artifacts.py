"""serve's start-up artifact paths in a snapshot directory (issue 24): reading a
rank's ``.startup`` bundle never fails the daemon's start, and rewriting a
rank's snapshot removes that rank's old bundle."""

from __future__ import annotations

import threading
import types

import pytest

from wcache.daemon import serve
from wcache.store import artifacts as art
from wcache.store.snapshot import STARTUP_DIR

RANK = "tp0of1-pp0of1-dp0of1"
LAYOUT = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0}


def _stub_server():
    return types.SimpleNamespace(
        artifacts=None,
        artifacts_state=None,
        artifacts_error=None,
        socket_dir=None,
        _shutdown_requested=threading.Event(),
    )


def test_unreadable_snapshot_tar_does_not_fail_the_daemon_start(tmp_path):
    """A snapshot whose startup.tar is a directory leaves the daemon without a bundle and the reason (artifacts-corrupt, EISDIR) in its state."""
    d = tmp_path / "snap" / STARTUP_DIR / RANK
    d.mkdir(parents=True)
    (d / art.MANIFEST_FILE).write_text('{"format": 1}')
    (d / art.TAR_FILE).mkdir()  # not a file
    server = _stub_server()
    serve._snapshot_artifacts(server, str(tmp_path / "snap"), RANK)
    assert (server.artifacts, server.artifacts_state) == (None, None)
    assert (
        server.artifacts_error.startswith("[artifacts-corrupt]")
        and "[EISDIR]" in server.artifacts_error
    )


def test_rewriting_a_rank_snapshot_removes_its_old_startup_bundle(tmp_path, monkeypatch):
    """_write_rank_snapshot deletes .startup/<rank> before writing the snapshot, keeps other ranks' bundles, and accepts a missing one."""
    from wcache.store import prebuilt, snapshot

    assert serve.snapshot_name(LAYOUT) == RANK
    snap = tmp_path / "snap"
    mine, other = (
        snap / STARTUP_DIR / RANK,
        snap / STARTUP_DIR / "tp1of2",
    )
    for d in (mine, other):
        d.mkdir(parents=True)
        (d / art.MANIFEST_FILE).write_text("{}")
    calls = []
    view = types.SimpleNamespace(tensor="arena", close=lambda: calls.append("closed"))
    monkeypatch.setattr(prebuilt, "served_arena", lambda server: view)
    monkeypatch.setattr(
        snapshot,
        "write_snapshot",
        lambda root, name, tensor, manifest, key, unusable: calls.append(
            (root, name, tensor, mine.exists())
        ),
    )
    server = types.SimpleNamespace(manifest="m", key="k")
    serve._write_rank_snapshot(server, str(snap), LAYOUT)
    assert calls == [(str(snap), RANK, "arena", False), "closed"]
    assert (mine.exists(), (other / art.MANIFEST_FILE).exists()) == (False, True)
    serve._write_rank_snapshot(server, str(snap), LAYOUT)  # nothing to remove now
    assert len(calls) == 4


def test_a_snapshot_dir_that_is_a_file_fails_as_snapshot_write_failed(tmp_path):
    """``--snapshot`` naming a regular file (`wcache serve` refuses it before the load;
    here the rank's write): the documented [snapshot-write-failed] saying the path is
    not a directory (it said an old start-up bundle could not be removed, break16 #7),
    and nothing is written."""
    from wcache.errors import SnapshotWriteFailed

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SnapshotWriteFailed, match=f"{afile} is not a directory") as info:
        serve._write_rank_snapshot(types.SimpleNamespace(), str(afile), LAYOUT)
    assert "bundle" not in str(info.value)
    assert info.value.code == "snapshot-write-failed"
    assert afile.read_text() == ""
