"""Issue 44 item 6: the parameters a restored layer ends with (class, ``requires_grad``,
attributes) against vLLM's own processed layer, for the plan contract tests
(tests/plans/test_param_contracts.py, CPU and simulated CUDA).

:func:`engine_restore` runs one layer through what the daemon and the engine do with
its parameters: the daemon's record (:func:`wcache.shell.param_flags`, taken as
``wcache.vllm.build`` takes it: the build's parameters before the checkpoint, then
prepare) and the engine's install (:func:`wcache.vllm.model.install_tensors_` on a
meta-built layer) and restore. :func:`parameter_diff` compares what ``wcache verify``
compares (:func:`wcache.vllm.verify.parameter_flags`). vLLM is imported inside the
functions."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from wcache.core import LayerConfig, Plan, Target
from wcache.shell import prepare_, restore_

#: The layer's name in the one-layer "model" (the layer is the root module).
ROOT = ""


def engine_restore(
    plan: Plan,
    config: LayerConfig,
    build: Callable[..., torch.nn.Module],
    fill: Callable[[torch.nn.Module], None],
    target: Target,
) -> torch.nn.Module:
    """The layer a restored engine holds: ``build()`` + ``fill`` + prepare on the
    daemon side, the daemon's parameter record, then ``build(meta=True)`` + the
    engine's install of fresh clones of the export + restore.

    Args:
        build: ``build(meta=False) -> layer`` (vLLM's ``create_weights``).
        fill: writes the checkpoint's tensors into a built layer.
    """
    from wcache.vllm.adapter import sync_kernel_state_
    from wcache.vllm.model import (
        PlannedLayer,
        daemon_param_flags,
        export_tensors,
        install_tensors_,
    )

    daemon = build()
    built = {n: weakref.ref(p) for n, p in daemon.named_parameters(remove_duplicate=False)}
    grads = {n: p.requires_grad for n, p in daemon.named_parameters(remove_duplicate=False)}
    fill(daemon)
    bound = plan.bind(config, target)
    prepared = prepare_(daemon, bound)
    planned = [PlannedLayer(ROOT, daemon, config, plan)]
    flags = daemon_param_flags(daemon, built, planned, grads)
    engine = build(meta=True)
    # the daemon's export (aliases: a stage's second name for a tensor, as vLLM's
    # ``layer.w13_weight = layer.w13_qweight``), as fresh tensors with the same bytes
    tensors, kinds, aliases, _ = export_tensors(daemon)
    tensors = {n: t.clone() for n, t in tensors.items()}
    tensors.update((a, tensors[c]) for a, c in aliases.items())
    install_tensors_(engine, tensors, kinds, {}, aliases, planned, param_flags=flags)
    restore_(engine, bound, prepared.recorded, strict=True, drops=prepared.drops)
    sync_kernel_state_(engine)
    return engine


def parameter_diff(expected: torch.nn.Module, actual: torch.nn.Module) -> dict:
    """``{"%name": (vLLM's, restored)}`` for each own parameter whose class,
    ``requires_grad`` or attributes differ (``wcache verify``'s comparison)."""
    from wcache.vllm.verify import parameter_flags

    a, b = parameter_flags(expected), parameter_flags(actual)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
