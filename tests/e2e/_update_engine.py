"""One vLLM CPU engine (in process) that goes through vLLM's weight-update paths
step by step and prints one JSON line: the greedy tokens after each step.

Run by tests/e2e/test_weight_updates_e2e.py, once with ``load_format="auto"`` and
once restored from a daemon (``wcache``, fallback off), so that both engines get
the very same updates:

    python tests/e2e/_update_engine.py --model DIR --load-format wcache --extra '{...}'

Steps (each followed by a greedy generation):

* ``baseline``: as loaded.
* ``load_weights``: ``model.load_weights`` through ``collective_rpc`` (what RL
  frameworks call), on ``model.norm.weight``.
* ``reload_iterator``: ``reload_weights(weights_iterator=...)`` in checkpoint
  format: a whole linear (``down_proj`` of layer 0, re-processed by vLLM) and a norm.
* ``reload_kernel_format``: ``reload_weights(..., is_checkpoint_format=False)`` on a
  norm, under ``torch.no_grad`` (vLLM 0.32 needs it on a disk-loaded model).
* ``reload_disk``: ``reload_weights()``: every weight read back from the checkpoint.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # collective_rpc with a callable
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", load_format=args.load_format,
              model_loader_extra_config=json.loads(args.extra), enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=1, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params,
                                                                   use_tqdm=False)]

    norm1 = _norm_weight(SEED)
    down = -_checkpoint_tensor(args.model, "model.layers.0.mlp.down_proj.weight")
    norm2, norm3 = _norm_weight(SEED + 1), _norm_weight(SEED + 2)
    steps = {"baseline": generate()}
    llm.collective_rpc(lambda w: w.model_runner.model.load_weights(
        [("model.norm.weight", norm1)]))
    steps["load_weights"] = generate()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [
        ("model.layers.0.mlp.down_proj.weight", down),
        ("model.layers.0.input_layernorm.weight", norm2)]})
    steps["reload_iterator"] = generate()

    def kernel_format_reload(worker) -> None:
        import torch

        # vLLM 0.32 copies into each parameter with grad mode on: a disk-loaded model's
        # parameters require grad, so without no_grad it raises "a leaf Variable that
        # requires grad is being used in an in-place operation"
        with torch.no_grad():
            worker.reload_weights(
                weights_iterator=[("model.layers.1.post_attention_layernorm.weight", norm3)],
                is_checkpoint_format=False)

    llm.collective_rpc(kernel_format_reload)
    steps["reload_kernel_format"] = generate()
    llm.collective_rpc("reload_weights")
    steps["reload_disk"] = generate()
    print(json.dumps({"steps": steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
