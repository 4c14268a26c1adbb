"""The acceptance's results rows name the checkout that produced them."""

from __future__ import annotations

import json
import os
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
    monkeypatch.setattr(ea, "gpu_name", lambda: "NVIDIA H200")
    out = tmp_path / "r.jsonl"
    ea.record_result({"case": "a", "outcome": "restored"}, out)
    ea.record_result({"case": "b", "outcome": "failed"}, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["case"], r["outcome"], r["git"], r["git_dirty"], r["device"]) for r in rows] == [
        ("a", "restored", "abc", False, "NVIDIA H200"),
        ("b", "failed", "abc", False, "NVIDIA H200"),
    ]
    assert all(r["time"].endswith("Z") for r in rows)


def test_gpu_name_asks_nvidia_smi_for_the_first_visible_device(tmp_path, monkeypatch):
    """The GPU of the first CUDA_VISIBLE_DEVICES entry, from nvidia-smi; None without it."""
    stub = tmp_path / "nvidia-smi"
    stub.write_text('#!/bin/sh\necho "$*" > "$(dirname "$0")/args"; echo "NVIDIA H100 80GB HBM3"\n')
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    ea.gpu_name.cache_clear()
    assert ea.gpu_name() == "NVIDIA H100 80GB HBM3"
    assert (tmp_path / "args").read_text().split()[-2:] == ["-i", "3"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    ea.gpu_name.cache_clear()
    assert ea.gpu_name() is None
    ea.gpu_name.cache_clear()


def test_summary_of_a_tier_stopped_before_any_case_finished(tmp_path, capsys):
    """A tier stopped at TIER_TIMEOUT leaves progress but no results file: the summary
    says so and where each case's last step is, exit 1, no traceback."""
    results = tmp_path / "results.jsonl"
    assert ea.main(["--summary", str(results)]) == 1
    err = capsys.readouterr().err
    assert "no case finished" in err
    assert f"{results}.progress" in err


def test_summary_table_of_the_last_row_per_case(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    rows = [
        {"case": "bf16-compiled", "outcome": "failed", "reason": "first"},
        {"case": "bf16-compiled", "outcome": "passed"},
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ea.main(["--summary", str(results)]) == 0
    table = capsys.readouterr().out
    assert "| bf16-compiled | passed |" in table
    assert "failed" not in table
