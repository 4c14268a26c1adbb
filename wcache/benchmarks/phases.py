"""One engine start as a list of phases: from its wall-clock marks and vLLM's log.

An engine run by :mod:`wcache.vllm.run_engine` reports wall-clock marks (its
``phases`` entry: process start, after ``import vllm``, after ``LLM()``, after the
first token); vLLM's engine log (stderr) gives the durations inside ``LLM()``. This
module turns both into the phases of :data:`PHASES`, in order, whose seconds add up
to the time from process start to the first token:

=====================  =================================================================
phase                  seconds
=====================  =================================================================
process start          process start (``/proc/self/stat``) -> run_engine's module top
vLLM import            module top -> ``from vllm import LLM`` returned
model build            vLLM's "Initializing model took" (disk); the wcache loader's
                       ``meta_init`` step (daemon: the model built on the meta device)
weights                vLLM's "Model loading took" (CUDA model runner; build included,
                       so the build is subtracted), else the wcache timing record's
                       load phase (``disk``/``restore``/``fallback``) minus the build,
                       else "Loading weights took" (vLLM's default loader)
compile                the "(compilation: X s)" of vLLM's "init engine ... took" line,
                       else the sum of its "torch.compile ... took X s in total" lines,
                       else (vLLM CPU, which logs no compile time) the time between its
                       "Warming up model for the compilation..." and "Warming up done."
                       (log timestamps, whole seconds); a warm cache's load counts here
graph capture          the sum of vLLM's "Graph capturing finished in X secs" lines
                       (whole seconds). vLLM 0.33 on CUDA prints two: the first is
                       ``profile_cudagraph_memory``'s capture, made while profiling
                       memory for the KV cache and thrown away; the second the real one
KV-cache/other init    "init engine (profile, create kv cache, warmup model) took X s"
                       minus compile and graph capture (both run inside it)
other                  the rest of ``LLM()``: engine-core process start, config,
                       tokenizer, worker init
first token            ``LLM()`` returned -> the first request's first token
=====================  =================================================================

A phase that does not apply (compile and graph capture of an eager engine, graph
capture on CPU) is 0 with a note saying why. Every line is matched as vLLM 0.32.0
and 0.33.0 print it (the same strings in both; tests/benchmarks/test_bench_phases.py
holds one of each).

Source: vllm/model_executor/model_loader/base_loader.py (``Initializing model
took``), default_loader.py (``Loading weights took``),
vllm/v1/worker/gpu_model_runner.py (``Model loading took``, ``Graph capturing
finished``), vllm/compilation/monitor.py and decorators.py (``torch.compile took``),
vllm/compilation/backends.py (``Compiling a graph``, ``Directly load the compiled
graph(s)``), vllm/v1/engine/core.py (``init engine ...``); wcache/vllm/loader.py
(the timing record and its ``steps``).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = ["PHASES", "Phase", "parse_log", "breakdown", "total_s", "phase_lines", "LINES"]

#: The phases of one engine start, in order (the table's columns, the bars' stack).
PHASES = (
    "process start",
    "vLLM import",
    "model build",
    "weights",
    "compile",
    "graph capture",
    "KV-cache/other init",
    "other",
    "first token",
)

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
#: vLLM's (and wcache's) phase lines -> the regex that reads their seconds.
LINES: dict[str, re.Pattern[str]] = {
    "initializing_model": re.compile(rf"Initializing model took {_NUM} seconds"),
    "model_loading": re.compile(rf"Model loading took {_NUM} GiB memory and {_NUM} seconds"),
    "loading_weights": re.compile(rf"Loading weights took {_NUM} seconds"),
    "compile_total": re.compile(
        r"torch\.compile (?:and initial profiling/warmup run together )?"
        rf"took {_NUM} s in total"
    ),
    "compile_graph": re.compile(rf"Compiling a graph for compile range (.+?) takes {_NUM} s"),
    "compile_loaded": re.compile(
        r"Directly load the compiled graph\(s\) for compile range (.+?) "
        rf"from the cache, took {_NUM} s"
    ),
    "aot_loaded": re.compile(r"Directly load AOT compilation from path (\S+)"),
    "dynamo": re.compile(rf"Dynamo bytecode transform time: {_NUM} s"),
    "graph_capture": re.compile(rf"Graph capturing finished in {_NUM} secs, took {_NUM} GiB"),
    "init_engine": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took "
        rf"{_NUM} s(?: \(compilation: {_NUM} s)?"
    ),
}
#: vLLM's CPU model runner around its warm-up (``warming_up_model``): on CPU a compiled
#: engine runs Dynamo once with Inductor (``DYNAMO_TRACE_ONCE``), which logs no compile
#: time, so the compile is read from these two lines' timestamps (vLLM's log date
#: format ``%m-%d %H:%M:%S``: whole seconds).
_STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"
CPU_WARMUP_START = re.compile(_STAMP + r"\S* \[[^\]]*\] Warming up model for the compilation\.\.\.")
CPU_WARMUP_DONE = re.compile(_STAMP + r"\S* \[[^\]]*\] Warming up done\.")
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"
SECONDS_PER_DAY = 86400.0
#: vLLM 0.33's startup plan (vllm/v1/worker/startup_plan.py): applied, or refused with
#: its reason (``VLLM_ENABLE_STARTUP_PLAN=1`` only).
STARTUP_PLAN_APPLIED = re.compile(r"Applying persisted startup plan \(fingerprint (\w+)\)")
STARTUP_PLAN_REFUSED = re.compile(
    r"Startup plan not applied: (.+?)(?:; falling back.*)?$", re.MULTILINE
)
#: The wcache loader's own line (wcache/vllm/loader.py ``_record_timing``).
WCACHE_LOAD_LINE = re.compile(rf"wcache: weight-load phase \((\w+)\) took {_NUM} s")
#: A phase shorter than this counts as "does not remain" in the fresh-node summary (s):
#: below the marks' resolution (10 ms process-start ticks, vLLM's rounded lines).
NEGLIGIBLE_S = 0.05


@attrs.frozen
class Phase:
    """One phase of an engine start.

    Attributes:
        name: one of :data:`PHASES`.
        seconds: its duration (>= 0).
        note: where the figure comes from, or why it is 0.
    """

    name: str
    seconds: float
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": self.seconds, "note": self.note}


def parse_log(log: str) -> dict[str, Any]:
    """vLLM's phase figures in one engine's log (stderr of run_engine).

    Returns:
        A dict with, where the line was found: ``initializing_model_s``,
        ``model_loading_s`` and ``model_loading_gib``, ``loading_weights_s`` (the
        first of each: vLLM logs them once), ``compile_total_s`` (the sum of every
        ``torch.compile ... in total`` line), ``compile_graphs`` (``[range, s]`` per
        graph compiled), ``compile_loaded`` (``[range, s]`` per graph loaded from the
        cache), ``aot_loaded_from``, ``dynamo_s`` (sum), ``graph_captures``
        (``[s, GiB]`` per "Graph capturing finished" line), ``graph_capture_s`` (their
        sum) and ``graph_capture_gib`` (the last: the graphs kept), ``init_engine_s``
        and ``init_engine_compile_s``,
        ``cpu_warmup_s`` (vLLM CPU: its warm-up, which compiles, from the log
        timestamps), ``startup_plan`` (vLLM 0.33: ``"applied"`` or ``"not applied:
        <vLLM's reason>"``; absent when vLLM said neither); and
        ``compile_cache``: ``"aot-loaded"``, ``"graphs-loaded"``, ``"compiled"`` or
        ``"none"`` (no compile line: an eager engine).
    """
    out: dict[str, Any] = {}

    def first(name: str) -> re.Match[str] | None:
        return LINES[name].search(log)

    if m := first("initializing_model"):
        out["initializing_model_s"] = float(m.group(1))
    if m := first("model_loading"):
        out["model_loading_gib"], out["model_loading_s"] = float(m.group(1)), float(m.group(2))
    if m := first("loading_weights"):
        out["loading_weights_s"] = float(m.group(1))
    totals = [float(m.group(1)) for m in LINES["compile_total"].finditer(log)]
    if totals:
        out["compile_total_s"] = sum(totals)
    graphs = [[m.group(1), float(m.group(2))] for m in LINES["compile_graph"].finditer(log)]
    loaded = [[m.group(1), float(m.group(2))] for m in LINES["compile_loaded"].finditer(log)]
    if graphs:
        out["compile_graphs"] = graphs
    if loaded:
        out["compile_loaded"] = loaded
    if m := first("aot_loaded"):
        out["aot_loaded_from"] = m.group(1)
    dynamo = [float(m.group(1)) for m in LINES["dynamo"].finditer(log)]
    if dynamo:
        out["dynamo_s"] = sum(dynamo)
    captures = [
        (float(m.group(1)), float(m.group(2))) for m in LINES["graph_capture"].finditer(log)
    ]
    if captures:
        out["graph_captures"] = [list(c) for c in captures]
        out["graph_capture_s"] = sum(c[0] for c in captures)
        out["graph_capture_gib"] = captures[-1][1]
    if m := first("init_engine"):
        out["init_engine_s"] = float(m.group(1))
        if m.group(2) is not None:
            out["init_engine_compile_s"] = float(m.group(2))
    start, done = CPU_WARMUP_START.search(log), CPU_WARMUP_DONE.search(log)
    if start and done:
        out["cpu_warmup_s"] = _stamp_diff(start.group(1), done.group(1))
    if STARTUP_PLAN_APPLIED.search(log):
        out["startup_plan"] = "applied"
    elif m := STARTUP_PLAN_REFUSED.search(log):
        out["startup_plan"] = f"not applied: {m.group(1)}"
    out["compile_cache"] = (
        "aot-loaded"
        if "aot_loaded_from" in out
        else "graphs-loaded"
        if loaded and not graphs
        else "compiled"
        if graphs or totals
        else "none"
    )
    return out


def _stamp_diff(a: str, b: str) -> float:
    """Seconds from vLLM log timestamp ``a`` to ``b`` (``%m-%d %H:%M:%S``; a run that
    crosses midnight counts the day)."""

    d = (
        datetime.datetime.strptime(b, LOG_DATE_FORMAT)
        - datetime.datetime.strptime(a, LOG_DATE_FORMAT)
    ).total_seconds()
    return d + SECONDS_PER_DAY if d < 0 else d


def phase_lines(log: str) -> list[str]:
    """The lines of ``log`` that one of :data:`LINES` (or the wcache loader's timing
    line) matches, in order: the evidence a breakdown was computed from."""
    wanted = (
        *LINES.values(),
        WCACHE_LOAD_LINE,
        CPU_WARMUP_START,
        CPU_WARMUP_DONE,
        STARTUP_PLAN_APPLIED,
        STARTUP_PLAN_REFUSED,
    )
    return [ln.strip() for ln in log.splitlines() if any(p.search(ln) for p in wanted)]


def _load_record(load: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The wcache loader's record of the weight-load phase (the last one)."""
    recs = [r for r in load if r.get("phase") in ("disk", "restore", "fallback")]
    return recs[-1] if recs else None


def _span(marks: Mapping[str, float], a: str, b: str) -> float | None:
    return marks[b] - marks[a] if a in marks and b in marks else None


def breakdown(
    marks: Mapping[str, float],
    log: str,
    load: Sequence[Mapping[str, Any]] = (),
    compiled: bool = False,
    device: str = "cpu",
) -> list[Phase]:
    """The phases of :data:`PHASES` for one engine start.

    Args:
        marks: run_engine's ``phases["marks"]`` (wall-clock seconds since the epoch).
        log: the engine's stderr (``run_engine(...)["log"]``).
        load: run_engine's ``load`` records (the wcache loader's timing file; empty
            for ``load_format="auto"``).
        compiled: the engine ran with torch.compile (``--compile``).
        device: ``cpu`` or ``cuda`` (CUDA graphs exist only on ``cuda``).

    Returns:
        One :class:`Phase` per name of :data:`PHASES`, in that order; the seconds add
        up to ``marks["first_token"] - marks["process_start"]`` unless a figure from
        the log exceeds the span it lies in (then "other" is clamped at 0 and its note
        says by how much).

    Raises:
        ValueError: a mark the breakdown needs is missing (``process_start``,
            ``module_start``, ``vllm_imported``, ``llm_ready``, ``first_token``).
    """
    need = ("process_start", "module_start", "vllm_imported", "llm_ready", "first_token")
    missing = [k for k in need if k not in marks]
    if missing:
        raise ValueError(
            f"phase marks missing: {missing} (run_engine without the first-token "
            f"request, or an older run_engine)"
        )
    figs = parse_log(log)
    rec = _load_record(load)
    steps = (rec or {}).get("steps") or {}
    llm_s = _span(marks, "vllm_imported", "llm_ready")
    assert llm_s is not None

    # model build
    if "meta_init" in steps and rec and rec.get("phase") == "restore":
        build = Phase(
            "model build",
            float(steps["meta_init"]),
            "wcache loader: the model built on the meta device (steps.meta_init)",
        )
    elif "initializing_model_s" in figs:
        build = Phase("model build", figs["initializing_model_s"], "vLLM: Initializing model took")
    else:
        build = Phase("model build", 0.0, "not logged; inside 'weights'/'other'")

    # weights
    if "model_loading_s" in figs:
        weights = Phase(
            "weights",
            max(figs["model_loading_s"] - build.seconds, 0.0),
            "vLLM: Model loading took, minus the model build",
        )
    elif rec is not None:
        weights = Phase(
            "weights",
            max(float(rec["seconds"]) - build.seconds, 0.0),
            f"wcache timing record ({rec['phase']}), minus the model build",
        )
    elif "loading_weights_s" in figs:
        weights = Phase(
            "weights",
            figs["loading_weights_s"],
            "vLLM: Loading weights took (post-processing not included)",
        )
    else:
        weights = Phase("weights", 0.0, "no weight-load line in the log; inside 'other'")

    # compile
    if not compiled:
        compile_ = Phase("compile", 0.0, "eager (enforce_eager): no torch.compile")
    elif "init_engine_compile_s" in figs:
        compile_ = Phase(
            "compile",
            figs["init_engine_compile_s"],
            f"vLLM: init engine ... (compilation: s); cache: {figs['compile_cache']}",
        )
    elif "compile_total_s" in figs:
        compile_ = Phase(
            "compile",
            figs["compile_total_s"],
            f"vLLM: torch.compile ... s in total; cache: {figs['compile_cache']}",
        )
    elif "cpu_warmup_s" in figs:
        compile_ = Phase(
            "compile",
            figs["cpu_warmup_s"],
            "vLLM CPU: Warming up model for the compilation... -> Warming up done. "
            "(log timestamps, whole seconds; Dynamo + Inductor and the warm-up run)",
        )
    else:
        compile_ = Phase("compile", 0.0, "compiled engine, but no compile line in the log")

    # graph capture
    if "graph_capture_s" in figs:
        n = len(figs.get("graph_captures", ())) or 1
        graphs = Phase(
            "graph capture",
            figs["graph_capture_s"],
            "vLLM: Graph capturing finished in (whole seconds)"
            if n == 1
            else f"vLLM: the sum of its {n} Graph capturing finished lines (whole "
            "seconds; in 0.33 the first is the memory-profiling capture, "
            "profile_cudagraph_memory, which kv_cache_memory_bytes skips)",
        )
    elif not compiled:
        graphs = Phase("graph capture", 0.0, "eager (enforce_eager): no CUDA graphs")
    elif device != "cuda":
        graphs = Phase("graph capture", 0.0, f"{device}: vLLM captures no CUDA graphs")
    else:
        graphs = Phase("graph capture", 0.0, "no Graph capturing line in the log")

    # KV-cache profiling and the rest of vLLM's engine init
    if "init_engine_s" in figs:
        kv_s = figs["init_engine_s"] - compile_.seconds - graphs.seconds
        kv = Phase(
            "KV-cache/other init",
            max(kv_s, 0.0),
            "vLLM: init engine (profile, create kv cache, warmup model) took, minus "
            "compile and graph capture",
        )
        init_s = figs["init_engine_s"]
    else:
        kv = Phase("KV-cache/other init", 0.0, "no init engine line in the log; inside 'other'")
        init_s = compile_.seconds + graphs.seconds
    rest = llm_s - build.seconds - weights.seconds - init_s
    other = Phase(
        "other",
        max(rest, 0.0),
        "rest of LLM(): engine-core start, config, tokenizer, worker init"
        + (f" (log figures exceed LLM() by {-rest:.3f} s; clamped)" if rest < 0 else ""),
    )
    return [
        Phase(
            "process start",
            _span(marks, "process_start", "module_start") or 0.0,
            "process start -> run_engine module top",
        ),
        Phase(
            "vLLM import",
            _span(marks, "module_start", "vllm_imported") or 0.0,
            "module top -> from vllm import LLM",
        ),
        build,
        weights,
        compile_,
        graphs,
        kv,
        other,
        Phase(
            "first token",
            _span(marks, "llm_ready", "first_token") or 0.0,
            "LLM() returned -> first token of a 1-token request",
        ),
    ]


def total_s(phases: Sequence[Phase | Mapping[str, Any]]) -> float:
    """Sum of the phases' seconds (process start to the first token)."""
    return sum(p.seconds if isinstance(p, Phase) else float(p["seconds"]) for p in phases)
