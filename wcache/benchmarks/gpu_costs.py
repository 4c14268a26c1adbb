"""Where the restore's time goes on a GPU: three small measurements of an 8B-sized
arena (docs/benchmarks.md, "Where the costs are"), each in this fresh process.

    python3 -m wcache.benchmarks.gpu_costs checksum [GiB]    # one content-check pass per reduction variant
    python3 -m wcache.benchmarks.gpu_costs guard-cold        # first use of the guard's kernels, then the whole guard
    python3 -m wcache.benchmarks.gpu_costs vmm-steps [GiB]   # each step of a cuda_vmm (and cuda_ipc) attach

``checksum``: how fast one pass of the restore guard's content check reads the
arena (32 layer ranges), per reduction variant, and what ``import
cuda.bindings.driver`` costs in a fresh process. ``guard-cold``: the cold-start
cost of the content check (first use of torch's int64 sum kernel), then the whole
:class:`wcache.core.RestoreGuard` over 128 layer ranges of a 13 GiB arena, cold
and warm. ``vmm-steps``: the time of each step of an attach (``transport_vmm.last_open_ms``)
in a child process, three times per transport. Results print as text lines.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from wcache.store import CacheKey, DaemonServer, Export

#: An 8B bf16 model's weights (GiB): the default arena size.
DEFAULT_GIB = 13.0
#: Layer ranges of the checksum measurement (Llama-3.1-8B's 32 decoder layers).
CHECKSUM_LAYERS = 32
#: Layer ranges of the guard measurement (32 layers x 4 linears).
GUARD_LAYERS = 128
#: Timed repetitions per variant; the median is printed.
REPS = 5
#: A child attach run gets this long (seconds): a cold CUDA context plus 3 attaches.
CHILD_TIMEOUT_S = 300


def _timed_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median wall time of ``fn`` in milliseconds, synchronizing the device around it."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(sorted(out)[len(out) // 2], 3)


def checksum(gib: float) -> None:
    """One content-check pass over a ``gib`` GiB arena per reduction variant."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.core import ByteRange, RestoreGuard, range_sums  # noqa: PLC0415 (torch import ~2 s: only when called)

    n = int(gib * 2**30) // 4096 * 4096
    arena = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    per = n // CHECKSUM_LAYERS // 8 * 8
    views = [arena[i * per : (i + 1) * per] for i in range(CHECKSUM_LAYERS)]
    ranges = [ByteRange(v, (f"l{i}",), 0, per) for i, v in enumerate(views)]
    res = {
        "range_sums int64": _timed_ms(lambda: range_sums(ranges)),
        "int64 sum, no sync": _timed_ms(lambda: [v.view(torch.int64).sum() for v in views]),
        "int32 sum(dtype=int64)": _timed_ms(
            lambda: [v.view(torch.int32).sum(dtype=torch.int64) for v in views]
        ),
        "int64 2-D rows sum then sum": _timed_ms(
            lambda: [v.view(torch.int64).view(-1, 512).sum(1).sum() for v in views]
        ),
        "float32 view nansum": _timed_ms(lambda: [v.view(torch.float32).nansum() for v in views]),
        "copy (read+write) d2d": _timed_ms(lambda: arena.clone()),
    }
    for k, ms in res.items():
        print(f"{k:32s} {ms:8.3f} ms  {n / ms / 1e6:7.1f} GB/s read", flush=True)
    layers = {f"l{i}": {"w": views[i].view(torch.bfloat16)} for i in range(CHECKSUM_LAYERS)}
    t0 = time.perf_counter()
    guard = RestoreGuard(layers)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for i in range(CHECKSUM_LAYERS):
        guard.check_layer(f"l{i}", ())
    t2 = time.perf_counter()
    guard.check_all()
    t3 = time.perf_counter()
    print(
        f"RestoreGuard: init {1e3 * (t1 - t0):.2f} ms, {CHECKSUM_LAYERS} check_layer "
        f"{1e3 * (t2 - t1):.2f} ms, check_all {1e3 * (t3 - t2):.2f} ms"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time, torch; torch.empty(1, device='cuda'); "
            "t0 = time.perf_counter(); import cuda.bindings.driver; "
            "print(f'import cuda.bindings.driver {1e3*(time.perf_counter()-t0):.1f} ms')",
        ],
        capture_output=True,
        text=True,
    )
    print(r.stdout.strip() or r.stderr[-500:])


def guard_cold() -> None:
    """The guard's content check cold (first kernel use) and the whole guard over
    :data:`GUARD_LAYERS` ranges of a 13 GiB arena, three times."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    from wcache.core import RestoreGuard, layer_ranges, range_sums  # noqa: PLC0415 (torch import ~2 s: only when called)

    small = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    t0 = time.perf_counter()
    range_sums(layer_ranges({"w": small}))
    t1 = time.perf_counter()
    range_sums(layer_ranges({"w": small}))
    t2 = time.perf_counter()
    print(
        f"first range_sums (cold kernels) {1e3 * (t1 - t0):.2f} ms, second {1e3 * (t2 - t1):.2f} ms"
    )
    n = int(DEFAULT_GIB) * 2**30
    arena = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    per = n // GUARD_LAYERS // 256 * 256
    layers = {
        f"l{i}": {"weight": arena[i * per : (i + 1) * per].view(torch.bfloat16)}
        for i in range(GUARD_LAYERS)
    }
    for rep in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        guard = RestoreGuard(layers)
        t1 = time.perf_counter()
        for i in range(GUARD_LAYERS):
            guard.check_stage(f"l{i}", "s", layers[f"l{i}"])
            guard.check_layer(f"l{i}", ())
        t2 = time.perf_counter()
        guard.check_all()
        t3 = time.perf_counter()
        print(
            f"rep {rep}: init {1e3 * (t1 - t0):.2f} ms, {GUARD_LAYERS}x(check_stage+check_layer) "
            f"{1e3 * (t2 - t1):.2f} ms, check_all {1e3 * (t3 - t2):.2f} ms"
        )


#: The child of :func:`vmm_steps`: three attaches, each with its steps' times.
_ATTACH_CHILD = """
import time, torch, json
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
import cuda.bindings.driver  # imported before the timed region in one run, so both are seen
from wcache.store import CacheKey, attach
from wcache.store import transport_vmm
from wcache.store.paths import cuda_device_uuid
out = []
for i in range(3):
    t0 = time.perf_counter()
    att = attach(CacheKey({fields!r}), socket_dir={sock!r}, device="cuda:0", device_id=cuda_device_uuid(0))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    s = float(att.tensors["w"][:1024].float().sum())
    out.append({{"attach_ms": round((t1 - t0) * 1e3, 2), "steps": dict(transport_vmm.last_open_ms)}})
    att.close(); del att
print(json.dumps(out))
"""


def vmm_steps(gib: float) -> None:
    """Each step of an attach of a ``gib`` GiB bf16 arena, per CUDA transport."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    n = int(gib * 2**30) // 2
    key = CacheKey({"bench": "vmm-steps", "gib": gib})
    for transport in ("cuda_vmm", "cuda_ipc"):
        sock = tempfile.mkdtemp(prefix="wvs-")
        os.chmod(sock, 0o700)
        export = Export(
            {"w": torch.zeros(n, dtype=torch.bfloat16, device="cuda:0")}, {"w": "param"}, {}, {}, {}
        )
        server = DaemonServer(
            export, key, socket_dir=sock, device="cuda:0", transport=transport
        ).start()
        del export
        torch.cuda.empty_cache()
        child = subprocess.run(
            [sys.executable, "-c", _ATTACH_CHILD.format(fields=key.fields, sock=sock)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        print(transport, child.stdout.strip() or child.stderr[-2000:], flush=True)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m wcache.benchmarks.gpu_costs", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="what", required=True)
    for name, help_ in (
        ("checksum", "one content-check pass per reduction variant"),
        ("vmm-steps", "each step of a cuda_vmm / cuda_ipc attach"),
    ):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("gib", nargs="?", type=float, default=DEFAULT_GIB, help="arena size (GiB)")
    sub.add_parser("guard-cold", help="the guard's kernels cold, then the whole guard")
    a = p.parse_args(argv)
    if a.what == "checksum":
        checksum(a.gib)
    elif a.what == "vmm-steps":
        vmm_steps(a.gib)
    else:
        guard_cold()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
