"""`wcache serve`'s refusals before any load give a fix that works as written: a snapshot
directory inside the checkpoint directory is refused (its files would join the
checkpoint's fingerprint), and the daemon-busy hint names the socket dir the serve was
given (found by a new user serving a tiny Qwen3-MoE from /tmp)."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import types
from pathlib import Path

import pytest

from wcache import cli
from wcache.daemon import serve
from wcache.errors import DaemonBusy
from wcache.store import paths
from wcache.store.fingerprint import checkpoint_files
from wcache.vllm import key


def _checkpoint(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    return model


def _args(model: Path, **snap: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model=str(model), snapshot=snap.get("snapshot"), from_snapshot=snap.get("from_snapshot")
    )


@pytest.mark.parametrize("flag", ["snapshot", "from_snapshot"])
@pytest.mark.parametrize("where", [".", "snap", "sub/snap"])
def test_snapshot_inside_the_checkpoint_is_refused(tmp_path, flag, where):
    model = _checkpoint(tmp_path)
    snap = model / where
    problem = cli._check_snapshot_arg(_args(model, **{flag: str(snap)}))
    assert problem is not None
    assert f"--{flag.replace('_', '-')} {snap} is inside the checkpoint directory" in problem
    assert ".wcache-snapshot" in problem  # the fix


@pytest.mark.parametrize("where", ["../snap", ".wcache-snapshot", ".hidden/snap"])
def test_snapshot_outside_or_hidden_is_allowed(tmp_path, where):
    model = _checkpoint(tmp_path)
    assert cli._check_snapshot_arg(_args(model, snapshot=str(model / where))) is None
    assert cli._check_snapshot_arg(_args(model)) is None


def test_hidden_snapshot_stays_out_of_the_fingerprint(tmp_path):
    """What the refusal's fix relies on: the snapshot's files under a hidden folder are
    not checkpoint files, those under a plain one are."""

    model = _checkpoint(tmp_path)
    for sub in (".wcache-snapshot", "snap"):
        rank = model / sub / "tp0of1-pp0of1-dp0of1"
        rank.mkdir(parents=True)
        (rank / "arena.safetensors").write_bytes(b"a")
        (rank / "key.json").write_text("{}")
    assert checkpoint_files(str(model)) == [
        "config.json",
        "model.safetensors",
        "snap/tp0of1-pp0of1-dp0of1/arena.safetensors",
        "snap/tp0of1-pp0of1-dp0of1/key.json",
    ]


def test_serve_refuses_a_snapshot_inside_the_checkpoint_before_loading(tmp_path, capsys):
    model = _checkpoint(tmp_path)
    assert 2 == cli.main(["serve", "--model", str(model), "--snapshot", str(model / "snap")])
    assert "is inside the checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--snapshot", "--from-snapshot"])
def test_serve_refuses_a_file_as_the_snapshot_before_loading(tmp_path, monkeypatch, capsys, flag):
    """A regular file given as the snapshot directory exits 2 before the load (it was
    accepted: the model loaded, then the write failed naming a start-up bundle,
    break16 #7); --from-snapshot given a file of a rank's folder names the directory."""
    monkeypatch.setattr(serve, "main", lambda *a, **k: pytest.fail("serve ran"))
    model = _checkpoint(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert 2 == cli.main(["serve", "--model", str(model), flag, str(afile)])
    err = capsys.readouterr().err
    assert f"wcache serve: {flag} {afile} is not a directory: " in err
    assert 1 == len(err.splitlines())
    rank = tmp_path / "snap" / "tp0of1-pp0of1-dp0of1"
    rank.mkdir(parents=True)
    (rank / "digests.json").write_text("{}")
    assert 2 == cli.main(["serve", "--model", str(model), flag, str(rank / "digests.json")])
    err = capsys.readouterr().err
    if flag == "--from-snapshot":
        assert f"give the directory that holds that folder, `--from-snapshot {rank.parent}`" in err
    else:
        assert "give the directory to keep the snapshot in (created when missing)" in err
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")  # it was called "a file" (break17 #7)
    assert 2 == cli.main(["serve", "--model", str(model), flag, str(dangling)])
    assert f"{flag} {dangling} is a symlink to nothing (dangling, or a loop)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("flag", ["--snapshot", "--from-snapshot"])
@pytest.mark.parametrize("where", [".", "tp0of1-pp0of1-dp0of1", ".startup/tp0of1-pp0of1-dp0of1"])
def test_serve_refuses_a_snapshot_others_can_write_before_loading(
    tmp_path, monkeypatch, capsys, flag, where
):
    """A snapshot directory, rank folder or start-up bundle folder that others can
    write exits 2 with [unsafe-path] and the fix before the load (break16 #1)."""
    monkeypatch.setattr(serve, "main", lambda *a, **k: pytest.fail("serve ran"))
    model = _checkpoint(tmp_path)
    snap = tmp_path / "snap"
    (snap / where).mkdir(parents=True, exist_ok=True)
    (snap / "tp0of1-pp0of1-dp0of1").mkdir(exist_ok=True)
    (snap / where).chmod(0o777)
    assert 2 == cli.main(["serve", "--model", str(model), flag, str(snap)])
    err = capsys.readouterr().err
    target = os.path.normpath(snap / where)
    assert err.startswith("wcache serve: error [unsafe-path]: snapshot ")
    assert f"{target} has mode 777: group or others can write it" in err
    assert f"chmod -R go-w {target}" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_serve_refuses_a_snapshot_directory_of_another_user_before_loading(
    tmp_path, monkeypatch, capsys
):
    """A --snapshot directory another user made (a squatted /tmp path) exits 2 with
    [unsafe-path] naming its owner, before the load; nothing is written into it."""
    monkeypatch.setattr(serve, "main", lambda *a, **k: pytest.fail("serve ran"))
    model = _checkpoint(tmp_path)
    snap = tmp_path / "squatted"
    snap.mkdir(mode=0o755)
    os.chown(snap, 65534, -1)
    assert 2 == cli.main(["serve", "--model", str(model), "--snapshot", str(snap)])
    err = capsys.readouterr().err
    assert f"error [unsafe-path]: snapshot directory {snap} is owned by uid 65534" in err
    assert [] == os.listdir(snap)


def test_daemon_busy_names_the_socket_dir_it_was_given(monkeypatch):
    """The daemon-busy fix names the --socket-dir this serve was given (quoted for the
    shell), and none when it was given none."""
    # short, with a space to quote: a socket path must fit sun_path (107 bytes), and
    # xdist's tmp_path is long
    sock_dir = Path(tempfile.mkdtemp(prefix="wc s-", dir="/tmp"))
    monkeypatch.setattr(key, "device_id", lambda *a, **k: "cpu-tp0of1-pp0of1-abc")
    monkeypatch.setattr(serve, "parallel_layout", lambda: {})
    monkeypatch.setattr(paths, "socket_accepts", lambda sock, *a, **k: True)
    config = types.SimpleNamespace(
        device_config=types.SimpleNamespace(device="cpu"), model_config=None
    )
    try:
        with pytest.raises(DaemonBusy) as exc:
            serve._preflight(config, str(sock_dir), "")
        fix = f"`wcache stop --socket-dir {shlex.quote(str(sock_dir))} --device cpu-tp0of1-pp0of1-abc`"
        assert fix in str(exc.value)

        # no --socket-dir: the default dir, and no --socket-dir in the fix
        monkeypatch.setattr(paths, "ensure_socket_dir", lambda d=None, **k: str(d or sock_dir))
        with pytest.raises(DaemonBusy) as exc:
            serve._preflight(config, None, "")
        assert "`wcache stop --device cpu-tp0of1-pp0of1-abc`" in str(exc.value)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_daemon_busy_with_another_checkpoint_says_so_and_gives_the_job_fix(monkeypatch):
    """A daemon of another model of the same architecture, dtype and layout on this
    serve's socket (its key's hf_config differs): daemon-busy says another checkpoint
    serves there and how to run both (a job each), then how to replace it."""
    sock_dir = Path(tempfile.mkdtemp(prefix="wcs-", dir="/tmp"))
    monkeypatch.setattr(key, "device_id", lambda *a, **k: "cpu-tp0of1-pp0of1-abc")
    monkeypatch.setattr(key, "config_key_fields", lambda mc: {"model_config.hf_config": {"h": 576}})
    monkeypatch.setattr(serve, "parallel_layout", lambda: {})
    monkeypatch.setattr(paths, "socket_accepts", lambda sock, *a, **k: True)
    theirs = {"key_fields": {"model_config.hf_config": {"h": 64}}}
    monkeypatch.setattr(serve, "daemon_status", lambda sock: theirs)
    config = types.SimpleNamespace(
        device_config=types.SimpleNamespace(device="cpu"), model_config=None
    )
    try:
        with pytest.raises(DaemonBusy) as exc:
            serve._preflight(config, str(sock_dir), "")
        msg = str(exc.value)
        assert "a daemon of another checkpoint already serves" in msg
        assert "model_config.hf_config.h: engine=576 daemon=64" in msg
        assert "`wcache serve --job NAME`" in msg and "To replace it instead" in msg
        # the same config (another job or the same model): the plain message
        theirs["key_fields"] = {"model_config.hf_config": {"h": 576}}
        with pytest.raises(DaemonBusy) as exc:
            serve._preflight(config, str(sock_dir), "")
        assert "another checkpoint" not in str(exc.value)
        # a daemon that does not answer status: the plain message, no error of its own
        monkeypatch.setattr(serve, "daemon_status", lambda sock: 1 / 0)
        with pytest.raises(DaemonBusy, match="a daemon already serves"):
            serve._preflight(config, str(sock_dir), "")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
