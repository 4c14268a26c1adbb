"""The priming engine of ``wcache serve --prime-compile``: one vLLM engine built from
the serve's own vLLM engine arguments, restored from the daemon, compiled, one token.

    python -m wcache.vllm.prime_engine --model DIR --extra JSON -- [vLLM engine args]

vLLM keys its torch.compile cache by ``vllm_config.compute_hash()``, which covers the
model, scheduler, cache, parallel and compilation configs (``max_num_seqs`` decides
the CUDA-graph capture sizes, for one). A priming engine with any setting of its own
would compile for another key than the engines it primes for, and its artifacts would
be refused as stale. So this engine takes exactly the arguments the daemon was started
with (the same the serving engines are given; DESIGN.md: "use the same engine arguments
as the engine that will attach"), parsed by vLLM's own engine-argument parser, and
changes only what priming needs: ``load_format="wcache"`` with the given loader config,
and compilation on (:func:`wcache.daemon.prime.priming_args` drops the serve's
``--enforce-eager``). Engines started with other arguments get a bundle whose
``config_hash`` differs, and refuse it as stale (they compile as usual).

Prints one JSON line: ``{"token_ids": [[...]], "llm_start_s": s}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

PROMPT = "wcache priming"


def engine_kwargs(model: str, vllm_args: list[str]) -> dict[str, Any]:
    """The ``LLM(**kwargs)`` that ``vllm_args`` (vLLM engine CLI arguments) give: the
    fields of vLLM's ``EngineArgs`` parsed from them that differ from what the same
    parser gives for ``--model`` alone (so what the arguments set, nothing else), with
    ``model``.

    Source: vllm/engine/arg_utils.py (``EngineArgs.add_cli_args``, ``from_cli_args``).
    """
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    from wcache.vllm.build import _engine_args  # noqa: PLC0415

    parsed = _engine_args("wcache-prime", ["--model", model, *vllm_args])
    default = _engine_args("wcache-prime", ["--model", model])
    return {f.name: getattr(parsed, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name == "model" or getattr(parsed, f.name) != getattr(default, f.name)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wcache.vllm.prime_engine",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="{}", help="model_loader_extra_config as JSON")
    ap.add_argument("vllm_args", nargs=argparse.REMAINDER,
                    help="after --: the serve's vLLM engine arguments, verbatim")
    args = ap.parse_args(argv)
    rest = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = engine_kwargs(args.model, rest)
    kwargs.update(load_format="wcache", model_loader_extra_config=json.loads(args.extra),
                  enforce_eager=False)
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    print(json.dumps({"token_ids": [list(o.outputs[0].token_ids) for o in out],
                      "llm_start_s": start_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
