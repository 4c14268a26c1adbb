"""``wcache bench --soak`` (wcache.benchmarks.bench_soak), run small (400 cycles): a real
``wcache serve`` on the bf16 fixture that hands off to its lean process, raw
clients, SIGKILLed clients and a snapshot written mid-run. It checks what the
run reports, not how fast it is (the full soak is a benchmark:
docs/benchmarks.md)."""

from pathlib import Path

import pytest

from wcache.benchmarks import bench_soak

pytestmark = pytest.mark.slow

#: Small but past the hand-off (the daemon's snapshot is written within ~100 cycles).
CYCLES = 400
WARMUP_CYCLES = 200
#: Kill a client often enough that a 200-cycle run kills some.
KILL_EVERY_S = 0.5


@pytest.fixture(scope="module")
def soak():
    return bench_soak.run(2, CYCLES, KILL_EVERY_S, WARMUP_CYCLES, peer=False, live_snapshot=True)


def test_the_run_leaves_no_folder_behind(soak):
    """The run's working folder (socket, the daemon's snapshot, the mid-run snapshot:
    ~0.5 GB, once left behind by every run) is gone when it returns."""
    assert Path(soak["workdir"]).name.startswith("wc-soak-")
    assert not Path(soak["workdir"]).exists()


def test_small_soak_reads_right_bytes_and_reports_every_figure(soak):
    """Every attach read the right bytes, every cycle ran, no client erred, and the report holds the issue's figures."""
    assert (0, CYCLES, {}) == (soak["wrong_reads"], soak["cycles"], soak["client_errors"])
    assert CYCLES == soak["reads_checked"]
    for k in ("attaches_per_s", "p50_ms", "p99_ms", "rss_ratio", "fds_ratio"):
        assert soak[k] > 0, k
    for sample in ("ready", "warm", "end"):
        assert {"VmRSS", "RssAnon", "RssFile", "RssShmem", "fds"} <= set(soak[sample]), sample
    assert ["full", "lean"] == soak["serving_states"]
    assert soak["live_snapshot"]["ok"] is True, soak["live_snapshot"]
    assert {"skipped": True} == soak["peer"]
    text = bench_soak.report(soak)
    for what in (
        "attaches/s",
        "p50/p99",
        "wrong reads             0 of 400",
        "VmRSS",
        "open fds",
        "live snapshot           written",
        "peer seeding            not run",
        "vLLM engines            not run (--engines 0)",
    ):
        assert what in text, what


def test_small_soak_killed_clients_leave_no_attachment(soak):
    """After the run no attachment is active and every attach ended in a release or a disconnect."""
    m = soak["metrics"]
    ended = m.get("wcache_releases_total{how=release}", 0) + m.get(
        "wcache_releases_total{how=disconnect}", 0
    )
    assert (0, m["wcache_attaches_total"]) == (m["wcache_attachments_active"], ended)
    assert 0 == soak["end"]["connections"]


def test_report_names_each_engine_and_a_token_mismatch(soak):
    """--engines rows: each engine's cycles and restore time; a mismatch or a failure is shouted."""
    runs = [
        {"at_cycle": 10, "end_cycle": 90, "process_s": 31.5, "identical": True, "restore_s": 0.25},
        {"at_cycle": 90, "end_cycle": 170, "process_s": 30.0, "identical": False, "restore_s": 0.2},
        {"at_cycle": 170, "end_cycle": 171, "process_s": 3.0, "error": "RestoreFailed: x"},
    ]
    lines = bench_soak.report(dict(soak, engines={"runs": runs})).splitlines()
    assert (
        "  vLLM engine 1           cycles 10-90, process 31.5 s: restore 0.250 s, same tokens as the disk engine"
        in lines
    )
    assert (
        "  vLLM engine 2           cycles 90-170, process 30.0 s: restore 0.200 s, TOKENS DIFFER"
        in lines
    )
    assert (
        "  vLLM engine 3           cycles 170-171, process 3.0 s: FAILED: RestoreFailed: x" in lines
    )
