"""wcache.benchmarks.host: the host's state and the quiet start before a timed row
(fake /proc/meminfo, clock and sync: nothing here depends on this host's disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wcache.benchmarks.host import (
    QUIET_PENDING_MIB,
    cpu_shares,
    cpu_times,
    describe,
    host_state,
    pending_mib,
    quiet_host,
)

MEMINFO = """MemTotal:       131072000 kB
MemAvailable:   104857600 kB
Dirty:             20480 kB
Writeback:          1024 kB
WritebackTmp:          0 kB
"""


def test_host_state_reads_meminfo_in_mib_and_the_load(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text(MEMINFO)
    st = host_state(f)
    assert st["dirty_mib"] == 20.0
    assert st["writeback_mib"] == 1.0  # WritebackTmp is not Writeback
    assert st["available_mib"] == 102400.0
    assert st["load_1m"] is None or isinstance(st["load_1m"], float)  # None: no getloadavg
    assert pending_mib(st) == 21.0


def test_host_state_without_meminfo_gives_none(tmp_path):
    st = host_state(tmp_path / "absent")
    assert st["dirty_mib"] is None and st["writeback_mib"] is None
    assert pending_mib(st) is None


class FakeHost:
    """Pending writes that fall by ``drain`` MiB per poll after the sync."""

    def __init__(self, pending: float, drain: float):
        self.pending, self.drain, self.now, self.synced, self.polls = pending, drain, 0.0, 0, 0

    def state(self):
        return {"load_1m": 1.5, "dirty_mib": self.pending, "writeback_mib": 0.0}

    def sync(self):
        self.synced += 1

    def sleep(self, s):
        self.now += s
        self.polls += 1
        self.pending = max(0.0, self.pending - self.drain)


def _quiet(h: FakeHost, **kw):
    return quiet_host(sync=h.sync, state=h.state, clock=lambda: h.now, sleep=h.sleep, **kw)


def test_quiet_host_syncs_and_waits_until_the_writes_fall():
    h = FakeHost(pending=1000.0, drain=300.0)
    rec = _quiet(h, poll_s=1.0)
    assert h.synced == 1
    assert h.polls == 4  # 1000 -> 700 -> 400 -> 100 -> 0 (<= 64)
    assert rec["quiet"] is True
    assert rec["before"]["dirty_mib"] == 1000.0 and rec["after"]["dirty_mib"] == 0.0
    assert rec["settle_s"] == pytest.approx(4.0)
    assert "was 1000 MiB" in describe(rec) and "NOT quiet" not in describe(rec)


def test_quiet_host_gives_up_at_its_timeout_and_says_so():
    h = FakeHost(pending=10_000.0, drain=1.0)
    rec = _quiet(h, poll_s=1.0, timeout_s=5.0)
    assert rec["quiet"] is False
    assert h.polls == 5
    assert rec["after"]["dirty_mib"] > QUIET_PENDING_MIB
    assert "NOT quiet" in describe(rec)


def test_quiet_host_on_a_quiet_host_does_not_wait():
    h = FakeHost(pending=3.0, drain=0.0)
    rec = _quiet(h)
    assert h.synced == 1 and h.polls == 0 and rec["quiet"] is True


def test_quiet_host_where_meminfo_is_missing_only_syncs():
    synced = []
    rec = quiet_host(
        sync=lambda: synced.append(1),
        state=lambda: {"load_1m": None, "dirty_mib": None, "writeback_mib": None},
        sleep=lambda s: pytest.fail("no figures: nothing to wait for"),
    )
    assert synced == [1] and rec["quiet"] is None
    assert describe(rec).startswith("load ?")


def test_host_state_on_this_linux_host_reads_real_figures():
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo (not Linux)")
    st = host_state()
    assert st["available_mib"] is not None and st["available_mib"] > 0
    assert pending_mib(st) is not None


def test_cpu_shares_between_two_proc_stat_records(tmp_path):
    """cpu_times reads /proc/stat's first line; cpu_shares gives what the CPUs did in
    between as shares of all CPU time: busy (user+nice+system+irq+softirq), iowait,
    steal; describe says it."""
    f = tmp_path / "stat"
    f.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n")
    before = cpu_times(f)
    assert before == {
        "user": 100,
        "nice": 0,
        "system": 50,
        "idle": 800,
        "iowait": 10,
        "irq": 0,
        "softirq": 0,
        "steal": 40,
    }
    f.write_text("cpu  300 0 100 1400 60 0 0 140 0 0\n")
    shares = cpu_shares(before, cpu_times(f))
    # deltas: user 200, system 50, idle 600, iowait 50, steal 100; total 1000
    assert shares == {"busy": 0.25, "iowait": 0.05, "steal": 0.1}
    rec = {
        "before": {},
        "after": {"load_1m": 2.0},
        "settle_s": 0.1,
        "quiet": True,
        "during": shares,
    }
    assert describe(rec).endswith("during the start: CPUs busy 25%, iowait 5%, steal 10%")
    assert cpu_times(tmp_path / "absent") is None
    assert cpu_shares(None, before) is None and cpu_shares(before, before) is None


def test_quiet_host_bounds_a_flush_that_does_not_end():
    """os.sync can outlast any wait worth paying (a 16 GB checkpoint just written): the
    flush runs in a thread joined with the timeout, and the record says it had not ended."""
    import threading
    import time

    never = threading.Event()
    t0 = time.monotonic()
    rec = quiet_host(
        timeout_s=0.3,
        sync=never.wait,
        state=lambda: {"load_1m": 1.0, "dirty_mib": 5000.0, "writeback_mib": 0.0},
    )
    assert time.monotonic() - t0 < 5.0
    assert rec["flushed"] is False and rec["quiet"] is False
    assert "flush still running" in describe(rec)
    never.set()


def test_quiet_host_with_no_time_neither_flushes_nor_waits():
    """--quiet-host-timeout 0: only the record; quiet None (not tried), never "NOT quiet"."""
    h = FakeHost(pending=5000.0, drain=0.0)
    rec = _quiet(h, timeout_s=0)
    assert h.synced == 0 and h.polls == 0
    assert rec["quiet"] is None and rec["flushed"] is False
    assert "NOT quiet" not in describe(rec) and "flush still running" not in describe(rec)


def test_cpu_times_of_an_odd_proc_stat_is_none(tmp_path):
    f = tmp_path / "stat"
    f.write_text("cpu  12 x 3\n")
    assert cpu_times(f) is None
