"""``make demo``'s rows, exit status and options (wcache/demo.py), engines stubbed.

The real engines run in ``make demo`` itself and in tests/e2e (the same
``run_engine``/``DaemonProcess`` pair); here each row's daemon-and-two-engines step is
replaced, so what is checked is the demo's own logic: which rows run (formats this
host's vLLM cannot serve are skipped, ``--no-moe``, ``--gemma3``), what the summary
says of each, and that a difference or a failure gives exit status 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from wcache import demo


def _engine(tokens: list[int], text: str, seconds: float) -> dict:
    return {"token_ids": [tokens], "texts": [text], "load": [{"seconds": seconds}]}


@pytest.fixture
def stubbed(monkeypatch):
    """The demo with a probe that serves every format but AWQ and a row step that
    records which checkpoint it was given; ``calls`` lists the rows run, in order."""
    calls: list[str] = []
    differ: set[str] = set()
    fail: set[str] = set()

    def disk_vs_daemon(row: str, model: Path, max_tokens: int) -> dict:
        calls.append(row)
        if row in fail:
            raise RuntimeError(f"{row}: engine failed")
        restored = [1, 2, 9] if row in differ else [1, 2, 3]
        return {
            "disk": _engine([1, 2, 3], " Paris.", 2.0),
            "restored": _engine(restored, " Paris.", 0.5),
        }

    monkeypatch.setattr(demo, "_disk_vs_daemon", disk_vs_daemon)
    monkeypatch.setattr(
        demo, "probe", lambda build: {"isa": ["avx512f"], "kernels": {"cpu.kernel_library": "_C"}}
    )
    monkeypatch.setattr(
        demo,
        "unservable_reason",
        lambda fmt, kernels: "no cpu_gemm_wna16 here" if fmt == "awq" else None,
    )
    import wcache.testing.fixtures as fixtures
    import wcache.testing.tiny_models as tiny_models

    monkeypatch.setattr(fixtures, "build", lambda fmt, model="smollm2": Path(f"/ck/{model}-{fmt}"))
    monkeypatch.setattr(tiny_models, "build_arch", lambda arch: Path(f"/ck/{arch}"))
    return calls, differ, fail


def test_rows_run_in_order_and_unservable_formats_are_skipped(stubbed, capsys):
    calls, _, _ = stubbed
    assert demo.main(["--formats", "bf16,awq,ct_w8a8_int8"]) == 0
    assert calls == ["bf16", "ct_w8a8_int8", demo.MOE_ROW]
    out = capsys.readouterr().out
    assert "[awq]\n  skipped:            no cpu_gemm_wna16 here" in out
    assert "outputs:            identical" in out
    assert "ratio 4.0x" in out
    assert demo.GEMMA3_ROW not in out


def test_gemma3_row_only_when_asked(stubbed, capsys):
    calls, _, _ = stubbed
    assert demo.main(["--formats", "bf16", "--no-moe", "--gemma3"]) == 0
    assert calls == ["bf16", demo.GEMMA3_ROW]
    assert f"[{demo.GEMMA3_ROW}]" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["differ", "fail"])
def test_a_different_or_failed_row_exits_1_and_the_others_still_run(stubbed, capsys, how):
    calls, differ, fail = stubbed
    (differ if how == "differ" else fail).add("bf16")
    assert demo.main(["--formats", "bf16,ct_w8a8_int8", "--no-moe"]) == 1
    assert calls == ["bf16", "ct_w8a8_int8"]
    out = capsys.readouterr().out
    assert ("outputs:            DIFFERENT" in out) == (how == "differ")
    assert ("[bf16]\n  FAILED (first traceback above)" in out) == (how == "fail")


def test_unknown_format_is_refused(stubbed, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--formats", "bf16,int3"])
    assert exc.value.code == 2
    assert "unknown format(s) ['int3']" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", ["0", "-1"])
def test_max_tokens_under_one_is_refused_before_any_work(stubbed, tokens, monkeypatch, capsys):
    """--max-tokens 0 or less is an argument error (exit 2) before the probe, the build
    or an engine: it ran a minute, then failed with vLLM's traceback ("max_tokens must be
    at least 1")."""
    monkeypatch.setattr(demo, "probe", lambda build: pytest.fail("the probe ran"))
    with pytest.raises(SystemExit) as exc:
        demo.main(["--formats", "bf16", "--max-tokens", tokens])
    assert 2 == exc.value.code
    assert f"--max-tokens {tokens}: give 1 or more tokens" in capsys.readouterr().err
    assert [] == stubbed[0]


#: A demo whose row step is real down to the daemon, which is a stand-in that writes its
#: pid into the row's socket directory and never becomes ready (argv: the pid file).
_SIGTERM_DEMO = """
import os, sys
from pathlib import Path
import wcache.testing.fixtures as fixtures
from wcache import demo

class StandInDaemon(demo.DaemonProcess):
    def __init__(self, model, socket_dir, *a, **k):
        super().__init__(model, socket_dir, *a, **k)
        pid_file = os.path.join(socket_dir, "x.sock.pid")
        self.args = [sys.executable, "-c",
                     "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                     "time.sleep(120)", pid_file]

demo.DaemonProcess = StandInDaemon
demo.probe = lambda build: {"isa": [], "kernels": {"cpu.kernel_library": "_C"}}
demo.unservable_reason = lambda fmt, kernels: None
fixtures.build = lambda fmt, model="smollm2": Path("/nonexistent")
sys.exit(demo.main(["--formats", "bf16", "--no-moe"]))
"""


def test_sigterm_stops_the_rows_daemon_and_removes_its_socket_dir(tmp_path):
    """`timeout` or `kill` of the demo while a row's daemon starts: exit 143, the daemon's
    process group is stopped and the row's ``wcache-demo-*`` directory is gone (Python's
    default SIGTERM would leave both, break pass 8)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_DEMO],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        pid_files: list[Path] = []
        while not pid_files and time.monotonic() < deadline and proc.poll() is None:
            pid_files = [p for p in tmp.glob("wcache-demo-*/x.sock.pid") if p.read_text()]
            time.sleep(0.1)
        assert pid_files, "the stand-in daemon never started"
        daemon_pid = int(pid_files[0].read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert not list(tmp.glob("wcache-demo-*"))
    with pytest.raises(ProcessLookupError):
        os.kill(daemon_pid, 0)
