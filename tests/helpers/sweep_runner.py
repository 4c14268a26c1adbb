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
