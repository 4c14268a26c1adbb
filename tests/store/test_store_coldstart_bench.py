"""CPU smoke test of `wcache bench --cold-start` at the tiny size: every path it
times (checkpoint, snapshot warm/cold, gloo peer) serves the checkpoint-built
arena's bytes, and the table and JSON carry every figure. No timing is asserted."""

from __future__ import annotations

import json

from wcache.bench import main


def test_cold_start_bench_smoke(tmp_path, capsys):
    """The tiny bf16 row: all three ready paths give the same arena digest; ratios are computed."""
    out = tmp_path / "cold.json"
    assert 0 == main(
        [
            "--cold-start",
            "--device",
            "cpu",
            "--sizes",
            "tiny",
            "--formats",
            "bf16",
            "--bench-dir",
            str(tmp_path / "bench"),
            "--snapshot-dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["snapshot_warm_equal"] and row["snapshot_cold_equal"] and row["peer_equal"]
    for k in (
        "checkpoint_s",
        "checkpoint_cold_s",
        "snapshot_warm_s",
        "snapshot_cold_s",
        "peer_s",
        "raw_read_s",
        "raw_read_cold_s",
        "raw_memcpy_s",
    ):
        assert row[k] > 0, k
    assert row["ckpt_over_snapshot_warm"] == row["checkpoint_s"] / row["snapshot_warm_s"]
    table = capsys.readouterr().out
    assert "| bf16 | tiny |" in table and table.count("| yes |") == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("wcache-snap-")] == []
