"""An installed (non-editable) wcache works without a source tree: ``wcache plans`` and
``wcache bench --help`` run from a fresh venv, importing the installed copy."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Building the wheel and a venv takes ~20 s on 2 cores; well under this.
INSTALL_TIMEOUT_S = 300


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_installed_wheel_runs_plans_and_bench_help(tmp_path):
    """pip install of the built wheel into a fresh venv (dependencies from this
    interpreter's site-packages, the editable finder of a dev install not loaded)
    gives a `wcache` whose `plans` lists the plans and `bench --help` prints, run
    from an empty folder and importing the venv's copy."""
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", ".hypothesis", "__pycache__", "fixtures-cache"
        ),
    )
    wheels = tmp_path / "wheels"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(wheels),
            str(src),
        ],
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("wcache-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path
        ).strip()
    )
    # the dependencies (torch, attrs, ...) of this interpreter, as a plain path entry:
    # a .pth line adds the folder without running its .pth files (no editable finder)
    deps = [
        p for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"]) if Path(p).is_dir()
    ]
    (purelib / "zz_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--ignore-installed",
            "--quiet",
            "--prefix",
            str(venv),
            str(wheel),
        ],
        cwd=tmp_path,
    )
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = _run(
        [str(py), "-c", "import wcache.benchmarks.bench_restore as b; print(b.__file__)"],
        run_dir,
        env,
    )
    assert Path(where.strip()).is_relative_to(venv), where  # the installed copy, benchmarks too
    plans = _run([str(venv / "bin" / "wcache"), "plans"], run_dir, env)
    assert "awq/marlin@1" in plans and "unquantized/onednn@1" in plans
    bench = _run([str(venv / "bin" / "wcache"), "bench", "--help"], run_dir, env)
    assert "usage: wcache bench" in bench and "--cpu-engine" in bench
