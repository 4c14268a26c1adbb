"""Run one vLLM CPU engine, generate greedily, print one JSON line of results.

Used by the demo, the e2e tests and the benchmarks, each engine in its own
process (vLLM spawns workers; a process builds one engine):

    python -m wcache.vllm.run_engine --model DIR --load-format wcache \
        --extra '{"fallback": false, "socket_dir": "/tmp/x"}' --prompt "The capital of France is"

Output (stdout, last line): ``{"texts": [...], "token_ids": [[...]], "load": {...},
"state": {...}, "phases": {...}}`` where ``load`` is the loader's timing record (phase
and seconds), ``state`` (with ``--dump-state``) a per-layer digest of tensors and plan
attributes from the worker, and ``phases`` this process's wall-clock marks
(:func:`phase_marks`): process start, after ``import vllm``, after ``LLM()`` returns,
after the first token of a separate 1-token request, at the end.
"""

from __future__ import annotations

import time

#: Wall clock (``time.time()``, seconds since the epoch) when this module starts to
#: run, before its other imports: the process-start mark where /proc/self/stat cannot
#: be read, and the end of the "process start" phase.
_MODULE_START = time.time()

import argparse  # noqa: E402  (after the module-start mark)
import atexit  # noqa: E402  (after the module-start mark)
import importlib  # noqa: E402  (after the module-start mark)
import importlib.util  # noqa: E402  (after the module-start mark)
import json  # noqa: E402  (after the module-start mark)
import os  # noqa: E402  (after the module-start mark)
import sys  # noqa: E402  (after the module-start mark)
import tempfile  # noqa: E402  (after the module-start mark)
from pathlib import Path  # noqa: E402  (after the module-start mark)
from typing import Any  # noqa: E402  (after the module-start mark)

#: ``--image-prompt``'s picture: a fixed pseudo-random RGB image (the same pixels in
#: every engine, so their tokens compare), ``--image-size`` pixels a side; 32 is the
#: tiny multimodal fixtures' native size (wcache.testing.tiny_models.IMAGE_SIZE).
IMAGE_SEED = 0
DEFAULT_IMAGE_SIZE = 32
#: Channels of the RGB image and the top of uint8's range (exclusive) its pixels take.
RGB_CHANNELS = 3
PIXEL_LEVELS = 256
#: Prompts used when none are given (greedy, 16 tokens in the tests).
DEFAULT_PROMPTS = ("The capital of France is", "Water boils at a temperature of")
#: KV-cache share of host memory on this 2-core, 24 GB class machine (vLLM on CPU
#: sizes its KV cache from it); 0.2 leaves room for a daemon and a second engine.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.2
DEFAULT_MAX_MODEL_LEN = 512
#: One sequence at a time: every test and the demo run one request after another.
DEFAULT_MAX_NUM_SEQS = 1
#: ``--max-model-len 0`` / ``--max-num-seqs 0``: leave the value to vLLM (its default
#: for the model and the device: a "production defaults" engine).
VLLM_DEFAULT = 0
#: Field 22 of /proc/PID/stat: the process start, in clock ticks after boot (proc(5)).
PROC_STAT_STARTTIME_FIELD = 22
#: Fields of /proc/PID/stat before the ones after the ``comm`` field's closing ")".
PROC_STAT_FIELDS_BEFORE_STATE = 2
#: The order of the marks in ``phases["marks"]``.
PHASE_MARKS = ("process_start", "module_start", "vllm_imported", "llm_ready", "first_token", "end")


def _state_digest(model) -> dict:
    """Per planned layer: tensor checksums and the plan-declared attributes; and the
    groups of parameter names that are one object (tied weights)."""
    from wcache.shell import snapshot  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.vllm.compat import bound_attr_path  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.vllm.model import planned_layers  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.vllm.probe import host_target  # noqa: PLC0415 (torch import ~2 s: only when called)

    out = {}
    for p in planned_layers(model, host_target("cpu")):
        # kv_cache is the load-time placeholder that the model runner rebinds to the
        # real (uninitialized, engine-sized) KV cache after loading: not load state.
        # Kernel state is read where vLLM keeps it (on its kernel object).
        paths = sorted(
            {bound_attr_path(p.module, a) for s in p.plan.stages for a in s.attrs} - {"kv_cache"}
        )
        snap = snapshot(p.module, paths)
        out[p.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in snap.items()}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    ties = sorted(sorted(names) for names in groups.values() if len(names) > 1)
    return json.loads(json.dumps({"state": out, "ties": ties}, default=str))


#: Optional packages vLLM switches on when ``importlib.util.find_spec`` finds them
#: (``vllm.utils.flashinfer.has_flashinfer``): one that is found but does not import
#: fails the engine at start with a bare ModuleNotFoundError.
OPTIONAL_MODULES = ("flashinfer", "flashinfer_cubin", "deep_gemm")


def _report_broken_optional_modules() -> None:
    """Print to stderr each optional module that ``find_spec`` finds but that does not
    import, with where it was found (the cause of an otherwise opaque engine failure)."""
    for name in OPTIONAL_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            print(f"wcache: find_spec({name!r}) raised {exc!r}", file=sys.stderr)
            continue
        if spec is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (a report, whatever breaks the import)
            print(
                f"wcache: {name!r} is found (origin={spec.origin}, "
                f"locations={list(spec.submodule_search_locations or [])}, "
                f"loader={type(spec.loader).__name__}) but does not import: {exc!r}",
                file=sys.stderr,
                flush=True,
            )


def process_start_time() -> tuple[float, str]:
    """This process's start as wall-clock seconds since the epoch, and its source.

    Reads the start in clock ticks after boot from ``/proc/self/stat`` (field 22)
    and subtracts the process's age from ``time.time()`` (age = ``CLOCK_BOOTTIME``
    now minus the start), so the mark has the tick's resolution (10 ms at the usual
    ``CLK_TCK`` of 100) and no truncated boot time (``/proc/stat``'s ``btime`` is
    whole seconds). Where that cannot be read (not Linux), the time this module
    started to run (``time.time()`` at its top: after interpreter start-up and the
    imports ``python -m`` makes first). In a child forked by the engine template
    (``wcache run``), the client's process start instead
    (:func:`wcache.template.started.run_started`): the launch of the command typed,
    where a direct start's timer starts.

    Returns:
        ``(seconds since the epoch, "proc-stat" | "module-top" | "wcache-run-client")``.
    """
    from wcache.template.started import run_started  # noqa: PLC0415 (after the module-start mark)

    client = run_started()
    if client is not None:  # a template child: its timer starts at `wcache run`'s launch
        return client, "wcache-run-client"
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # comm (field 2) may hold spaces and ")": split after its last ")"
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[PROC_STAT_STARTTIME_FIELD - PROC_STAT_FIELDS_BEFORE_STATE - 1])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age, "proc-stat"
    except (OSError, ValueError, IndexError, AttributeError):
        return _MODULE_START, "module-top"


def phase_marks(marks: dict[str, float], source: str, first_token_s: float | None) -> dict:
    """The ``phases`` entry of the JSON line: each mark of :data:`PHASE_MARKS` that was
    taken (wall-clock seconds since the epoch, ``time.time()``), where the process-start
    mark came from (:func:`process_start_time`), and the first request's time to its
    first token (seconds)."""
    return {
        "clock": "time.time",
        "process_start_source": source,
        "marks": {k: marks[k] for k in PHASE_MARKS if k in marks},
        "first_token_s": first_token_s,
    }


def start_llm(**kwargs: Any) -> Any:
    """vLLM's ``LLM(**kwargs)`` (for wcache's own tools outside this package, which
    reach vLLM only through :mod:`wcache.vllm`)."""
    from vllm import LLM  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return LLM(**kwargs)


def fixed_image(size: int = DEFAULT_IMAGE_SIZE) -> Any:
    """The ``--image-prompt`` picture: ``size`` x ``size`` RGB (PIL) of pseudo-random
    pixels from :data:`IMAGE_SEED`, the same in every process."""
    import numpy as np  # noqa: PLC0415 (only an image prompt needs it)
    from PIL import Image  # noqa: PLC0415 (only an image prompt needs it)

    rng = np.random.default_rng(IMAGE_SEED)
    pixels = rng.integers(0, PIXEL_LEVELS, size=(size, size, RGB_CHANNELS), dtype=np.uint8)
    return Image.fromarray(pixels)


def requests(prompts: list[str], image_prompt: str | None, image_size: int) -> list[Any]:
    """What ``llm.generate`` gets: the text prompts, then (with ``image_prompt``) one
    request of that text with :func:`fixed_image` as its ``multi_modal_data``."""
    out: list[Any] = list(prompts)
    if image_prompt is not None:
        out.append({"prompt": image_prompt, "multi_modal_data": {"image": fixed_image(image_size)}})
    return out


def greedy_texts(llm: Any, prompts: list[str], max_tokens: int) -> list[str]:
    """``llm``'s greedy completions (temperature 0) of ``prompts``, one text each."""
    from vllm import SamplingParams  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


#: run_engine options that are vLLM engine arguments of the same name and meaning
#: (``--max-model-len`` / ``--max-num-seqs`` with :data:`VLLM_DEFAULT` aside).
VLLM_OPTIONS = (
    "--dtype",
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--quantization",
    "--moe-backend",
    "--attention-backend",
    "--mm-encoder-attn-backend",
    "--attention-config",
    "--kv-cache-memory-bytes",
)


def vllm_engine_args(argv: list[str]) -> list[str]:
    """The vLLM engine arguments (``vllm serve`` / ``wcache serve`` form) of the engine
    that these run_engine options (``--model`` excluded) build, defaults included: what
    ``wcache serve --prime-compile`` needs for its priming engine to compile for this
    engine's compile-cache key (``vllm_config.compute_hash()`` covers
    ``max_model_len`` and ``max_num_seqs``; :mod:`wcache.vllm.prime_engine`).
    """
    args = _parser().parse_args(["--model", "-", *argv])
    out: list[str] = []
    for opt in VLLM_OPTIONS:
        value = getattr(args, opt[2:].replace("-", "_"))
        if value is None or (
            opt in ("--max-model-len", "--max-num-seqs") and value == VLLM_DEFAULT
        ):
            continue
        out += [opt, str(value)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _run(args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}", help="model_loader_extra_config as JSON")
    ap.add_argument("--prompt", action="append", help="repeatable; default: two prompts")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"default {DEFAULT_MAX_MODEL_LEN}; {VLLM_DEFAULT}: vLLM's default "
        "for the model (its max_position_embeddings)",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"default {DEFAULT_MAX_NUM_SEQS}; {VLLM_DEFAULT}: vLLM's default for "
        "the device (production; it also decides the CUDA graph sizes)",
    )
    ap.add_argument(
        "--no-first-token",
        action="store_true",
        help="skip the separate 1-token request that times the first token "
        "(phases.first_token_s is then null)",
    )
    ap.add_argument(
        "--dump-state",
        action="store_true",
        help="also report a digest of every planned layer's state",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        help="vLLM's --quantization (e.g. fp8 for online FP8 on CUDA)",
    )
    ap.add_argument(
        "--moe-backend",
        default=None,
        help="vLLM's --moe-backend (e.g. marlin); default vLLM's auto",
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM's attention backend (TRITON_ATTN on the H200 bundle)",
    )
    ap.add_argument(
        "--mm-encoder-attn-backend",
        default=None,
        help="vLLM's multimodal encoder (ViT) attention backend (TRITON_ATTN on the H200 bundle)",
    )
    ap.add_argument(
        "--attention-config",
        default=None,
        help="vLLM's attention config as JSON (vLLM's --attention-config), e.g. to name "
        "the MLA prefill backend (CPU: PyTorch, no FlashAttention on the H200 bundle)",
    )
    ap.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="fixed KV-cache size (skips vLLM's memory profiling; engines that share one GPU)",
    )
    ap.add_argument(
        "--logprobs",
        type=int,
        default=0,
        help="also report the top-N logprobs of every generated token",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile and CUDA graphs (default: enforce_eager)",
    )
    ap.add_argument(
        "--image-prompt",
        default=None,
        help="one more request: this text (holding the model's image placeholder) with a "
        "fixed random image; its output follows the text prompts' (multimodal models)",
    )
    ap.add_argument(
        "--image-size",
        type=int,
        default=DEFAULT_IMAGE_SIZE,
        help=f"pixels a side of --image-prompt's image (default {DEFAULT_IMAGE_SIZE})",
    )
    return ap


def _run(args: argparse.Namespace) -> int:
    process_start, start_source = process_start_time()
    marks = {"process_start": process_start, "module_start": _MODULE_START}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.dump_state:
        # collective_rpc with a callable needs in-process execution to be simple
        from wcache.vllm import VLLM_ONE_PROCESS  # noqa: PLC0415 (light; only here)

        os.environ.update(VLLM_ONE_PROCESS)
    _report_broken_optional_modules()
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    marks["vllm_imported"] = time.time()
    extra = json.loads(args.extra)
    timing = tempfile.NamedTemporaryFile(  # noqa: SIM115 (only its name is used: closed at once)
        prefix="wcache-timing-", suffix=".jsonl", delete=False
    )
    timing.close()
    # removed below once read; on any other way out (an engine that fails) at exit
    atexit.register(Path(timing.name).unlink, missing_ok=True)
    if args.load_format in ("wcache", "wcache_timed_auto"):
        extra.setdefault("timing_file", timing.name)
    optional = {
        k: v
        for k, v in (
            ("quantization", args.quantization),
            ("moe_backend", args.moe_backend),
            ("attention_backend", args.attention_backend),
            ("mm_encoder_attn_backend", args.mm_encoder_attn_backend),
            (
                "attention_config",
                json.loads(args.attention_config) if args.attention_config else None,
            ),
            ("kv_cache_memory_bytes", args.kv_cache_memory_bytes),
            ("max_model_len", args.max_model_len or None),
            ("max_num_seqs", args.max_num_seqs or None),
        )
        if v is not None
    }
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        model_loader_extra_config=extra,
        enforce_eager=not args.compile,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=0,
        **optional,
    )
    start_s = time.perf_counter() - t0
    marks["llm_ready"] = time.time()
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    first_token_s = None
    if not args.no_first_token:
        # the first request's time to its first token: the first prompt, one token;
        # then the prefix cache is emptied, so the outputs below see the engine as if
        # this request had not run
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        marks["first_token"] = time.time()
        first_token_s = marks["first_token"] - marks["llm_ready"]
        llm.reset_prefix_cache()
    # ignore_eos: always max_tokens tokens, so runs compare token for token
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=args.logprobs or None
    )
    outs = llm.generate(
        requests(prompts, args.image_prompt, args.image_size), params, use_tqdm=False
    )
    result = {
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "llm_start_s": start_s,
    }
    if args.logprobs:
        # per prompt, per generated token: {token id: logprob} of the top N
        result["logprobs"] = [
            [
                {str(t): float(lp.logprob) for t, lp in step.items()}
                for step in (o.outputs[0].logprobs or [])
            ]
            for o in outs
        ]
    with open(timing.name) as f:
        result["load"] = [json.loads(line) for line in f if line.strip()]
    os.unlink(timing.name)
    if args.dump_state:
        result.update(llm.collective_rpc(lambda self: _state_digest(self.model_runner.model))[0])
    marks["end"] = time.time()
    result["phases"] = phase_marks(marks, start_source, first_token_s)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
