"""Cold start: how long a daemon takes to become ready from the checkpoint, from
a prepared snapshot, and from a peer daemon; and the machine's raw read/copy
bandwidth measured in the same run (``wcache bench --cold-start``).

Synthetic mode (``run_synthetic``, no vLLM; the GPU path): per format and size,
in this process, with the Llama-shaped stacks of :mod:`wcache.benchmarks.synthetic`:

* **checkpoint**: read the safetensors checkpoint (page cache warm), run each
  layer's ``plan.prepare`` (every TRANSFORM), build the daemon's arena
  (``DaemonServer``): what ``wcache serve`` does after vLLM's model build.
* **snapshot (warm / cold)**: ``DaemonServer(snapshot_arena(open_snapshot(...)))``:
  open and check the small files, read the arena file (reader threads), blake3
  it, fill the arena (CUDA: pinned staging + async copies). ``cold`` first drops
  the file from the page cache (``POSIX_FADV_DONTNEED``), so it reads the disk.
* **peer**: a second ``DaemonServer`` seeded from the first over
  torch.distributed (gloo on CPU; NCCL from cuda:0 to cuda:1, only with two GPUs).
* **raw**: the same bytes with nothing else: the snapshot file read into a
  pre-faulted host buffer by the same reader threads (page cache warm), a
  host-to-device copy from pinned memory (CUDA), and the copy a peer needs
  (host memcpy on CPU, cuda:0 -> cuda:1 on two GPUs).

Every daemon's arena digest is compared with the checkpoint-built one's.

Engine mode (``run_engine_daemons``, vLLM CPU): real ``wcache serve`` daemons on
the SmolLM2 fixtures, started from the checkpoint (``--snapshot``), restarted
from the snapshot, and seeded from a peer; the ``ready_s`` each prints.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

import wcache.benchmarks.synthetic as syn
from wcache.benchmarks.bench_restore import (
    _key_fields,
    _target,
    _warm_page_cache,
    load_cpu_ops,
    planned_linears,
    prepare_from_checkpoint,
)
from wcache.core import NoPlan
from wcache.store import CacheKey, DaemonServer, Export
from wcache.store.seed import SeedSource, seed_arena
from wcache.store.snapshot import _memview, read_bytes_into
from wcache.testing.fixtures import build

__all__ = ["run_synthetic", "run_engine_daemons", "synthetic_table", "engine_table"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _digest(server: Any) -> str:
    from wcache.store.prebuilt import served_arena  # noqa: PLC0415 (imported at call time: tests patch served_arena)
    from wcache.store.seed import arena_digest  # noqa: PLC0415 (imported at call time: tests patch arena_digest)

    view = served_arena(server)
    try:
        return arena_digest(view.tensor)[1]
    finally:
        view.close()


def _raw(path: str, offset: int, nbytes: int, device: torch.device, peer: bool) -> dict[str, float]:
    """Raw bandwidth figures for ``nbytes`` (seconds)."""

    out: dict[str, float] = {}
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(0)  # pre-fault: page faults are not part of a read's bandwidth
    t0 = time.perf_counter()
    read_bytes_into(path, offset, _memview(host))
    out["raw_read_s"] = time.perf_counter() - t0
    _drop_page_cache(path)
    t0 = time.perf_counter()
    read_bytes_into(path, offset, _memview(host))
    out["raw_read_cold_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        chunk = 256 << 20
        pinned = torch.empty(min(chunk, nbytes), dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _sync(device)
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            n = min(chunk, nbytes - off)
            dst[off : off + n].copy_(pinned[:n], non_blocking=True)
        _sync(device)
        out["raw_h2d_s"] = time.perf_counter() - t0
        if peer:
            other = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            other.copy_(dst)
            torch.cuda.synchronize(1)
            torch.cuda.synchronize(device)
            out["raw_p2p_s"] = time.perf_counter() - t0
            del other
        del dst, pinned
        torch.cuda.empty_cache()
    else:
        other = torch.empty(nbytes, dtype=torch.uint8)
        other.fill_(0)
        t0 = time.perf_counter()
        other.copy_(host)
        out["raw_memcpy_s"] = time.perf_counter() - t0
        del other
    del host
    return out


def run_synthetic(
    device: torch.device,
    sizes: tuple[str, ...],
    formats: tuple[str, ...],
    *,
    bench_dir: str | None,
    snap_dir: str | None,
    seed: int,
    layers: int | None,
    socket_dir: str,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One row per (format, size); see the module docstring for what is timed."""
    from wcache.store.prebuilt import served_arena  # noqa: PLC0415 (imported at call time: tests patch served_arena)
    from wcache.store.snapshot import ARENA_FILE, open_snapshot, snapshot_arena, write_snapshot  # noqa: PLC0415 (imported at call time: tests patch write_snapshot)

    load_cpu_ops(device)
    target = _target(device, False)
    dev = str(device) if device.type == "cuda" else "cpu"
    peer = device.type == "cpu" or torch.cuda.device_count() >= 2
    rows = []
    for size in sizes:
        for fmt in formats:
            shape = syn.SHAPES[size].with_layers(layers)
            row: dict[str, Any] = {
                "format": fmt,
                "size": size,
                "layers": shape.num_layers,
                "device": dev,
            }
            try:
                planned = planned_linears(shape, fmt, target)
            except NoPlan as e:
                row["skipped"] = f"no plan on {target.device_type}: {e}"
                log(f"[cold {fmt}/{size}] skipped: {e}")
                rows.append(row)
                continue
            path, _ = syn.ensure_checkpoint(
                syn.bench_dir(bench_dir), shape, syn.CHECKPOINT_KIND[fmt], seed, device
            )
            _warm_page_cache(path)
            key = CacheKey(_key_fields(shape, fmt, planned, target, uuid.uuid4().hex[:12]))
            servers: list[Any] = []
            snap_root = tempfile.mkdtemp(prefix="wcache-snap-", dir=snap_dir)
            try:
                _drop_page_cache(str(path))  # from the disk first, then from the page cache
                _sync(device)
                t0 = time.perf_counter()
                tensors, kinds, layers_data, _, _ = prepare_from_checkpoint(
                    path, planned, device, target
                )
                cold = DaemonServer(
                    Export(tensors=tensors, kinds=kinds, layers=layers_data),
                    key,
                    socket_dir=socket_dir,
                    device=dev,
                    device_id=f"cold-ck-{fmt}",
                )
                _sync(device)
                row["checkpoint_cold_s"] = time.perf_counter() - t0
                del tensors
                cold.stop()
                del cold
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                log(
                    f"[cold {fmt}/{size}] checkpoint (cold page cache) -> ready "
                    f"{row['checkpoint_cold_s']:.3f} s"
                )
                _warm_page_cache(path)
                _sync(device)
                t0 = time.perf_counter()
                tensors, kinds, layers_data, read_s, prep_s = prepare_from_checkpoint(
                    path, planned, device, target
                )
                src = DaemonServer(
                    Export(tensors=tensors, kinds=kinds, layers=layers_data),
                    key,
                    socket_dir=socket_dir,
                    device=dev,
                    device_id=f"cold-src-{fmt}",
                )
                _sync(device)
                row["checkpoint_s"] = time.perf_counter() - t0
                row["checkpoint_read_s"], row["prepare_s"] = read_s, prep_s
                del tensors
                servers.append(src.start())
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                nbytes = row["arena_bytes"] = src.nbytes
                ref = _digest(src)
                log(
                    f"[cold {fmt}/{size}] checkpoint -> ready {row['checkpoint_s']:.3f} s "
                    f"(read {read_s:.3f}, prepare {prep_s:.3f}; {nbytes / 2**30:.2f} GiB arena)"
                )
                view = served_arena(src)
                t0 = time.perf_counter()
                rank_dir = write_snapshot(snap_root, "rank0", view.tensor, src.manifest, key)
                row["snapshot_write_s"] = time.perf_counter() - t0
                view.close()
                apath = os.path.join(rank_dir, ARENA_FILE)
                snap = open_snapshot(snap_root, "rank0")
                row.update(_raw(apath, snap.data_offset, src.manifest.arena_nbytes, device, peer))
                for mode in ("warm", "cold"):
                    if mode == "cold":
                        _drop_page_cache(apath)
                    else:
                        _warm_page_cache(apath)
                    _sync(device)
                    t0 = time.perf_counter()
                    s = DaemonServer(
                        snapshot_arena(open_snapshot(snap_root, "rank0")),
                        key,
                        socket_dir=socket_dir,
                        device=dev,
                        device_id=f"cold-snap-{fmt}-{mode}",
                    )
                    _sync(device)
                    row[f"snapshot_{mode}_s"] = time.perf_counter() - t0
                    row[f"snapshot_{mode}_equal"] = _digest(s) == ref
                    s.stop()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    log(
                        f"[cold {fmt}/{size}] snapshot ({mode} page cache) -> ready "
                        f"{row[f'snapshot_{mode}_s']:.3f} s"
                    )
                if peer:
                    src.seed_source = SeedSource(src)
                    recv_dev = "cuda:1" if device.type == "cuda" else "cpu"
                    view = served_arena(src)
                    src.seed_source.digest(view.tensor)  # once per daemon, before any receiver
                    view.close()
                    t0 = time.perf_counter()
                    r = DaemonServer(
                        seed_arena(src.socket_path, key),
                        key,
                        socket_dir=socket_dir,
                        device=recv_dev,
                        device_id=f"cold-peer-{fmt}",
                    )
                    if recv_dev != "cpu":
                        torch.cuda.synchronize(1)
                    row["peer_s"] = time.perf_counter() - t0
                    row["peer_equal"] = _digest(r) == ref
                    r.stop()
                    log(f"[cold {fmt}/{size}] peer -> ready {row['peer_s']:.3f} s")
                else:
                    row["peer_skipped"] = "needs a second GPU"
                _ratios(row)
            finally:
                for s in servers:
                    s.stop()

                shutil.rmtree(snap_root, ignore_errors=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


def _ratios(row: dict[str, Any]) -> None:
    def r(a: str, b: str) -> float | None:
        return row[a] / row[b] if row.get(a) and row.get(b) else None

    row["ckpt_over_snapshot_warm"] = r("checkpoint_s", "snapshot_warm_s")
    row["ckpt_over_snapshot_cold"] = r("checkpoint_cold_s", "snapshot_cold_s")
    row["snapshot_cold_over_raw"] = r("snapshot_cold_s", "raw_read_cold_s")
    row["ckpt_over_peer"] = r("checkpoint_s", "peer_s")
    floor = max(row.get("raw_read_s", 0.0), row.get("raw_h2d_s", 0.0))
    row["raw_snapshot_floor_s"] = floor
    row["snapshot_warm_over_raw"] = row["snapshot_warm_s"] / floor if floor else None
    copy = row.get("raw_p2p_s") or row.get("raw_memcpy_s")
    row["peer_over_raw"] = row["peer_s"] / copy if row.get("peer_s") and copy else None


def _fmt(v: Any, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def synthetic_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| format | size | arena GiB | page cache | checkpoint s | snapshot s | peer s | "
        "raw read s | raw h2d / copy s | checkpoint/snapshot | checkpoint/peer | "
        "snapshot/raw | peer/raw | bytes equal |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['format']} | {r['size']} | skipped: {r['skipped']} |")
            continue
        copy = r.get("raw_h2d_s") or r.get("raw_memcpy_s")
        equal = all(
            r.get(k, True) for k in ("snapshot_warm_equal", "snapshot_cold_equal", "peer_equal")
        )
        head = f"| {r['format']} | {r['size']} | {r['arena_bytes'] / 2**30:.2f} "
        lines.append(
            f"{head}| warm | {r['checkpoint_s']:.3f} | {r['snapshot_warm_s']:.3f} | "
            f"{_fmt(r.get('peer_s'))} | {r['raw_read_s']:.3f} | {_fmt(copy)} | "
            f"{_fmt(r['ckpt_over_snapshot_warm'], '.1f', 'x')} | {_fmt(r['ckpt_over_peer'], '.1f', 'x')} | "
            f"{_fmt(r['snapshot_warm_over_raw'], '.2f', 'x')} | {_fmt(r['peer_over_raw'], '.2f', 'x')} | "
            f"{'yes' if equal else 'NO'} |"
        )
        lines.append(
            f"{head}| cold | {r['checkpoint_cold_s']:.3f} | {r['snapshot_cold_s']:.3f} | - | "
            f"{r['raw_read_cold_s']:.3f} | - | {_fmt(r['ckpt_over_snapshot_cold'], '.1f', 'x')} | - | "
            f"{_fmt(r['snapshot_cold_over_raw'], '.2f', 'x')} | - | {'yes' if equal else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- engine mode

_READY = re.compile(r"from=(\w+) ready_s=([0-9.]+)")


def run_engine_daemons(
    formats: tuple[str, ...], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Per SmolLM2 fixture format: ``wcache serve`` from the checkpoint with
    ``--snapshot`` (writes it), stopped; restarted with the same flags (from the
    snapshot); a second daemon ``--seed-from`` the first (another ``--job``).
    Each row holds the ``ready_s`` each printed (seconds from the start of
    ``serve_rank``: engine arguments, distributed init, key, arena; Python and
    vLLM imports excluded) and the process wall time to the ready line."""
    from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

    rows = []
    for fmt in formats:
        model = build(fmt)
        row: dict[str, Any] = {"format": fmt, "fixture": str(model)}
        with (
            tempfile.TemporaryDirectory(prefix="wcb-cold-") as tmp,
            tempfile.TemporaryDirectory(prefix="wcb-cs-") as sock_dir,
        ):
            snap = os.path.join(tmp, "snap")
            for label, extra in (
                ("checkpoint", ["--snapshot", snap]),
                ("snapshot", ["--snapshot", snap]),
            ):
                with DaemonProcess(model, sock_dir, extra) as d:
                    found = _READY.search(d.ready_lines[0])
                    assert found is not None, d.ready_lines[
                        0
                    ]  # a ready line names from= and ready_s=
                    origin, ready_s = found.groups()
                    if origin != label:
                        raise RuntimeError(f"{fmt}: expected a start from {label}, got {origin}")
                    row[f"{label}_ready_s"] = float(ready_s)
                    row[f"{label}_wall_s"] = d.ready_s
                    if label == "snapshot":
                        with DaemonProcess(
                            model, sock_dir, ["--seed-from", sock_dir, "--job", "peer"]
                        ) as p:
                            found = _READY.search(p.ready_lines[0])
                            assert found is not None, p.ready_lines[0]
                            origin, ready_s = found.groups()
                            if origin != "peer":
                                raise RuntimeError(
                                    f"{fmt}: expected a start from a peer, got {origin}"
                                )
                            row["peer_ready_s"] = float(ready_s)
                            row["peer_wall_s"] = p.ready_s
                    fills = [ln for ln in d.lines if "filled from" in ln or "arena (shm):" in ln]
                    row[f"{label}_arena_line"] = fills[-1] if fills else None
        log(
            f"[cold engine {fmt}] ready_s checkpoint {row['checkpoint_ready_s']:.2f}, snapshot "
            f"{row['snapshot_ready_s']:.2f}, peer {row['peer_ready_s']:.2f}"
        )
        rows.append(row)
    return rows


def engine_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| format | checkpoint ready_s | snapshot ready_s | peer ready_s | ckpt/snapshot | "
        "ckpt/peer | wall to ready line (ckpt / snapshot / peer) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c, s, p = r["checkpoint_ready_s"], r["snapshot_ready_s"], r["peer_ready_s"]
        lines.append(
            f"| {r['format']} | {c:.2f} | {s:.2f} | {p:.2f} | {c / s:.2f}x | {c / p:.2f}x | "
            f"{r['checkpoint_wall_s']:.1f} / {r['snapshot_wall_s']:.1f} / "
            f"{r['peer_wall_s']:.1f} s |"
        )
    return "\n".join(lines) + "\n"
