"""SIGTERM to `wcache serve` with several ranks stops every rank process (it ended only
the parent, leaving the ranks serving, orphaned). Stand-in ranks: no vLLM load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

#: A parent with two spawned stand-in ranks starts in a few seconds; room for a busy host.
START_TIMEOUT_S = 120.0
#: The ranks get SIGTERM and the parent joins them (10 s each at most).
STOP_TIMEOUT_S = 30.0

RANK = """
import os, time

def fake_rank_main(rank, local_rank, world, model, rest, init_method, socket_dir,
                   progress, job, ready, sources):
    with open(os.path.join(socket_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    ready.put((rank, "ready"))
    time.sleep(600)
"""

PARENT = """
import argparse, sys
import fake_rank
from wcache.daemon import serve
serve._rank_main = fake_rank.fake_rank_main
args = argparse.Namespace(model="m", socket_dir=sys.argv[1], no_progress=True)
sys.exit(serve._serve_ranks(args, [], 2, range(2), "tcp://127.0.0.1:1", "", {}))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_stops_every_rank(tmp_path):
    (tmp_path / "fake_rank.py").write_text(textwrap.dedent(RANK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while "all 2 ranks ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        assert "all 2 ranks ready" in line
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "ranks still running after SIGTERM"
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for f in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
