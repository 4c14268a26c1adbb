"""One vLLM engine (in process) with speculative decoding that prints one JSON line:
its greedy tokens, and what its drafter holds of the target's weights.

Run by tests/e2e/test_spec_decode_e2e.py (CPU, eager) and
tests/gpu_engine/test_spec_decode_engines.py (CUDA), once with ``load_format="auto"``
and once restored from a daemon (``wcache``, fallback off), with the same
``speculative_config``:

    python tests/e2e/_spec_engine.py --model DIR --spec '{"method": "draft_model", ...}' \
        --load-format wcache --extra '{...}' [--device cuda --mode eager|graphs]

``--mode`` and ``--device`` as in tests/e2e/_update_engine.py. Greedy speculative
decoding gives the target's greedy tokens whatever the draft proposes, so a restored
engine's tokens must equal a disk engine's with the same speculative config.

The JSON line: ``tokens`` (per prompt), ``drafter`` (the drafter model's class; None
for a method without drafter weights, e.g. ``ngram``),
``target``/``draft`` (per model: the wcache attachment's transport, arena range and
closed flag, or None for a model loaded from disk), and ``shared``: for
``embed_tokens`` and ``lm_head``, whether the drafter's module *is* the target's,
both weights' ``data_ptr()``, and whether the drafter's weight lies in the target's
arena (mapped once, by the target's attachment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _update_engine import PROMPTS, _engine_kwargs, _model  # the script's folder is on sys.path

#: Greedy tokens per prompt: several speculative rounds of 3 drafted tokens each.
SPEC_MAX_TOKENS = 12
#: The daemons' max_model_len (the key holds it: wcache.daemon.process.ENGINE_ARGS).
SPEC_MAX_MODEL_LEN = 512


def _unwrap(module):
    """A model under vLLM's CUDA-graph wrapper (``CUDAGraphWrapper.unwrap``), or itself."""
    unwrap = getattr(module, "unwrap", None)
    return unwrap() if callable(unwrap) else module


def _attachment(model):
    from wcache.vllm import compat

    att = compat.attachment_of(model)
    if att is None:
        return None
    lo, hi = att.arena_range
    return {"transport": att.transport, "lo": lo, "hi": hi, "closed": att.closed}


def _inner(model):
    """The decoder stack holding ``embed_tokens`` (``model.model``), or None."""
    return getattr(model, "model", None)


def _sharing(worker) -> dict:
    """The drafter's embed_tokens and lm_head against the target's (module
    identity, ``data_ptr()``, inside the target's arena)."""
    target = _model(worker)
    runner = worker.model_runner
    # vLLM's V1 runner keeps the proposer as ``drafter``; the GPU runner of 0.33
    # (vllm/v1/worker/gpu/model_runner.py) as ``speculator``
    proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    if getattr(proposer, "model", None) is None:  # ngram, suffix: a drafter with no model
        return {"drafter": None, "target": _attachment(target), "draft": None, "shared": {}}
    drafter = _unwrap(proposer.model)
    tatt, datt = _attachment(target), _attachment(drafter)
    out: dict = {"drafter": type(drafter).__name__, "target": tatt, "draft": datt, "shared": {}}
    pairs = {
        "embed_tokens": (
            getattr(_inner(target), "embed_tokens", None),
            getattr(_inner(drafter), "embed_tokens", None),
        ),
        "lm_head": (getattr(target, "lm_head", None), getattr(drafter, "lm_head", None)),
    }
    for name, (t, d) in pairs.items():
        if t is None or d is None:
            out["shared"][name] = None
            continue
        tp, dp = t.weight.data_ptr(), d.weight.data_ptr()
        out["shared"][name] = {
            "same_module": t is d,
            "target_ptr": tp,
            "draft_ptr": dp,
            "in_target_arena": tatt is not None and tatt["lo"] <= dp < tatt["hi"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", required=True, help="speculative_config (JSON)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mode", choices=("eager", "graphs", "compiled"), default="eager")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # collective_rpc with a callable
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        load_format=args.load_format,
        model_loader_extra_config=json.loads(args.extra),
        speculative_config=json.loads(args.spec),
        max_model_len=SPEC_MAX_MODEL_LEN,
        max_num_seqs=len(PROMPTS),
        seed=0,
        **_engine_kwargs(args.device, args.mode),
    )
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    out = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    try:
        out |= llm.collective_rpc(_sharing)[0]
    except Exception as exc:  # noqa: BLE001 (the probe's own failure is reported, not taken for vLLM's)
        out["sharing_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
