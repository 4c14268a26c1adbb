"""Draw benchmark results as PNGs: the restore-cost curve (restore time vs model size),
or a ``bench_ipc_cache`` run (model loading and first token per case and system).

python -m wcache.benchmarks.plot benchmarks/results/cuda.json docs/restore_cost.png
python -m wcache.benchmarks.plot --ipc-cache benchmarks/results-h200-ipc-cache-moe.json docs/x.png
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot_restore_cost", "plot_ipc_cache", "pyplot_for", "main"]

#: Figure size in inches and resolution: readable in docs at GitHub's page width.
FIGSIZE_IN = (6.4, 4.0)
DPI = 150
PARAMS_PER_BILLION = 1e9
MS_PER_S = 1e3
#: Room above the highest point so its size label is not clipped.
LABEL_HEADROOM = 1.2


def pyplot_for(png: str | Path) -> tuple[Any, Path]:
    """matplotlib's ``pyplot`` on the Agg backend (files only, no display), and ``png``
    as a Path whose parent directory exists.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the ``bench`` extra).
    """
    import matplotlib  # noqa: PLC0415 (optional dependency (the bench extra))

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional dependency (the bench extra))

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    return plt, png


def plot_restore_cost(results: Mapping, png: str | Path) -> Path:
    """Plot ``results["curve"]`` (one line per format: restore ms vs billions of
    linear-layer parameters) and, where measured, the ordinary load for scale.

    Args:
        results: what :func:`benchmarks.bench_restore.run_suite` returns (or its JSON).
        png: output path; parent dirs are created.

    Returns:
        The path written.
    """
    plt, png = pyplot_for(png)
    by_fmt: dict[str, list[tuple[float, float, str]]] = {}
    for p in results.get("curve", []):
        by_fmt.setdefault(p["format"], []).append(
            (p["params"] / PARAMS_PER_BILLION, p["restore_s"] * MS_PER_S, p["size"])
        )
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    for fmt, pts in sorted(by_fmt.items()):
        pts.sort()
        xs, ys, labels = zip(*pts)
        ax.plot(xs, ys, marker="o", label=f"{fmt} restore")
        for x, y, lab in pts:
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    device = results.get("info", {}).get("gpu") or results.get("info", {}).get("device", "")
    ax.set_xlabel("linear-layer parameters (billions)")
    ax.set_ylabel("restore time (ms): attach + install + replay")
    ax.set_title(f"wcache restore cost vs model size ({device})", fontsize=9)
    ax.set_ylim(
        bottom=0,
        top=max((y for pts in by_fmt.values() for _, y, _ in pts), default=1.0) * LABEL_HEADROOM,
    )
    ax.grid(True, alpha=0.3)
    if by_fmt:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    plt.close(fig)
    return png


#: The systems of a ``bench_ipc_cache`` row, in the order they are drawn.
IPC_CACHE_SYSTEMS = ("disk", "wcache", "ipc_cache")


def plot_ipc_cache(result: Mapping, png: str | Path) -> Path:
    """Two bar panels of a ``bench_ipc_cache`` result (``{"meta", "rows"}``): vLLM's
    "Model loading took" (seconds, log scale) and the engine process's start to its
    first token (seconds), one group per case, one bar per system; a system that
    refused or failed has no bar and is named under its group.

    Args:
        result: the JSON ``bench_ipc_cache --out`` writes.
        png: output path; parent dirs are created.

    Returns:
        ``png`` as a Path.
    """
    plt, png = pyplot_for(png)
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(FIGSIZE_IN[0] * 1.6, FIGSIZE_IN[1]))
    width = 0.8 / len(IPC_CACHE_SYSTEMS)
    for ax, key, title in (
        (axes[0], "model_loading_s", "vLLM's model loading (s, log)"),
        (axes[1], "ttft_s", "process start to first token (s)"),
    ):
        for i, system in enumerate(IPC_CACHE_SYSTEMS):
            xs, ys = [], []
            for j, row in enumerate(rows):
                v = (row.get(system) or {}).get(key)
                if v is not None:
                    xs.append(j + (i - 1) * width)
                    ys.append(v)
            bars = ax.bar(xs, ys, width, label=system)
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        labels = []
        for row in rows:
            failed = [s for s in IPC_CACHE_SYSTEMS if (row.get(s) or {}).get(key) is None]
            labels.append(row["case"] + ("".join(f"\n{s}: failed" for s in failed)))
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "model_loading_s":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    meta = result.get("meta", {})
    fig.suptitle(f"{meta.get('device', '')}, vLLM {meta.get('vllm', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ipc = bool(args) and args[0] == "--ipc-cache"
    args = args[1:] if ipc else args
    if len(args) != 2:
        print(__doc__)
        return 2
    draw = plot_ipc_cache if ipc else plot_restore_cost
    draw(json.loads(Path(args[0]).read_text()), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
