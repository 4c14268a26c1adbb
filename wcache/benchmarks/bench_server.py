"""`wcache bench --server`: the restart cost a user sees, disk vs daemon.

For each SmolLM2 fixture format: one ``wcache serve`` daemon, then vLLM's
OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``)
started ``--reps`` times from disk (``--load-format auto``) and ``--reps`` times
from the daemon (``--load-format wcache``, fallback off, so a daemon start can
never be a disk load in disguise), alternating. Each start is timed from just
before the process is spawned until the first ``POST /v1/completions`` (two
prompts x 16 greedy tokens) has returned; the median per side and their ratio
are printed as a markdown table (``--out`` also writes JSON). The daemon runs
during the disk starts too, as it would on a host that restarts engines.

    python -m wcache.cli bench --server --formats bf16 --reps 3 --out /tmp/server.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wcache.daemon.process import DaemonProcess, ServerProcess

PROMPTS = ("The capital of France is", "Water boils at a temperature of")
MAX_TOKENS = 16
#: Server starts per side and format: one start costs ~30-60 s on 2 cores; 3 gives
#: a median that one slow start (other work on the machine) does not move.
DEFAULT_REPS = 3
RESTORE_LINE = "wcache: weight-load phase (restore)"


def _log(msg: str) -> None:
    print(f"[bench --server {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_format(fmt: str, reps: int, log=_log) -> dict[str, Any]:
    """Time ``reps`` server starts per side for one fixture format.

    Raises:
        RuntimeError: a daemon-backed start did not restore, or the two sides answered
            differently (the comparison would be meaningless).
    """
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    model = build(fmt)
    runs: dict[str, list[dict[str, Any]]] = {"disk": [], "daemon": []}
    with tempfile.TemporaryDirectory(prefix="wc-bsrv-") as runtime:
        env = {"XDG_RUNTIME_DIR": runtime}
        with DaemonProcess(model, Path(runtime) / "wcache", env=env) as daemon:
            log(f"{fmt}: daemon ready in {daemon.ready_s:.1f} s")
            for rep in range(reps):
                for side, load_format, extra in (
                    ("disk", "auto", None),
                    ("daemon", "wcache", {"fallback": False}),
                ):
                    with ServerProcess(model, load_format, extra, env=env) as server:
                        texts = server.complete(PROMPTS, MAX_TOKENS)
                    if side == "daemon" and RESTORE_LINE not in server.log:
                        raise RuntimeError(
                            f"{fmt}: the daemon-backed server did not log {RESTORE_LINE!r}"
                        )
                    runs[side].append(
                        {
                            "first_completion_s": server.first_completion_s,
                            "health_s": server.ready_s,
                            "texts": texts,
                        }
                    )
                    log(
                        f"{fmt} {side} #{rep + 1}: /health {server.ready_s:.1f} s, first "
                        f"completion {server.first_completion_s:.1f} s, {texts[0]!r}"
                    )
    answers = {json.dumps(r["texts"]) for side in runs.values() for r in side}
    if len(answers) != 1:
        raise RuntimeError(f"{fmt}: starts answered differently: {sorted(answers)}")
    med = {
        side: statistics.median(r["first_completion_s"] for r in rs) for side, rs in runs.items()
    }
    health = {side: statistics.median(r["health_s"] for r in rs) for side, rs in runs.items()}
    return {
        "format": fmt,
        "reps": reps,
        "disk_s": med["disk"],
        "daemon_s": med["daemon"],
        "disk_health_s": health["disk"],
        "daemon_health_s": health["daemon"],
        "ratio": med["disk"] / med["daemon"],
        "texts": runs["disk"][0]["texts"],
        "runs": runs,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per format the medians (seconds) of both sides and disk/daemon."""
    out = [
        "| format | starts per side | disk: first completion s | daemon: first completion s "
        "| disk: /health s | daemon: /health s | disk/daemon |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['format']} | {r['reps']} | {r['disk_s']:.1f} | {r['daemon_s']:.1f} | "
            f"{r['disk_health_s']:.1f} | {r['daemon_health_s']:.1f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="wcache bench --server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--formats", default="bf16", help="comma-separated SmolLM2 fixture formats (default bf16)"
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=DEFAULT_REPS,
        help=f"server starts per side and format (default {DEFAULT_REPS})",
    )
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    rows = [run_format(fmt, args.reps) for fmt in args.formats.split(",") if fmt]
    print(table(rows))
    for r in rows:
        print(
            f"{r['format']}: time to first completion {r['disk_s']:.1f} s from disk, "
            f"{r['daemon_s']:.1f} s from the daemon: {r['ratio']:.2f}x"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"server": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
