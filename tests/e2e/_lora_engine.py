"""One vLLM engine (in process) with or without LoRA that prints one JSON line: its
greedy tokens without an adapter, with a ``LoRARequest`` and without again, and
what LoRA reads from each base layer it wraps.

Run by tests/e2e/test_lora_e2e.py (CPU, eager) and tests/gpu_engine/test_lora_engines.py
(CUDA), once with ``load_format="auto"`` and once restored from a daemon (``wcache``,
fallback off), so both engines get the same adapter:

    python tests/e2e/_lora_engine.py --model DIR --adapter ADAPTER_DIR \
        --load-format wcache --extra '{...}' [--device cuda --mode graphs] [--no-lora]

``--no-lora``: an engine without ``enable_lora`` (only ``base`` tokens): the daemon
that serves LoRA engines serves it too. ``--mode`` and ``--device`` as in
tests/e2e/_update_engine.py.

``layers``: per LoRA-wrapped module (``BaseLayerWithLoRA``): the wrapper's and the
base layer's classes; ``_get_lora_device(base_layer)``; every base-layer attribute,
parameter and buffer that is a tensor or None (shape, dtype, device type, content
checksum); the base layer's partition sizes; the wrapper's sizes and slices; and its
stacked LoRA buffers (``lora_a_stacked``, ``lora_b_stacked``, ``lora_bias_stacked``)
as filled after the adapter ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _update_engine import PROMPTS, _engine_kwargs, _model  # the script's folder is on sys.path

#: Greedy tokens per generation: LoRA on vLLM's CPU backend is slow (about 10x a
#: plain engine per token on a busy 2-core host), and a few tokens already show
#: whether an adapter took effect.
LORA_MAX_TOKENS = 6
#: One prompt: each engine generates three times.
LORA_PROMPTS = PROMPTS[:1]
#: Context length and batch budget (tokens): the daemon's max_model_len (the key holds
#: it: wcache.daemon.process's shared engine arguments), and a batch budget no larger,
#: so the LoRA engine's warm-up (a dummy adapter over a full batch, gathered per token
#: by vLLM's CPU LoRA ops) stays short.
LORA_MAX_MODEL_LEN = 512
#: The adapter's rank (wcache.testing.lora.RANK): vLLM's max_lora_rank for the engine.
MAX_LORA_RANK = 8
#: The base layer's partition sizes LoRA reads (vllm/lora/layers/*.py).
BASE_SIZES = (
    "input_size",
    "output_size",
    "input_size_per_partition",
    "output_size_per_partition",
    "output_partition_sizes",
    "org_vocab_size",
    "embedding_dim",
)
#: The wrapper's own sizes.
LORA_SIZES = ("input_size", "output_size", "n_slices", "output_slices", "tp_size", "tp_rank")
STACKED = ("lora_a_stacked", "lora_b_stacked", "lora_bias_stacked")


def _describe(value):
    """A tensor as ``[shape, dtype, device type, checksum]``; None as None."""
    from wcache.core import tensor_checksum

    if value is None:
        return None
    checksum = tensor_checksum(value) if value.numel() else ""
    return [list(value.shape), str(value.dtype), value.device.type, checksum]


def _lora_layers(worker) -> dict:
    """What LoRA reads from each base layer it wraps (see the module docstring)."""
    import torch
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.lora.layers.utils import _get_lora_device

    out = {}
    for name, module in _model(worker).named_modules():
        if not isinstance(module, BaseLayerWithLoRA):
            continue
        base = module.base_layer
        try:
            device = str(_get_lora_device(base))
        except ValueError:  # vLLM's answer for a base layer without weights (LogitsProcessor)
            device = None
        rec = {"class": type(module).__name__, "base_class": type(base).__name__}
        rec["lora_device"] = device
        slots = {**vars(base), **base._parameters, **base._buffers}
        for key, value in sorted(slots.items()):
            if value is None or isinstance(value, torch.Tensor):
                rec[f"base.{key}"] = _describe(value)
        for key in BASE_SIZES:
            if hasattr(base, key):
                rec[f"base.{key}"] = repr(getattr(base, key))
        for key in LORA_SIZES:
            if hasattr(module, key):
                rec[key] = repr(getattr(module, key))
        for key in STACKED:
            value = getattr(module, key, None)
            if isinstance(value, (tuple, list)):
                rec[key] = [_describe(v) for v in value]
            elif value is None or isinstance(value, torch.Tensor):
                rec[key] = _describe(value)
        out[name] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mode", choices=("eager", "graphs", "compiled"), default="eager")
    ap.add_argument("--no-lora", action="store_true")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # collective_rpc with a callable
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = (
        {}
        if args.no_lora
        else {"enable_lora": True, "max_lora_rank": MAX_LORA_RANK, "max_loras": 1}
    )
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        load_format=args.load_format,
        model_loader_extra_config=json.loads(args.extra),
        max_model_len=LORA_MAX_MODEL_LEN,
        max_num_batched_tokens=LORA_MAX_MODEL_LEN,
        max_num_seqs=1,
        seed=0,
        **lora,
        **_engine_kwargs(args.device, args.mode),
    )
    params = SamplingParams(temperature=0.0, max_tokens=LORA_MAX_TOKENS, ignore_eos=True)

    def generate(request=None) -> list[list[int]]:
        outs = llm.generate(list(LORA_PROMPTS), params, lora_request=request, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    out: dict = {"base": generate()}
    if not args.no_lora:
        out["lora"] = generate(LoRARequest("random-r8", 1, os.path.abspath(args.adapter)))
        out["base_after"] = generate()
        out["layers"] = llm.collective_rpc(_lora_layers)[0]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
