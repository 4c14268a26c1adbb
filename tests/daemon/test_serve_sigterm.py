"""`wcache serve` with several ranks: SIGTERM to the serve stops every
rank (it ended only the parent, leaving the ranks serving, orphaned), a SIGKILLed serve
takes its ranks with it (``PR_SET_PDEATHSIG``), and a rank's exit status (75 asks for a
restart) is the serve's. Real rank processes (``_rank_main``) with a
stand-in ``serve_rank``: no vLLM load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

#: A parent with two spawned stand-in ranks starts in a few seconds; room for a busy host.
START_TIMEOUT_S = 120.0
#: The ranks get SIGTERM and the parent joins them (10 s each at most).
STOP_TIMEOUT_S = 30.0

#: The ranks: the real ``_rank_main`` around a ``serve_rank`` that reports ready, ends
#: with status 0 on SIGTERM (as a real rank's stop does), and rank 1 returns the status
#: in the file ``rank1.exit`` once that file appears.
RANK = """
import os, signal, sys, time

# the exec'd server: it closes every inherited fd (wcache.store.lean's
# _close_inherited_fds: multiprocessing's sentinel pipe too, so the parent's sentinel
# reads EOF while it serves on), and its stop takes a second (a real one drains, unmaps)
LEAN = (
    "import os, signal, sys, time\\n"
    "os.closerange(3, 1024)\\n"
    "stuck = os.environ.get('FAKE_RANK_EXEC') == 'stuck'\\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN if stuck else lambda *_: sys.exit(0))\\n"
    "time.sleep(600)"
)

def serve_rank(model, rest, *, rank, ready, socket_dir, **_):
    from wcache.errors import WcacheError

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(os.path.join(socket_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1 and os.environ.get("FAKE_RANK_REFUSE"):  # a refusal before ready
        while not os.path.exists(os.path.join(socket_dir, "rank0.pid")):  # rank 0 is up
            time.sleep(0.05)
        raise WcacheError("expert parallelism over 2 ranks", code="meta-build")
    ready.send((rank, "ready"))
    ready.close()  # as the real rank does once its ready line went
    if os.environ.get("FAKE_RANK_EXEC"):  # as the lean hand-off: execve, same pid, serving on
        os.execv(sys.executable, [sys.executable, "-c", LEAN])
    exit_file = os.path.join(socket_dir, f"rank{rank}.exit")
    for _ in range(6000):
        if os.path.exists(exit_file):
            with open(exit_file) as f:
                status = f.read()
            if status == "refuse":  # a refusal after ready (priming, say)
                raise WcacheError("the priming engine failed", code="prime-failed")
            return int(status)
        time.sleep(0.1)
    return 0

def rank_main(*args):
    from wcache.daemon import serve
    serve.serve_rank = serve_rank
    serve._rank_main(*args)
"""

PARENT = """
import argparse, sys
import fake_rank
from wcache.daemon import serve
serve._rank_main = fake_rank.rank_main
serve.RANK_STOP_GRACE_S = 3.0
args = argparse.Namespace(model="m", socket_dir=sys.argv[1], no_progress=True)
sys.exit(serve._serve_ranks(args, [], 2, range(2), "tcp://127.0.0.1:1", "", {}))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def serve_two_ranks(tmp_path, request):
    """Start the two-rank serve; yields ``(proc, rank pids, folder)`` once both are ready.
    Parametrized (indirect) ``"1"``: each rank ``execve``'s after ready, as the lean
    hand-off does; ``"stuck"``: and then ignores SIGTERM."""
    (tmp_path / "fake_rank.py").write_text(textwrap.dedent(RANK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    if getattr(request, "param", None):
        env["FAKE_RANK_EXEC"] = request.param
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        line = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while "all 2 ranks ready" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        assert "all 2 ranks ready" in line
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
        yield proc, pids, tmp_path
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ranks_end(pids: list[int]) -> list[int]:
    """The pids still running after :data:`STOP_TIMEOUT_S`."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_sigterm_stops_every_rank_and_exits_0(serve_two_ranks):
    """SIGTERM to the serve stops both ranks as Ctrl-C does; a stop asked once every
    rank served, each rank stopping cleanly, exits 0 (a one-rank serve's status)."""
    proc, pids, _ = serve_two_ranks
    proc.send_signal(signal.SIGTERM)
    assert 0 == proc.wait(timeout=STOP_TIMEOUT_S), proc.stderr.read()
    assert [] == _ranks_end(pids), "ranks still running after SIGTERM"


def test_a_sigkilled_serve_takes_its_ranks_with_it(serve_two_ranks):
    """SIGKILL (no handler runs) of the serve: each rank gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and stops, instead of serving on, orphaned."""
    proc, pids, _ = serve_two_ranks
    proc.kill()
    proc.wait(timeout=STOP_TIMEOUT_S)
    assert [] == _ranks_end(pids), "ranks still running after their serve was SIGKILLed"


def _tell_rank1(folder, status: str) -> None:
    """Give stand-in rank 1 its exit ``status``, atomically: it polls for the file, and
    a plain write let it read the file while still empty once in CI (`int('')`)."""
    tmp = folder / "rank1.exit.tmp"
    tmp.write_text(status)
    os.replace(tmp, folder / "rank1.exit")


def test_a_rank_that_ends_leaves_the_other_serving_and_its_status_is_kept(serve_two_ranks):
    """Rank 1 ends with 75 (a client's guard fired: restart me): rank 0 serves on (an
    engine loads only rank 1 from disk), and a later SIGTERM to the serve exits 75, the
    largest of the ranks' statuses (a rank's status was dropped: it exited 0)."""
    proc, pids, folder = serve_two_ranks
    _tell_rank1(folder, "75")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[1])
    time.sleep(0.5)
    assert proc.poll() is None and _alive(pids[0])
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=STOP_TIMEOUT_S)
    err = proc.stderr.read()
    assert 75 == status, err
    assert [] == _ranks_end(pids)
    # the serve said so when it happened (a supervisor watching its output saw
    # nothing: break14 #5); rank 0's clean stop printed nothing
    assert (
        "wcache serve: rank 1 exited with status 75 (a client's guard fired; it asks for "
        "a restart); rank(s) 0 serve on, and an engine loads rank 1 from disk" in err
    ), err
    assert "rank 0 exited" not in err


def test_a_rank_that_stops_alone_is_said(serve_two_ranks):
    """A rank that stops by itself with status 0 while the other serves on: an engine
    loads it from disk from then on, so the serve says so (it said nothing: break15 #4)."""
    proc, pids, folder = serve_two_ranks
    _tell_rank1(folder, "0")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the serve's watch looks twice a second
    proc.send_signal(signal.SIGTERM)
    assert 0 == proc.wait(timeout=STOP_TIMEOUT_S)
    err = proc.stderr.read()
    assert "wcache serve: rank 1 stopped (status 0); rank(s) 0 still serve" in err, err


@pytest.mark.parametrize("serve_two_ranks", ["stuck"], indirect=True)
def test_a_second_sigterm_while_the_ranks_stop_is_ignored(serve_two_ranks):
    """SIGTERM twice (a supervisor repeating it, Ctrl-C pressed again) while ranks that
    ignore SIGTERM are given their grace: no traceback (it raised through the stop,
    two chained tracebacks: break15 #3); the ranks are SIGKILLed after the grace."""
    proc, pids, _ = serve_two_ranks
    time.sleep(1.0)  # the ranks exec'd
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=STOP_TIMEOUT_S)
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    assert "wcache serve: SIGTERM; stopping the ranks" in err
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.parametrize("serve_two_ranks", ["1", "stuck"], indirect=True)
def test_sigterm_stops_ranks_that_exec_within_the_grace(serve_two_ranks):
    """Ranks that execve'd (the lean hand-off, which closes their sentinel pipe): SIGTERM
    to the serve returns once every rank has exited, and a rank that ignores SIGTERM is
    SIGKILLed after the grace (3 s here; ``join(timeout)`` blocked for ever)."""
    proc, pids, _ = serve_two_ranks
    time.sleep(1.0)  # the ranks exec'd
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=STOP_TIMEOUT_S)
    assert [p for p in pids if _alive(p)] == []


def test_a_refusal_during_start_up_is_one_line(tmp_path):
    """A rank's WcacheError before ready: the serve prints the rank's reason code and
    message once and exits 1, with no traceback nor multiprocessing's "Process
    wcache-rank1:" header around it (break13 #3), and stops the other rank."""
    (tmp_path / "fake_rank.py").write_text(textwrap.dedent(RANK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    env["FAKE_RANK_REFUSE"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        "wcache serve: rank 1 failed during start-up: error [meta-build]: expert "
        "parallelism over 2 ranks"
    ], r.stderr
    assert not _alive(int((tmp_path / "rank0.pid").read_text()))


def test_a_refusal_after_ready_is_printed_by_the_rank(serve_two_ranks):
    """A rank's WcacheError once every rank is ready (the parent reads no more ready
    lines): the rank prints its reason itself, once, without a traceback, and its
    status 1 is the serve's when it stops."""
    proc, pids, folder = serve_two_ranks
    _tell_rank1(folder, "refuse")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert 1 == proc.wait(timeout=STOP_TIMEOUT_S)
    err = proc.stderr.read()
    assert "wcache: rank 1: error [prime-failed]: the priming engine failed" in err, err
    assert "Traceback" not in err and "Process wcache-rank1" not in err, err
