"""``wcache bench --soak``: a daemon under attach/release load (a benchmark, not a test).

One real ``wcache serve --snapshot DIR --http PORT`` on the SmolLM2 bf16 fixture
(CPU); ``--clients`` raw client processes (``wcache.store.attach``, no engine)
attach and release in a loop, ``--cycles`` in all. The clients are started
before the daemon and begin as soon as its socket serves, so the first cycles
run while the daemon writes its snapshot. Every ``--kill-every-s`` seconds a
further client process, attaching and releasing as fast as it can, is
SIGKILLed at a random moment (mid-attach, most of the time: that is where it
spends its time).

Once the daemon serves lean, a peer daemon (``wcache serve --seed-from SOCKET``,
a full one with its vLLM imports) seeds from it while the clients attach
(``--no-peer`` leaves it out), and its arena is checked against the soak
daemon's, tensor by tensor; halfway through the cycles a further client
process writes a snapshot of the served arena (``write_snapshot``, as ``wcache
serve --snapshot`` does) and reads it back (``open_snapshot``, every file's
digest checked) (``--no-live-snapshot`` leaves it out).

``--engines N`` adds real vLLM CPU engines: once the daemon serves lean, N engines
restore from it side by side (``load_format="wcache"``, ``fallback=false``) while
the clients attach (an engine start takes ~1-3 min here beside the clients: give
the soak enough cycles to outlast them); then one engine loads the checkpoint from
disk, and each restored engine must have given its greedy tokens.

Each attach reads one tensor of the mapped arena (tensor ``cycle % n``; each
client starts at another offset, so every tensor is read many times) and
records its blake3 digest; ``wrong reads`` counts the reads whose digest differs
from that tensor's digest in a full read of the arena after the soak. Reported: attaches/s, p50/p99 attach
latency (connect + hello + get + map, seconds), the daemon's RSS (and its
anonymous/file/shmem parts) and open fds after the warm-up and at the end, with
their ratios, the snapshot's state over the run, and the daemon's own counters
from ``/metrics``.

    wcache bench --soak --clients 4 --cycles 10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from typing import Any

import blake3
from prometheus_client.parser import text_string_to_metric_families

from wcache.cli_args import reasoned
from wcache.store.protocol import parse_seconds

__all__ = ["main", "build_parser"]

#: Attach/release cycles over all clients: the issue's minimum for "RSS and fds flat".
DEFAULT_CYCLES = 10_000
#: Raw clients attaching in parallel: 2 cores here; 4 keeps the daemon's accept
#: loop and handler threads contended without starving the daemon itself.
DEFAULT_CLIENTS = 4
#: A client process is killed about this often (seconds): several kills in a run
#: of a minute or two, each a dropped connection mid-attach.
DEFAULT_KILL_EVERY_S = 3.0
#: A killed client runs this long at most before its SIGKILL (seconds), drawn
#: uniformly from (0, this] after it started attaching.
KILL_WINDOW_S = 1.0
#: Cycles (in all) before the "start" sample of RSS and fds, taken while every
#: client pauses between two cycles (no connection open): the first attaches
#: grow the daemon's thread stacks, msgpack buffers and allocator arenas once.
WARMUP_CYCLES = 1_000
#: RSS and fds are sampled this often (seconds).
SAMPLE_S = 0.5
#: After the last client ends, wait this long for the daemon's handler threads to
#: finish before the "end" sample (seconds): each exits within milliseconds.
SETTLE_S = 2.0
#: Clients wait at most this long for the daemon's socket (seconds): a bf16
#: SmolLM2 daemon serves in under a minute on 2 cores.
SERVE_TIMEOUT_S = 600.0
#: Seconds for one client connect + hello + get.
CONNECT_TIMEOUT_S = 30.0
#: RSS and fds are also reported at this many evenly spaced cycles after the
#: warm-up (samples taken with the clients running), to show a level, not a trend.
CHECKPOINTS = 4
#: The live snapshot is written once this fraction of the cycles is done.
LIVE_SNAPSHOT_AT = 0.5

_LIVE_SNAPSHOT = """
import json, sys, time
import warnings; warnings.filterwarnings("ignore")
from wcache.store import CacheKey, attach
from wcache.store.snapshot import check_key, open_snapshot, write_snapshot
key, sock_dir, dev, root = CacheKey(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
with attach(key, socket_dir=sock_dir, device_id=dev) as att:
    write_snapshot(root, "soak", att.arena, att.manifest, key)
t1 = time.perf_counter()
check_key(open_snapshot(root, "soak"), key)
print(json.dumps({"write_s": t1 - t0, "read_s": time.perf_counter() - t1}))
"""

_KILLED_CLIENT = """
import sys
from wcache.store import CacheKey, attach
import json
key, sock_dir, dev = CacheKey(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
print("go", flush=True)
while True:
    attach(key, socket_dir=sock_dir, device_id=dev).close()
"""


def rss_parts(pid: int) -> dict[str, int]:
    """VmRSS and its RssAnon/RssFile/RssShmem parts of ``pid`` (bytes), from
    ``/proc/PID/status``."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(rest.split()[0]) * 1024  # kB
    return out


def _proc_status(pid: int) -> dict[str, int]:
    """:func:`rss_parts` and the open fds of ``pid``."""
    return {**rss_parts(pid), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _digest(t: Any) -> str:
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    return blake3.blake3(memoryview(t.flatten().view(torch.uint8).numpy())).hexdigest()


def _wait_socket(sock_dir: str, deadline: float) -> tuple[str, dict[str, Any]]:
    from wcache.store import StoreError, daemon_status  # noqa: PLC0415 (imported at call time: tests patch daemon_status)
    from wcache.store.paths import list_sockets  # noqa: PLC0415 (imported at call time: tests patch list_sockets)

    while time.monotonic() < deadline:
        for sock in list_sockets(sock_dir) if os.path.isdir(sock_dir) else ():
            try:
                return sock, daemon_status(sock)
            except StoreError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"no daemon served in {sock_dir}")


def _client(
    index: int,
    clients: int,
    cycles: int,
    sock_dir: str,
    done: Any,
    results: Any,
    paused: Any,
    resume: Any,
    warmup_cycles: int = WARMUP_CYCLES,
) -> None:
    """One soak client: ``cycles`` attach/read/release cycles; puts its result dict."""

    warnings.filterwarnings("ignore")  # torch.frombuffer on a read-only mapping warns once
    from wcache.store import CacheKey, StoreError, attach  # noqa: PLC0415 (imported at call time: tests patch attach)

    _, st = _wait_socket(sock_dir, time.monotonic() + SERVE_TIMEOUT_S)
    key, dev = CacheKey(st["key_fields"]), st["device_id"]
    first = attach(key, socket_dir=sock_dir, device_id=dev, connect_timeout_s=CONNECT_TIMEOUT_S)
    names = sorted(first.tensors)
    first.close()
    latencies: list[float] = []
    errors: dict[str, int] = {}  # StoreError reason code -> count
    seen: dict[tuple[str, str], int] = {}  # (tensor, digest read) -> reads
    start = time.perf_counter()
    warmup = warmup_cycles // clients
    for i in range(cycles):
        if i == warmup:  # hold no connection while the main process samples the daemon
            with paused.get_lock():
                paused.value += 1
            resume.wait()
        t0 = time.perf_counter()
        try:
            att = attach(
                key, socket_dir=sock_dir, device_id=dev, connect_timeout_s=CONNECT_TIMEOUT_S
            )
        except StoreError as e:
            errors[e.code] = errors.get(e.code, 0) + 1
            continue
        latencies.append(time.perf_counter() - t0)
        name = names[(i + index * len(names) // clients) % len(names)]
        read = (name, _digest(att.tensors[name]))
        seen[read] = seen.get(read, 0) + 1
        att.close()
        with done.get_lock():
            done.value += 1
    results.put(
        {
            "client": index,
            "latencies": latencies,
            "seen": list(seen.items()),
            "errors": errors,
            "seconds": time.perf_counter() - start,
            "tensors": len(names),
        }
    )


def _reference(sock_dir: str, st: dict[str, Any]) -> dict[str, str]:
    """Every tensor's blake3, from one more attach after the soak: the reads during
    the soak (while the snapshot was written, clients were killed) must equal it."""
    from wcache.store import CacheKey, attach  # noqa: PLC0415 (imported at call time: tests patch attach)

    with attach(CacheKey(st["key_fields"]), socket_dir=sock_dir, device_id=st["device_id"]) as att:
        return {name: _digest(t) for name, t in att.tensors.items()}


def _metrics(url: str) -> dict[str, float]:

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("tp_rank", "pp_rank")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _killer(
    key_fields: dict,
    sock_dir: str,
    dev: str,
    every_s: float,
    stop: threading.Event,
    kills: list[float],
    env: dict[str, str],
) -> None:
    rng = random.Random(0)
    while not stop.wait(every_s):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CLIENT, json.dumps(key_fields), sock_dir, dev],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert proc.stdout is not None  # stdout=PIPE
        if proc.stdout.readline().strip() != "go":
            proc.kill()
            proc.wait()
            continue
        delay = rng.uniform(0, KILL_WINDOW_S)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(delay)


def _live_snapshot(
    key_fields: dict, sock_dir: str, dev: str, root: str, env: dict[str, str], out: dict[str, Any]
) -> None:
    """Write a snapshot of the served arena from a client process, read it back."""
    done = subprocess.run(
        [sys.executable, "-c", _LIVE_SNAPSHOT, json.dumps(key_fields), sock_dir, dev, root],
        capture_output=True,
        text=True,
        env=env,
        timeout=SERVE_TIMEOUT_S,
    )
    out.update(
        json.loads(done.stdout.strip().splitlines()[-1])
        if done.returncode == 0
        else {"error": done.stderr.strip()[-500:]}
    )
    out["ok"] = done.returncode == 0


def _peer(
    model: str, sock: str, peer_dir: str, st: dict[str, Any], done: Any, out: dict[str, Any]
) -> None:
    """``wcache serve --seed-from sock``: its origin, how long it took, the cycles
    done meanwhile, and whether it serves the soak daemon's bytes."""
    from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)
    from wcache.store import daemon_status  # noqa: PLC0415 (imported at call time: tests patch daemon_status)
    from wcache.store.paths import list_sockets  # noqa: PLC0415 (imported at call time: tests patch list_sockets)

    out["at_cycle"] = done.value
    t0 = time.monotonic()
    # --no-lean: it is read once and stopped, so its own hand-off would only cost time
    peer = DaemonProcess(model, peer_dir, ["--seed-from", sock, "--no-lean"])
    try:
        peer.start()
        out["ready_s"] = time.monotonic() - t0
        out["ready_at_cycle"] = done.value
        pst = daemon_status(list_sockets(peer_dir)[0])
        out["origin"] = pst.get("origin")
        out["digests"] = _reference(peer_dir, pst)
    except Exception as e:  # noqa: BLE001  (reported, the soak goes on)
        out["error"] = f"{type(e).__name__}: {e}; {' | '.join(list(peer.lines)[-5:])}"
    finally:
        peer.stop()


def _engines(
    model: str, sock_dir: str, n: int, lean: threading.Event, done: Any, out: dict[str, Any]
) -> None:
    """Once the daemon serves lean, ``n`` engines restoring from it side by side (each
    its own process, while the clients attach); then a disk engine, the reference their
    greedy tokens are compared with (it needs no daemon, so it may run after the soak)."""
    from wcache.daemon.process import run_engine  # noqa: PLC0415 (imported at call time: tests patch run_engine)

    lean.wait(SERVE_TIMEOUT_S)
    runs: list[dict[str, Any]] = [{} for _ in range(n)]

    def one(row: dict[str, Any]) -> None:
        row["at_cycle"] = done.value
        t0 = time.monotonic()
        try:
            res = run_engine(model, "wcache", {"fallback": False, "socket_dir": sock_dir})
            row["token_ids"] = res["token_ids"]
            row["restore_s"] = next(
                (r["seconds"] for r in res.get("load", []) if r.get("phase") == "restore"), None
            )
        except RuntimeError as e:  # reported, the soak goes on
            row["error"] = str(e).splitlines()[-1]
        row["process_s"] = time.monotonic() - t0
        row["end_cycle"] = done.value

    threads = [threading.Thread(target=one, args=(row,), daemon=True) for row in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["runs"] = runs
    try:
        disk = run_engine(model, "auto", {})["token_ids"]
    except RuntimeError as e:
        out["error"] = f"disk engine: {str(e).splitlines()[-1]}"
        return
    for row in runs:
        if "token_ids" in row:
            row["identical"] = row.pop("token_ids") == disk


def run(
    clients: int,
    cycles: int,
    kill_every_s: float,
    warmup_cycles: int = WARMUP_CYCLES,
    peer: bool = True,
    live_snapshot: bool = True,
    engines: int = 0,
) -> dict[str, Any]:
    """One soak run; returns its figures (see the module docstring). The warm-up
    sample is taken after ``warmup_cycles`` cycles over all clients; ``peer`` and
    ``live_snapshot`` add the seeding peer and the snapshot written mid-run;
    ``engines`` the vLLM CPU engines restoring from the daemon during the run.

    Its working folder (``wc-soak-*`` under the temporary directory: the socket, the
    daemon's snapshot and the one written mid-run, about 0.5 GB for the bf16 SmolLM2)
    is removed when the run ends, also when it fails, after the daemon is stopped."""
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    model = str(build("bf16"))
    tmp = tempfile.mkdtemp(prefix="wc-soak-")
    daemons: list[Any] = []
    try:
        out = _run_in(
            tmp,
            model,
            daemons,
            clients,
            cycles,
            kill_every_s,
            warmup_cycles,
            peer,
            live_snapshot,
            engines,
        )
        out["workdir"] = tmp  # removed below: the report's readers can check it is gone
        return out
    finally:
        for daemon in daemons:
            daemon.stop()  # a no-op after _run_in's own stop
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in(
    tmp: str,
    model: str,
    daemons: list[Any],
    clients: int,
    cycles: int,
    kill_every_s: float,
    warmup_cycles: int,
    peer: bool,
    live_snapshot: bool,
    engines: int,
) -> dict[str, Any]:
    """``run``'s body in the working folder ``tmp``; the daemon it starts is appended to
    ``daemons`` (for ``run`` to stop when this raises)."""
    from wcache.daemon.process import DaemonProcess, free_port  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)
    from wcache.store.paths import list_sockets  # noqa: PLC0415 (imported at call time: tests patch list_sockets)

    sock_dir = os.path.join(tmp, "s")
    os.mkdir(sock_dir, 0o700)
    snap = os.path.join(tmp, "snap")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    done, results, paused, resume = ctx.Value("l", 0), ctx.Queue(), ctx.Value("l", 0), ctx.Event()
    per = [cycles // clients + (1 if i < cycles % clients else 0) for i in range(clients)]
    workers = [
        ctx.Process(
            target=_client,
            args=(i, clients, per[i], sock_dir, done, results, paused, resume, warmup_cycles),
        )
        for i in range(clients)
    ]
    for w in workers:
        w.start()  # they import torch meanwhile and wait for the socket
    daemon = DaemonProcess(model, sock_dir, ["--snapshot", snap, "--http", f"127.0.0.1:{port}"])
    daemons.append(daemon)
    threading.Thread(target=daemon.start, daemon=True).start()
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while daemon.proc is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sock, st = _wait_socket(sock_dir, deadline)
    # one row per sample: time, cycles, memory and fd counts, snapshot state
    samples: list[dict[str, Any]] = [
        {
            "t": 0.0,
            "cycles": 0,
            **_proc_status(daemon.pid),
            "snapshot": (st.get("snapshot") or {}).get("state"),
            "connections": 0,
        }
    ]
    snapshot_states = [samples[0]["snapshot"]]
    stop = threading.Event()
    kills: list[float] = []
    killer = threading.Thread(
        target=_killer,
        args=(st["key_fields"], sock_dir, st["device_id"], kill_every_s, stop, kills, daemon.env),
        daemon=True,
    )
    killer.start()
    t0 = time.monotonic()
    warm: dict[str, Any] | None = None
    from wcache.store import StoreError, daemon_status  # noqa: PLC0415 (imported at call time: tests patch daemon_status)

    side: list[threading.Thread] = []
    peer_out: dict[str, Any] = {} if peer else {"skipped": True}
    snap_out: dict[str, Any] = {} if live_snapshot else {"skipped": True}
    # the serving state from the first status on: on a quick host the hand-off to the
    # lean process can come before the loop's first sample (SAMPLE_S)
    serving_states = [None, *([st["serving"]] if st.get("serving") else [])]
    engines_out: dict[str, Any] = {} if engines else {"skipped": True}
    lean = threading.Event()
    if engines:
        side.append(
            threading.Thread(
                target=_engines,
                args=(model, sock_dir, engines, lean, done, engines_out),
                daemon=True,
            )
        )
        side[-1].start()
    while any(w.is_alive() for w in workers):
        time.sleep(SAMPLE_S)
        try:
            now = daemon_status(sock)
        except StoreError:
            now = {}
        state = (now.get("snapshot") or {}).get("state")
        if state != snapshot_states[-1]:
            snapshot_states.append(state)
        if now.get("serving") and now.get("serving") != serving_states[-1]:
            serving_states.append(now["serving"])
        if now.get("serving") == "lean":
            lean.set()
        if peer and not peer_out and now.get("serving") == "lean":  # seed from the lean process
            peer_out["started"] = True
            side.append(
                threading.Thread(
                    target=_peer,
                    args=(model, sock, os.path.join(tmp, "peer"), st, done, peer_out),
                    daemon=True,
                )
            )
            os.mkdir(os.path.join(tmp, "peer"), 0o700)
            side[-1].start()
        if live_snapshot and not snap_out and done.value >= cycles * LIVE_SNAPSHOT_AT:
            snap_out["at_cycle"] = done.value
            side.append(
                threading.Thread(
                    target=_live_snapshot,
                    args=(
                        st["key_fields"],
                        sock_dir,
                        st["device_id"],
                        os.path.join(tmp, "live-snap"),
                        daemon.env,
                        snap_out,
                    ),
                    daemon=True,
                )
            )
            side[-1].start()
        samples.append(
            {
                "t": time.monotonic() - t0,
                "cycles": done.value,
                **_proc_status(daemon.pid),
                "snapshot": state,
                "connections": now.get("clients_connected", 0) + 1,
            }
        )  # + this status
        if warm is None and paused.value == clients:  # every client between two cycles
            time.sleep(SETTLE_S)
            warm = {
                "t": time.monotonic() - t0,
                "cycles": done.value,
                **_proc_status(daemon.pid),
                "connections": 0,
            }
            resume.set()
        if done.value >= cycles:
            break
    got = [results.get(timeout=SERVE_TIMEOUT_S) for _ in workers]
    wall = time.monotonic() - t0
    lean.set()  # engines that never saw the lean process restore from what serves
    for thread in side:  # a peer still starting, a snapshot or an engine still running
        thread.join(SERVE_TIMEOUT_S)
    reference = _reference(sock_dir, st)
    for w in workers:
        w.join()
    stop.set()
    killer.join()
    time.sleep(SETTLE_S)
    end = {**_proc_status(daemon.pid), "connections": 0}
    metrics = _metrics(url)
    daemon.stop()
    if warm is None:
        raise RuntimeError("the clients ended before the warm-up sample")
    lat = sorted(x for g in got for x in g["latencies"])
    after = [x for x in samples if warm is not None and x["t"] > warm["t"]]

    def nearest(c: int) -> dict[str, Any]:
        """The sample after the warm-up whose cycle count is nearest ``c``."""
        return min(after, key=lambda x: abs(x["cycles"] - c))

    checkpoints = (
        [
            nearest(c)
            for c in (
                warm["cycles"] + (cycles - warm["cycles"]) * (i + 1) // CHECKPOINTS
                for i in range(CHECKPOINTS)
            )
        ]
        if after
        else []
    )
    if "digests" in peer_out:
        peer_out["wrong_tensors"] = sum(
            1 for k, v in reference.items() if peer_out["digests"].get(k) != v
        )
        peer_out["tensors"] = len(peer_out.pop("digests"))
    client_s = max(g["seconds"] for g in got)
    return {
        "clients": clients,
        "cycles": len(lat),
        "cycles_asked": cycles,
        "kills": len(kills),
        "wall_s": wall,
        "attaches_per_s": len(lat) / client_s,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1e3,
        "reads_checked": sum(n for g in got for _, n in g["seen"]),
        "wrong_reads": sum(
            n for g in got for (name, digest), n in g["seen"] if reference[name] != digest
        ),
        "client_errors": {k: v for g in got for k, v in g["errors"].items()},
        "tensors": got[0]["tensors"],
        "ready": samples[0],
        "warm": warm,
        "end": end,
        "rss_ratio": end["VmRSS"] / warm["VmRSS"],
        "fds_ratio": end["fds"] / warm["fds"],
        # the daemon's fds that are not client connections (each connection is one fd)
        "idle_fds_ratio": (end["fds"] - end["connections"]) / (warm["fds"] - warm["connections"]),
        "snapshot_states": snapshot_states,
        "snapshot_written_at_cycle": next(
            (s["cycles"] for s in samples if s["snapshot"] == "written"), None
        ),
        "metrics": {
            k: v
            for k, v in metrics.items()
            if k.startswith(
                (
                    "wcache_attaches",
                    "wcache_releases",
                    "wcache_refusals",
                    "wcache_attachments_active",
                    "wcache_clients",
                    "wcache_snapshot_state{state=written",
                    "wcache_seeds_served",
                )
            )
        },
        "sockets_left": len(list_sockets(sock_dir)),
        "serving_states": serving_states[1:],
        "peer": peer_out,
        "live_snapshot": snap_out,
        "engines": engines_out,
        "checkpoints": [
            {k: c[k] for k in ("t", "cycles", "VmRSS", "RssAnon", "fds", "connections")}
            for c in checkpoints
        ],
        "rss_anon_max_after_warmup": max((x["RssAnon"] for x in after), default=None),
        "seeds_served": metrics.get("wcache_seeds_served_total"),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(r: dict[str, Any]) -> str:
    """The run as text (what docs/benchmarks.md records)."""
    lines = [
        f"soak: {r['clients']} clients, {r['cycles']} attach/read/release cycles "
        f"({r['cycles_asked']} asked), {r['kills']} clients SIGKILLed mid-attach, {r['wall_s']:.1f} s",
        f"  attaches/s              {r['attaches_per_s']:.0f}",
        f"  attach latency p50/p99  {r['p50_ms']:.2f} ms / {r['p99_ms']:.2f} ms",
        f"  wrong reads             {r['wrong_reads']} of {r['reads_checked']} (one tensor's "
        f"blake3 per attach, {r['tensors']} tensors in rotation, against every tensor's digest "
        f"read after the soak)",
        f"  client errors           {r['client_errors'] or 'none'}",
        f"  snapshot state          {' -> '.join(map(str, r['snapshot_states']))} "
        f"(written by cycle {r['snapshot_written_at_cycle']})",
        "  daemon                  ready         after warm-up  end           end/warm-up",
    ]
    for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
        ratio = r["end"][k] / r["warm"][k] if r["warm"][k] else float("nan")
        lines.append(
            f"    {k:<21} {_mib(r['ready'][k]):<13} {_mib(r['warm'][k]):<14} "
            f"{_mib(r['end'][k]):<13} {ratio:.4f}"
        )
    lines.append(
        f"    {'open fds':<21} {r['ready']['fds']:<13} {r['warm']['fds']:<14} "
        f"{r['end']['fds']:<13} {r['fds_ratio']:.4f}"
    )
    idle = [r[k]["fds"] - r[k]["connections"] for k in ("ready", "warm", "end")]
    lines.append(
        f"    {'fds - connections':<21} {idle[0]:<13} {idle[1]:<14} {idle[2]:<13} "
        f"{r['idle_fds_ratio']:.4f}"
    )
    if r["checkpoints"]:
        lines.append(
            "  after warm-up (clients running)  "
            + "  ".join(
                f"cycle {c['cycles']}: {_mib(c['VmRSS'])}, {c['fds']} fds" for c in r["checkpoints"]
            )
        )
        lines.append(f"    RssAnon max after warm-up {_mib(r['rss_anon_max_after_warmup'])}")
    lines.append(f"  serving                 {' -> '.join(r['serving_states']) or '?'}")
    p = r["peer"]
    if p.get("skipped"):
        lines.append("  peer seeding            not run (--no-peer)")
    elif "error" in p or "wrong_tensors" not in p:
        lines.append(f"  peer seeding            FAILED: {p.get('error', 'did not start')}")
    else:
        lines.append(
            f"  peer seeding            `wcache serve --seed-from` started at cycle {p['at_cycle']}, "
            f"ready (origin={p['origin']}) at cycle {p['ready_at_cycle']} after {p['ready_s']:.1f} s; "
            f"{p['wrong_tensors']} of {p['tensors']} tensors differ from the soak daemon's; "
            f"seeds served {r['seeds_served']:g}"
        )
    q = r["live_snapshot"]
    if q.get("skipped"):
        lines.append("  live snapshot           not run (--no-live-snapshot)")
    elif not q.get("ok"):
        lines.append(f"  live snapshot           FAILED: {q.get('error', 'did not run')}")
    else:
        lines.append(
            f"  live snapshot           written by a client at cycle {q['at_cycle']} in {q['write_s']:.1f} s, "
            f"read back (digests checked) in {q['read_s']:.1f} s"
        )
    e = r.get("engines", {"skipped": True})
    if e.get("skipped"):
        lines.append("  vLLM engines            not run (--engines 0)")
    elif "error" in e:
        lines.append(f"  vLLM engines            FAILED: {e['error']}")
    else:
        for i, x in enumerate(e["runs"], 1):
            what = (
                f"FAILED: {x['error']}"
                if "error" in x
                else f"restore {x['restore_s']:.3f} s, "
                f"{'same tokens as the disk engine' if x['identical'] else 'TOKENS DIFFER'}"
            )
            lines.append(
                f"  vLLM engine {i:<11} cycles {x['at_cycle']}-{x['end_cycle']}, "
                f"process {x['process_s']:.1f} s: {what}"
            )
    lines.append(
        f"  warm-up and end samples: every client paused (no connection open), "
        f"{SETTLE_S:.0f} s after; warm-up at cycle {r['warm']['cycles']} (t={r['warm']['t']:.1f} s)"
    )
    lines.append(
        "  daemon /metrics at the end: "
        + ", ".join(f"{k}={v:g}" for k, v in sorted(r["metrics"].items()))
    )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wcache bench --soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--clients",
        type=int,
        default=DEFAULT_CLIENTS,
        help=f"raw client processes attaching in parallel (default {DEFAULT_CLIENTS})",
    )
    p.add_argument(
        "--cycles",
        type=int,
        default=DEFAULT_CYCLES,
        help=f"attach/read/release cycles over all clients (default {DEFAULT_CYCLES}, "
        "the issue's minimum; ~1-2 min here)",
    )
    p.add_argument(
        "--kill-every-s",
        type=reasoned(parse_seconds),
        default=DEFAULT_KILL_EVERY_S,
        help="a further client, attaching in a loop, is SIGKILLed at a random moment "
        f"this often (seconds, default {DEFAULT_KILL_EVERY_S:g})",
    )
    p.add_argument(
        "--warmup-cycles",
        type=int,
        default=WARMUP_CYCLES,
        help="cycles (over all clients) before the warm-up sample of RSS and fds "
        f"(default {WARMUP_CYCLES}); a CPU daemon hands off to its lean "
        "serving process after the snapshot is written, a few hundred cycles "
        "in, so the serving process's own warm-up starts there",
    )
    p.add_argument(
        "--no-peer",
        action="store_true",
        help="leave out the peer daemon (`wcache serve --seed-from SOCKET`, a full "
        "process with vLLM's imports: ~1 GB and ~30-60 s here) that seeds from "
        "the soak daemon once it serves lean",
    )
    p.add_argument(
        "--no-live-snapshot",
        action="store_true",
        help="leave out the snapshot of the served arena that a client process "
        # %% : argparse %-formats help strings (a bare "50% of" raised TypeError on --help)
        f"writes and reads back once {LIVE_SNAPSHOT_AT:.0%}% of the cycles are done",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=0,
        help="vLLM CPU engines that restore from the daemon side by side during "
        "the soak, each compared with a disk engine's greedy tokens (default "
        "0; each costs ~1-3 min and ~3-4 GB here: use --cycles 30000)",
    )
    p.add_argument("--json", help="also write the figures here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    r = run(
        args.clients,
        args.cycles,
        args.kill_every_s,
        args.warmup_cycles,
        peer=not args.no_peer,
        live_snapshot=not args.no_live_snapshot,
        engines=args.engines,
    )
    sys.stdout.write(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    ok = (
        r["wrong_reads"] == 0
        and r["cycles"] >= args.cycles
        and (args.no_peer or r["peer"].get("wrong_tensors") == 0)
        and (args.no_live_snapshot or r["live_snapshot"].get("ok"))
        and (
            not args.engines
            or (
                len(r["engines"].get("runs", [])) == args.engines
                and all(x.get("identical") for x in r["engines"]["runs"])
            )
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
