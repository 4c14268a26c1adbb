"""The host queries behind :meth:`wcache.core.Target.detect`: the only place in
:mod:`wcache.core` that reads the machine (``/proc/cpuinfo``, ``platform``, torch's
ISA and CUDA queries) or the environment. Stages never call these; they read the
frozen :class:`~wcache.core.Target` built from them.

Imports nothing from wcache.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

import torch

__all__ = ["CPUINFO", "cpu_isa", "cpuinfo_flags", "cuda_capability", "environment"]

#: Where Linux lists the CPU's flags (the fallback when torch cannot be asked).
CPUINFO = "/proc/cpuinfo"


def environment(names: Iterable[str]) -> dict[str, str]:
    """The values of ``names`` that are set in ``os.environ``."""
    return {k: os.environ[k] for k in names if k in os.environ}


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability ``(major, minor)`` of ``device``."""
    cap = torch.cuda.get_device_capability(device)
    return int(cap[0]), int(cap[1])


def cpuinfo_flags(path: str = CPUINFO) -> set[str]:
    """The ``flags`` line of ``path`` as a set (empty when it cannot be read)."""
    try:
        with open(path) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return set(flags)


def cpu_isa() -> frozenset[str]:
    """The CPU ISA flags that decide vLLM's layouts on this host: ``"riscv"``,
    ``"power"``, ``"avx512"``, ``"avx512_bf16"``, ``"amx"``.

    The x86 flags come from the same torch queries vLLM asks
    (platforms/cpu.py::import_kernels, cpu.py::_get_isa_hint), so a host (or a
    test) that makes torch report a smaller ISA is that ISA here too;
    ``/proc/cpuinfo`` answers only where torch has no such query.
    """
    isa: set[str] = set()
    machine = platform.machine().lower()
    if machine.startswith("riscv"):
        isa.add("riscv")
    elif machine.startswith(("ppc", "power")):
        isa.add("power")
    fset = cpuinfo_flags()
    cpu = torch.cpu
    queries = {
        "avx512": getattr(cpu, "_is_avx512_supported", None),
        "avx512_bf16": getattr(cpu, "_is_avx512_bf16_supported", None),
        "amx": getattr(cpu, "_is_amx_tile_supported", None),
    }
    cpuinfo = {
        "avx512": "avx512f" in fset,
        "avx512_bf16": "avx512_bf16" in fset,
        "amx": {"amx_bf16", "amx_tile"} <= fset,
    }
    for flag, query in queries.items():
        if query() if query is not None else cpuinfo[flag]:
            isa.add(flag)
    return frozenset(isa)
