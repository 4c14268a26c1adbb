"""One vLLM engine (in process) that goes through vLLM's weight-update paths
step by step and prints one JSON line: the greedy tokens after each step, each
step's error code (a refused update), the parameters whose ``data_ptr()`` a step
changed, and the engine's transport and CUDA-graph / compile modes.

Run by tests/e2e/test_weight_updates_e2e.py (CPU, eager) and
tests/gpu_engine/test_weight_updates_graphs.py (CUDA, with CUDA graphs and
torch.compile), once with ``load_format="auto"`` and once restored from a daemon
(``wcache``, fallback off), so that both engines get the very same updates:

    python tests/e2e/_update_engine.py --model DIR --load-format wcache --extra '{...}' \
        [--device cuda --mode graphs|compiled] [--steps baseline]

``--mode``: ``eager`` (``enforce_eager=True``), ``graphs`` (CUDA graphs without
torch.compile: compilation mode ``NONE``, ``cudagraph_mode`` ``FULL``) or
``compiled`` (vLLM's CUDA defaults: torch.compile and piecewise + full graphs).
``--device cuda`` adds the tier's engine options (TRITON_ATTN, a fixed 1 GiB KV
cache, a small ``gpu_memory_utilization``: wcache.testing.engine_acceptance).

Steps (each followed by a greedy generation):

* ``baseline``: as loaded.
* ``reload_kernel_format_grad``: ``reload_weights(..., is_checkpoint_format=False)``
  of zeros into ``model.norm.weight`` with grad mode on, as vLLM's worker calls it:
  vLLM 0.32 raises ("a leaf Variable that requires grad is being used in an in-place
  operation") where the parameter requires grad, as vLLM's load leaves the norms;
  it fails before any write (a plain ``param.copy_``), so the model stays as loaded.
* ``load_weights``: ``model.load_weights`` through ``collective_rpc`` (what RL
  frameworks call), on ``model.norm.weight``.
* ``reload_iterator``: ``reload_weights(weights_iterator=...)`` in checkpoint
  format: a whole linear (``down_proj`` of layer 0, re-processed by vLLM) and a norm.
* ``reload_kernel_format``: ``reload_weights(..., is_checkpoint_format=False)`` on a
  norm, under ``torch.no_grad`` (vLLM 0.32 needs it on a disk-loaded model).
* ``reload_disk``: ``reload_weights()``: every weight read back from the checkpoint.

The JSON line also holds ``params``, each parameter's class, ``requires_grad`` and
attributes as loaded (:func:`wcache.vllm.verify.parameter_flags`), and
``messages``, the first line of each refused step's error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: Hidden size of SmolLM2-135M (the norms' length).
HIDDEN = 576
PROMPTS = ("The capital of France is", "Water boils at a temperature of")
MAX_TOKENS = 12
#: Seed of the replacement norm weights: fixed, so both engines get the same bytes.
SEED = 1234
#: Replacement norm weights lie in [NORM_LOW, NORM_LOW + NORM_SPAN): far enough
#: from the trained weights to change greedy tokens, small enough to stay finite.
NORM_LOW, NORM_SPAN = 0.25, 1.5


def _norm_weight(seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(HIDDEN, generator=gen) * NORM_SPAN + NORM_LOW).to(torch.bfloat16)


def _checkpoint_tensor(model_dir: str, name: str):
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


STEPS = (
    "baseline",
    "reload_kernel_format_grad",
    "load_weights",
    "reload_iterator",
    "reload_kernel_format",
    "reload_disk",
)
#: CPU engines' share of memory (vLLM's CPU worker sizes its KV cache from it).
CPU_MEMORY_UTILIZATION = 0.2


def _engine_kwargs(device: str, mode: str) -> dict:
    """``LLM`` keyword arguments for the device and the graph/compile mode."""
    kwargs: dict = {"enforce_eager": mode == "eager"}
    if mode == "graphs":
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL"}  # 0: NONE
    if device == "cuda":
        from wcache.testing.engine_acceptance import (
            ATTENTION_BACKEND,
            GPU_MEMORY_UTILIZATION,
            KV_CACHE_BYTES,
        )

        kwargs.update(
            attention_backend=ATTENTION_BACKEND,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        )
    else:
        kwargs["gpu_memory_utilization"] = CPU_MEMORY_UTILIZATION
    return kwargs


def _model(worker):
    return worker.model_runner.get_model()  # unwraps vLLM's CUDA-graph wrapper


def _ptrs(worker) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in _model(worker).named_parameters()}


def _param_flags(worker) -> dict:
    """Every parameter's class, ``requires_grad`` and attributes (JSON-able)."""
    from wcache.vllm.verify import parameter_flags

    return {
        f"{mod}.{key[1:]}" if mod else key[1:]: repr(value)
        for mod, module in _model(worker).named_modules()
        for key, value in parameter_flags(module).items()
    }


def _engine_info(worker) -> dict:
    from wcache.vllm import compat

    att = compat.attachment_of(_model(worker))
    cfg = worker.model_runner.vllm_config.compilation_config
    return {
        "transport": getattr(att, "transport", None),
        "cudagraph_mode": getattr(cfg.cudagraph_mode, "name", str(cfg.cudagraph_mode)),
        "compilation_mode": getattr(cfg.mode, "name", str(cfg.mode)),
    }


def _error_code(exc: BaseException) -> str:
    """The wcache reason code of a refused update (vLLM may re-raise it wrapped)."""
    code = getattr(exc, "code", None)
    if code:
        return str(code)
    return (
        "update-unsupported"
        if "update-unsupported" in str(exc) or type(exc).__name__ == "UpdateUnsupported"
        else type(exc).__name__
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mode", choices=("eager", "graphs", "compiled"), default="eager")
    ap.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated, in order, from {STEPS}"
    )
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # collective_rpc with a callable
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        load_format=args.load_format,
        model_loader_extra_config=json.loads(args.extra),
        max_model_len=512,
        max_num_seqs=1,
        seed=0,
        **_engine_kwargs(args.device, args.mode),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [
            list(o.outputs[0].token_ids)
            for o in llm.generate(list(PROMPTS), params, use_tqdm=False)
        ]

    norm1 = _norm_weight(SEED)
    down = -_checkpoint_tensor(args.model, "model.layers.0.mlp.down_proj.weight")
    norm2, norm3 = _norm_weight(SEED + 1), _norm_weight(SEED + 2)

    def kernel_format_reload(worker) -> None:
        # vLLM 0.32 copies into each parameter with grad mode on: a disk-loaded model's
        # parameters require grad, so without no_grad it raises "a leaf Variable that
        # requires grad is being used in an in-place operation"
        with torch.no_grad():
            worker.reload_weights(
                weights_iterator=[("model.layers.1.post_attention_layernorm.weight", norm3)],
                is_checkpoint_format=False,
            )

    updates = {
        "load_weights": lambda: llm.collective_rpc(
            lambda w: _model(w).load_weights([("model.norm.weight", norm1)])
        ),
        "reload_iterator": lambda: llm.collective_rpc(
            "reload_weights",
            kwargs={
                "weights_iterator": [
                    ("model.layers.0.mlp.down_proj.weight", down),
                    ("model.layers.0.input_layernorm.weight", norm2),
                ]
            },
        ),
        "reload_kernel_format": lambda: llm.collective_rpc(kernel_format_reload),
        "reload_disk": lambda: llm.collective_rpc("reload_weights"),
        "reload_kernel_format_grad": lambda: llm.collective_rpc(
            "reload_weights",
            kwargs={
                "weights_iterator": [
                    ("model.norm.weight", torch.zeros(HIDDEN, dtype=torch.bfloat16))
                ],
                "is_checkpoint_format": False,
            },
        ),
    }
    out: dict = {
        "steps": {},
        "errors": {},
        "messages": {},
        "ptrs_changed": {},
        "engine": llm.collective_rpc(_engine_info)[0],
        "params": llm.collective_rpc(_param_flags)[0],
    }
    for step in args.steps.split(","):
        if step not in STEPS:
            raise SystemExit(f"unknown step {step!r}; steps: {STEPS}")
        before = llm.collective_rpc(_ptrs)[0]
        if step != "baseline":
            try:
                updates[step]()
            except Exception as exc:  # noqa: BLE001  (a refused update: recorded, the engine serves on)
                out["errors"][step] = _error_code(exc)
                out["messages"][step] = (str(exc).splitlines() or [""])[0]
                print(f"{step}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        after = llm.collective_rpc(_ptrs)[0]
        out["ptrs_changed"][step] = sorted(n for n in before if after.get(n) != before[n])
        out["steps"][step] = generate()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
