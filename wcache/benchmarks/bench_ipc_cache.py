"""wcache beside vLLM's own weight cache (``vllm preload`` + ``load_format="ipc_cache"``).

``python -m wcache.benchmarks.bench_ipc_cache --cases 8b-bf16,8b-fp8,8b-fp8-block`` (or
``--cases moe30b-fp8-block,moe30b-nvfp4,moe30b-awq``: Qwen3-30B-A3B-shaped MoE)
(on the H200 under vLLM 0.33, after tools/gpu/device-setup.sh: ``export
WCACHE_GPU_VLLM=0.33.0; source tools/gpu/env.sh``). vLLM 0.32 has ``ipc_cache`` too; the issue's comparison is 0.33's.

For each case (a checkpoint and a vLLM ``--quantization``), in one run, each engine in
its own process, one daemon on the GPU at a time:

1. an engine from disk (``load_format="auto"``): the reference tokens;
2. ``wcache serve``, then an engine with ``load_format="wcache"``, ``fallback=false``
   (wcache's guard on: read-only mapping and the restore checks);
3. ``vllm preload`` (its ``/health`` polled until 200), then an engine with
   ``load_format="ipc_cache"``, ``fallback=false``, ``mode="zero_copy"``.

Reported per system: the daemon's ready time (process start to ready), the GPU memory
the daemon holds once ready (``nvidia-smi``'s used memory, minus what was used before it
started, MiB), the engine's "Model loading took" seconds and GiB (vLLM's own line),
the whole ``LLM()`` start, and whether its greedy tokens equal the disk engine's. A
system that refuses the checkpoint is reported with its refusal (the formats only
wcache supports: ``--cases smol-awq,smol-ct-w8a8-int8,smol-online-fp8``).

``--swap`` adds the checkpoint-swap case: two SmolLM2 bf16 checkpoints whose
safetensors headers are identical and whose bytes differ in one value
(``model.embed_tokens.weight[tok, 0]``, ``tok`` the prompt's last token). Each daemon
loads checkpoint A; an engine then asks for checkpoint B; the report says which
tokens each system served (B's disk tokens are right; A's mean the engine silently
got another checkpoint's weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from wcache.daemon.process import (
    engine_failure_cause,
    exit_on_sigterm,
    free_port,
    stop_process_group,
)
from wcache.testing.cross_version import is_key_mismatch
from wcache.testing.engine_acceptance import CUDA_ENGINE_ARGS

__all__ = ["CASES", "run", "run_swap", "table", "write_swapped_checkpoint"]

#: Case -> (model, checkpoint kind, vLLM --quantization). "8b" models are written by
#: bench_engine_cuda.write_llama_checkpoint (Llama-3-8B shapes); "moe30b" ones by
#: wcache.testing.moe_bench.write_qwen3_moe (Qwen3-30B-A3B's geometry, ``--moe-layers``
#: of its 48 layers); "smol" ones are the SmolLM2 fixtures (wcache.testing.fixtures).
#: Block FP8 128x128 exists only at 8B and 30B-A3B: vLLM itself refuses it on SmolLM2
#: (576 % 128 != 0).
CASES: dict[str, tuple[str, str, str | None]] = {
    "8b-bf16": ("8b", "bf16", None),
    "8b-fp8": ("8b", "fp8", None),
    "8b-fp8-block": ("8b", "fp8_block", None),
    "moe30b-fp8-block": ("moe30b", "fp8_block", None),
    "moe30b-nvfp4": ("moe30b", "nvfp4", None),
    "moe30b-awq": ("moe30b", "awq", None),
    "smol-bf16": ("smol", "bf16", None),
    "smol-fp8": ("smol", "fp8", None),
    "smol-awq": ("smol", "awq", None),
    "smol-ct-w8a8-int8": ("smol", "ct_w8a8_int8", None),
    "smol-online-fp8": ("smol", "bf16", "fp8"),
}
PROMPT = "The capital of France is"
MAX_TOKENS = 8
#: Engine and daemon options both systems get, so each daemon's key matches its engines.
COMMON_ARGS = (
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--attention-backend",
    "TRITON_ATTN",
)
#: Share of the H200 one engine may claim (an 8B model's weights plus its KV cache,
#: with a daemon's copy beside it).
GPU_MEMORY_UTILIZATION = 0.3
#: Decoder layers of the 30B-A3B-shaped MoE checkpoints (of Qwen3-30B-A3B's 48): 12 in
#: block FP8 are ~7.6 GB, which the H200 machine writes and three systems load within
#: one 10-minute device call.
MOE_LAYERS = 12
#: An 8B daemon loads and prepares in ~30 s on the H200; room for a cold cache.
DAEMON_READY_TIMEOUT_S = 300.0
#: Engine start, load and 8 tokens (~10 s for 8B), with room.
ENGINE_TIMEOUT_S = 300.0
#: How often ``vllm preload``'s /health is polled (seconds).
HEALTH_POLL_S = 0.1
#: Grace for a daemon to exit after SIGTERM before SIGKILL (seconds).
STOP_GRACE_S = 20.0
#: The value written into checkpoint B of the swap case: large enough that the
#: changed embedding row moves greedy decoding, representable in bf16.
SWAP_VALUE = 8.0


def gpu_used_mib() -> float | None:
    """GPU 0's used memory per ``nvidia-smi`` (MiB), or None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return float(out.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


class PreloadProcess:
    """``vllm preload`` for one checkpoint in a child process (its own session);
    ``start()`` returns once its ``/health`` answers 200.

    Raises (from ``start``):
        RuntimeError: the daemon exited or did not become healthy in time; the
            message holds its output tail.
    """

    def __init__(
        self, model: str | Path, socket_dir: str | Path, quantization: str | None, log_path: Path
    ):

        self.port = free_port()
        self.args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "preload",
            "--model",
            str(model),
            "--weight-cache-socket-dir",
            str(socket_dir),
            "--weight-cache-health-port",
            str(self.port),
            "--weight-cache-health-host",
            "127.0.0.1",
            "--no-enable-flashinfer-autotune",
            *COMMON_ARGS,
        ]
        if quantization:
            self.args += ["--quantization", quantization]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self) -> PreloadProcess:
        log = open(self.log_path, "w")  # noqa: SIM115  (closed with the process)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() - t0 < DAEMON_READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        self.stop()
        raise RuntimeError(
            f"vllm preload did not become healthy (exit {self.proc.returncode}):\n{tail}"
        )

    def stop(self) -> None:

        stop_process_group(self.proc, STOP_GRACE_S)

    def __enter__(self) -> PreloadProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _checkpoint(model: str, kind: str, root: Path, moe_layers: int = MOE_LAYERS) -> Path:
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    if model == "smol":
        return Path(build(kind))
    if model == "moe30b":
        from wcache.testing.moe_bench import write_under  # noqa: PLC0415 (torch import ~2 s: only when called)

        return write_under(root, kind, moe_layers)
    from wcache.benchmarks.bench_engine_cuda import write_llama_checkpoint  # noqa: PLC0415 (torch import ~2 s: only when called)

    return write_llama_checkpoint(root / f"llama-8b-{kind}", kind, Path(build("bf16")))


def _engine_args(quantization: str | None, model: str) -> list[str]:
    """8B engines size their KV cache by profiling (a share of the GPU, as a user's
    would); SmolLM2 engines get the tier's fixed KV cache, which skips the profiling
    that fails when other processes on the GPU free memory meanwhile."""

    args = (
        list(CUDA_ENGINE_ARGS)
        if model == "smol"
        else [
            "--attention-backend",
            "TRITON_ATTN",
            "--gpu-memory-utilization",
            str(GPU_MEMORY_UTILIZATION),
        ]
    )
    return args + (["--quantization", quantization] if quantization else [])


def _engine(
    ckpt: Path, load_format: str, extra: dict, quantization: str | None, model: str
) -> dict:
    from wcache.daemon.process import run_engine  # noqa: PLC0415 (imported at call time: tests patch run_engine)

    return run_engine(
        ckpt,
        load_format,
        extra,
        prompts=[PROMPT],
        max_tokens=MAX_TOKENS,
        timeout_s=ENGINE_TIMEOUT_S,
        engine_args=_engine_args(quantization, model),
    )


def _summary(res: dict) -> dict[str, Any]:
    marks = (res.get("phases") or {}).get("marks") or {}
    ttft = (
        marks["first_token"] - marks["process_start"]
        if "first_token" in marks and "process_start" in marks
        else None
    )
    return {
        "model_loading_s": res.get("model_loading_s"),
        "model_loading_gib": res.get("model_loading_gib"),
        "llm_start_s": res.get("llm_start_s"),
        # the engine process's start to its first request's first token (run_engine's
        # phase marks): what a restart waits for
        "ttft_s": ttft,
        "token_ids": res["token_ids"],
    }


def _error(exc: Exception) -> list[str]:
    """The refusal or failure: the last lines of the root-cause traceback that
    ``run_engine`` puts first in its message (else of the whole message)."""

    text = str(exc)
    root = engine_failure_cause(exc) if "First traceback" in text else text
    lines = [ln.strip() for ln in root.splitlines() if ln.strip()]
    keep = [ln for ln in lines if "Error" in ln or "refus" in ln.lower()]
    # where it was raised: the innermost frame and its source line (a bare
    # ``AssertionError`` says nothing without them)
    frames = [i for i, ln in enumerate(lines) if ln.startswith('File "')]
    where = lines[frames[-1] : frames[-1] + 2] if frames else []
    return where + [ln for ln in (keep or lines)[-4:] if ln not in where]


def _system(
    name: str,
    ckpt: Path,
    quantization: str | None,
    model: str,
    log_dir: Path,
    serve_ckpt: Path | None = None,
) -> dict[str, Any]:
    """One system's daemon (on ``serve_ckpt``, default ``ckpt``) and one engine on ``ckpt``."""
    from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

    serve_ckpt = serve_ckpt or ckpt
    out: dict[str, Any] = {}
    before = gpu_used_mib()
    with tempfile.TemporaryDirectory(prefix=f"wcb-{name}-") as sock:
        try:
            if name == "wcache":
                serve = ("--attention-backend", "TRITON_ATTN") + (
                    ("--quantization", quantization) if quantization else ()
                )
                daemon: Any = DaemonProcess(serve_ckpt, sock, extra_args=serve).start()
                extra = {"fallback": False, "socket_dir": sock}
                fmt = "wcache"
            else:
                daemon = PreloadProcess(
                    serve_ckpt, sock, quantization, log_dir / f"preload-{serve_ckpt.name}.log"
                ).start()
                extra = {"fallback": False, "socket_dir": sock, "mode": "zero_copy"}
                fmt = "ipc_cache"
        except RuntimeError as exc:
            return {"daemon_error": _error(exc)}
        try:
            out["daemon_ready_s"] = daemon.ready_s
            after = gpu_used_mib()
            if before is not None and after is not None:
                out["daemon_gpu_mib"] = after - before
            try:
                out.update(_summary(_engine(ckpt, fmt, extra, quantization, model)))
            except RuntimeError as exc:
                out["engine_error"] = _error(exc)
        finally:
            daemon.stop()
    return out


def run(
    cases: Sequence[str],
    root: Path,
    log: Callable[[str], None],
    on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
    moe_layers: int = MOE_LAYERS,
) -> list[dict]:
    """One row per case: ``disk``, ``wcache`` and ``ipc_cache`` (see the module doc)."""
    rows: list[dict[str, Any]] = []
    log_dir = root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for case in cases:
        model, kind, quant = CASES[case]
        row: dict[str, Any] = {"case": case, "quantization": quant}
        try:
            ckpt = _checkpoint(model, kind, root, moe_layers)
            row["disk"] = _summary(_engine(ckpt, "auto", {}, quant, model))
        except RuntimeError as exc:
            row["disk"] = {"engine_error": _error(exc)}
            rows.append(row)
            on_row(rows)
            continue
        for name in ("wcache", "ipc_cache"):
            res = _system(name, ckpt, quant, model, log_dir)
            if "token_ids" in res:
                res["identical"] = res["token_ids"] == row["disk"]["token_ids"]
            row[name] = res
            log(f"{case} {name}: " + json.dumps({k: v for k, v in res.items() if k != "token_ids"}))
        rows.append(row)
        on_row(rows)
    return rows


def write_swapped_checkpoint(
    src: Path, dst: Path, token_id: int, value: float = SWAP_VALUE
) -> dict[str, Any]:
    """Copy checkpoint ``src`` to ``dst`` with one bf16 value changed in place:
    ``model.embed_tokens.weight[token_id, 0]`` := ``value``. The safetensors headers
    (names, dtypes, shapes, offsets) stay byte-identical.

    Returns: ``{"file", "tensor", "index", "old", "new"}`` of the change.

    Raises:
        ValueError: no ``model.embed_tokens.weight`` in bf16 in ``src``.
    """
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    name = "model.embed_tokens.weight"
    for f in sorted(dst.glob("*.safetensors")):
        with open(f, "r+b") as fh:
            (hlen,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(hlen))
            if name not in header:
                continue
            meta = header[name]
            if meta["dtype"] != "BF16":
                raise ValueError(f"{name} in {f} is {meta['dtype']}, not BF16")
            cols = meta["shape"][1]
            at = 8 + hlen + meta["data_offsets"][0] + 2 * token_id * cols
            fh.seek(at)
            old = torch.frombuffer(bytearray(fh.read(2)), dtype=torch.bfloat16).item()
            fh.seek(at)
            fh.write(
                torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
            )
            return {
                "file": f.name,
                "tensor": name,
                "index": [token_id, 0],
                "old": old,
                "new": value,
            }
    raise ValueError(f"no {name} in {src}")


def _headers(path: Path) -> list[bytes]:
    out = []
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (hlen,) = struct.unpack("<Q", fh.read(8))
            out.append(fh.read(hlen))
    return out


def run_swap(root: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The checkpoint-swap case (module doc): daemons on A, engines asking for B."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers import ~1 s: only when called)

    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    a = Path(build("bf16"))
    tok = AutoTokenizer.from_pretrained(str(a))
    last = tok(PROMPT)["input_ids"][-1]
    b = root / "swap-b"
    change = write_swapped_checkpoint(a, b, last)
    out: dict[str, Any] = {"change": change, "headers_identical": _headers(a) == _headers(b)}
    out["disk_a"] = _summary(_engine(a, "auto", {}, None, "smol"))
    out["disk_b"] = _summary(_engine(b, "auto", {}, None, "smol"))
    out["a_b_differ"] = out["disk_a"]["token_ids"] != out["disk_b"]["token_ids"]
    for name in ("wcache", "ipc_cache"):
        res = _system(name, b, None, "smol", root / "logs", serve_ckpt=a)
        if "token_ids" in res:
            res["served"] = (
                "B (right)"
                if res["token_ids"] == out["disk_b"]["token_ids"]
                else "A (another checkpoint's weights)"
                if res["token_ids"] == out["disk_a"]["token_ids"]
                else "neither"
            )
        elif is_key_mismatch(" ".join(res.get("engine_error", []))):
            res["served"] = "nothing: refused (key-mismatch, the checkpoint content differs)"
        out[name] = res
        log(f"swap {name}: " + json.dumps({k: v for k, v in res.items() if k != "token_ids"}))
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`run`'s rows: one line per case and system."""
    out = [
        "| case | system | daemon ready (s) | daemon GPU memory (MiB) | Model loading "
        "took (s) | engine GiB | LLM() start (s) | first token (s) | same tokens as disk |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        d = r["disk"]
        out.append(
            f"| {r['case']} | disk | - | - | {_fmt(d.get('model_loading_s'))} | "
            f"{_fmt(d.get('model_loading_gib'), '.2f')} | "
            f"{_fmt(d.get('llm_start_s'), '.1f')} | {_fmt(d.get('ttft_s'), '.1f')} | "
            "(reference) |"
        )
        for name in ("wcache", "ipc_cache"):
            s = r.get(name)
            if s is None:
                continue
            err = s.get("daemon_error") or s.get("engine_error")
            if err:
                where = "daemon" if "daemon_error" in s else "engine"
                msg = " ".join(err).replace("|", "\\|")[:240]
                out.append(
                    f"| {r['case']} | {name} | refused/failed ({where}): {msg} | | | | | | |"
                )
                continue
            out.append(
                f"| {r['case']} | {name} | {_fmt(s.get('daemon_ready_s'), '.1f')} | "
                f"{_fmt(s.get('daemon_gpu_mib'), '.0f')} | "
                f"{_fmt(s.get('model_loading_s'))} | "
                f"{_fmt(s.get('model_loading_gib'), '.2f')} | "
                f"{_fmt(s.get('llm_start_s'), '.1f')} | "
                f"{_fmt(s.get('ttft_s'), '.1f')} | "
                f"{'yes' if s.get('identical') else 'NO'} |"
            )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m wcache.benchmarks.bench_ipc_cache", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--cases",
        default="8b-bf16,8b-fp8,8b-fp8-block",
        help=f"comma-separated subset of {','.join(CASES)} (may be empty)",
    )
    ap.add_argument(
        "--swap", action="store_true", help="also run the checkpoint-swap case (SmolLM2 bf16)"
    )
    ap.add_argument(
        "--root",
        type=Path,
        default=Path(os.environ.get("WCACHE_BENCH_DIR", "/tmp/wcache-8b")),
        help="where checkpoints and daemon logs are written",
    )
    ap.add_argument(
        "--moe-layers",
        type=int,
        default=MOE_LAYERS,
        help=f"decoder layers of the moe30b checkpoints (of 48; default {MOE_LAYERS})",
    )
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.vllm.compat import vllm_version  # noqa: PLC0415 (torch import ~2 s: only when called)

    meta = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    result: dict[str, Any] = {"meta": meta, "rows": []}

    def save(rows: list[dict[str, Any]]) -> None:
        result["rows"] = rows
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))

    def log(m: str) -> None:
        print(f"[bench-ipc-cache] {m}", flush=True)

    exit_on_sigterm()  # daemons stop on the way out
    rows = run(cases, args.root, log, on_row=save, moe_layers=args.moe_layers)
    print(table(rows))
    if args.swap:
        result["swap"] = run_swap(args.root, log)
        save(rows)
        print(json.dumps({k: v for k, v in result["swap"].items()}, default=str)[:4000])
    ok = all("token_ids" in r.get("wcache", {}) and r["wcache"].get("identical") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
