"""The plan registry: ``register(plan)`` at import time, ``plan_for(...)`` to resolve.

Plans for one method are tried in registration order (the way vLLM's
``choose_mp_linear_kernel`` walks its kernel list); the first whose ``match``
accepts (config, target) wins. With ``QuantSpec.kernel`` set, only plans for
that kernel are considered. No match raises :class:`NoPlan` listing every
candidate's reason.
"""

from __future__ import annotations

from typing import Any

from wcache.core import LayerConfig, NoPlan, Plan, QuantSpec, Target

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
    _load_all()
    return tuple(_PLANS)


def refused() -> dict[str, str]:
    _load_all()
    return dict(_REFUSED)


def _load_all() -> None:
    import wcache.plans  # noqa: F401  (imports every plan module)


def plan_for(method: Any, layer: Any = None, target: Target | None = None) -> Plan:
    """Resolve exactly one plan.

    Args:
        method: a :class:`QuantSpec`, a :class:`LayerConfig`, or a vLLM quant
            method object (resolved through :mod:`wcache.vllm.adapter`).
        layer: a :class:`LayerConfig` or a vLLM layer (needed with a vLLM method
            or when the plan depends on shapes).
        target: where the layer runs (default: ``Target.detect("cpu")``).

    Raises:
        NoPlan: no plan matches; the message names every candidate's reason.
    """
    _load_all()
    if target is None:
        target = Target.detect("cpu")
    if isinstance(method, LayerConfig):
        config = method
    elif isinstance(method, QuantSpec):
        config = layer if isinstance(layer, LayerConfig) else LayerConfig(quant=method, size_k=0, size_n=0)
        if config.quant != method:
            config = LayerConfig(quant=method, size_k=config.size_k, size_n=config.size_n,
                                 params_dtype=config.params_dtype, has_bias=config.has_bias,
                                 name=config.name, extra=config.extra)
    else:
        from wcache.vllm.adapter import layer_config  # imports vLLM; only on this path

        config = layer_config(method, layer, target)
    spec = config.quant
    if spec.method in _REFUSED:
        raise NoPlan(f"{spec.method}: {_REFUSED[spec.method]}")
    candidates = [p for p in _PLANS if p.method == spec.method]
    if not candidates:
        known = sorted({p.method for p in _PLANS})
        raise NoPlan(f"no plan for method {spec.method!r} (layer {config.name or '?'}); "
                     f"wcache has plans for {known}. Load this model without wcache "
                     f"(load_format='auto') or add a plan.")
    if spec.kernel is not None:
        kernel_plans = [p for p in candidates if p.kernel == spec.kernel]
        if not kernel_plans:
            why = [r for r in (p.match(config, target) for p in candidates) if r]
            raise NoPlan(f"{spec.method} (layer {config.name or '?'}): vLLM picks kernel "
                         f"{spec.kernel!r} here and wcache has no plan for it (plans exist for "
                         f"{sorted({p.kernel for p in candidates})})"
                         + (f": {why[0]}" if why else ""))
        candidates = kernel_plans
    reasons = []
    for plan in candidates:
        reason = plan.match(config, target)
        if reason is None:
            return plan
        reasons.append(f"{plan.kernel}: {reason}")
    raise NoPlan(f"no plan for {spec.method} on {target.device_type} "
                 f"(layer {config.name or '?'}): " + "; ".join(reasons))
