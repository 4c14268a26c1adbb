"""What the CPU plan tests (tests/plans/test_cpu_plan_properties.py and the plan
modules' own tests, tests/plans/test_<module>.py) share: load and restore as the
engine runs them, the plan this host resolves, and a daemon export installed on a
meta-built engine layer. Needs vLLM: importing this module skips the importing test
module without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.helpers import vllm_layers as vl
from tests.helpers.cpu_cases import HOST, HOST_LIBRARY
from wcache.core import LayerConfig, NoPlan, Plan, QuantSpec, Target
from wcache.plans import plan_for
from wcache.shell import load_, prepare_, restore_
from wcache.vllm.compat import sync_kernel_state_

#: The NoPlan reason for a layer whose vLLM kernel cannot run on this host at all
#: (its op is missing from the loaded kernel library): skipped, not failed.
VLLM_CANNOT_RUN = "vLLM itself cannot run this layer here"


def load_synced_(layer, bound) -> None:
    """:func:`wcache.shell.load_`, then the kernel state bound onto vLLM's kernel
    objects (:func:`wcache.vllm.compat.sync_kernel_state_`), as the engine does."""
    load_(layer, bound)
    sync_kernel_state_(layer)


def restore_synced_(layer, bound, recorded, **kwargs):
    """:func:`wcache.shell.restore_`, then :func:`sync_kernel_state_` (as the
    engine's ``wcache.vllm.model.restore_layers_`` does)."""
    state = restore_(layer, bound, recorded, **kwargs)
    sync_kernel_state_(layer)
    return state


def forward(case: vl.Case, layer) -> torch.Tensor | None:
    """``case``'s vLLM ``apply`` on ``layer`` with its activations (``None`` without one)."""
    if case.apply is None:
        return None
    with vl.vllm_context():
        return case.apply(layer, case.activations())


def host_plan(case: vl.Case) -> Plan:
    """The plan for ``case`` on this host; skips when vLLM itself cannot run it here."""
    try:
        return plan_for(case.config, target=HOST).plan
    except NoPlan as exc:
        if VLLM_CANNOT_RUN in str(exc):
            pytest.skip(f"{HOST_LIBRARY}: {exc}")
        raise


def exported_layer(case: vl.Case, plan: Plan, seed: int = 0, target: Target | None = None):
    """prepare on a daemon-side layer; install fresh clones on a meta-built one."""
    daemon = case.new_layer(seed=seed)
    prepared = prepare_(daemon, plan.bind(case.config, target or HOST))
    engine = case.new_layer("meta", seed=None)
    vl.install_exported_(engine, vl.export_clone(prepared), prepared.buffers)
    return engine, prepared


def assert_resolves(spec: QuantSpec, config_kw: dict, target: Target, plan_id: str) -> None:
    """plan_for(spec) on a 256x128 bf16 layer (``config_kw`` overriding) gives ``plan_id``."""
    config = LayerConfig(
        spec, **{"size_k": 256, "size_n": 128, "params_dtype": "bfloat16", **config_kw}
    )
    assert plan_id == plan_for(spec, config, target=target).id


def assert_refused(spec: QuantSpec, size: tuple[int, int], target: Target, message: str) -> None:
    """plan_for(spec) on a ``size`` = (K, N) bf16 layer raises NoPlan matching ``message``."""
    config = LayerConfig(spec, size[0], size[1], "bfloat16", name="model.layers.0.x")
    with pytest.raises(NoPlan, match=message):
        plan_for(spec, config, target=target)
