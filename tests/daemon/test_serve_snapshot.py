"""serve's use of a rank's snapshot directory around the load: a snapshot found stale
or corrupt is handed to the rank's write, which removes it before writing its
replacement, and a rank that started from its snapshot removes what a killed write
left there (``--snapshot``) or says it is there (``--from-snapshot``) (break16 #2, #6)."""

from __future__ import annotations

import logging
import os
import types

import pytest
import safetensors.torch as st

from wcache.daemon import serve
from wcache.store import CacheKey, DaemonServer
from wcache.store import snapshot as snap_mod
from wcache.store.prebuilt import served_arena
from wcache.testing.store import BASE_KEY, synthetic_export

RANK = "tp0of1-pp0of1-dp0of1"
LAYOUT = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": 0}
CONFIG = types.SimpleNamespace(device_config=types.SimpleNamespace(device_type="cpu"))


@pytest.fixture
def served(sock_dir):
    """A daemon of BASE_KEY serving the synthetic export, and a second one of it (the
    server a checkpoint load would build)."""
    key = CacheKey(BASE_KEY)
    servers = [
        DaemonServer(synthetic_export(), key, socket_dir=sock_dir, device_id=f"cpu-{i}")
        for i in range(2)
    ]
    yield servers
    for s in servers:
        s.stop()


def _write(server, root):
    view = served_arena(server)
    try:
        return snap_mod.write_snapshot(root, RANK, view.tensor, server.manifest, server.key)
    finally:
        view.close()


def test_a_snapshot_whose_arena_is_corrupt_is_removed_before_its_replacement(
    served, sock_dir, tmp_path, monkeypatch, caplog
):
    """--snapshot over a snapshot of this key whose arena fails its digest: the daemon
    loads the checkpoint, says the old one is removed first, and the rank's write
    removes it before writing the new arena (it stayed until the new one was
    complete, so a volume sized for one snapshot never took the new one)."""
    first, loaded = served
    root = str(tmp_path / "snap")
    path = _write(first, root)
    apath = os.path.join(path, snap_mod.ARENA_FILE)
    with open(apath, "r+b") as f:
        f.seek(os.path.getsize(apath) - 100)
        f.write(b"\xff")
    monkeypatch.setattr(serve.build, "expected_key", lambda config: first.key)
    monkeypatch.setattr(serve, "parallel_layout", lambda: LAYOUT)
    monkeypatch.setattr(serve.build, "build_server", lambda *a, **k: loaded)
    with caplog.at_level(logging.WARNING, logger="wcache.daemon"):
        server, origin, unusable = serve.build_ready_server(
            CONFIG, socket_dir=sock_dir, device_id="cpu-t", snapshot=root
        )
    assert (loaded, "checkpoint") == (server, origin)
    assert unusable is not None and path == unusable.path
    assert f"(the old one at {path} is removed first)" in caplog.text
    seen = []

    def dying_save(tensors, filename, metadata=None):
        seen.append(os.path.lexists(path))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", dying_save)
    with pytest.raises(OSError, match=f"nothing of {RANK} remains"):
        serve._write_rank_snapshot(loaded, root, LAYOUT, unusable)
    assert [False] == seen and [] == os.listdir(root)


@pytest.mark.parametrize("own", [True, False])
def test_a_rank_started_from_its_snapshot_tidies_a_killed_writes_leftovers(
    served, tmp_path, caplog, own
):
    """After a start from the snapshot, the rank's .tmp-/.old- dirs of a killed write
    are removed with --snapshot (only a write removed them, and such a daemon never
    writes); --from-snapshot leaves the directory as it is and says what stays."""
    root = str(tmp_path / "snap")
    _write(served[0], root)
    left = os.path.join(root, f"{snap_mod.TEMP_PREFIX}{RANK}-killed")
    os.makedirs(left)
    with caplog.at_level(logging.INFO, logger="wcache.daemon"):
        serve._tidy_snapshot_dir(root, RANK, own=own)
    assert (not own) == os.path.exists(left)
    if not own:
        assert f"{left} left by a snapshot write that did not finish" in caplog.text
        assert (
            f"start with --snapshot {root} where the daemon may write it, which removes them"
            in (caplog.text)
        )
