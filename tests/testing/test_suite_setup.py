"""What running the suite on several pytest-xdist workers relies on: fixture builders
take turns on one folder (wcache.testing.fixtures.build_lock), and the modules that
tests/conftest.py hands out first still exist (tests.helpers.suite_order) (CPU; no engine)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.suite_order import LONGEST_MODULES, module_rank
from wcache.testing import fixtures as fx

#: How long the child must stay blocked on the held lock to prove it waits (seconds);
#: far above a child's start-up to the lock call, far below the test's budget.
HOLD_S = 3.0
#: Upper bound on the child's whole run once the lock is free (seconds).
CHILD_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
from pathlib import Path
from wcache.testing import fixtures as fx
print("waiting", flush=True)
with fx.build_lock(Path(sys.argv[1])):
    print(f"acquired {time.time()}", flush=True)
"""


def test_a_second_builder_waits_for_the_folder_lock(tmp_path):
    """A process asking for a fixture folder's build lock held by another gets it only
    after the holder lets go (workers sharing ~/.cache/wcache/fixtures build once)."""
    final = tmp_path / "fixtures" / "smollm2-135m-instruct-bf16"
    with fx.build_lock(final):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(final)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(HOLD_S)
        released = time.time()
    out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0
    (line,) = out.splitlines()
    assert line.startswith("acquired ")
    assert float(line.split()[1]) >= released
    assert (final.parent / f".{final.name}.lock").is_file()
    assert not final.exists()  # the lock is beside the folder, not in it


def test_the_longest_modules_exist_and_go_first():
    """suite_order's LONGEST_MODULES name real modules (a rename would silently
    send them last), ranked before every slow module and those before the rest."""
    for path in LONGEST_MODULES:
        assert (REPO / path).is_file(), path
    ranks = [module_rank(p, slow=True) for p in LONGEST_MODULES]
    assert ranks == sorted(ranks)
    assert max(ranks) < module_rank("tests/e2e/test_x.py", slow=True)
    assert module_rank("tests/e2e/test_x.py", slow=True) < module_rank(
        "tests/core/test_x.py", slow=False
    )
