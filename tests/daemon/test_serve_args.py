"""`wcache serve` refuses a snapshot directory inside the checkpoint directory before any
load: the snapshot's files would join the checkpoint's fingerprint (found by a new user
serving a tiny Qwen3-MoE from /tmp)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from wcache import cli
from wcache.store.fingerprint import checkpoint_files


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
