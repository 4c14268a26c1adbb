"""The priming engine of ``wcache serve --prime-compile``: one vLLM engine built from
the serve's own vLLM engine arguments, restored from the daemon, compiled, one token.

    python -m wcache.vllm.prime_engine --model DIR [--usage-context serve|llm] --extra JSON \
        -- [vLLM engine args]

vLLM keys its torch.compile cache by ``vllm_config.compute_hash()``, which covers the
model, scheduler, cache, parallel and compilation configs (``max_num_seqs`` decides
the CUDA-graph capture sizes, for one). A priming engine with any setting of its own
would compile for another key than the engines it primes for, and its artifacts would
be refused as stale. So this engine takes exactly the arguments the daemon was started
with (the same the serving engines are given: an engine attaches only with the
engine arguments the daemon was started with, docs/quickstart.md), parsed by vLLM's own engine-argument parser, and
changes only what priming needs: ``load_format="wcache"`` with the given loader config,
and compilation on (:func:`wcache.daemon.prime.priming_args` drops the serve's
``--enforce-eager``). Engines started with other arguments get a bundle whose
``config_hash`` differs, and refuse it as stale (they compile as usual).

The usage context counts as an argument: vLLM's default ``max_num_batched_tokens`` /
``max_num_seqs`` depend on it (``EngineArgs.get_batch_defaults``; CPU: 2048/128 for
the API server, 4096/256 for ``LLM()``) and ``SchedulerConfig.compute_hash`` covers
them. So the engine's config is built the way the engines primed for build theirs,
``engine_args.create_engine_config(usage_context=...)`` with ``OPENAI_API_SERVER``
(``serve``: ``vllm serve``) or ``LLM_CLASS`` (``llm``: ``LLM()``), and run by
``LLMEngine.from_vllm_config`` (``add_request`` / ``step`` for the one token).

Prints one JSON line: ``{"token_ids": [[...]], "llm_start_s": s}``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from typing import Any

PROMPT = "wcache priming"
#: ``--usage-context`` value -> the vLLM ``UsageContext`` member of the engines primed
#: for: ``serve`` is ``vllm serve`` (the OpenAI API server), ``llm`` is ``LLM()``.
USAGE_CONTEXTS = {"serve": "OPENAI_API_SERVER", "llm": "LLM_CLASS"}


def engine_kwargs(model: str, vllm_args: list[str]) -> dict[str, Any]:
    """The ``LLM(**kwargs)`` that ``vllm_args`` (vLLM engine CLI arguments) give: the
    fields of vLLM's ``EngineArgs`` parsed from them that differ from what the same
    parser gives for ``--model`` alone (so what the arguments set, nothing else), with
    ``model``.

    Source: vllm/engine/arg_utils.py (``EngineArgs.add_cli_args``, ``from_cli_args``).
    """
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    from wcache.vllm.build import _engine_args  # noqa: PLC0415 (torch import ~2 s: only when called)

    parsed = _engine_args("wcache-prime", ["--model", model, *vllm_args])
    default = _engine_args("wcache-prime", ["--model", model])
    return {
        f.name: getattr(parsed, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.name == "model" or getattr(parsed, f.name) != getattr(default, f.name)
    }


def priming_engine_args(model: str, vllm_args: list[str], extra: dict[str, Any]) -> Any:
    """vLLM's ``EngineArgs`` of the priming engine: :func:`engine_kwargs`, loaded by
    wcache with the loader config ``extra``, compiled (``enforce_eager=False``)."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return EngineArgs(
        **{
            **engine_kwargs(model, vllm_args),
            "load_format": "wcache",
            "model_loader_extra_config": extra,
            "enforce_eager": False,
        }
    )


def usage_context(usage: str) -> Any:
    """vLLM's ``UsageContext`` for a ``--usage-context`` value (:data:`USAGE_CONTEXTS`).

    Source: vllm/usage/usage_lib.py (``UsageContext``).
    """
    from vllm.usage.usage_lib import UsageContext  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return UsageContext[USAGE_CONTEXTS[usage]]


def engine_config(engine_args: Any, usage: str) -> Any:
    """The ``VllmConfig`` the priming engine runs with: ``engine_args`` under the usage
    context of the engines primed for (what its ``compute_hash()`` keys the compile by).
    ``engine_args`` is left as it was (vLLM writes its batch defaults into the object
    it builds from; this builds from a copy).

    Source: vllm/v1/engine/llm_engine.py (``LLMEngine.from_engine_args``).
    """
    return copy.deepcopy(engine_args).create_engine_config(usage_context=usage_context(usage))


def _generate_one(engine: Any) -> list[list[int]]:
    """One greedy token for :data:`PROMPT`, by vLLM's ``add_request`` / ``step``."""
    from vllm import SamplingParams  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    engine.add_request("wcache-prime-0", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return [list(o.outputs[0].token_ids) for o in finished]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m wcache.vllm.prime_engine", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--usage-context",
        choices=tuple(USAGE_CONTEXTS),
        default="serve",
        help="the engines primed for: serve (vllm serve) or llm (LLM())",
    )
    ap.add_argument("--extra", default="{}", help="model_loader_extra_config as JSON")
    ap.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="after --: the serve's vLLM engine arguments, verbatim",
    )
    args = ap.parse_args(argv)
    rest = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    engine_args = priming_engine_args(args.model, rest, json.loads(args.extra))
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    t0 = time.perf_counter()
    engine = LLMEngine.from_vllm_config(
        engine_config(engine_args, args.usage_context),
        usage_context=usage_context(args.usage_context),
        disable_log_stats=engine_args.disable_log_stats,
    )
    start_s = time.perf_counter() - t0
    print(json.dumps({"token_ids": _generate_one(engine), "llm_start_s": start_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
