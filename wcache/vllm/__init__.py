"""vLLM integration: the only wcache package that imports vLLM.

- ``wcache.vllm.plugin``: the ``vllm.general_plugins`` entry point (registers
  load formats ``wcache`` and ``wcache_timed_auto`` in every vLLM process).
- ``wcache.vllm.loader``: the engine-side restore loader.
- ``wcache.vllm.build``: the daemon's model build with vLLM's own loader (what
  ``wcache serve``, in :mod:`wcache.daemon`, asks of vLLM).
- ``wcache.vllm.adapter``: vLLM quant method -> LayerConfig.
- :func:`plan_for`: a vLLM quant method object -> its bound plan.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.core import BoundPlan, Target

__all__ = [
    "VLLM_LOG_TO_STDERR",
    "VLLM_ONE_PROCESS",
    "VLLM_QUIET",
    "plan_for",
    "vllm_logs_quiet",
]

#: vLLM logs to stdout by default; a process whose stdout carries a result
#: (:mod:`wcache.vllm.run_engine`'s JSON line, whose caller reads vLLM's lines from
#: its stderr) sends them to stderr. Source: vllm/envs.py ``VLLM_LOGGING_STREAM``.
VLLM_LOG_TO_STDERR = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
#: vLLM's engine core and its worker in the engine's own process (an ``LLM`` engine;
#: vllm/envs.py ``VLLM_ENABLE_V1_MULTIPROCESSING``): no second and third import of vLLM.
VLLM_ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: The same at WARNING and above: commands that build vLLM's engine config in their
#: own process and print a verdict (`wcache status --wait-ready`, `wcache verify`).
VLLM_QUIET = {**VLLM_LOG_TO_STDERR, "VLLM_LOGGING_LEVEL": "WARNING"}


@contextlib.contextmanager
def vllm_logs_quiet() -> Iterator[None]:
    """:data:`VLLM_QUIET` in this process's environment while the block runs, for
    each variable the environment does not set already; removed after. vLLM reads
    them when its logger is configured (its first import), so enter before that."""
    added = [k for k in VLLM_QUIET if k not in os.environ]
    os.environ.update({k: VLLM_QUIET[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def plan_for(method: Any, layer: Any = None, *, target: Target, name: str = "") -> BoundPlan:
    """:func:`wcache.plans.plan_for` for a vLLM quant method object: the card's
    ``restore_(layer, plan_for(layer.quant_method, layer, target=t), recorded)``
    (:func:`wcache.shell.restore_`).

    Args:
        method: ``module.quant_method`` (a vLLM ``QuantizeMethodBase``), or a
            :class:`~wcache.core.QuantSpec` / :class:`~wcache.core.LayerConfig`
            (passed through to :func:`wcache.plans.plan_for`).
        layer: the vLLM module (any device, meta included) with a vLLM method;
            the :class:`~wcache.core.LayerConfig` with a bare ``QuantSpec``.
        target: where the layer runs (:func:`wcache.vllm.probe.host_target` on CPU).
        name: the module's qualified name, for messages.

    Raises:
        NoPlan: no plan matches, or the module has no post-load work to plan.

    Source: the method -> config mapping is :func:`wcache.vllm.adapter.layer_config`.
    """
    from wcache.core import LayerConfig, NoPlan, QuantSpec  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.plans import plan_for as resolve  # noqa: PLC0415 (torch import ~2 s: only when called)

    if isinstance(method, (QuantSpec, LayerConfig)):
        return resolve(method, layer, target=target)
    from wcache.vllm.adapter import layer_config  # noqa: PLC0415 (torch import ~2 s: only when called)

    config = layer_config(method, layer, target, name=name)
    if config is None:
        raise NoPlan(
            f"layer {name or type(layer).__name__!r} ({type(method).__name__}) has no "
            f"post-load work for wcache to plan"
        )
    return resolve(config, target=target)
