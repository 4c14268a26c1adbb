"""The acceptance's results rows name the checkout that produced them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from wcache.testing import engine_acceptance as ea

REPO = Path(__file__).resolve().parents[2]


def test_source_revision_names_this_checkouts_commit():
    """In a git checkout: the commit git reports for it and a dirty flag."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    rev = ea.source_revision()
    if head.returncode != 0:  # an exported tree (no .git): nothing to name
        assert rev == {"git": None, "git_dirty": None}
    else:
        assert rev["git"] == head.stdout.strip()
        assert isinstance(rev["git_dirty"], bool)


def test_source_revision_without_git_is_none(monkeypatch):
    """No git executable: both fields None, no exception."""

    def missing(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(ea.subprocess, "run", missing)
    assert ea.source_revision() == {"git": None, "git_dirty": None}


def test_record_result_appends_the_row_with_time_and_revision(tmp_path, monkeypatch):
    """One line per row: the row's fields, the time and the checkout's revision."""
    monkeypatch.setattr(ea, "source_revision", lambda: {"git": "abc", "git_dirty": False})
    out = tmp_path / "r.jsonl"
    ea.record_result({"case": "a", "outcome": "restored"}, out)
    ea.record_result({"case": "b", "outcome": "failed"}, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["case"], r["outcome"], r["git"], r["git_dirty"]) for r in rows] == [
        ("a", "restored", "abc", False),
        ("b", "failed", "abc", False),
    ]
    assert all(r["time"].endswith("Z") for r in rows)
