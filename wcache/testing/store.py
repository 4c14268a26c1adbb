"""Helpers for the store tests: a deterministic synthetic export, a daemon run as
a subprocess (``python -m wcache.testing.store serve ...``), and /proc readers.

Here rather than under tests/ because the tests' child processes (a daemon, a
client on another GPU) import it too; nothing in production imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

import torch

from wcache.store import CacheKey, DaemonServer, Export, attach, lean, seed, serve
from wcache.store.artifacts import read_bundle
from wcache.store.seed import SeedSource, parse_host_port, read_secret, seed_arena

# A daemon subprocess imports torch and builds its arena; on 2 busy cores that
# can take several seconds.
READY_TIMEOUT_S = 60.0
BASE_KEY = {"checkpoint": "c0ffee", "dtype": "bfloat16", "tp": [1, 0], "plan": "unquantized@1"}


def synthetic_tensors(seed: int = 0, n: int = 6, numel: int = 4096) -> dict[str, torch.Tensor]:
    """Deterministic tensors of mixed dtypes and layouts: contiguous, transposed
    (non-contiguous), a strided slice, a scalar, an empty one, and a view
    sharing storage with another tensor."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, numel // 64, generator=g)
    out = {
        "w0": base.to(torch.bfloat16),
        "w0_t": base.t(),  # non-contiguous view of `base`'s storage
        "q": torch.randint(-(2**31), 2**31 - 1, (numel // 8,), generator=g, dtype=torch.int32),
        "q_slice": torch.arange(1000, dtype=torch.int16)[3::7],
        "scale": torch.tensor(0.125, dtype=torch.float32),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "base": base,  # same storage as w0_t: stored once
    }
    for i in range(n):
        out[f"layer{i}.weight"] = torch.randn(16, numel // 16, generator=g).to(torch.float16)
    return out


def synthetic_export(seed: int = 0, n: int = 6, numel: int = 4096) -> Export:
    tensors = synthetic_tensors(seed, n, numel)
    kinds = {k: ("buffer" if k in ("scale", "q_slice") else "param") for k in tensors}
    return Export(
        tensors,
        kinds,
        aliases={"lm_head.weight": "w0", "rope.cache": "scale"},
        layers={"layer0": {"plan_id": "unquantized", "plan_version": 1, "recorded": {"x": 1}}},
        extra={"seed": seed},
        nonpersistent={"q_slice"},
    )


def assert_serves_export(
    key: CacheKey, sock_dir: str, device_id: str, export: Export | None = None
) -> None:
    """Attach to the daemon of ``device_id`` and assert it serves ``export`` (default:
    :func:`synthetic_export`) bit for bit: values, strides, dtypes, the alias, the
    extra and the recorded values."""
    export = export or synthetic_export()
    with attach(key, socket_dir=sock_dir, device_id=device_id) as att:
        for name, t in export.tensors.items():
            v = att.tensors[name]
            assert torch.equal(t, v) and t.stride() == v.stride() and t.dtype == v.dtype, name
        assert att.tensors["lm_head.weight"] is att.tensors["w0"]
        assert {"seed": 0} == att.extra and {"x": 1} == att.layers["layer0"]["recorded"]


class DaemonPopen(subprocess.Popen):
    """A daemon subprocess (:func:`start_daemon`) with its stderr file and ready line."""

    #: the daemon's stderr (a temporary file, closed by :func:`stop_daemon`)
    log: IO[str]
    #: the ``wcache-store ready ...`` line it printed
    ready_line: str


def start_daemon(
    socket_dir: str,
    device_id: str = "cpu",
    *,
    seed: int = 0,
    n: int = 6,
    numel: int = 4096,
    key: dict | None = None,
    extra_args: tuple[str, ...] = (),
) -> DaemonPopen:
    """Start a daemon subprocess and wait for its ready line."""
    cmd = [
        sys.executable,
        "-m",
        "wcache.testing.store",
        "serve",
        "--socket-dir",
        socket_dir,
        "--device-id",
        device_id,
        "--seed",
        str(seed),
        "--n",
        str(n),
        "--numel",
        str(numel),
        "--key",
        json.dumps(key or BASE_KEY),
        *extra_args,
    ]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (kept on proc: a pipe could fill up and block a chatty daemon)
    proc = DaemonPopen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    proc.log = log
    stdout = proc.stdout
    assert stdout is not None  # stdout=PIPE
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = stdout.readline()
        if line.startswith("wcache-store ready"):
            proc.ready_line = line.strip()
            return proc
        if not line and proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"daemon exited with {proc.returncode}: {log.read()[-4000:]}")
    proc.kill()
    raise RuntimeError("daemon did not become ready")


def stop_daemon(proc: DaemonPopen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:  # start_daemon's stdout=PIPE: always set
        proc.stdout.close()
    proc.log.close()


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mapping_of(addr: int) -> tuple[str, str]:
    """(permissions, path) of the mapping in this process containing ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[1], (parts[5].strip() if len(parts) > 5 else "")
    raise LookupError(hex(addr))


def count_arena_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:wcache-arena" in line for line in f)


#: The line a daemon of :func:`_serve_main` prints when ``--seed-stall-after`` stops its seeding.
SEED_STALLED_LINE = "wcache-store seed-stalled"


def fault_seeding(chunk_bytes: int | None = None, stall_after: int | None = None) -> None:
    """Testing: change this process's seeding (both sides of :mod:`wcache.store.seed`).

    ``chunk_bytes``: broadcast the arena in chunks of that many bytes (a source's
    reply tells its receivers), so a small arena travels in many. ``stall_after``:
    after that many broadcasts, print :data:`SEED_STALLED_LINE` to stdout and block
    that seeding for good, as a peer that hangs or is about to be killed mid-transfer.
    """

    if chunk_bytes:
        seed.SEED_CHUNK_BYTES = chunk_bytes
    if stall_after is None:
        return
    broadcast, done = seed._broadcast, [0]

    def stalling(pg: Any, t: Any, timeout_s: float) -> None:
        if done[0] >= stall_after:
            print(SEED_STALLED_LINE, flush=True)
            threading.Event().wait()
        broadcast(pg, t, timeout_s)
        done[0] += 1

    seed._broadcast = stalling


def _ready_line(server: Any) -> str:
    """The line a daemon of this module prints once it serves (:func:`start_daemon` waits for it)."""
    return (
        f"wcache-store ready key={server.key.digest} bytes={server.nbytes} "
        f"socket={server.socket_path} pid={os.getpid()} transport={server.transport}"
    )


def _receive_main(argv: list[str]) -> None:
    """``seed-receive``: a daemon filled from ``--seed-from`` (wcache.store.seed), with
    the seeding faults of :func:`fault_seeding`; prints the ready line and serves."""

    p = argparse.ArgumentParser()
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--device-id", default="cpu-dst")
    p.add_argument("--seed-from", required=True, help="the source daemon's socket")
    p.add_argument("--key", default=json.dumps(BASE_KEY))
    p.add_argument("--seed-stall-after", type=int, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    fault_seeding(stall_after=a.seed_stall_after)
    key = CacheKey(json.loads(a.key))
    server = DaemonServer(
        seed_arena(a.seed_from, key), key, socket_dir=a.socket_dir, device_id=a.device_id
    )
    signal.signal(signal.SIGTERM, lambda *_: server.request_shutdown())
    server.start()
    print(_ready_line(server), flush=True)
    server.serve_forever()
    raise SystemExit(server.exit_code)


def _serve_main(argv: list[str]) -> None:

    p = argparse.ArgumentParser()
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--device-id", default="cpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--key", default=json.dumps(BASE_KEY))
    p.add_argument("--transport", default=None, help="CUDA: cuda_vmm or cuda_ipc (default: best)")
    p.add_argument("--seed-source", action="store_true", help="answer `seed` (wcache.store.seed)")
    p.add_argument(
        "--seed-listen", help="HOST:PORT: also answer `seed` over TCP (needs --seed-source)"
    )
    p.add_argument("--seed-secret-file", help="the shared secret for --seed-listen")
    p.add_argument(
        "--seed-chunk-bytes",
        type=int,
        default=None,
        help="with --seed-source: seed in chunks of this many bytes (fault_seeding)",
    )
    p.add_argument(
        "--seed-stall-after",
        type=int,
        default=None,
        help="with --seed-source: stall each seeding after this many broadcasts",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="after the ready line, hand off to the torch-free server (wcache.store.lean)",
    )
    p.add_argument(
        "--artifacts",
        help="with --lean: serve the start-up artifact bundle in this "
        "directory (wcache.store.artifacts.write_bundle's files)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if a.seed_chunk_bytes or a.seed_stall_after is not None:
        fault_seeding(a.seed_chunk_bytes, a.seed_stall_after)
    export = synthetic_export(a.seed, a.n, a.numel)
    if a.device != "cpu":
        export = Export(
            {k: v.to(a.device) for k, v in export.tensors.items()},
            export.kinds,
            export.aliases,
            export.layers,
            export.extra,
            export.nonpersistent,
        )
    kw = {"transport": a.transport} if a.transport else {}
    if a.lean:  # as `wcache serve` does on CPU once ready
        server = DaemonServer(
            export,
            CacheKey(json.loads(a.key)),
            socket_dir=a.socket_dir,
            device=a.device,
            device_id=a.device_id,
            **kw,
        )
        signal.signal(signal.SIGTERM, lambda *_: server.request_shutdown())
        if a.artifacts:
            server.artifacts, server.artifacts_state = read_bundle(a.artifacts), "snapshot"
        server.start()
        print(_ready_line(server), flush=True)
        lean.handoff(server)
        server.serve_forever()
        raise SystemExit(server.exit_code)
    if a.seed_source:  # also answer `seed` (wcache.store.seed), as `wcache serve` does
        server = DaemonServer(
            export,
            CacheKey(json.loads(a.key)),
            socket_dir=a.socket_dir,
            device=a.device,
            device_id=a.device_id,
            **kw,
        )
        listen = parse_host_port(a.seed_listen) if a.seed_listen else None
        server.seed_source = (
            SeedSource(server) if listen is None else SeedSource(server, host=listen[0])
        )
        signal.signal(signal.SIGTERM, lambda *_: server.request_shutdown())
        server.start()
        tail = ""
        if listen is not None:
            host, port = server.listen_seed_tcp(*listen, read_secret(a.seed_secret_file))
            tail = f" seed_listen={host}:{port}"
        print(_ready_line(server) + tail, flush=True)
        server.serve_forever()
        raise SystemExit(server.exit_code)
    raise SystemExit(
        serve(
            export,
            CacheKey(json.loads(a.key)),
            socket_dir=a.socket_dir,
            device=a.device,
            device_id=a.device_id,
            **kw,
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve_main(sys.argv[2:])
    elif sys.argv[1:2] == ["seed-receive"]:
        _receive_main(sys.argv[2:])
    else:
        raise SystemExit(
            "usage: python -m wcache.testing.store serve|seed-receive --socket-dir DIR [...]"
        )
