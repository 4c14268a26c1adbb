"""What a template child still imports: ``-X importtime`` after the template's preloads (CPU).

    PYTHONPATH=$PWD python tests/template/lazy_imports.py [--compile] [--preload-only]
        [--json OUT] [--top 40]

A forked child cannot turn on ``-X importtime``, so this runs the child's situation in
one interpreter: ``python -X importtime -c PRELUDE``, where PRELUDE imports exactly
what the template imports (:func:`wcache.template.server.default_preload`, the same
tripwire-free order), prints a marker on stderr, then runs ``wcache.vllm.run_engine``
as ``__main__`` on the SmolLM2 bf16 fixture (vLLM's engine core in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so every import of the start lands in this
process). Every ``import time:`` line after the marker is an import the child would
still pay. With ``--compile`` the engine runs torch.compile on a private cache root
twice (the first fills it, the second, measured, loads from it: the path a fresh node's
engine takes with the carried artifacts).

Prints the measured run's top-level lazy imports (cumulative microseconds, as
``-X importtime`` reports them, which inflates them) and the self time summed by
package; ``--json`` writes both. CPU only: the CUDA worker's lazy imports (Triton's
kernels, the CUDA graph path) are read from vLLM's source (docs/template.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

MARKER = "@@wcache-template-preloaded@@"
IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
#: Generous: a compiled CPU engine's cold Inductor compile takes minutes on 2 cores.
RUN_TIMEOUT_S = 1800
PACKAGE_DEPTH = 2  # "vllm.compilation" / "torch._inductor": the level a preload names


def prelude(preloads: list[str], run_args: list[str]) -> str:
    """The ``-c`` program: the template's imports, the marker, run_engine as __main__."""
    return (
        "import importlib, runpy, sys\n"
        f"for m in {preloads!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as e:\n"
        "        print('preload skipped', m, e, file=sys.stderr)\n"
        f"print({MARKER!r}, file=sys.stderr, flush=True)\n"
        f"sys.argv = ['run_engine', *{run_args!r}]\n"
        "runpy.run_module('wcache.vllm.run_engine', run_name='__main__', alter_sys=True)\n"
    )


def parse(stderr: str) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """The top-level imports after the marker (name, cumulative us) and self us by package."""
    after = stderr.split(MARKER, 1)[1] if MARKER in stderr else ""
    top: list[tuple[str, int]] = []
    by_pkg: dict[str, int] = defaultdict(int)
    for line in after.splitlines():
        m = IMPORT_LINE.match(line)
        if not m:
            continue
        self_us, cum_us, indent, name = int(m[1]), int(m[2]), len(m[3]), m[4]
        by_pkg[".".join(name.split(".")[:PACKAGE_DEPTH])] += self_us
        if indent <= 1:  # "-X importtime" indents nested imports by two per level
            top.append((name, cum_us))
    return sorted(top, key=lambda t: -t[1]), dict(sorted(by_pkg.items(), key=lambda t: -t[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true", help="torch.compile (a warm cache root)")
    p.add_argument("--json", default=None)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    from wcache.template.server import default_preload
    from wcache.testing.caches import cache_env
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    root = tempfile.mkdtemp(prefix="wct-lazy-")
    env = {
        **os.environ,
        **cache_env(root),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    run_args = ["--model", model, "--max-model-len", "512", "--max-tokens", "1"]
    run_args += ["--prompt", "The capital of France is"]
    if args.compile:
        run_args.append("--compile")
        warm = subprocess.run(
            [sys.executable, "-m", "wcache.vllm.run_engine", *run_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        if warm.returncode:
            print(warm.stdout[-2000:], warm.stderr[-4000:], file=sys.stderr)
            return 1
    preloads = list(default_preload(cpu=True))
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", prelude(preloads, run_args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if proc.returncode or MARKER not in proc.stderr:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        return 1
    top, by_pkg = parse(proc.stderr)
    total = sum(us for _, us in top)
    print(f"{len(top)} top-level imports after the preloads, {total / 1e6:.2f} s cumulative")
    for name, us in top[: args.top]:
        print(f"{us / 1e6:8.3f} s  {name}")
    print("self time by package:")
    for name, us in list(by_pkg.items())[: args.top]:
        print(f"{us / 1e6:8.3f} s  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compile": args.compile, "top": top, "by_package": by_pkg}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
