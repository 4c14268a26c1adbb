"""The plan registry: ``register(plan)`` at import time, ``plan_for(...)`` to resolve.

Importing this module imports its package first, whose ``__init__`` imports every
plan module (:data:`wcache.plans.PLAN_MODULES`), so the registry is full before
anyone can call :func:`plan_for`.

``plan_for(config, target=t)`` returns a :class:`~wcache.core.BoundPlan`, a pure
value the shell's entry points take: ``wcache.shell.restore_(layer, plan_for(config,
target=t), recorded)``.

Plans for one method are tried in registration order (the way vLLM's
``choose_mp_linear_kernel`` walks its kernel list); the first whose ``match``
accepts (config, target) wins. With ``QuantSpec.kernel`` set, only plans for
that kernel are considered. No match raises :class:`NoPlan` listing every
candidate's reason.
"""

from __future__ import annotations

from typing import Any

from attrs import evolve

from wcache.core import BoundPlan, LayerConfig, NoPlan, Plan, QuantSpec, Target
from wcache.errors import PlanArgumentError

__all__ = ["PlanArgumentError", "all_plans", "plan_for", "refuse", "refused", "register"]

_PLANS: list[Plan] = []
#: method -> reason, for methods refused outright (e.g. GPTQ int8 on CPU).
_REFUSED: dict[str, str] = {}


def register(plan: Plan) -> Plan:
    """Add ``plan``; a second plan with the same id is an error."""
    if any(p.id == plan.id for p in _PLANS):
        raise ValueError(f"plan {plan.id} registered twice")
    _PLANS.append(plan)
    return plan


def refuse(method: str, reason: str) -> None:
    """Record that ``method`` has no plan at all, with the reason shown by NoPlan."""
    _REFUSED[method] = reason


def all_plans() -> tuple[Plan, ...]:
    """Every registered plan, in registration order."""
    return tuple(_PLANS)


def refused() -> dict[str, str]:
    return dict(_REFUSED)


def _layer_config(method: Any, layer: Any) -> LayerConfig:
    """The :class:`LayerConfig` to resolve for ``(method, layer)``."""
    if isinstance(method, LayerConfig):
        if layer is not None:
            raise PlanArgumentError(
                "plan_for(LayerConfig, ...) takes no layer: the config "
                "already holds the layer's sizes"
            )
        return method
    if isinstance(method, QuantSpec):
        if not isinstance(layer, LayerConfig):
            raise PlanArgumentError(
                f"plan_for({method.method!r} QuantSpec) needs the layer's sizes: pass "
                f"plan_for(LayerConfig(spec, size_k=..., size_n=...), target=...) or "
                f"plan_for(spec, layer_config, target=...); got layer={layer!r}"
            )
        return evolve(layer, quant=method)
    raise PlanArgumentError(
        f"plan_for takes a QuantSpec or LayerConfig, got {type(method).__name__}; a vLLM quant "
        f"method resolves through wcache.vllm.plan_for(quant_method, layer, target=...)"
    )


def plan_for(
    method: QuantSpec | LayerConfig, layer: LayerConfig | None = None, *, target: Target
) -> BoundPlan:
    """Resolve exactly one plan and bind it to the layer's config and target.

    Args:
        method: a :class:`LayerConfig` (the spec and the layer's sizes), or a
            :class:`QuantSpec` with ``layer`` its :class:`LayerConfig`. vLLM quant
            method objects resolve through :func:`wcache.vllm.plan_for`.
        layer: the :class:`LayerConfig` with a bare :class:`QuantSpec`.
        target: where the layer runs; required (a GPU caller must not get CPU
            plans by omission). On CPU, :func:`wcache.vllm.probe.host_target`
            gives this host's vLLM kernel decisions.

    Returns:
        A :class:`BoundPlan` for :func:`wcache.shell.load_`, ``prepare_`` and
        ``restore_``; ``.plan`` is the registered plan.

    Raises:
        NoPlan: no plan matches; the message names every candidate's reason.
        PlanArgumentError: no layer sizes, or a vLLM object (use ``wcache.vllm``).
    """
    if not isinstance(target, Target):
        raise PlanArgumentError(f"plan_for needs target=Target(...), got {target!r}")
    spec = method.quant if isinstance(method, LayerConfig) else method
    if isinstance(spec, QuantSpec):
        _known_method(spec, getattr(layer, "name", "") or getattr(method, "name", ""))
    config = _layer_config(method, layer)
    return BoundPlan(_resolve(config, target), config, target)


def _known_method(spec: QuantSpec, name: str) -> None:
    """Raise :class:`NoPlan` for a refused or unknown method (before sizes matter)."""
    if spec.method in _REFUSED:
        raise NoPlan(f"{spec.method}: {_REFUSED[spec.method]}")
    if not any(p.method == spec.method for p in _PLANS):
        known = sorted({p.method for p in _PLANS})
        kernel = f", which vLLM runs with {spec.kernel} here" if spec.kernel else ""
        raise NoPlan(
            f"no plan for method {spec.method!r}{kernel} (layer {name or '?'}); "
            f"wcache has plans for {known}. Load this model without wcache "
            f"(load_format='auto') or add a plan."
        )


def _resolve(config: LayerConfig, target: Target) -> Plan:
    """The first registered plan whose ``match`` accepts ``(config, target)``."""
    spec = config.quant
    _known_method(spec, config.name)
    candidates = [p for p in _PLANS if p.method == spec.method]
    if spec.kernel is not None:
        kernel_plans = [p for p in candidates if p.kernel == spec.kernel]
        if not kernel_plans:
            why = [r for r in (p.match(config, target) for p in candidates) if r]
            raise NoPlan(
                f"{spec.method} (layer {config.name or '?'}): vLLM picks kernel "
                f"{spec.kernel!r} here and wcache has no plan for it (plans exist for "
                f"{sorted({p.kernel for p in candidates})})" + (f": {why[0]}" if why else "")
            )
        candidates = kernel_plans
    reasons = []
    for plan in candidates:
        reason = plan.match(config, target)
        if reason is None:
            return plan
        reasons.append(f"{plan.kernel}: {reason}")
    raise NoPlan(
        f"no plan for {spec.method} on {target.device_type} "
        f"(layer {config.name or '?'}): " + "; ".join(reasons)
    )
