"""A stand-in for the architecture sweep's per-case runner (no engines), importable by
the sweep's spawned pool processes: it records where and when it ran."""

from __future__ import annotations

import os
import time

#: How long a fake case takes (s): long beside a spawned process's start, so two
#: cases of a two-worker pool overlap.
CASE_S = 2.0


def fake_case(arch_name: str, fmt: str, device: str, root: str | None, gpu: int | None) -> dict:
    """One fake row: the case, this process's pid, the GPU given, start and end times."""
    start = time.time()
    time.sleep(CASE_S)
    return {
        "case": f"{arch_name}/{fmt}",
        "device": device,
        "outcome": "restored",
        "pid": os.getpid(),
        "gpu": gpu,
        "start": start,
        "end": time.time(),
    }


def stoppable_case(
    arch_name: str, fmt: str, device: str, root: str | None, gpu: int | None
) -> dict:
    """A case that runs until stopped: it marks ``root/started-ARCH`` and, when SIGTERM
    ends it (as the sweep's own worker runner would, exit_on_sigterm), ``root/stopped-ARCH``
    from its ``finally`` block."""
    from pathlib import Path

    from wcache.daemon.process import exit_on_sigterm

    assert root is not None
    exit_on_sigterm()
    (Path(root) / f"started-{arch_name}").write_text(str(os.getpid()))
    try:
        time.sleep(120)
    finally:
        (Path(root) / f"stopped-{arch_name}").write_text("stopped")
    return {"case": f"{arch_name}/{fmt}", "device": device, "outcome": "failed"}
