"""Prepared snapshots (write, restart, refusals, atomicity) and seeding a daemon
from a peer daemon over gloo, at the store level (no vLLM)."""

import os
import shutil

import pytest
import torch

from wcache.store import CacheKey, DaemonServer, KeyMismatch, attach, daemon_status, socket_path
from wcache.store import snapshot as snap_mod
from wcache.store.prebuilt import served_arena
from wcache.store.seed import SeedFailed, SeedSource, seed_arena
from wcache.store.snapshot import (
    ARENA_FILE,
    MANIFEST_FILE,
    SnapshotCorrupt,
    SnapshotMissing,
    SnapshotStale,
    check_key,
    list_snapshots,
    open_snapshot,
    snapshot_arena,
    write_snapshot,
)
from wcache.testing.store import (
    BASE_KEY,
    assert_serves_export,
    start_daemon,
    stop_daemon,
    synthetic_export,
)

NAME = "tp0of1-pp0of1-dp0of1"


def _write(server, root, name=NAME):
    view = served_arena(server)
    try:
        return write_snapshot(root, name, view.tensor, server.manifest, server.key)
    finally:
        view.close()


@pytest.fixture
def snap_root(tmp_path):
    return str(tmp_path / "snap")


def test_snapshot_restart_serves_the_same_bytes(daemon, key, sock_dir, snap_root):
    """A daemon started from a snapshot serves the exported tensors bit for bit, same manifest."""
    path = _write(daemon, snap_root)
    assert sorted(os.listdir(path)) == sorted(
        [ARENA_FILE, MANIFEST_FILE, "key.json", "digests.json"]
    )
    assert [NAME] == list_snapshots(snap_root)
    snap = open_snapshot(snap_root, NAME)
    check_key(snap, key)
    server = DaemonServer(snapshot_arena(snap), key, socket_dir=sock_dir, device_id="cpu-b").start()
    try:
        assert daemon.manifest == server.manifest and "shm" == server.transport
        assert_serves_export(key, sock_dir, "cpu-b")
    finally:
        server.stop()


def test_snapshot_file_is_plain_safetensors(daemon, snap_root):
    """safetensors.safe_open reads arena.safetensors as one U8 tensor equal to the daemon's arena."""
    from safetensors import safe_open

    path = _write(daemon, snap_root)
    with safe_open(os.path.join(path, ARENA_FILE), framework="pt") as f:
        data = f.get_tensor("arena")
        assert daemon.key.digest == f.metadata()["key_digest"]
    view = served_arena(daemon)
    try:
        assert torch.equal(view.tensor, data)
    finally:
        view.close()


def test_stale_snapshot_is_refused_naming_the_fields(daemon, snap_root):
    """A snapshot of another checkpoint digest and tp layout is refused with snapshot-stale naming both."""
    _write(daemon, snap_root)
    other = CacheKey({**BASE_KEY, "checkpoint": "beef", "tp": [2, 0]})
    with pytest.raises(SnapshotStale) as ei:
        check_key(open_snapshot(snap_root, NAME), other)
    assert ["checkpoint", "tp"] == ei.value.fields and "snapshot-stale" == ei.value.code
    assert isinstance(ei.value, KeyMismatch) and "--snapshot" in str(ei.value)


def test_corrupted_arena_byte_is_refused_and_nothing_is_served(daemon, key, sock_dir, snap_root):
    """One flipped byte in the arena file fails the digest check; the device is free again afterwards."""
    path = _write(daemon, snap_root)
    apath = os.path.join(path, ARENA_FILE)
    size = os.path.getsize(apath)
    with open(apath, "r+b") as f:
        f.seek(size - 100)
        b = f.read(1)
        f.seek(size - 100)
        f.write(bytes([b[0] ^ 0x01]))
    snap = open_snapshot(snap_root, NAME)  # the small files are intact
    with pytest.raises(SnapshotCorrupt, match="does not match its digest"):
        DaemonServer(snapshot_arena(snap), key, socket_dir=sock_dir, device_id="cpu-c")
    # the failed build released the device lock: a daemon from the checkpoint starts there
    DaemonServer(synthetic_export(), key, socket_dir=sock_dir, device_id="cpu-c").stop()


@pytest.mark.parametrize("damage", ["manifest", "truncate", "digests"])
def test_damaged_small_files_are_refused(daemon, snap_root, damage):
    """A changed manifest, a truncated arena file or an unreadable digests.json is snapshot-corrupt."""
    path = _write(daemon, snap_root)
    if damage == "manifest":
        with open(os.path.join(path, MANIFEST_FILE), "a") as f:
            f.write(" ")
    elif damage == "truncate":
        apath = os.path.join(path, ARENA_FILE)
        os.truncate(apath, os.path.getsize(apath) - 4096)
    else:
        with open(os.path.join(path, "digests.json"), "w") as f:
            f.write("{")
    with pytest.raises(SnapshotCorrupt) as ei:
        open_snapshot(snap_root, NAME)
    assert "snapshot-corrupt" == ei.value.code and "write" in str(ei.value)


def test_unfinished_write_is_ignored(daemon, snap_root):
    """A temp dir from a crashed write (even a complete-looking one) and a dir without digests are never read."""
    path = _write(daemon, snap_root)
    tmp = os.path.join(snap_root, f"{snap_mod.TEMP_PREFIX}{NAME}-crashed")
    shutil.copytree(path, tmp)
    shutil.rmtree(path)
    assert [] == list_snapshots(snap_root)
    with pytest.raises(SnapshotMissing, match="no directory"):
        open_snapshot(snap_root, NAME)
    shutil.copytree(tmp, path)
    os.unlink(os.path.join(path, "digests.json"))
    with pytest.raises(SnapshotMissing, match="unfinished write"):
        open_snapshot(snap_root, NAME)


def test_a_rank_folder_or_a_file_given_as_the_snapshot_names_what_to_give(daemon, snap_root):
    """--from-snapshot given one rank's folder (it holds digests.json) or a file of it
    is refused naming the directory to give, never suggesting a --snapshot there."""
    path = _write(daemon, snap_root)
    with pytest.raises(SnapshotMissing) as ei:
        open_snapshot(path, NAME)
    assert f"`--from-snapshot {os.path.normpath(snap_root)}`" in str(ei.value)
    assert "--snapshot " not in str(ei.value)
    with pytest.raises(SnapshotMissing) as ei:
        open_snapshot(os.path.join(path, ARENA_FILE), NAME)
    assert f"`--from-snapshot {os.path.normpath(snap_root)}`" in str(ei.value)  # break11 #10
    assert "--snapshot " not in str(ei.value)
    stray = os.path.join(snap_root, "notes.txt")
    with open(stray, "w") as f:
        f.write("not a snapshot")
    with pytest.raises(SnapshotMissing) as ei:
        open_snapshot(stray, NAME)
    assert "is a file: give the snapshot directory" in str(ei.value)
    assert "--snapshot " not in str(ei.value).replace("`--snapshot` wrote", "")


def _dying_save(seen, final):
    """A safetensors ``save_file`` that records whether ``final`` is still in place,
    writes a little, then fails as a full disk does."""

    def save(tensors, filename, metadata=None):
        seen.append(os.path.lexists(final))
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(28, "No space left on device")

    return save


def test_failed_overwrite_keeps_the_old_snapshot_of_its_key(daemon, key, snap_root, monkeypatch):
    """A write that dies mid-file leaves the previous snapshot of the same key intact
    and no temp dir, and its message names that snapshot and the space it holds; a
    good write then replaces it."""
    import safetensors.torch as st

    path = _write(daemon, snap_root)
    seen: list[bool] = []
    monkeypatch.setattr(st, "save_file", _dying_save(seen, path))
    with pytest.raises(OSError, match="No space") as ei:
        _write(daemon, snap_root)
    assert [True] == seen and [NAME] == os.listdir(snap_root)  # no temp dir left behind
    assert "snapshot-write-failed" == ei.value.code
    assert f"still in {snap_root}: {path} (0.1 MiB); deleting what" in str(ei.value)
    assert key == open_snapshot(snap_root, NAME).key
    monkeypatch.undo()
    _write(daemon, snap_root)
    assert [NAME] == os.listdir(snap_root)  # the replaced one is gone too
    assert key == open_snapshot(snap_root, NAME).key


def test_an_old_snapshot_that_cannot_be_removed_is_named_by_the_failed_write(
    daemon, sock_dir, snap_root, monkeypatch, caplog
):
    """A stale snapshot the write cannot move aside (a read-only mount, an immutable
    folder) fails the write naming that folder and its MiB, not "the snapshot of this
    key" nor "no older snapshot", and leaves no empty .old dir (break17 #3); files of a
    leftover that cannot be removed are logged with their error, not ignored (break17
    #4)."""
    import errno

    path = _write(daemon, snap_root)
    other = DaemonServer(
        synthetic_export(seed=1),
        CacheKey({**BASE_KEY, "checkpoint": "beef"}),
        socket_dir=sock_dir,
        device_id="cpu-o",
    )
    rename = os.rename

    def read_only(src, dst, *a, **k):
        if src == path:
            raise OSError(errno.EROFS, "Read-only file system", src)
        return rename(src, dst, *a, **k)

    try:
        monkeypatch.setattr(os, "rename", read_only)
        with pytest.raises(OSError, match="Read-only") as ei:
            _write(other, snap_root)
        assert f"still in {snap_root}: {path} (0.1 MiB)" in str(ei.value)
        assert [NAME] == os.listdir(snap_root)  # no empty .old-* left
        monkeypatch.undo()
        stuck = os.path.join(snap_root, f".old-{NAME}-x")  # a removal that did not finish
        os.makedirs(stuck)
        with open(os.path.join(stuck, "arena.safetensors"), "w") as f:
            f.write("x")

        def immutable(p, *a, **k):  # as chattr +i: even root cannot unlink it
            raise PermissionError(errno.EPERM, "Operation not permitted", p)

        with monkeypatch.context() as m, caplog.at_level("WARNING", logger="wcache.store"):
            m.setattr(os, "unlink", immutable)
            snap_mod._remove_leftovers(snap_root, NAME)
        assert f"could not remove {stuck}: " in caplog.text and "remove it by hand" in caplog.text
    finally:
        other.stop()


@pytest.mark.parametrize("old", ["other-key", "corrupt-key-file", "unfinished"])
def test_a_snapshot_that_cannot_serve_the_key_is_removed_before_the_write(
    daemon, sock_dir, snap_root, monkeypatch, old
):
    """The rank's snapshot of another key (stale), a corrupt or an unfinished one is
    removed before its replacement is written, so a volume sized for one snapshot
    takes the new one; a failed write says nothing of the rank remains (break16 #2: the
    stale one stayed, and every start failed with ENOSPC)."""
    import safetensors.torch as st

    path = _write(daemon, snap_root)
    if old == "corrupt-key-file":
        with open(os.path.join(path, "key.json"), "a") as f:
            f.write(" ")
    elif old == "unfinished":
        os.unlink(os.path.join(path, "digests.json"))
    other_key = CacheKey({**BASE_KEY, "checkpoint": "beef"}) if old == "other-key" else None
    other = DaemonServer(
        synthetic_export(seed=1), other_key or daemon.key, socket_dir=sock_dir, device_id="cpu-o"
    )
    try:
        seen: list[bool] = []
        monkeypatch.setattr(st, "save_file", _dying_save(seen, path))
        with pytest.raises(OSError, match="No space") as ei:
            _write(other, snap_root)
        assert [False] == seen  # gone before the arena's bytes were written
        assert [] == os.listdir(snap_root)  # nor a temp nor an .old dir
        assert f"nothing of {NAME} remains in {snap_root}" in str(ei.value)
        monkeypatch.undo()
        _write(other, snap_root)
        snap = open_snapshot(snap_root, NAME)
        assert other.key == snap.key and other.manifest == snap.manifest
    finally:
        other.stop()


def test_a_snapshot_whose_arena_failed_its_digest_is_removed_before_the_write(
    daemon, snap_root, monkeypatch
):
    """The write given the snapshot the daemon found corrupt (`unusable`) removes it
    first when it is still that very write; one that another writer has put in its
    place since (same key, opens) is kept until the replacement is complete."""
    import safetensors.torch as st

    path = _write(daemon, snap_root)
    found = open_snapshot(snap_root, NAME)
    seen: list[bool] = []
    monkeypatch.setattr(st, "save_file", _dying_save(seen, path))
    view = served_arena(daemon)
    try:
        args = (snap_root, NAME, view.tensor, daemon.manifest, daemon.key)
        with pytest.raises(OSError, match="No space"):
            write_snapshot(*args, unusable=found)
        assert [False] == seen and [] == os.listdir(snap_root)
        monkeypatch.undo()
        write_snapshot(*args)  # another writer's, after the daemon looked
        monkeypatch.setattr(st, "save_file", _dying_save(seen, path))
        with pytest.raises(OSError, match="No space"):
            write_snapshot(*args, unusable=found)
    finally:
        view.close()
    assert [False, True] == seen and [NAME] == os.listdir(snap_root)
    assert daemon.key == open_snapshot(snap_root, NAME).key


def test_gloo_seeding_between_two_daemons(sock_dir, key):
    """A daemon seeded over gloo from a daemon subprocess serves identical bytes; the source keeps serving."""
    src = start_daemon(sock_dir, "cpu-src", extra_args=("--seed-source",))
    try:
        src_sock = socket_path(sock_dir, "cpu-src")
        with attach(key, socket_dir=sock_dir, device_id="cpu-src"):  # an engine holds the source
            receiver = DaemonServer(
                seed_arena(src_sock, key), key, socket_dir=sock_dir, device_id="cpu-dst"
            ).start()
            try:
                assert_serves_export(key, sock_dir, "cpu-dst")
                st = daemon_status(src_sock)
                assert 1 == st["attachments_active"] and st["invalidated"] is None
            finally:
                receiver.stop()
        assert_serves_export(key, sock_dir, "cpu-src")  # still serving after it seeded
        # refusals: another key (named), and a digest that differs
        with pytest.raises(KeyMismatch, match="receiver=.*source=.*start the receiver with") as ei:
            seed_arena(src_sock, CacheKey({**BASE_KEY, "dtype": "float16"}))
        assert ["dtype"] == ei.value.fields
    finally:
        stop_daemon(src)


@pytest.mark.parametrize("source_class", ["full", "lean"])
@pytest.mark.parametrize("receiver_vllm,source_vllm", [("0.32.0", "0.33.0"), ("0.33.0", "0.32.0")])
def test_seeding_between_vllm_releases_is_refused_naming_both(
    sock_dir, source_class, receiver_vllm, source_vllm
):
    """A seed between daemons of different vLLM releases (keys equal but for versions.vllm) is a key-mismatch led by both versions, from the full and the lean seed source alike."""
    from wcache.store.lean import LeanSeedSource

    versions = {"wcache": "0.1.0", "torch": "2.13.0+cpu"}
    source_key = CacheKey({**BASE_KEY, "versions": {**versions, "vllm": source_vllm}})
    receiver_key = CacheKey({**BASE_KEY, "versions": {**versions, "vllm": receiver_vllm}})
    server = DaemonServer(
        synthetic_export(), source_key, socket_dir=sock_dir, device_id="cpu-s"
    ).start()
    server.seed_source = SeedSource(server) if source_class == "full" else LeanSeedSource(server, 0)
    try:
        with pytest.raises(KeyMismatch) as ei:
            seed_arena(server.socket_path, receiver_key)
    finally:
        server.stop()
    assert ["versions"] == ei.value.fields
    message = str(ei.value)
    lead = message.split(f"daemon on {server.socket_path}: ", 1)[-1]  # the source's own message
    assert lead.startswith(
        f"the receiver and the source run different releases (vLLM "
        f"{receiver_vllm} (receiver) vs {source_vllm} (source)): "
    ), message
    assert f'versions.vllm: receiver="{receiver_vllm}" source="{source_vllm}"' in message


def test_seeding_refuses_a_digest_mismatch(sock_dir, key, monkeypatch):
    """When the receiver's digest of what arrived differs from the source's, nothing is served."""
    from wcache.store import seed as seed_mod

    server = DaemonServer(synthetic_export(), key, socket_dir=sock_dir, device_id="cpu-s").start()
    server.seed_source = SeedSource(server)
    try:
        server.seed_source.digest(served_arena(server).tensor)  # the source's digest, cached
        monkeypatch.setattr(seed_mod, "arena_digest", lambda t: ("blake3", "00" * 32))
        with pytest.raises(SeedFailed, match="does not match the source's digest"):
            DaemonServer(
                seed_arena(server.socket_path, key), key, socket_dir=sock_dir, device_id="cpu-r"
            )
    finally:
        for t in server.seed_source.threads:
            t.join(30)
        server.stop()


def test_a_full_file_system_is_an_oserror_with_a_reason_code(daemon, snap_root):
    """A write that hits the file-size limit (as a full disk) raises an OSError naming snapshot-write-failed; nothing is left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(
        resource.RLIMIT_FSIZE, (4096, hard)
    )  # Python ignores SIGXFSZ: writes get EFBIG
    caught = None
    try:
        _write(daemon, snap_root)
    except Exception as e:  # noqa: BLE001  (kept as text: its frames hold views of an unmapped arena)
        caught = (isinstance(e, OSError), getattr(e, "code", None), str(e))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught is not None and (True, "snapshot-write-failed") == caught[:2], caught
    assert "File too large" in caught[2] and snap_root in caught[2]
    assert [] == os.listdir(snap_root)  # the temp dir is gone, nothing half-written remains


def test_seeding_from_a_source_that_died_before_the_transfer_fails_in_bounded_time(
    sock_dir, key, monkeypatch
):
    """When the source is gone before the receiver joins, fill raises SeedFailed within the connect timeout, not the transfer timeout."""
    import threading

    from wcache.store import seed as seed_mod

    monkeypatch.setattr(seed_mod, "SEED_CONNECT_TIMEOUT_S", 1.0, raising=False)
    server = DaemonServer(synthetic_export(), key, socket_dir=sock_dir, device_id="cpu-s").start()
    server.seed_source = SeedSource(server)
    # the source answers, then dies: its store closes and nobody joins the group
    monkeypatch.setattr(SeedSource, "_send", lambda self, store, *a: None)
    try:
        arena = seed_arena(server.socket_path, key)
    finally:
        server.stop()
    errors = []

    def receive():
        try:
            DaemonServer(arena, key, socket_dir=sock_dir, device_id="cpu-r")
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(e)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    t.join(60.0)  # the transfer timeout (SEED_TIMEOUT_S) is 600 s; a dead source must not cost that
    assert not t.is_alive(), "the receiver still waits for a dead source"
    assert 1 == len(errors) and isinstance(errors[0], SeedFailed), errors


def test_snapshot_and_from_snapshot_together_are_refused(tmp_path, capsys):
    """`--snapshot` with `--from-snapshot` is a usage error (exit 2) naming both, not a silently ignored flag."""
    from wcache import cli

    assert 2 == cli.main(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--from-snapshot",
            str(tmp_path / "a"),
            "--snapshot",
            str(tmp_path / "b"),
        ]
    )
    err = capsys.readouterr().err
    assert "--snapshot" in err and "--from-snapshot" in err


def test_a_crashed_writers_leftovers_are_removed_by_the_next_write(daemon, key, snap_root):
    """Temp and replaced dirs that a killed writer left (arena-sized) are removed by the next write of that rank, not kept forever."""
    os.makedirs(snap_root, mode=0o700)
    crashed_tmp = os.path.join(snap_root, f"{snap_mod.TEMP_PREFIX}{NAME}-dead1")
    crashed_old = os.path.join(snap_root, f"{snap_mod.OLD_PREFIX}{NAME}-dead2", NAME)
    other_rank = os.path.join(snap_root, f"{snap_mod.TEMP_PREFIX}tp1of2-pp0of1-dp0of1-x")
    for d in (crashed_tmp, crashed_old, other_rank):
        os.makedirs(d)
        with open(os.path.join(d, ARENA_FILE), "wb") as f:
            f.write(b"\0" * 4096)
    _write(daemon, snap_root)
    # another rank's temp dir may be a live write of that rank: left alone
    assert sorted([NAME, os.path.basename(other_rank)]) == sorted(os.listdir(snap_root))
    assert key == open_snapshot(snap_root, NAME).key


def test_two_writers_of_one_snapshot_at_once_leave_one_intact_snapshot(
    sock_dir, snap_root, monkeypatch
):
    """Two daemons writing the same rank's snapshot at once both succeed, one after the other; one intact snapshot and nothing else remains."""
    import threading
    import time

    real_rename = os.rename

    def slow_rename(a, b):  # widen the window between the checks and the renames
        time.sleep(0.05)
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", slow_rename)

    servers = [
        DaemonServer(
            synthetic_export(seed=i),
            CacheKey({**BASE_KEY, "checkpoint": f"c{i}"}),
            socket_dir=sock_dir,
            device_id=f"cpu-w{i}",
        )
        for i in range(2)
    ]
    try:
        for _ in range(5):
            errors = []
            barrier = threading.Barrier(2)

            def write(s, barrier=barrier, errors=errors):
                barrier.wait()
                try:
                    _write(s, snap_root)
                except Exception as e:  # noqa: BLE001 (the test reports it)
                    errors.append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=write, args=(s,)) for s in servers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [] == errors
            assert [NAME] == os.listdir(snap_root)
            snap = open_snapshot(snap_root, NAME)
            assert snap.key in {s.key for s in servers}
            snapshot_arena(snap).build("cpu", None, None)[0].close()  # digest-checked read
    finally:
        for s in servers:
            s.stop()


def test_seed_from_bad_paths_say_what_to_give(daemon, key, sock_dir, tmp_path):
    """--seed-from a missing path, a plain file, a dead daemon's socket or a directory without this key's daemon: DaemonMissing, each with a fix."""
    import socket as socket_mod

    from wcache.daemon.serve import find_seed_source
    from wcache.store import DaemonMissing, KeyMismatch

    plain = tmp_path / "plain"
    plain.write_text("x")
    for path in (str(tmp_path / "nope"), str(plain)):
        with pytest.raises(DaemonMissing, match="wcache status"):
            find_seed_source(path, key)
    assert daemon.socket_path == find_seed_source(sock_dir, key)
    # a directory whose daemons answer, none of this key: the closest one's fields are
    # named, as for a socket (break16 #4: only two digests were)
    with pytest.raises(KeyMismatch, match=r"closest, .*differs in dtype: .*seen: .*source's"):
        find_seed_source(sock_dir, CacheKey({**BASE_KEY, "dtype": "float16"}))
    stale = os.path.join(sock_dir, "stale.sock")
    s = socket_mod.socket(socket_mod.AF_UNIX)
    s.bind(stale)
    s.close()  # a socket file nobody listens on: a dead daemon's
    with pytest.raises(DaemonMissing):
        seed_arena(find_seed_source(stale, key), key)


def test_seed_from_a_directory_where_only_another_ranks_daemon_answers(tmp_path, monkeypatch):
    """--seed-from DIR where this rank's daemon is gone and another rank's answers:
    daemon-missing, not a key-mismatch naming the rank fields (break17 #1: it said the
    keys differ in parallel.tp_rank and to use the source's engine arguments); a
    daemon of this rank of another key is still key-mismatch naming its fields."""
    from wcache.daemon.serve import find_seed_source
    from wcache.store import DaemonMissing, KeyMismatch

    def key_of(tp_rank, dtype="bfloat16"):
        parallel = {"tp_size": 2, "tp_rank": tp_rank, "pp_size": 1, "pp_rank": 0}
        return CacheKey({**BASE_KEY, "dtype": dtype, "parallel": parallel})

    statuses = {f"{tmp_path}/rank1.sock": {"key_digest": "x", "key_fields": key_of(1).fields}}
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: sorted(statuses))
    monkeypatch.setattr("wcache.store.daemon_status", lambda s, **k: statuses[s])
    with pytest.raises(DaemonMissing, match=r"serves key .*seen: rank1.sock") as ei:
        find_seed_source(str(tmp_path), key_of(0))
    assert "tp_rank" not in str(ei.value)
    statuses[f"{tmp_path}/rank0.sock"] = {"key_digest": "y", "key_fields": key_of(0, "half").fields}
    with pytest.raises(KeyMismatch, match=r"closest, rank0.sock, differs in dtype"):
        find_seed_source(str(tmp_path), key_of(0))


def test_arena_file_gone_after_open_is_snapshot_corrupt(daemon, snap_root):
    """An arena file removed between the check and the read is snapshot-corrupt (so --snapshot falls back to the checkpoint), not a bare store error."""
    _write(daemon, snap_root)
    snap = open_snapshot(snap_root, NAME)
    os.unlink(os.path.join(snap_root, NAME, ARENA_FILE))
    with pytest.raises(SnapshotCorrupt, match="write the snapshot again"):
        snapshot_arena(snap).build("cpu", None, None)


@pytest.mark.parametrize("fname", [ARENA_FILE, MANIFEST_FILE, "digests.json"])
def test_a_snapshot_file_that_is_a_fifo_is_refused_not_waited_on(daemon, snap_root, fname):
    """A FIFO in a snapshot's place is refused by name; opening it would block for
    ever (break10 #5: `--from-snapshot` hung in wait_for_partner)."""
    import concurrent.futures

    path = _write(daemon, snap_root)
    os.unlink(os.path.join(path, fname))
    os.mkfifo(os.path.join(path, fname))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(open_snapshot, snap_root, NAME)
        try:
            with pytest.raises(SnapshotCorrupt, match=f"{fname} is a FIFO, not a regular file"):
                fut.result(timeout=30)
        finally:
            if not fut.done():  # unblock the open so the pool can exit
                with open(os.path.join(path, fname), "wb"):
                    pass


def test_seed_from_a_directory_names_a_daemon_that_listens_but_does_not_answer(key, tmp_path):
    """A socket in the --seed-from directory that accepts but never answers (a
    stalled, SIGSTOPped daemon) is named as such, with the check to run, instead of
    "seen: none"; a stale socket file of a dead daemon is still passed over
    (break10 #7)."""
    import socket as socket_mod

    from wcache.daemon.serve import find_seed_source
    from wcache.store import DaemonMissing
    from wcache.store.paths import SOCKET_PREFIX, SOCKET_SUFFIX

    d = tmp_path / "socks"
    d.mkdir(mode=0o700)
    stalled = d / f"{SOCKET_PREFIX}cpu-0{SOCKET_SUFFIX}"
    dead = d / f"{SOCKET_PREFIX}cpu-1{SOCKET_SUFFIX}"
    listener = socket_mod.socket(socket_mod.AF_UNIX)
    listener.bind(str(stalled))
    listener.listen(8)  # accepts (the kernel's backlog), never answers
    gone = socket_mod.socket(socket_mod.AF_UNIX)
    gone.bind(str(dead))
    gone.close()
    try:
        with pytest.raises(DaemonMissing) as ei:
            find_seed_source(str(d), key)
    finally:
        listener.close()
    msg = str(ei.value)
    assert f"listening but not answering: {stalled.name} [daemon-missing]" in msg
    assert "wcache status --socket-dir" in msg
    assert dead.name not in msg


@pytest.mark.parametrize(
    "where, mode",
    [(".", 0o777), (".", 0o770), (NAME, 0o775), (f"{NAME}/{ARENA_FILE}", 0o666)],
)
def test_a_snapshot_others_can_write_is_neither_read_nor_written(daemon, snap_root, where, mode):
    """A snapshot directory, rank folder or file that group or others can write is
    refused (unsafe-path, naming the mode and the fix) before it is read, and before
    anything is written into it (break16 #1: a forged snapshot there was served)."""
    from wcache.errors import UnsafePath

    path = _write(daemon, snap_root)
    target = os.path.normpath(os.path.join(snap_root, where))
    os.chmod(target, mode)
    with pytest.raises(UnsafePath) as ei:
        open_snapshot(snap_root, NAME)
    assert "unsafe-path" == ei.value.code
    assert f"{target} has mode {mode:o}: group or others can write it" in str(ei.value)
    assert f"chmod -R go-w {target}" in str(ei.value)
    before = {e: os.stat(os.path.join(snap_root, e)).st_mtime_ns for e in os.listdir(snap_root)}
    with pytest.raises(UnsafePath):
        _write(daemon, snap_root)
    after = {e: os.stat(os.path.join(snap_root, e)).st_mtime_ns for e in os.listdir(snap_root)}
    assert before == after and os.path.isdir(path)  # nothing written, nothing removed


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("where", [".", NAME, f"{NAME}/digests.json"])
def test_a_snapshot_of_another_user_is_neither_read_nor_taken_over(daemon, snap_root, where):
    """A snapshot directory, rank folder or file owned by another uid is refused
    (unsafe-path, naming the owner) on read and on write; a directory another user
    made before the daemon ran is not written into (os.makedirs(exist_ok=True) took
    it over)."""
    from wcache.errors import UnsafePath

    _write(daemon, snap_root)
    target = os.path.normpath(os.path.join(snap_root, where))
    os.chown(target, 65534, -1)
    for attempt in (lambda: open_snapshot(snap_root, NAME), lambda: _write(daemon, snap_root)):
        with pytest.raises(UnsafePath, match=f"{target} is owned by uid 65534, not by you"):
            attempt()
    squatted = os.path.join(os.path.dirname(snap_root), "squatted")
    os.mkdir(squatted, 0o755)
    os.chown(squatted, 65534, -1)
    with pytest.raises(UnsafePath, match="is owned by uid 65534"):
        _write(daemon, squatted)
    assert [] == os.listdir(squatted)


@pytest.mark.skipif(os.geteuid() != 0, reason="files owned by root need root to make")
def test_a_snapshot_of_root_is_read_by_another_user(daemon, snap_root, monkeypatch):
    """A snapshot root owns (a read-only volume, an image layer) is read by a daemon
    of another user: root could replace anything anyway; only another ordinary user's
    is refused (sshd's rule for the files it trusts)."""
    from wcache.errors import UnsafePath

    _write(daemon, snap_root)  # written as root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert open_snapshot(snap_root, NAME).key == daemon.key
    os.chown(os.path.join(snap_root, NAME), 65534, -1)
    with pytest.raises(UnsafePath, match="owned by uid 65534, not by you \\(uid 1000\\) or root"):
        open_snapshot(snap_root, NAME)


def test_the_arena_file_is_written_private_whatever_the_umask(daemon, snap_root):
    """What the unsafe-path check relies on: every file of a snapshot written under
    umask 002 is 0600 (safetensors makes the arena file so), so it is not refused as
    group-writable when read."""
    old = os.umask(0o002)
    try:
        path = _write(daemon, snap_root)
    finally:
        os.umask(old)
    assert {0o600} == {os.stat(os.path.join(path, f)).st_mode & 0o777 for f in os.listdir(path)}
    assert 0o700 == os.stat(path).st_mode & 0o777
    assert daemon.key == open_snapshot(snap_root, NAME).key


def test_leftovers_are_removed_under_the_writers_lock_only_when_no_writer_holds_it(
    daemon, snap_root
):
    """remove_leftovers (a daemon that started from its snapshot) removes the rank's
    .tmp-/.old- dirs a killed write left, not another rank's; while a writer holds
    the directory's lock it removes nothing and does not wait."""
    import fcntl

    _write(daemon, snap_root)
    mine = [
        os.path.join(snap_root, f"{snap_mod.TEMP_PREFIX}{NAME}-dead1"),
        os.path.join(snap_root, f"{snap_mod.OLD_PREFIX}{NAME}-dead2"),
    ]
    theirs = os.path.join(snap_root, f"{snap_mod.TEMP_PREFIX}tp1of2-pp0of1-dp0of1-x")
    for d in (*mine, theirs):
        os.makedirs(d)
    assert sorted(mine) == snap_mod.leftovers(snap_root, NAME)
    fd = os.open(snap_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer at work
        assert snap_mod.remove_leftovers(snap_root, NAME) is False
        assert sorted(mine) == snap_mod.leftovers(snap_root, NAME)
    finally:
        os.close(fd)
    assert snap_mod.remove_leftovers(snap_root, NAME) is True
    assert sorted([NAME, os.path.basename(theirs)]) == sorted(os.listdir(snap_root))
