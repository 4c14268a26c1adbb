"""Restore vs ordinary load, arena vs per-tensor IPC handles: the measurements.

For each (format, size) unit, in one run:

* **ordinary load**: a fresh worker process reads the safetensors checkpoint from
  the page cache onto the device (``safetensors.safe_open``) and runs every plan
  stage (``plan.load``) per layer;
* **daemon prepare**: this process reads the checkpoint, runs ``plan.prepare`` per
  layer and builds the arena (``DaemonServer``), then serves it;
* **restore**: fresh worker processes (``spawn``) attach, install the views and
  replay ``plan.restore`` per layer under the engine's default guard (one
  ``RestoreGuard`` over every layer: metadata checks after each stage, and a
  content checksum per layer range where the mapping is writable: ``cuda_ipc``,
  copy mode; a read-only ``cuda_vmm``/``shm`` mapping faults on writes instead),
  over the daemon's default transport (``cuda_vmm`` where the driver supports it);
* **per-tensor IPC restore**: the vLLM ``ipc_cache`` way: one
  ``torch.multiprocessing.reductions.reduce_tensor`` handle per tensor (pickled, as
  vLLM's ``TensorEntry``; CPU tensors are shipped by value, as vLLM does), rebuilt
  in the worker, then the same install and replay.

Sizes listed as *no-disk* skip the checkpoint: the export is synthesized from one
prepared layer per distinct linear shape, replicated with uninitialised host
tensors (values do not change restore cost), so a 30B-shaped point fits a 64 GB
disk and twice its bytes never sit on the GPU at once.

A separate *handles* measurement attaches N tensors (default 2000) once as one
arena and once as N per-tensor handles.

Every timed region ends with ``torch.cuda.synchronize()`` on CUDA and is timed
with ``time.perf_counter``. Workers import torch and initialise the device
before the timed region (an engine has done that before it loads weights), and
are started in parallel while this process prepares, so their start-up is not
on the critical path. Each restore repetition runs in its own fresh process.
"""

from __future__ import annotations

import cProfile
import hashlib
import importlib.util
import io
import math
import multiprocessing as mp
import os
import pickle
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import asdict, field, frozen
from safetensors import safe_open
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

import wcache.benchmarks.synthetic as synthetic
from wcache.core import LayerConfig, LayerState, NoPlan, Plan, RestoreGuard, Target
from wcache.core.values import as_tuple
from wcache.errors import WorkerFailed  # re-exported: its old home
from wcache.shell import apply_state_, load_, prepare_, restore_
from wcache.store import CacheKey, DaemonServer, Export
from wcache.vllm import compat

__all__ = [
    "BenchOptions",
    "run_suite",
    "markdown_table",
    "handles_table",
    "curve_points",
    "state_digest",
    "WorkerFailed",
]

#: Comparison runs only: ``WCACHE_BENCH_GUARD=off`` replays with the guard off (what
#: the guard costs); ``WCACHE_BENCH_TRANSPORT=cuda_ipc`` makes the daemon serve that
#: transport instead of its default (cuda_vmm where the driver supports it).
GUARD_ENV = "WCACHE_BENCH_GUARD"
TRANSPORT_ENV = "WCACHE_BENCH_TRANSPORT"
#: ``WCACHE_BENCH_PROFILE=/path/prefix`` writes a cProfile of each restore's replay.
PROFILE_ENV = "WCACHE_BENCH_PROFILE"
#: A worker that has not reported within this many seconds is considered hung
#: (an 8B ordinary load from page cache takes ~10 s on an H200; a 30B arena
#: build from host memory ~30 s; 600 s leaves room for a slow CPU host).
WORKER_TIMEOUT_S = 600.0
#: Elements per chunk of the on-device checksum (bounds its temporary memory).
DIGEST_CHUNK = 1 << 26
#: Position weights of the checksum wrap at this prime so sums stay in int64.
DIGEST_MODULUS = 65521
#: Default number of tensors of the handles measurement (the arena target is
#: stated for 2000 tensors).
DEFAULT_HANDLE_TENSORS = 2000
#: Default size of each handle-measurement tensor: above the caching allocator's
#: 10 MiB large-allocation threshold, so every tensor is its own cudaMalloc
#: segment and needs its own IPC handle, like a real model's weights.
DEFAULT_HANDLE_MIB = 12.0


# --------------------------------------------------------------------------- options


@frozen
class BenchOptions:
    """One benchmark run.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        sizes: shape names (``tiny``, ``1b``, ``8b``, ``30b``).
        formats: benchmark formats (``bf16``, ``awq``, ``fp8``).
        no_disk: sizes measured from a synthesized in-memory export (restore only).
        layers: override of every shape's layer count (smoke tests).
        reps: restore repetitions (each in a fresh process).
        load_reps: ordinary-load repetitions (one worker, page cache warm).
        handle_tensors: tensors of the handles measurement (0 skips it).
        handle_mib: MiB per handle-measurement tensor.
        bench_dir: checkpoint cache dir.
        seed: value seed of the synthetic checkpoints.
        simulate_cuda_target: resolve the CUDA plans (kernels none/marlin/cutlass,
            capability 9.0) while running on ``device``; a smoke-test aid for
            the GPU code path on a CPU host.
        start_method: how workers start: ``"spawn"`` (a fresh interpreter each) or
            ``"forkserver"`` (forked from a server that has imported torch and
            wcache but never touched the device, so no CUDA context, IPC handle or
            mapping leaks into a worker; much faster start-up on small hosts).
    """

    device: str = "cuda"
    sizes: tuple[str, ...] = field(default=("8b",), converter=as_tuple)
    formats: tuple[str, ...] = field(default=("bf16", "awq", "fp8"), converter=as_tuple)
    no_disk: tuple[str, ...] = field(default=(), converter=as_tuple)
    layers: int | None = None
    reps: int = 3
    load_reps: int = 2
    handle_tensors: int = DEFAULT_HANDLE_TENSORS
    handle_mib: float = DEFAULT_HANDLE_MIB
    bench_dir: str | None = None
    seed: int = 0
    simulate_cuda_target: bool = False
    start_method: str = "spawn"


#: Capability the simulated CUDA target reports (H100/H200).
SIMULATED_CAPABILITY = (9, 0)


def _device(opts_device: str) -> torch.device:
    return torch.device("cuda:0") if opts_device == "cuda" else torch.device("cpu")


def _target(device: torch.device, simulate_cuda: bool) -> Target:
    if simulate_cuda:
        return Target("cuda", SIMULATED_CAPABILITY)
    if device.type == "cpu":
        try:  # the CPU plans need vLLM's own kernel decisions
            from wcache.vllm.probe import host_target  # noqa: PLC0415 (optional dependency, checked where it is used)
        except ImportError:
            return Target.detect(device)
        return host_target(device)
    return Target.detect(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_cpu_ops(device: torch.device) -> None:
    """On CPU, load vLLM's ``_C`` ops (oneDNN, cpu_gemm_wna16) that CPU plans' DERIVE
    stages call, when vLLM is installed. Never on CUDA: the GPU path imports no vLLM."""
    if device.type != "cpu" or importlib.util.find_spec("vllm") is None:
        return

    compat.load_custom_ops()  # registers torch.ops._C


def _synthetic():

    return synthetic


# --------------------------------------------------------------------------- layers


@frozen
class Layer:
    """One planned linear: its name, config and plan (no tensors)."""

    name: str
    config: LayerConfig
    plan: Plan


def planned_linears(shape: Any, fmt: str, target: Target) -> tuple[Layer, ...]:
    """Resolve a plan for every linear of the stack.

    Raises:
        NoPlan: the format has no plan on the target.
    """
    from wcache.plans import plan_for  # noqa: PLC0415 (imported at call time: tests patch plan_for)

    syn = _synthetic()
    out = []
    cache: dict[LayerConfig, Plan] = {}
    for spec in syn.linears(shape):
        cfg = syn.layer_config(spec, fmt, target)
        key = LayerConfig(
            quant=cfg.quant,
            size_k=cfg.size_k,
            size_n=cfg.size_n,
            params_dtype=cfg.params_dtype,
            extra=cfg.extra,
        )
        if key not in cache:
            cache[key] = plan_for(cfg, target=target).plan
        out.append(Layer(spec.name, cfg, cache[key]))
    return tuple(out)


def _install_(
    module: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    buffers: frozenset[str] = frozenset(),
) -> None:
    apply_state_(module, LayerState(tensors=dict(tensors), buffers=buffers))


def _group_by_layer(names: Sequence[str], layers: Sequence[Layer]) -> dict[str, list[str]]:
    by_layer: dict[str, list[str]] = {ly.name: [] for ly in layers}
    for full in names:
        layer, _, _ = full.rpartition(".")
        by_layer.setdefault(layer, []).append(full)
    return by_layer


def state_digest(modules: Mapping[str, torch.nn.Module]) -> str:
    """A cheap on-device fingerprint of every module's tensors and scalar attributes:
    per tensor its shape, dtype and two sums over its bytes in logical order (plain
    and position-weighted), so equal digests mean equal bytes for benchmark
    purposes (tests use exact comparisons)."""

    h = hashlib.blake2b(digest_size=16)
    for mname in sorted(modules):
        m = modules[mname]
        for tname, t in sorted({**m._parameters, **m._buffers}.items()):
            if t is None:
                h.update(f"{mname}.{tname}=None;".encode())
                continue
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            s1 = s2 = 0
            for lo in range(0, flat.numel(), DIGEST_CHUNK):
                chunk = flat[lo : lo + DIGEST_CHUNK].to(torch.int64)
                pos = (
                    torch.arange(lo, lo + chunk.numel(), device=chunk.device) % DIGEST_MODULUS
                ) + 1
                s1 += int(chunk.sum())
                s2 += int((chunk * pos).sum())
            h.update(f"{mname}.{tname}:{tuple(t.shape)}:{t.dtype}:{s1}:{s2};".encode())
        for attr in ("logical_output_size", "input_scale", "input_global_scale"):
            if attr in m.__dict__:
                value = m.__dict__[attr]
                h.update(f"{mname}@{attr}={value if not torch.is_tensor(value) else 't'};".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- workers


def _worker_main(conn: Any, task: str, payload: dict) -> None:
    """Entry point of a spawned worker: initialise, report ready, wait for go, run."""
    try:
        sys.path[:0] = [p for p in payload.get("sys_path", ()) if p not in sys.path]
        device = torch.device(payload["device"])
        if not payload["simulate_cuda_target"]:
            load_cpu_ops(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.ones(1, device=device).add_(1)
            torch.cuda.synchronize(device)
        prepared = _TASKS[task][0](payload)
        conn.send(("ready", None))
        while True:
            op, value = conn.recv()
            if op == "payload":  # what only exists once the daemon serves (its key)
                payload.update(value)
                continue
            if op != "go":
                return
            break
        result = _TASKS[task][1](conn, payload, prepared)
        conn.send(("result", result))
    except BaseException:  # noqa: BLE001 (sent to the parent, which reports it)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


def _skeleton(payload: dict) -> dict:
    syn = _synthetic()
    device = torch.device(payload["device"])
    target = _target(device, payload["simulate_cuda_target"])
    shape = syn.ModelShape(**payload["shape"])
    layers = planned_linears(shape, payload["fmt"], target)
    return {
        "device": device,
        "target": target,
        "shape": shape,
        "layers": layers,
        "modules": {ly.name: torch.nn.Module() for ly in layers},
    }


def _load_prepare(payload: dict) -> dict:
    return _skeleton(payload)


def _load_run(conn: Any, payload: dict, sk: dict) -> dict:
    """Ordinary load, ``load_reps`` times: safetensors from page cache + plan.load."""

    device, target = sk["device"], sk["target"]
    seconds = []
    digest = None
    for rep in range(payload["reps"]):
        modules = {ly.name: torch.nn.Module() for ly in sk["layers"]}
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), safe_open(payload["path"], framework="pt", device=str(device)) as f:
            names = list(f.keys())
            by_layer = _group_by_layer(names, sk["layers"])
            for ly in sk["layers"]:
                local = {n.rpartition(".")[2]: f.get_tensor(n) for n in by_layer[ly.name]}
                _install_(modules[ly.name], local)
                load_(modules[ly.name], ly.plan.bind(ly.config, target))
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        if rep == payload["reps"] - 1:
            digest = state_digest(modules)
        del modules
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"seconds": seconds, "digest": digest}


def _replay(
    sk: dict,
    layers_data: Mapping[str, dict],
    views: Mapping[str, torch.Tensor],
    kinds: Mapping[str, str],
    content: bool = True,
) -> None:
    """Install every layer's views, then restore every layer under one guard, as
    the engine does (``wcache.vllm.model.restore_layers_``)."""

    by_layer = _group_by_layer(list(views), sk["layers"])
    for ly in sk["layers"]:
        local = {n.rpartition(".")[2]: views[n] for n in by_layer[ly.name]}
        bufs = frozenset(n.rpartition(".")[2] for n in by_layer[ly.name] if kinds[n] == "buffer")
        _install_(sk["modules"][ly.name], local, bufs)
    if os.environ.get(GUARD_ENV) == "off":  # the comparison run: what the guard costs
        for ly in sk["layers"]:
            data = layers_data[ly.name]
            restore_(
                sk["modules"][ly.name],
                ly.plan.bind(ly.config, sk["target"]),
                data["recorded"],
                guard=False,
                drops=data["drops"],
            )
        return
    guard = RestoreGuard(
        {
            ly.config.name: {
                n.rpartition(".")[2]: views[n]
                for n in by_layer[ly.name]
                if views[n].device.type != "meta"
            }
            for ly in sk["layers"]
        },
        content=content,
        defer=True,
    )
    for ly in sk["layers"]:
        data = layers_data[ly.name]
        if data["plan"] != ly.plan.id:
            raise WorkerFailed(f"{ly.name}: daemon ran plan {data['plan']}, worker {ly.plan.id}")
        restore_(
            sk["modules"][ly.name],
            ly.plan.bind(ly.config, sk["target"]),
            data["recorded"],
            guard=guard,
            drops=data["drops"],
        )
    guard.check_all()


def _restore_run(conn: Any, payload: dict, sk: dict) -> dict:
    """attach + install + plan.restore per layer (default guard and transport)."""
    from wcache.store import attach  # noqa: PLC0415 (imported at call time: tests patch attach)

    device = sk["device"]
    key = CacheKey(payload["key"])
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        att = attach(
            key,
            socket_dir=payload["socket_dir"],
            device=str(device),
            device_id=payload["device_id"],
        )
        t_attach = time.perf_counter()
        if os.environ.get(PROFILE_ENV):  # where replay time goes (a profiling run only)
            prof = cProfile.Profile()
            prof.runcall(_replay, sk, att.layers, att.tensors, att.kinds, content=att.writable)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            with open(f"{os.environ[PROFILE_ENV]}.{os.getpid()}.txt", "w") as f:
                f.write(buf.getvalue())
        else:
            _replay(sk, att.layers, att.tensors, att.kinds, content=att.writable)
        _sync(device)
        t1 = time.perf_counter()
    out = {
        "seconds": t1 - t0,
        "attach_s": t_attach - t0,
        "tensors": len(att.tensors),
        "transport": att.transport,
        "content_check": att.writable,
        "digest": state_digest(sk["modules"]) if payload.get("digest") else None,
    }
    sk["modules"].clear()
    att.close()
    return out


def _rebuild(entry: tuple, device: torch.device) -> torch.Tensor:
    """A vLLM ``TensorEntry.rebuild``: CUDA reduction args -> tensor, else the value."""
    kind, ipc_args, value = entry
    if ipc_args is None:
        data, dtype = value
        return data.view(getattr(torch, dtype))

    args = list(ipc_args)
    args[6] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


def _per_tensor_run(conn: Any, payload: dict, sk: dict) -> dict:
    """Request one handle per tensor, rebuild each, install + plan.restore."""
    device = sk["device"]
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        conn.send(("handles", None))
        entries = pickle.loads(conn.recv_bytes())  # noqa: S301 (our own child's pipe)
        views = {name: _rebuild(e, device) for name, e in entries.items()}
        t_attach = time.perf_counter()
        kinds = {name: e[0] for name, e in entries.items()}
        if payload.get("plans", True):
            _replay(sk, payload["layers_data"], views, kinds)
        _sync(device)
        t1 = time.perf_counter()
    out = {
        "seconds": t1 - t0,
        "attach_s": t_attach - t0,
        "tensors": len(views),
        "digest": state_digest(sk["modules"]) if payload.get("digest") else None,
    }
    sk["modules"].clear()
    del views
    return out


def _attach_only_prepare(payload: dict) -> dict:
    return {"device": torch.device(payload["device"])}


def _attach_only_run(conn: Any, payload: dict, sk: dict) -> dict:
    """Handles measurement, arena side: attach and build every view."""
    from wcache.store import attach  # noqa: PLC0415 (imported at call time: tests patch attach)

    device = sk["device"]
    _sync(device)
    t0 = time.perf_counter()
    att = attach(
        CacheKey(payload["key"]),
        socket_dir=payload["socket_dir"],
        device=str(device),
        device_id=payload["device_id"],
    )
    n = len(att.tensors)
    _sync(device)
    t1 = time.perf_counter()
    att.close()
    return {"seconds": t1 - t0, "tensors": n}


def _handles_only_run(conn: Any, payload: dict, sk: dict) -> dict:
    """Handles measurement, per-tensor side: receive and rebuild every handle."""
    device = sk["device"]
    _sync(device)
    t0 = time.perf_counter()
    conn.send(("handles", None))
    entries = pickle.loads(conn.recv_bytes())  # noqa: S301 (our own child's pipe)
    views = {name: _rebuild(e, device) for name, e in entries.items()}
    _sync(device)
    t1 = time.perf_counter()
    n = len(views)
    del views
    return {"seconds": t1 - t0, "tensors": n}


_TASKS: dict[str, tuple[Callable, Callable]] = {
    "load": (_load_prepare, _load_run),
    "restore": (_skeleton, _restore_run),
    "per_tensor": (_skeleton, _per_tensor_run),
    "attach_only": (_attach_only_prepare, _attach_only_run),
    "handles_only": (_attach_only_prepare, _handles_only_run),
}


#: Modules the forkserver imports once, so forked workers start without importing.
FORKSERVER_PRELOAD = (
    "torch",
    "safetensors",
    "wcache.core",
    "wcache.plans",
    "wcache.store",
    "wcache.benchmarks.synthetic",
    "wcache.benchmarks.bench_restore",
)
START_METHODS = ("spawn", "forkserver")


def _context(start_method: str):
    if start_method not in START_METHODS:
        raise ValueError(f"start method {start_method!r} is not one of {START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


class Worker:
    """A fresh worker process: started at once, run when :meth:`run` is called."""

    def __init__(self, task: str, payload: dict):
        ctx = _context(payload.get("start_method", "spawn"))
        self.conn, child = ctx.Pipe()
        self.task = task
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child, task, payload),
            daemon=True,
            name=f"wcache-bench-{task}",
        )
        self.proc.start()
        child.close()

    def _recv(self) -> tuple:
        if not self.conn.poll(WORKER_TIMEOUT_S):
            self.kill()
            raise WorkerFailed(f"{self.task} worker did not answer within {WORKER_TIMEOUT_S} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(1)
            raise WorkerFailed(f"{self.task} worker died (exit {self.proc.exitcode})") from None

    def run(
        self, extra: dict | None = None, serve_handles: Callable[[], bytes] | None = None
    ) -> dict:
        """Wait until ready, send ``extra`` (merged into the worker's payload), say
        go, answer handle requests, return the result."""
        msg = self._recv()
        if msg[0] == "error":
            raise WorkerFailed(f"{self.task} worker failed while starting:\n{msg[1]}")
        if extra:
            self.conn.send(("payload", extra))
        self.conn.send(("go", None))
        while True:
            msg = self._recv()
            if msg[0] == "handles":
                if serve_handles is None:
                    raise WorkerFailed(f"{self.task} worker asked for handles")
                self.conn.send_bytes(serve_handles())
                continue
            if msg[0] == "error":
                raise WorkerFailed(f"{self.task} worker failed:\n{msg[1]}")
            self.close()
            return msg[1]

    def close(self) -> None:
        try:
            self.conn.send(("stop", None))
        except OSError:
            pass
        self.proc.join(WORKER_TIMEOUT_S)
        self.conn.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


#: itemsize -> an integer dtype that pickles by value (the view keeps strides).
_BY_VALUE_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def per_tensor_entries(tensors: Mapping[str, torch.Tensor], kinds: Mapping[str, str]) -> bytes:
    """vLLM's ``TensorEntry.from_tensor`` for every tensor, pickled as vLLM's
    ``send_msg`` does: CUDA tensors as ``reduce_tensor`` args, others by value."""

    # name -> (kind, reduce_tensor args or None, (bytes view, dtype name) or None)
    out: dict[str, tuple[str, Any, tuple[torch.Tensor, str] | None]] = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.is_cuda:
            out[name] = (kinds[name], reduce_tensor(t)[1], None)
        else:
            # by value; float8 storages do not unpickle in torch 2.x, so every
            # tensor travels as a same-strided view of its bytes' itemsize
            carrier = _BY_VALUE_CARRIER.get(t.element_size(), None)
            data = t.view(carrier) if carrier is not None else t
            out[name] = (kinds[name], None, (data, str(t.dtype).removeprefix("torch.")))
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


# --------------------------------------------------------------------------- daemon side


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _layer_entries(layers: Sequence[Layer], prepared: Mapping[str, Any]) -> dict[str, dict]:
    return {
        ly.name: {
            "plan": ly.plan.id,
            "kernel": ly.plan.kernel,
            "recorded": {k: dict(v) for k, v in prepared[ly.name].recorded.items()},
            "drops": list(prepared[ly.name].drops),
        }
        for ly in layers
    }


def prepare_from_checkpoint(
    path: Path, layers: Sequence[Layer], device: torch.device, target: Target
) -> tuple[dict, dict, dict, float, float]:
    """Read the checkpoint and run ``plan.prepare`` per layer.

    Returns:
        (tensors by full name, kinds, per-layer manifest data, read seconds,
        prepare seconds).
    """

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    prepared = {}
    read_s = prep_s = 0.0
    with torch.no_grad(), safe_open(str(path), framework="pt", device=str(device)) as f:
        by_layer = _group_by_layer(list(f.keys()), layers)
        for ly in layers:
            _sync(device)
            t0 = time.perf_counter()
            module = torch.nn.Module()
            _install_(module, {n.rpartition(".")[2]: f.get_tensor(n) for n in by_layer[ly.name]})
            _sync(device)
            t1 = time.perf_counter()
            prep = prepare_(module, ly.plan.bind(ly.config, target))
            _sync(device)
            read_s += t1 - t0
            prep_s += time.perf_counter() - t1
            prepared[ly.name] = prep
            for local, t in prep.tensors.items():
                tensors[f"{ly.name}.{local}"] = t
                kinds[f"{ly.name}.{local}"] = "buffer" if local in prep.buffers else "param"
    return tensors, kinds, _layer_entries(layers, prepared), read_s, prep_s


def prepare_synthesized(
    shape: Any, fmt: str, layers: Sequence[Layer], device: torch.device, target: Target, seed: int
) -> tuple[dict, dict, dict, float]:
    """A no-disk export: one real ``plan.prepare`` per distinct linear shape, then
    every layer gets uninitialised host tensors of the prepared shapes, strides
    and dtypes (restore cost depends on those, not on the values).

    Returns:
        (tensors, kinds, per-layer manifest data, prepare seconds of the samples).
    """
    syn = _synthetic()
    kind = syn.CHECKPOINT_KIND[fmt]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    samples: dict[tuple[int, int], Any] = {}
    specs = {s.name: s for s in syn.linears(shape)}
    prep_s = 0.0
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    prepared = {}
    with torch.no_grad():
        for ly in layers:
            spec = specs[ly.name]
            dims = (spec.size_n, spec.size_k)
            if dims not in samples:
                module = torch.nn.Module()
                _install_(module, syn.make_linear_tensors(spec, kind, gen, device))
                t0 = time.perf_counter()
                prep = prepare_(module, ly.plan.bind(ly.config, target))
                _sync(device)
                prep_s += time.perf_counter() - t0
                samples[dims] = (
                    {
                        k: (tuple(v.shape), tuple(v.stride()), v.dtype)
                        for k, v in prep.tensors.items()
                    },
                    prep,
                )
            layout, prep = samples[dims]
            prepared[ly.name] = prep
            for local, (shp, stride, dtype) in layout.items():
                name = f"{ly.name}.{local}"
                tensors[name] = torch.empty_strided(shp, stride, dtype=dtype, device="cpu")
                kinds[name] = "buffer" if local in prep.buffers else "param"
        # the samples' device tensors are dropped here; only host placeholders remain
    return tensors, kinds, _layer_entries(layers, prepared), prep_s


class Daemon:
    """An in-process ``DaemonServer`` for one unit, with a private socket dir."""

    def __init__(
        self,
        tensors: dict,
        kinds: dict,
        layers_data: dict,
        key_fields: dict,
        device: torch.device,
        socket_dir: str,
        device_id: str,
    ):

        self.key = CacheKey(key_fields)
        export = Export(tensors=tensors, kinds=kinds, layers=layers_data)
        _sync(device)
        t0 = time.perf_counter()
        transport = (
            {"transport": os.environ[TRANSPORT_ENV]} if os.environ.get(TRANSPORT_ENV) else {}
        )
        self.server = DaemonServer(
            export,
            self.key,
            socket_dir=socket_dir,
            **transport,
            device=str(device) if device.type == "cuda" else "cpu",
            device_id=device_id,
        )
        _sync(device)
        self.arena_s = time.perf_counter() - t0
        self.server.start()
        self.nbytes = self.server.nbytes

    def stop(self) -> None:
        self.server.stop()
        self.server = None


# --------------------------------------------------------------------------- suite


def _key_fields(shape: Any, fmt: str, layers: Sequence[Layer], target: Target, nonce: str) -> dict:
    return {
        "bench": "wcache-bench",
        "shape": shape.name,
        "layers": shape.num_layers,
        "format": fmt,
        "plans": sorted({ly.plan.id for ly in layers}),
        "target": target.to_json(),
        "run": nonce,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _base_payload(opts: BenchOptions, device: torch.device) -> dict:

    return {
        "device": str(device),
        "simulate_cuda_target": opts.simulate_cuda_target,
        "sys_path": list(sys.path),
        "start_method": opts.start_method,
    }


def run_unit(
    opts: BenchOptions, fmt: str, size: str, socket_dir: str, log: Callable[[str], None]
) -> dict:
    """Measure one (format, size). Returns a JSON-able result row."""

    syn = _synthetic()
    device = _device(opts.device)
    target = _target(device, opts.simulate_cuda_target)
    shape = syn.SHAPES[size].with_layers(opts.layers)
    row: dict[str, Any] = {
        "format": fmt,
        "size": size,
        "layers": shape.num_layers,
        "params": shape.params,
        "no_disk": size in opts.no_disk,
    }
    try:
        layers = planned_linears(shape, fmt, target)
    except NoPlan as e:
        row["skipped"] = f"no plan on {target.device_type}: {e}"
        log(f"[{fmt}/{size}] skipped: {e}")
        return row
    row["plans"] = sorted({ly.plan.id for ly in layers})
    nonce = uuid.uuid4().hex[:12]
    device_id = f"bench-{os.getpid()}-{fmt}-{size}"
    payload = {**_base_payload(opts, device), "shape": asdict(shape), "fmt": fmt}
    disk = size not in opts.no_disk
    kind = syn.CHECKPOINT_KIND[fmt]
    root = syn.bench_dir(opts.bench_dir)
    # every worker starts now, importing and initialising the device while this
    # process writes/reads the checkpoint and prepares
    load_worker = (
        Worker(
            "load",
            {
                **payload,
                "reps": opts.load_reps,
                "path": str(syn.checkpoint_path(root, shape, kind)),
            },
        )
        if disk
        else None
    )
    restore_workers = [Worker("restore", payload) for _ in range(opts.reps)]
    per_tensor_workers = [Worker("per_tensor", payload) for _ in range(opts.reps)] if disk else []
    tensors: dict[str, torch.Tensor] | None  # None in `finally`: the references dropped
    daemon = None
    try:
        if disk:
            t0 = time.perf_counter()
            path, written = syn.ensure_checkpoint(root, shape, kind, opts.seed, device)
            row["checkpoint"] = str(path)
            row["checkpoint_bytes"] = path.stat().st_size
            log(
                f"[{fmt}/{size}] checkpoint {path} ({'written' if written else 'cached'}, "
                f"{path.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t0:.1f} s)"
            )
            _warm_page_cache(path)
            assert load_worker is not None  # made when disk
            res = load_worker.run()
            load_worker = None
            row["load_s_all"] = res["seconds"]
            row["load_s"] = _median(res["seconds"])
            load_digest = res["digest"]
            log(f"[{fmt}/{size}] ordinary load {row['load_s']:.3f} s")
            tensors, kinds, layers_data, read_s, prep_s = prepare_from_checkpoint(
                path, layers, device, target
            )
            row["daemon_read_s"] = read_s
        else:
            load_digest = None
            tensors, kinds, layers_data, prep_s = prepare_synthesized(
                shape, fmt, layers, device, target, opts.seed
            )
        daemon = Daemon(
            tensors,
            kinds,
            layers_data,
            _key_fields(shape, fmt, layers, target, nonce),
            device,
            socket_dir,
            device_id,
        )
        row["prepare_stages_s"] = prep_s
        row["arena_s"] = daemon.arena_s
        row["prepare_s"] = prep_s + daemon.arena_s if disk else None
        row["arena_bytes"] = daemon.nbytes
        row["tensors"] = len(tensors)
        log(
            f"[{fmt}/{size}] prepare {prep_s:.3f} s + arena {daemon.arena_s:.3f} s "
            f"({daemon.nbytes / 2**30:.2f} GiB, {len(tensors)} tensors)"
        )
        rp = {"key": daemon.key.fields, "socket_dir": socket_dir, "device_id": device_id}
        restores, attaches, digests = [], [], []
        for i, w in enumerate(restore_workers):
            w_payload_digest = i == 0 and load_digest is not None
            res = w.run({**rp, "digest": w_payload_digest})
            restores.append(res["seconds"])
            attaches.append(res["attach_s"])
            if res["digest"]:
                digests.append(res["digest"])
        restore_workers = []
        row["restore_s_all"] = restores
        row["restore_s"] = _median(restores)
        row["restore_attach_s"] = _median(attaches)
        if load_digest is not None and digests:
            row["restore_matches_load"] = digests[0] == load_digest
            if not row["restore_matches_load"]:
                log(
                    f"[{fmt}/{size}] WARNING: the restored layers' bytes differ from the "
                    f"ordinary load's"
                )
        log(
            f"[{fmt}/{size}] restore {row['restore_s'] * 1e3:.2f} ms "
            f"(attach {row['restore_attach_s'] * 1e3:.2f} ms)"
        )
        if per_tensor_workers:
            pts = []
            serve = lambda: per_tensor_entries(tensors, kinds)  # noqa: E731 (a one-line local function)
            for w in per_tensor_workers:
                res = w.run({"layers_data": layers_data, "digest": False}, serve)
                pts.append(res["seconds"])
            per_tensor_workers = []
            row["per_tensor_s_all"] = pts
            row["per_tensor_s"] = _median(pts)
            log(f"[{fmt}/{size}] per-tensor IPC restore {row['per_tensor_s'] * 1e3:.2f} ms")
        row["ratio_load_restore"] = _ratio(row.get("load_s"), row["restore_s"])
        row["ratio_per_tensor_arena"] = _ratio(row.get("per_tensor_s"), row["restore_s"])
    finally:
        for w in [*restore_workers, *per_tensor_workers, *([load_worker] if load_worker else [])]:
            w.kill()
        if daemon is not None:
            daemon.stop()
        tensors = None
        if device.type == "cuda":
            torch.cuda.ipc_collect()  # per-tensor handles' producer-side references
            torch.cuda.empty_cache()
    return row


def _warm_page_cache(path: str | Path, chunk: int = 64 << 20) -> None:
    """Read the file once so the ordinary load reads from the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass


def run_handles(opts: BenchOptions, socket_dir: str, log: Callable[[str], None]) -> dict:
    """Arena attach vs per-tensor handles for ``handle_tensors`` separate tensors."""
    device = _device(opts.device)
    n = opts.handle_tensors
    numel = max(1, int(opts.handle_mib * 2**20) // 2)
    payload = _base_payload(opts, device)
    arena_workers = [Worker("attach_only", payload) for _ in range(opts.reps)]
    pt_workers = [Worker("handles_only", payload) for _ in range(opts.reps)]
    daemon = None
    tensors: dict[str, torch.Tensor] = {}
    try:
        tensors = {
            f"h.{i}": torch.empty(numel, dtype=torch.bfloat16, device=device) for i in range(n)
        }
        kinds = {k: "param" for k in tensors}
        daemon = Daemon(
            tensors,
            kinds,
            {},
            {"bench": "wcache-bench-handles", "n": n, "run": uuid.uuid4().hex[:12]},
            device,
            socket_dir,
            f"bench-{os.getpid()}-handles",
        )
        rp = {
            "key": daemon.key.fields,
            "socket_dir": socket_dir,
            "device_id": f"bench-{os.getpid()}-handles",
        }
        arena = [w.run(rp)["seconds"] for w in arena_workers]
        arena_workers = []
        serve = lambda: per_tensor_entries(tensors, kinds)  # noqa: E731 (a one-line local function)
        pt = [w.run({}, serve)["seconds"] for w in pt_workers]
        pt_workers = []
    finally:
        for w in [*arena_workers, *pt_workers]:
            w.kill()
        if daemon is not None:
            daemon.stop()
        tensors.clear()
        if device.type == "cuda":
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
    row: dict[str, Any] = {
        "tensors": n,
        "tensor_mib": opts.handle_mib,
        "arena_s_all": arena,
        "per_tensor_s_all": pt,
        "arena_s": _median(arena),
        "per_tensor_s": _median(pt),
    }
    row["ratio_per_tensor_arena"] = _ratio(row["per_tensor_s"], row["arena_s"])
    log(
        f"[handles] {n} tensors: arena {row['arena_s'] * 1e3:.2f} ms, per-tensor "
        f"{row['per_tensor_s'] * 1e3:.2f} ms"
    )
    return row


def run_suite(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    """Every unit, the handles measurement and the curve; a JSON-able dict."""
    device = _device(opts.device)
    info: dict[str, Any] = {
        "device": opts.device,
        "torch": torch.__version__,
        "options": asdict(opts),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if not opts.simulate_cuda_target:
        load_cpu_ops(device)
    t_start = time.perf_counter()
    rows = []
    socket_dir = tempfile.mkdtemp(prefix="wcb-")
    try:
        for size in opts.sizes:
            for fmt in opts.formats:
                rows.append(run_unit(opts, fmt, size, socket_dir, log))
        handles = run_handles(opts, socket_dir, log) if opts.handle_tensors > 0 else None
    finally:  # the daemons are gone; their sockets' lock files stay behind
        shutil.rmtree(socket_dir, ignore_errors=True)
    info["wall_s"] = time.perf_counter() - t_start
    return {"info": info, "rows": rows, "handles": handles, "curve": curve_points(rows)}


def curve_points(rows: Sequence[dict]) -> list[dict]:
    """Restore seconds vs model size: one point per (format, size) measured."""
    return [
        {
            "format": r["format"],
            "size": r["size"],
            "params": r["params"],
            "restore_s": r["restore_s"],
        }
        for r in rows
        if r.get("restore_s") is not None
    ]


# --------------------------------------------------------------------------- report

TABLE_HEADER = (
    "| format | size | ordinary load s | prepare s | restore s | per-tensor IPC "
    "restore s | load/restore | per-tensor/arena |"
)


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4f}" if x < 1 else f"{x:.2f}"


def _fmt_ratio(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x" if x >= 1 else f"{x:.2g}x"


def markdown_table(rows: Sequence[dict]) -> str:
    """The results as a markdown table (one row per format and size)."""
    lines = [TABLE_HEADER, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {r['format']} | {r['size']} | skipped: {r['skipped'][:80]} | | | | | |"
            )
            continue
        lines.append(
            f"| {r['format']} | {r['size']} | {_fmt_s(r.get('load_s'))} | "
            f"{_fmt_s(r.get('prepare_s'))} | {_fmt_s(r.get('restore_s'))} | "
            f"{_fmt_s(r.get('per_tensor_s'))} | {_fmt_ratio(r.get('ratio_load_restore'))} | "
            f"{_fmt_ratio(r.get('ratio_per_tensor_arena'))} |"
        )
    return "\n".join(lines) + "\n"


def handles_table(h: dict | None) -> str:
    """The handles measurement as a one-row markdown table."""
    if not h:
        return ""
    return (
        "| tensors | MiB each | arena attach s | per-tensor handles s | per-tensor/arena |\n"
        "|---:|---:|---:|---:|---:|\n"
        f"| {h['tensors']} | {h['tensor_mib']:g} | {_fmt_s(h['arena_s'])} | "
        f"{_fmt_s(h['per_tensor_s'])} | {_fmt_ratio(h['ratio_per_tensor_arena'])} |\n"
    )
