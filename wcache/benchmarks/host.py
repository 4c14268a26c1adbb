"""The host around a timed engine start: its state, and a quiet start for the row.

A benchmark row that starts right after another row's big writes (a 16 GB checkpoint,
a snapshot, a cache root) can inherit that row's page-cache writeback: its import and
its loads then compete with the disk flush, and the row is slower for a reason that is
not its own. :func:`quiet_host` flushes dirty pages (``os.sync``) and waits, up to a
limit, until the kernel's Dirty + Writeback fall under a threshold, before the row's
clock starts; :func:`host_state` records what the host looked like, so a slow row can
be told from a loaded host afterwards (issue 48's disk rows spread 103-158 s on one
H100 machine, 2026-12-05).

Linux-only figures (``/proc/meminfo``, ``os.getloadavg``); elsewhere the fields are
None and :func:`quiet_host` only syncs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: The /proc/meminfo fields recorded, each as ``<name>_mib`` (the kernel gives kB).
MEMINFO_FIELDS = {
    "Dirty": "dirty_mib",
    "Writeback": "writeback_mib",
    "MemAvailable": "available_mib",
}
#: Dirty + Writeback (MiB) under which the host counts as quiet.
QUIET_PENDING_MIB = 64.0
#: The longest :func:`quiet_host` spends on the flush and the wait together (seconds).
QUIET_TIMEOUT_S = 60.0


def host_state(meminfo: Path = Path("/proc/meminfo")) -> dict[str, float | None]:
    """The host now: ``load_1m`` (the 1-minute load average) and, in MiB, ``dirty_mib``,
    ``writeback_mib``, ``available_mib`` (``/proc/meminfo``); a figure the host does
    not give is None."""
    out: dict[str, float | None] = dict.fromkeys(MEMINFO_FIELDS.values())
    try:
        out["load_1m"] = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        out["load_1m"] = None
    try:
        text = meminfo.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        key = MEMINFO_FIELDS.get(name.strip())
        fields = rest.split()
        if key and fields and fields[0].isdigit():
            out[key] = round(int(fields[0]) / 1024, 1)
    return out


#: /proc/stat's first line, in order (USER_HZ ticks summed over every CPU).
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: Path = Path("/proc/stat")) -> dict[str, int] | None:
    """The host's cumulative CPU time by kind (:data:`CPU_FIELDS`, ticks over all
    CPUs), or None where ``/proc/stat`` is not there."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu":
        return None
    try:
        values = [int(v) for v in first[1 : 1 + len(CPU_FIELDS)]]
    except ValueError:  # not the format documented in proc(5): no figures
        return None
    return dict(zip(CPU_FIELDS, values))


def cpu_shares(
    before: Mapping[str, int] | None, after: Mapping[str, int] | None
) -> dict[str, float] | None:
    """What the host's CPUs did between two :func:`cpu_times` records, as shares of all
    CPU time (0..1): ``busy`` (user, nice, system, irq, softirq), ``iowait`` (idle
    waiting on I/O) and ``steal`` (taken by the hypervisor: a VM's noisy neighbours).
    None when a record is missing or no time passed."""
    if not before or not after:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in CPU_FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {
        "busy": round(busy / total, 3),
        "iowait": round(d["iowait"] / total, 3),
        "steal": round(d["steal"] / total, 3),
    }


def pending_mib(state: Mapping[str, Any]) -> float | None:
    """Dirty + Writeback of a :func:`host_state` record, or None where not given."""
    dirty, writeback = state.get("dirty_mib"), state.get("writeback_mib")
    if dirty is None or writeback is None:
        return None
    return float(dirty) + float(writeback)


def quiet_host(
    max_pending_mib: float = QUIET_PENDING_MIB,
    timeout_s: float = QUIET_TIMEOUT_S,
    *,
    poll_s: float = 0.2,
    sync: Callable[[], None] = os.sync,
    state: Callable[[], dict[str, float | None]] = host_state,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Flush the host's dirty pages and wait for its writeback to settle, for at most
    ``timeout_s`` in all.

    The flush (``sync``) runs in a daemon thread joined with the timeout: ``os.sync``
    returns only when everything is written, which after a 16 GB checkpoint can take
    longer than any wait worth paying; a flush still running at the timeout is left to
    finish on its own (``flushed`` False).

    Args:
        max_pending_mib: Dirty + Writeback (MiB) at or under which the host is quiet.
        timeout_s: the longest flush and wait (seconds); a host still busy then is
            recorded as such (``quiet`` False) and the row runs anyway; 0 or less:
            neither flush nor wait, only the record (``quiet`` None).
        poll_s, sync, state, clock, sleep: the probe's parts (tests replace them).

    Returns:
        ``{"before", "after"}`` (:func:`host_state` records), ``settle_s`` (seconds
        spent: the flush and the wait), ``flushed`` (the flush ended in time) and
        ``quiet`` (True, False, or None where not tried or the host gives no
        Dirty/Writeback figures).
    """
    before = state()
    if timeout_s <= 0:
        return {"before": before, "after": before, "settle_s": 0.0, "flushed": False, "quiet": None}
    t0 = clock()
    flusher = threading.Thread(target=sync, name="wcache-host-sync", daemon=True)
    flusher.start()
    flusher.join(timeout_s)
    flushed = not flusher.is_alive()
    after = before if pending_mib(before) is None else state()
    while (p := pending_mib(after)) is not None and p > max_pending_mib:
        if clock() - t0 >= timeout_s:
            break
        sleep(poll_s)
        after = state()
    pending = pending_mib(after)
    return {
        "before": before,
        "after": after,
        "settle_s": round(clock() - t0, 3),
        "flushed": flushed,
        "quiet": None if pending is None else pending <= max_pending_mib,
    }


def describe(record: Mapping[str, Any]) -> str:
    """One :func:`quiet_host` record in words, e.g. ``"load 1.2, pending writes 3 MiB
    (was 850 MiB), settled in 4.1 s, during the start: CPUs busy 12%, iowait 1%, steal
    0%"`` (``during``: :func:`cpu_shares` over the timed start, where recorded)."""
    after = record.get("after") or {}
    before = record.get("before") or {}
    parts = [f"load {after['load_1m']}" if after.get("load_1m") is not None else "load ?"]
    now, was = pending_mib(after), pending_mib(before)
    if now is not None:
        text = f"pending writes {now:.0f} MiB"
        if was is not None and was > now:
            text += f" (was {was:.0f} MiB)"
        parts.append(text)
    parts.append(f"settled in {record.get('settle_s', 0):.1f} s")
    if record.get("flushed") is False and record.get("quiet") is not None:
        parts.append("flush still running")
    if record.get("quiet") is False:
        parts.append("NOT quiet")
    during = record.get("during")
    if isinstance(during, Mapping):
        parts.append(
            "during the start: CPUs busy {:.0%}, iowait {:.0%}, steal {:.0%}".format(
                during["busy"], during["iowait"], during["steal"]
            )
        )
    return ", ".join(parts)
