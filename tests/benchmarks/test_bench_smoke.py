"""CPU smoke test of the benchmark harness (`wcache bench`) at a tiny size.

It runs the real harness end to end (checkpoint writer, ordinary-load worker,
in-process daemon, fresh restore and per-tensor workers, handles measurement,
table, JSON, plot) with the CUDA plans resolved for a simulated sm90 target, so
the code path the H200 run takes is exercised without vLLM's CPU ops. The
arguments it refuses are refused before any work, with exit status 2.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

from wcache.bench import main

#: The smoke formats: unquantized (no stages) and online FP8 (TRANSFORM + METADATA).
SMOKE_FORMATS = ("bf16", "fp8")
TABLE_COLUMNS = 8
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == TABLE_COLUMNS and cells[0] in SMOKE_FORMATS:
            rows[cells[0]] = cells
    return rows


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """Run the harness once; returns (stdout, results JSON, png path)."""
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "cpu.json", tmp / "curve.png"
    argv = [
        "--device",
        "cpu",
        "--sizes",
        "tiny",
        "--layers",
        "1",
        "--formats",
        ",".join(SMOKE_FORMATS),
        "--no-disk",
        "",
        "--simulate-cuda-target",
        "--start-method",
        "forkserver",
        "--reps",
        "1",
        "--load-reps",
        "1",
        "--handle-tensors",
        "8",
        "--bench-dir",
        str(tmp / "ckpt"),
        "--out",
        str(out),
    ]
    # matplotlib is on the H200 image but optional here; without it no plot is drawn
    argv += ["--plot", str(png)] if HAVE_MATPLOTLIB else ["--no-plot"]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue(), json.loads(out.read_text()), png


def test_bench_exits_zero_and_prints_every_row(bench_run):
    """The harness succeeds and its markdown table has one row per requested format."""
    rc, text, _, _ = bench_run
    assert 0 == rc
    assert set(SMOKE_FORMATS) == set(_table_rows(text))


def test_bench_table_ratios_are_finite(bench_run):
    """Both ratio columns of every row are finite positive numbers (e.g. ``12.3x``),
    in the table and in the JSON."""
    _, text, results, _ = bench_run
    for r in results["rows"]:
        for key in ("ratio_load_restore", "ratio_per_tensor_arena"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["format"], key, r[key])
    for fmt, cells in _table_rows(text).items():
        for cell in cells[-2:]:
            m = re.fullmatch(r"([0-9.e+-]+)x", cell)
            assert m is not None, f"{fmt}: ratio cell {cell!r}"
            assert math.isfinite(float(m.group(1))) and float(m.group(1)) > 0


def test_bench_json_restore_matches_ordinary_load(bench_run):
    """The restored layers have the same bytes as the ordinarily loaded ones."""
    _, _, results, _ = bench_run
    assert [True] * len(SMOKE_FORMATS) == [r["restore_matches_load"] for r in results["rows"]]
    assert list(SMOKE_FORMATS) == [r["format"] for r in results["rows"]]


def test_bench_json_has_curve_handles_and_plot(bench_run):
    """JSON carries a curve point per row and the handles measurement; the PNG is
    drawn when matplotlib is installed."""
    _, text, results, png = bench_run
    assert len(SMOKE_FORMATS) == len(results["curve"])
    assert 8 == results["handles"]["tensors"]
    assert math.isfinite(results["handles"]["ratio_per_tensor_arena"])
    assert "| 8 |" in text
    if HAVE_MATPLOTLIB:
        assert b"\x89PNG\r\n\x1a\n" == png.read_bytes()[:8]
    else:
        assert not png.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "--reps 0: give 1 or more repetitions"),
        (["--load-reps", "0"], "--load-reps 0: give 1 or more repetitions"),
        (["--cpu-engine", "--engine-reps", "0"], "--engine-reps 0: give 1 or more"),
        (
            ["--cpu-engine", "--engine-formats", "bf16,bogus"],
            "unknown or missing in --engine-formats: bogus; fixture formats: "
            "bf16, awq, gptq, ct_w4a16, ct_w8a8_int8",
        ),
        (["--cpu-engine", "--engine-formats", ","], "--engine-formats: none given"),
        (["--cold-start", "--cpu-engine", "--engine-formats", "int3"], "--engine-formats: int3"),
        (["--device", "cpu", "--formats", ","], "--sizes/--formats: none given"),
        (["--device", "cpu", "--formats", "bf16,int3"], "--sizes/--formats: int3; sizes:"),
        (["--device", "cpu", "--sizes", ","], "--sizes/--formats: none given"),
        (["--cold-start", "--sizes", "bogus"], "--sizes/--formats: bogus; sizes:"),
        (["--cold-start", "--formats", ","], "--sizes/--formats: none given"),
        (["--sizes", "tiny", "--no-disk", "tiny,bogus"], "unknown or missing in --no-disk: bogus"),
        (["--sizes", "8b", "--no-disk", "8B"], "--no-disk: 8B; sizes: tiny,"),
        (["--layers", "0"], "--layers 0: give 1 or more layers"),
        (["--handle-tensors", "-5"], "--handle-tensors -5: give 0 (skip it) or more tensors"),
        (["--handle-mib", "-1"], "--handle-mib -1: give a size over 0 MiB"),
        (["--handle-mib", "0"], "--handle-mib 0: give a size over 0 MiB"),
        (["--cpu-engine", "--cpu-build", ","], "--cpu-build: none given; CPU builds: native"),
        (["--cpu-engine", "--cpu-build", "avx3"], "--cpu-build: avx3; CPU builds: native"),
    ],
)
def test_bench_refuses_bad_arguments_before_any_work(argv, message, capsys, monkeypatch):
    """A repetition or layer count under 1, a negative --handle-tensors or a --handle-mib
    not over 0 (measured as one-element tensors and written as a "-1 MiB" or "0 MiB"
    row), --engine-formats, --sizes, --formats
    (the plain suite's and --cold-start's) or --cpu-build naming no value or an
    unknown one, and --no-disk naming an unknown size (dropped: `--no-disk 8B` put the
    8b stack on disk) are argument errors (exit status 2, the reason and the values taken),
    not a KeyError, a TypeError, a silent default or a silent exit 0."""

    def no_work(*a, **k):
        pytest.fail("no work expected")

    monkeypatch.setattr("wcache.bench.run_cpu_engine", no_work)
    monkeypatch.setattr("wcache.benchmarks.bench_restore.run_suite", no_work)
    monkeypatch.setattr("wcache.benchmarks.bench_coldstart.run_engine_daemons", no_work)
    monkeypatch.setattr("wcache.benchmarks.bench_coldstart.run_synthetic", no_work)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert 2 == info.value.code
    err = capsys.readouterr().err
    assert "wcache bench: error: " in err and message in err
