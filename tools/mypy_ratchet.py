"""Run mypy (pyproject.toml's [tool.mypy]) and fail when it finds more than the recorded
baseline, so type findings only go down; lower tools/mypy-baseline.txt as they are fixed,
until it is 0 and this becomes plain `mypy`.

    python tools/mypy_ratchet.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BASELINE = Path(__file__).with_name("mypy-baseline.txt")


def main() -> int:
    """Run mypy, print its findings and the count against the baseline; 1 when above it."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], capture_output=True, text=True, check=False
    )
    found = len(re.findall(r"^\S+:\d+: error:", proc.stdout, flags=re.M))
    baseline = int(BASELINE.read_text().split()[0])
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (a config or crash)
        print(proc.stdout + proc.stderr)
        return proc.returncode
    if found > baseline:
        print(proc.stdout)
        print(
            f"mypy: {found} findings, more than the baseline {baseline} "
            f"({BASELINE.name}): fix the new ones"
        )
        return 1
    print(
        f"mypy: {found} findings (baseline {baseline}"
        + (f"; lower {BASELINE.name} to {found}" if found < baseline else "")
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
