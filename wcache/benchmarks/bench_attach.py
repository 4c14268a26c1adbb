"""Attach time: one arena handle vs one handle per tensor.

Serves N tensors (default 2000) two ways from this process and attaches from a
client subprocess (so CUDA IPC handles are opened in another process, as an
engine would):

* arena: ``wcache.store`` (one sealed memfd on CPU, one CUDA IPC handle on CUDA).
* per-tensor: one sealed memfd per tensor on CPU (passed with SCM_RIGHTS in
  batches of 253, the kernel's SCM_MAX_FD) or one ``reduce_tensor`` handle per
  tensor on CUDA, as vLLM's ipc_cache does.

Attach time is from connect to a dict of ready tensor views (no page touched),
measured in the client; median and minimum over repetitions (the minimum is
the less noisy figure on a shared host).

Usage: python -m wcache.benchmarks.bench_attach [--device cpu|cuda] [--ntensors 2000] [--tensor-kib 64] [--reps 15]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from wcache.store import CacheKey, DaemonServer, Export, attach
from wcache.store.arena import SEALS, frombuffer_readonly
from wcache.store.manifest import dtype_from_name, dtype_name
from wcache.store.protocol import recv_frame, send_frame
from wcache.store.transport_cuda import _ARG_NAMES, _STORAGE_CLASSES, encode_reduce_args

SCM_MAX_FD = 253  # Linux: most descriptors one SCM_RIGHTS message may carry
KEY = CacheKey({"bench": "attach"})


def make_tensors(n: int, kib: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        numel = max(1, (kib * 1024 // 2) * (1 + i % 4) // 2)  # 0.5x .. 2x of --tensor-kib, fp16
        out[f"model.layers.{i // 10}.t{i % 10}"] = (
            torch.randn(numel, generator=g).to(torch.float16).to(device)
        )
    return out


# --------------------------------------------------------------------------- per-tensor baseline server


class PerTensorServer:
    """One handle per tensor: a sealed memfd each (CPU) or a reduce_tensor each (CUDA)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str, device: str):
        self.device = device
        self.tensors = tensors
        self.entries = [
            [n, dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()]
            for n, t in tensors.items()
        ]
        self.fds = []
        if device == "cpu":
            for t in tensors.values():
                fd = os.memfd_create("wcache-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                nbytes = t.numel() * t.element_size()
                os.write(
                    fd, ctypes.string_at(t.data_ptr(), nbytes)
                )  # one memcpy, like the arena's fill
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
                self.fds.append(fd)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.path = path
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                while True:
                    try:
                        recv_frame(conn)
                    except Exception:  # noqa: BLE001 (any failure ends this client's loop)
                        break
                    if self.device == "cpu":
                        send_frame(
                            conn,
                            {"entries": self.entries, "batches": -(-len(self.fds) // SCM_MAX_FD)},
                        )
                        for i in range(0, len(self.fds), SCM_MAX_FD):
                            send_frame(conn, {"batch": i}, tuple(self.fds[i : i + SCM_MAX_FD]))
                    else:
                        handles = [encode_reduce_args(t) for t in self.tensors.values()]
                        send_frame(conn, {"entries": self.entries, "handles": handles})

    def close(self):
        self.listener.close()
        for fd in self.fds:
            os.close(fd)


# --------------------------------------------------------------------------- client (subprocess)


def client_main(args) -> None:

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.ntensors)), hard))
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.init()
    results: dict[str, list[float]] = {"arena": [], "per_tensor": []}
    for _ in range(args.reps):
        t0 = time.perf_counter()
        att = attach(KEY, socket_dir=args.socket_dir, device=dev, device_id="bench")
        if args.device == "cuda":
            torch.cuda.synchronize()
        results["arena"].append(time.perf_counter() - t0)
        n = len(att.tensors)
        att.close()
        del att

        t0 = time.perf_counter()
        views, maps = per_tensor_attach(args.per_tensor_socket, args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        results["per_tensor"].append(time.perf_counter() - t0)
        assert len(views) == args.ntensors == n, (len(views), n)
        views.clear()
        for mm in maps:
            mm.close()
    print(json.dumps(results), flush=True)


def per_tensor_attach(path: str, device: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    with s:
        send_frame(s, {"op": "get"})
        head, _ = recv_frame(s)
        views, maps = {}, []
        if device == "cpu":
            fds = []
            for _ in range(head["batches"]):
                _, got = recv_frame(s, max_fds=SCM_MAX_FD)
                fds.extend(got)
            for (name, dtype, shape, nbytes), fd in zip(head["entries"], fds):
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                os.close(fd)
                maps.append(mm)
                views[name] = frombuffer_readonly(mm).view(dtype_from_name(dtype)).view(shape)
        else:
            for (name, _dtype, _shape, _nbytes), h in zip(head["entries"], head["handles"]):
                views[name] = rebuild_cuda_tensor(*decode_reduce_args_any(h))
        return views, maps


def decode_reduce_args_any(d):
    """decode_reduce_args for any dtype (the store's arena is always uint8)."""

    out = dict(d)
    out["tensor_cls"] = torch.Tensor
    out["storage_cls"] = _STORAGE_CLASSES[d["storage_cls"]]
    out["dtype"] = dtype_from_name(d["dtype"])
    out["tensor_size"] = torch.Size(d["tensor_size"])
    out["tensor_stride"] = tuple(d["tensor_stride"])
    return tuple(out[k] for k in _ARG_NAMES)


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ntensors", type=int, default=2000)
    p.add_argument("--tensor-kib", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket-dir", help=argparse.SUPPRESS)
    p.add_argument("--per-tensor-socket", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(args)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.ntensors)), hard))
    dev = "cuda:0" if args.device == "cuda" else "cpu"
    tensors = make_tensors(args.ntensors, args.tensor_kib, dev)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    d = tempfile.mkdtemp(prefix="wcb-")
    os.chmod(d, 0o700)
    t0 = time.perf_counter()
    server = DaemonServer(
        Export(tensors, {k: "param" for k in tensors}),
        KEY,
        socket_dir=d,
        device=dev,
        device_id="bench",
    ).start()
    t_arena = time.perf_counter() - t0
    t0 = time.perf_counter()
    baseline = PerTensorServer(tensors, os.path.join(d, "per-tensor.sock"), args.device)
    t_per = time.perf_counter() - t0
    try:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--client",
            "--device",
            args.device,
            "--ntensors",
            str(args.ntensors),
            "--reps",
            str(args.reps),
            "--socket-dir",
            d,
            "--per-tensor-socket",
            baseline.path,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode:
            sys.exit(f"client failed:\n{out.stderr[-4000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
        baseline.close()
        shutil.rmtree(d, ignore_errors=True)
    arena_ms = statistics.median(res["arena"]) * 1e3
    per_ms = statistics.median(res["per_tensor"]) * 1e3
    print(
        f"device={args.device} tensors={args.ntensors} bytes={total} ({total / 2**20:.1f} MiB) reps={args.reps}"
    )
    print(
        f"build: arena {t_arena * 1e3:.1f} ms (one {'memfd' if args.device == 'cpu' else 'allocation'}), "
        f"per-tensor {t_per * 1e3:.1f} ms ({args.ntensors} {'memfds' if args.device == 'cpu' else 'tensors'})"
    )
    arena_min, per_min = min(res["arena"]) * 1e3, min(res["per_tensor"]) * 1e3
    print(f"attach arena      (1 handle):       median {arena_ms:8.2f} ms  min {arena_min:8.2f} ms")
    print(
        f"attach per-tensor ({args.ntensors} handles): median {per_ms:8.2f} ms  min {per_min:8.2f} ms"
    )
    print(
        f"ratio per-tensor / arena: median {per_ms / arena_ms:.1f}x  min {per_min / arena_min:.1f}x"
    )


if __name__ == "__main__":
    main()
