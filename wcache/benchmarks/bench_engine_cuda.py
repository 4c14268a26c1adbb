"""A real vLLM CUDA engine on an 8B-shaped Llama: disk vs daemon, per format, one run.

``python -m wcache.benchmarks.bench_engine_cuda --formats bf16,online-fp8,fp8,awq``
(on the H200, after tools/gpu/device-setup.sh; ``bash tools/gpu/run-tier.sh --bench``).

For each format: write the checkpoint once (random values in the real format,
Llama-3-8B's shapes: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV
heads, vocab 128256; SmolLM2's tokenizer), read it once so the page cache is warm,
then run in this order, each engine in its own process:

1. an engine from disk (``load_format="auto"``);
2. ``wcache serve`` (its ready time);
3. an engine from the daemon (``load_format="wcache"``, ``fallback=false``).

Reported per format: vLLM's own "Model loading took" seconds for (1) and (3), the
wcache loader's restore phase, the whole ``LLM()`` start, the daemon's ready time,
the speed-up of the model-loading phase, and whether both engines generated the
same greedy tokens. Targets (issue 21/22): from the daemon at most 0.25 s and at
least 10x (20x for AWQ/GPTQ) faster than from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch

from wcache.testing.engine_acceptance import EngineCase
from wcache.testing.fixtures import build

__all__ = ["LLAMA_8B", "write_llama_checkpoint", "run", "table", "FORMATS"]


#: Llama-3-8B's shapes (config.json of meta-llama/Meta-Llama-3-8B).
class LlamaConfig(TypedDict):
    """The ``config.json`` entries of the benchmark's Llama (sizes ints, the rest floats)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float


LLAMA_8B: LlamaConfig = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
#: Standard deviation of the random bf16 weights (typical of trained Llama linears).
WEIGHT_STD = 0.02
#: Weight scales of the random quantized formats: small and positive, so the
#: activations stay finite through 32 layers.
SCALE = 2e-3
#: int4 group size of the AWQ/GPTQ checkpoints (AutoAWQ's and AutoGPTQ's default).
GROUP_SIZE = 128
#: FP8 block shape of the block-quantized checkpoint (DeepSeek-V3 style).
FP8_BLOCK = 128
#: Bytes per safetensors shard (HF's default 5 GB).
SHARD_BYTES = 5 * 10**9
#: Benchmark format -> (checkpoint kind written, vLLM --quantization).
FORMATS: dict[str, tuple[str, str | None]] = {
    "bf16": ("bf16", None),
    "online-fp8": ("bf16", "fp8"),
    "fp8": ("fp8", None),
    "fp8-block": ("fp8_block", None),
    "awq": ("awq", None),
    "gptq": ("gptq", None),
}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
PROMPT = "The capital of France is"
MAX_TOKENS = 8
#: Share of the H200 an 8B engine may claim at start: the 16 GB of bf16 weights plus
#: the fixed KV cache, with a second copy held by the daemon beside it.
GPU_MEMORY_UTILIZATION = 0.3
#: Engine start, load and 8 tokens of an 8B model on the H200 (~10 s), with room.
ENGINE_TIMEOUT_S = 300.0


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each decoder linear."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    return {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def _linear_tensors(
    kind: str, n: int, k: int, g: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors in ``kind`` (random values, real layout)."""
    if kind == "bf16":
        return {
            "weight": (torch.randn(n, k, generator=g, device=device) * WEIGHT_STD).to(
                torch.bfloat16
            )
        }
    if kind in ("fp8", "fp8_block"):
        w = (torch.randn(n, k, generator=g, device=device) * 64).clamp(-448, 448)
        out = {"weight": w.to(torch.float8_e4m3fn)}
        if kind == "fp8":
            out["weight_scale"] = torch.tensor(SCALE / 64, dtype=torch.float32)
        else:
            out["weight_scale_inv"] = torch.full(
                (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), SCALE / 64, dtype=torch.float32
            )
        return out

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(
            -(2**31), 2**31 - 1, shape, generator=g, device=device, dtype=torch.int32
        )

    scales = torch.rand(k // GROUP_SIZE, n, generator=g, device=device) * SCALE + SCALE / 4
    if kind == "awq":
        return {
            "qweight": words(k, n // 8),
            "qzeros": words(k // GROUP_SIZE, n // 8),
            "scales": scales.to(torch.float16),
        }
    if kind == "gptq":
        return {
            "qweight": words(k // 8, n),
            "qzeros": torch.full((k // GROUP_SIZE, n // 8), 0x77777777, dtype=torch.int32),
            "scales": scales.to(torch.float16),
            "g_idx": torch.arange(k, dtype=torch.int32) // GROUP_SIZE,
        }
    raise ValueError(f"unknown checkpoint kind {kind!r}")


def _quantization_config(kind: str) -> dict[str, Any] | None:
    return {
        "bf16": None,
        "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "fp8_block": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
        "awq": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
        },
        "gptq": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        },
    }[kind]


def _tensors(
    kind: str, cfg: LlamaConfig, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    rest = torch.float16 if kind in ("awq", "gptq") else torch.bfloat16
    yield (
        "model.embed_tokens.weight",
        (torch.randn(vocab, h, generator=g, device=device) * WEIGHT_STD).to(rest),
    )
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", torch.ones(h, dtype=rest, device=device)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h, dtype=rest, device=device)
        for name, (n, k) in _shapes(cfg).items():
            for leaf, t in _linear_tensors(kind, n, k, g, device).items():
                yield (
                    f"{p}.{name}.{leaf}",
                    t.to(rest)
                    if t.is_floating_point()
                    and t.dtype == torch.bfloat16
                    and rest != torch.bfloat16
                    else t,
                )
    yield "model.norm.weight", torch.ones(h, dtype=rest, device=device)
    yield (
        "lm_head.weight",
        (torch.randn(vocab, h, generator=g, device=device) * WEIGHT_STD).to(rest),
    )


def write_llama_checkpoint(
    out: Path, kind: str, tokenizer_dir: Path, cfg: LlamaConfig = LLAMA_8B
) -> Path:
    """Write an 8B-shaped Llama checkpoint of ``kind`` to ``out`` (skipped when its
    stamp says it is complete), generating the values on the GPU when there is one.

    Returns:
        ``out``.
    """
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    stamp = out / "wcache-bench-checkpoint.json"
    want = {"kind": kind, "config": cfg, "version": 1}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for name, t in _tensors(kind, cfg, device):
        shard[name] = t.cpu().contiguous()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16" if kind in ("awq", "gptq") else "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
        **cfg,
    }
    qc = _quantization_config(kind)
    if qc:
        config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    stamp.write_text(json.dumps(want))
    return out


def _warm(path: Path) -> float:
    """Read every checkpoint file once (page cache warm); returns the bytes read."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return float(total)


def _phase_record(result: dict, phase: str) -> dict | None:
    return next((r for r in result.get("load", []) if r.get("phase") == phase), None)


def _phase(result: dict, phase: str) -> float | None:
    rec = _phase_record(result, phase)
    return None if rec is None else float(rec["seconds"])


def run(
    formats: Sequence[str],
    root: Path,
    log: Callable[[str], None],
    on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None,
    profile_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Disk vs daemon for each format; one row per format (see the module doc).
    ``on_row`` gets the rows so far after each format (results survive a timeout);
    with ``profile_dir``, the daemon-backed load's ``cProfile`` stats are written to
    ``profile_dir/<format>.prof`` (the loader's ``profile_file``; it adds profiler
    overhead to that load's figures)."""
    from wcache.daemon.process import DaemonProcess, run_engine  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess, run_engine)

    tokenizer_dir = build("bf16")
    rows = []
    for fmt in formats:
        kind, quant = FORMATS[fmt]
        t0 = time.perf_counter()
        ckpt = write_llama_checkpoint(root / f"llama-8b-{kind}", kind, tokenizer_dir)
        write_s = time.perf_counter() - t0
        nbytes = _warm(ckpt)
        case = EngineCase(fmt, kind, quantization=quant)
        engine_args = list(case.engine_args)
        if "--logprobs" in engine_args:  # tokens are compared; logprobs are not needed
            del engine_args[engine_args.index("--logprobs") : engine_args.index("--logprobs") + 2]
        engine_args[engine_args.index("--gpu-memory-utilization") + 1] = str(GPU_MEMORY_UTILIZATION)
        common: dict[str, Any] = dict(  # run_engine's keywords, shared by both runs
            prompts=[PROMPT],
            max_tokens=MAX_TOKENS,
            timeout_s=ENGINE_TIMEOUT_S,
            engine_args=engine_args,
        )
        row: dict[str, Any] = {"format": fmt, "checkpoint_gb": nbytes / 1e9, "write_s": write_s}
        try:
            disk = run_engine(ckpt, "auto", {}, **common)
            with tempfile.TemporaryDirectory(prefix="wcb-") as sock:
                with DaemonProcess(ckpt, sock, extra_args=case.serve_args) as daemon:
                    row["daemon_ready_s"] = daemon.ready_s
                    extra = {"fallback": False, "socket_dir": sock}
                    if profile_dir is not None:
                        extra["profile_file"] = str(profile_dir / f"{fmt}.prof")
                    wc = run_engine(ckpt, "wcache", extra, **common)
        except RuntimeError as exc:
            row["error"] = str(exc).splitlines()[-5:]
            log(f"{fmt}: FAILED {row['error']}")
            rows.append(row)
            on_row(rows)
            continue
        row.update(
            {
                "disk_model_loading_s": disk.get("model_loading_s"),
                "daemon_model_loading_s": wc.get("model_loading_s"),
                "restore_s": _phase(wc, "restore"),
                "restore_steps_s": (_phase_record(wc, "restore") or {}).get("steps"),
                "disk_llm_start_s": disk.get("llm_start_s"),
                "daemon_llm_start_s": wc.get("llm_start_s"),
                "disk_gib": disk.get("model_loading_gib"),
                "daemon_gib": wc.get("model_loading_gib"),
                "identical": disk["token_ids"] == wc["token_ids"],
            }
        )
        if row["disk_model_loading_s"] and row["daemon_model_loading_s"]:
            row["speedup"] = row["disk_model_loading_s"] / row["daemon_model_loading_s"]
        log(
            f"{fmt}: disk {row['disk_model_loading_s']} s, daemon "
            f"{row['daemon_model_loading_s']} s, restore {row['restore_s']}, "
            f"identical={row['identical']}"
        )
        rows.append(row)
        on_row(rows)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`run`'s rows."""

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    out = [
        "| format | checkpoint GB | disk: Model loading took (s) | daemon: same (s) | "
        "speed-up | wcache restore phase (s) | LLM() start disk / daemon (s) | "
        "daemon ready (s) | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"| {r['format']} | {f(r['checkpoint_gb'], '.1f')} | failed: "
                f"{' '.join(r['error'])[:200]} | | | | | | |"
            )
            continue
        out.append(
            f"| {r['format']} | {f(r['checkpoint_gb'], '.1f')} | "
            f"{f(r['disk_model_loading_s'])} | {f(r['daemon_model_loading_s'])} | "
            f"{f(r.get('speedup'), '.1f')}x | {f(r['restore_s'])} | "
            f"{f(r['disk_llm_start_s'], '.1f')} / {f(r['daemon_llm_start_s'], '.1f')} | "
            f"{f(r['daemon_ready_s'], '.1f')} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m wcache.benchmarks.bench_engine_cuda", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--formats",
        default="bf16,online-fp8,fp8,fp8-block,awq,gptq",
        help=f"comma-separated subset of {','.join(FORMATS)}",
    )
    ap.add_argument(
        "--root",
        default=os.environ.get("WCACHE_BENCH_DIR", "/tmp/wcache-8b"),
        help="where the 8B-shaped checkpoints are written (~45 GB for all)",
    )
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument(
        "--profile-dir",
        type=Path,
        help="write cProfile stats of each daemon-backed load here "
        "(<format>.prof; adds profiler overhead to those loads)",
    )
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"unknown formats {unknown}; choose from {','.join(FORMATS)}")
    meta = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "shape": LLAMA_8B,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    try:
        from wcache.vllm.compat import vllm_version  # noqa: PLC0415 (optional dependency, checked where it is used)

        meta["vllm"] = vllm_version()
    except ImportError:
        pass

    def save(rows: list[dict[str, Any]]) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    rows = run(
        formats,
        Path(args.root),
        lambda m: print(f"[bench-engine-cuda] {m}", flush=True),
        on_row=save,
        profile_dir=args.profile_dir,
    )
    print(table(rows))
    return 0 if all("error" not in r and r.get("identical") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
