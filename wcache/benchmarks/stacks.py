"""Read the stack samples of `wcache bench --phases --stack-samples` (a diagnostic):
where each process of an engine start spent its wall time, by the innermost frame of
a chosen package, and as a timeline.

    python -m wcache.benchmarks.stacks DIR/ROW.stacks [--thread MainThread]
        [--package vllm] [--top 25] [--timeline]

Samples are written by ``wcache/benchmarks/_stack_sampler/sitecustomize.py``: one
file ``PREFIX.{pid}`` per process, a ``#`` header line (pid, ppid, start, interval,
argv), then ``{unix s} {thread} {frame};...;{frame}`` lines, frames outermost first,
each ``path:line:function``. Seconds are samples x the interval: an estimate, good
to about one interval per stretch.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
from collections.abc import Sequence

import attrs

__all__ = ["Process", "read_samples", "hot_frames", "timeline", "main"]

_HEADER = re.compile(r"# pid=(\d+) ppid=(\d+) start=(\S+) interval=(\S+) argv=(.*)")
#: Defaults of the command line: keys printed per process.
TOP_DEFAULT = 25


@attrs.define
class Process:
    """One sampled process: ``samples`` are ``(unix s, thread name, frames)``, frames
    outermost first, each ``(path, line, function)``."""

    pid: int
    ppid: int
    start: float
    interval: float
    argv: str
    samples: list[tuple[float, str, list[tuple[str, int, str]]]] = attrs.field(factory=list)


def _frame(text: str) -> tuple[str, int, str]:
    path, line, func = text.rsplit(":", 2)
    return path, int(line), func


def read_samples(prefix: str) -> list[Process]:
    """The processes of every ``{prefix}.{pid}`` file (each header line starts one), by
    start time. Lines that do not parse are skipped (a sample cut off by the process's
    exit)."""
    procs: list[Process] = []
    for path in sorted(glob.glob(glob.escape(prefix) + ".*")):
        current = None
        with open(path, errors="replace") as f:
            for line in f:
                m = _HEADER.match(line)
                if m:
                    try:
                        current = Process(int(m[1]), int(m[2]), float(m[3]), float(m[4]), m[5])
                    except ValueError:
                        current = None  # a header cut off: its samples cannot be placed
                        continue
                    procs.append(current)
                    continue
                parts = line.rstrip("\n").split(" ", 2)
                if current is None or len(parts) != 3:
                    continue
                try:
                    current.samples.append(
                        (float(parts[0]), parts[1], [_frame(t) for t in parts[2].split(";") if t])
                    )
                except ValueError:
                    continue
    return sorted(procs, key=lambda p: p.start)


def _in_package(path: str, package: str) -> bool:
    return f"{os.sep}{package}{os.sep}" in path


def _key(frames: Sequence[tuple[str, int, str]], package: str, depth: int) -> str:
    """The innermost ``depth`` frames of ``package`` (else of the whole stack), shortened
    to ``package/...file:function``."""
    mine = [f for f in frames if _in_package(f[0], package)] or list(frames)

    def short(f: tuple[str, int, str]) -> str:
        path = f[0]
        i = path.rfind(f"{os.sep}{package}{os.sep}")
        return f"{path[i + 1 :] if i >= 0 else os.path.basename(path)}:{f[2]}"

    return " < ".join(short(f) for f in reversed(mine[-depth:]))


def hot_frames(
    proc: Process,
    *,
    thread: str = "MainThread",
    package: str = "vllm",
    depth: int = 1,
    since: float | None = None,
    until: float | None = None,
) -> list[tuple[str, float]]:
    """Seconds (samples x interval) per innermost ``package`` frame of ``thread``,
    most first, optionally only for samples in ``[since, until]``."""
    counts: collections.Counter[str] = collections.Counter()
    for t, name, frames in proc.samples:
        if name == thread and (since is None or t >= since) and (until is None or t <= until):
            counts[_key(frames, package, depth)] += 1
    return [(k, n * proc.interval) for k, n in counts.most_common()]


def timeline(
    proc: Process, *, thread: str = "MainThread", package: str = "vllm", depth: int = 2
) -> list[tuple[float, float, str]]:
    """``(first s, last s, key)`` for each stretch of consecutive samples of ``thread``
    with the same :func:`_key`, seconds from the process's start."""
    out: list[tuple[float, float, str]] = []
    for t, name, frames in proc.samples:
        if name != thread:
            continue
        k, rel = _key(frames, package, depth), t - proc.start
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], rel, k)
        else:
            out.append((rel, rel, k))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print, per sampled process, seconds per innermost frame of ``--package``
    (and with ``--timeline`` each stretch); 1 when no sample file is found."""
    p = argparse.ArgumentParser(
        prog="python -m wcache.benchmarks.stacks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prefix", help="the samples' prefix: {--out}.logs/{row}.stacks")
    p.add_argument("--thread", default="MainThread")
    p.add_argument(
        "--package",
        default="vllm",
        help="attribute each sample to this package's innermost frame (default vllm)",
    )
    p.add_argument("--depth", type=int, default=1, help="frames of the package per key")
    p.add_argument("--top", type=int, default=TOP_DEFAULT)
    p.add_argument("--timeline", action="store_true", help="also print each stretch in order")
    args = p.parse_args(argv)
    procs = read_samples(args.prefix)
    if not procs:
        print(f"no samples at {args.prefix}.*", file=sys.stderr)
        return 1
    for proc in procs:
        own = [s for s in proc.samples if s[1] == args.thread]
        if not own:
            continue
        print(
            f"pid {proc.pid} (ppid {proc.ppid}) {proc.argv[:120]}: {len(own)} samples "
            f"x {proc.interval} s, {own[0][0] - proc.start:.1f}-{own[-1][0] - proc.start:.1f} s "
            f"after its start"
        )
        for key, sec in hot_frames(
            proc, thread=args.thread, package=args.package, depth=args.depth
        )[: args.top]:
            print(f"  {sec:7.1f} s  {key}")
        if args.timeline:
            for a, b, key in timeline(
                proc, thread=args.thread, package=args.package, depth=max(args.depth, 2)
            ):
                if b - a >= proc.interval:
                    print(f"    {a:7.1f}-{b:7.1f} s  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
