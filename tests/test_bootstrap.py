"""tools/bootstrap.sh refuses, with the fix, an interpreter that cannot make a venv
(Debian's python3 without python3.X-venv), and never takes a venv that an earlier
failure left without pip for a made one. Nothing is installed: the interpreter is a
stand-in that fails as such a python3 does."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _stand_in(path: Path) -> Path:
    """A python3 whose ``import ensurepip`` fails and whose ``-m pip`` is missing."""
    path.write_text(
        "#!/bin/sh\n"
        'echo "$*" >> "$(dirname "$0")/calls"\n'
        "echo \"ModuleNotFoundError: No module named 'ensurepip'\" >&2\n"
        "exit 1\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _bootstrap(tmp_path: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(_stand_in(tmp_path / "python3")), "WCACHE_VENV": str(venv)}
    return subprocess.run(
        ["bash", str(REPO / "tools" / "bootstrap.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_interpreter_without_venv_is_refused_with_the_fix(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    res = _bootstrap(tmp_path, venv)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "venv/ensurepip modules are missing" in res.stderr
    assert "apt install python3-venv" in res.stderr
    assert not venv.exists()  # nothing half-made
    assert "-m venv" not in (tmp_path / "calls").read_text()


def test_a_venv_an_earlier_failure_left_without_pip_is_not_used(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _stand_in(venv / "bin" / "python")  # what `python3 -m venv` leaves when ensurepip fails
    res = _bootstrap(tmp_path, venv)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "venv/ensurepip modules are missing" in res.stderr
    # it asked the venv's python for pip, and did not go on to install with it
    calls = (venv / "bin" / "calls").read_text().splitlines()
    assert calls == ["-m pip --version"]
