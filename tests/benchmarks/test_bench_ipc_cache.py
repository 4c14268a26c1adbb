"""The pure parts of the ipc_cache side-by-side benchmark (the runs need the H200)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from wcache.benchmarks import bench_ipc_cache as B


def _checkpoint(path, rows=6, cols=4):
    path.mkdir()
    emb = torch.arange(rows * cols, dtype=torch.bfloat16).reshape(rows, cols)
    save_file(
        {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text("{}")
    return emb


def test_swapped_checkpoint_changes_one_value_and_keeps_the_header(tmp_path):
    """write_swapped_checkpoint changes exactly [tok, 0] of the embedding; headers stay byte-equal."""
    emb = _checkpoint(tmp_path / "a")
    change = B.write_swapped_checkpoint(tmp_path / "a", tmp_path / "b", token_id=3, value=8.0)
    assert B._headers(tmp_path / "a") == B._headers(tmp_path / "b")
    after = load_file(tmp_path / "b" / "model.safetensors")
    expected = emb.clone()
    expected[3, 0] = 8.0
    assert torch.equal(after["model.embed_tokens.weight"], expected)
    assert torch.equal(after["lm_head.weight"], emb + 1)
    assert change == {
        "file": "model.safetensors",
        "tensor": "model.embed_tokens.weight",
        "index": [3, 0],
        "old": float(emb[3, 0]),
        "new": 8.0,
    }
    assert (tmp_path / "b" / "config.json").is_file()


def test_swapped_checkpoint_refuses_a_non_bf16_embedding(tmp_path):
    """A float32 embedding is refused by name, not rewritten with the wrong width."""
    (tmp_path / "a").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "a" / "m.safetensors")
    with pytest.raises(ValueError, match="F32, not BF16"):
        B.write_swapped_checkpoint(tmp_path / "a", tmp_path / "b", token_id=0)


def test_table_lists_each_system_and_refusals():
    """The table has a disk reference line, a measured line and a refusal line per case."""
    rows = [
        {
            "case": "smol-awq",
            "disk": {
                "model_loading_s": 1.0,
                "model_loading_gib": 0.1,
                "llm_start_s": 5.0,
                "ttft_s": 9.5,
            },
            "wcache": {
                "daemon_ready_s": 20.0,
                "daemon_gpu_mib": 300.0,
                "model_loading_s": 0.2,
                "model_loading_gib": 0.0,
                "llm_start_s": 3.0,
                "ttft_s": 7.25,
                "identical": True,
            },
            "ipc_cache": {"daemon_error": ["RuntimeError: AWQMarlinLinearMethod | refused"]},
        }
    ]
    lines = B.table(rows).splitlines()
    assert lines[2] == "| smol-awq | disk | - | - | 1.000 | 0.10 | 5.0 | 9.5 | (reference) |"
    assert lines[3] == "| smol-awq | wcache | 20.0 | 300 | 0.200 | 0.00 | 3.0 | 7.2 | yes |"
    assert lines[4].startswith(
        "| smol-awq | ipc_cache | refused/failed (daemon): "
        "RuntimeError: AWQMarlinLinearMethod \\| refused"
    )


def test_cases_name_known_checkpoint_kinds():
    """Every case's SmolLM2 kind is a fixture the builder makes; 8B and 30B-A3B kinds
    are their writers'."""
    from wcache.benchmarks.bench_engine_cuda import FORMATS
    from wcache.testing.fixtures import ALL_FORMATS
    from wcache.testing.moe_bench import BENCH_FORMATS

    known = {
        "smol": set(ALL_FORMATS),
        "8b": {kind for kind, _ in FORMATS.values()},
        "moe30b": set(BENCH_FORMATS),
    }
    for case, (model, kind, _) in B.CASES.items():
        assert kind in known[model], case
    assert {k for k, (m, _, _) in B.CASES.items() if m == "moe30b"} == {
        "moe30b-fp8-block",
        "moe30b-nvfp4",
        "moe30b-awq",
    }


def test_summary_measures_first_token_from_the_engine_process_start():
    """ttft_s is run_engine's first_token mark minus its process_start mark (None
    when the engine skipped the first-token request)."""
    res = {
        "token_ids": [[1, 2]],
        "llm_start_s": 3.0,
        "phases": {"marks": {"process_start": 100.0, "llm_ready": 104.0, "first_token": 104.5}},
    }
    assert B._summary(res)["ttft_s"] == pytest.approx(4.5)
    assert B._summary({"token_ids": [[1]], "phases": {"marks": {}}})["ttft_s"] is None


def test_cross_version_env_swaps_only_the_vllm_tree(tmp_path):
    """env_for replaces the vllm-* entry of PYTHONPATH and refuses a missing tree."""
    from wcache.testing.cross_version import env_for

    (tmp_path / "vllm-0.33.0" / "vllm").mkdir(parents=True)
    pattern = str(tmp_path / "vllm-{version}")
    env = env_for("0.33.0", f"/repo:{tmp_path}/vllm-0.32.0:/tmp/site:/tmp/wcache-dist", pattern)
    assert env == {
        "PYTHONPATH": f"/repo:{tmp_path}/vllm-0.33.0:/tmp/site:/tmp/wcache-dist",
        "WCACHE_GPU_VLLM": "0.33.0",
    }
    with pytest.raises(FileNotFoundError, match="no vLLM 0.34.0"):
        env_for("0.34.0", "/repo", pattern)


def test_cross_version_passes_only_on_a_named_key_mismatch_and_its_fallback():
    """passed(): a refusal for another reason, one that does not name both releases as
    the key does, or a fallback for another reason does not pass."""
    from wcache.testing.cross_version import passed, versions_named

    msg = (
        "RestoreFailed [key-mismatch]: the engine and the daemon run different releases "
        "(vLLM 0.32.0 (engine) vs 0.33.0 (daemon)): ..."
    )
    assert versions_named(msg, "0.32.0", "0.33.0")
    assert not versions_named("/tmp/vllm-0.32.0/x.py 0.33.0 OOM", "0.32.0", "0.33.0")
    good = {
        "strict": {"refused": True, "key_mismatch": True, "names_both": True},
        "fallback": {"identical": True, "reasons": ["key-mismatch"]},
    }
    assert passed(good)
    for broken in (
        {"strict": {**good["strict"], "key_mismatch": False}},
        {"strict": {**good["strict"], "names_both": False}},
        {"strict": {"refused": False}},
        {"fallback": {"identical": True, "reasons": ["daemon-missing"]}},
        {"fallback": {"identical": False, "reasons": ["key-mismatch"]}},
    ):
        assert not passed({**good, **broken}), broken


def test_cross_version_recognizes_the_key_mismatch_a_real_engine_prints():
    """is_key_mismatch(): the first traceback of a real vLLM 0.33 engine refused by a 0.32
    daemon (H200, 2026-12-01) shows the class, not the reason code; other errors do not
    count."""
    from wcache.testing.cross_version import is_key_mismatch

    seen = (
        "First traceback (the root cause, often in vLLM's worker):\n"
        "wcache.errors.KeyMismatch: daemon on /tmp/wcx-uesyc04t/wcache-cuda-3de7.sock: the "
        "engine and the daemon run different releases (vLLM 0.33.0 (engine) vs 0.32.0 "
        "(daemon)): a daemon's bytes come from its own vLLM's post-load"
    )
    assert is_key_mismatch(seen)
    assert is_key_mismatch("RestoreFailed [key-mismatch]: ...")
    assert not is_key_mismatch("wcache.errors.TransportFailed: cuda_vmm import failed")
    assert not is_key_mismatch("AssertionError: KeyMismatchTable")


def test_engine_error_keeps_where_a_bare_assertion_was_raised():
    """_error(): a bare AssertionError comes back with its innermost frame and source
    line (what a row needs to say which assert fired), then the error lines."""
    from wcache.benchmarks.bench_ipc_cache import _error

    exc = RuntimeError(
        "engine (ipc_cache) failed with exit 1.\n"
        "First traceback (the root cause, often in vLLM's worker):\n"
        "Traceback (most recent call last):\n"
        '  File "/x/vllm/model_executor/layers/linear.py", line 10, in forward\n'
        "    out = self.quant_method.apply(self, x)\n"
        '  File "/x/vllm/model_executor/kernels/linear/scaled_mm/cutlass.py", line 248, in '
        "apply_scaled_mm\n"
        "    assert output_size is not None\n"
        "AssertionError\n"
        "--- output tail ---\nlater lines"
    )
    from wcache.daemon import process

    exc = RuntimeError(str(exc).replace("--- output tail ---", process.OUTPUT_TAIL))
    assert _error(exc) == [
        'File "/x/vllm/model_executor/kernels/linear/scaled_mm/cutlass.py", line 248, in '
        "apply_scaled_mm",
        "assert output_size is not None",
        "AssertionError",
    ]


def test_plot_draws_the_recorded_moe_run_and_a_case_with_a_refusal(tmp_path):
    """plot_ipc_cache writes a PNG of its declared size from the recorded H200 MoE run,
    also when a case has a system without figures (a refusal: no bar, no crash)."""
    import json
    import struct
    from pathlib import Path

    from wcache.benchmarks import plot

    recorded = Path(__file__).parents[2] / "benchmarks/results-h200-ipc-cache-moe-vllm-0.33.0.json"
    result = json.loads(recorded.read_text())
    result["rows"].append(
        {"case": "moe30b-awq", "disk": result["rows"][0]["disk"], "ipc_cache": {"daemon_error": []}}
    )
    png = plot.plot_ipc_cache(result, tmp_path / "sub" / "moe.png")
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert (width, height) == (
        round(plot.FIGSIZE_IN[0] * 1.6 * plot.DPI),
        round(plot.FIGSIZE_IN[1] * plot.DPI),
    )
