"""The heart of wcache: tagged stages, plans, the runner and the restore guard.

A quantization method's post-load work is an ordered tuple of :class:`Stage`
values. Each stage is a pure function over a layer's tensors, tagged with what
it does to state (:class:`Tag`). A :class:`Plan` runs its stages as one fold over
an immutable :class:`LayerState` (:meth:`Plan.run`):

* load: every stage (an ordinary load);
* prepare: TRANSFORM, METADATA and VALIDATE stages (the daemon); the tensors
  left afterwards are exported, METADATA values are recorded;
* restore: METADATA, ALLOCATE, DERIVE and VALIDATE stages only (a restarting
  engine, on mapped tensors), with the restore guard as the fold's per-step hook.

The package, one concern per module (docs/design.md section 2):

* :mod:`~wcache.core.values`: Tag, Target, QuantSpec, LayerConfig, StageOut,
  Stage, LayerState, Prepared (frozen values);
* :mod:`~wcache.core.decisions`: the names and outcomes of the engine's kernel
  decisions that :attr:`Target.kernels` records;
* :mod:`~wcache.core.registry`: the ``@stage`` decorator, StageDef, stage names
  and verbs;
* :mod:`~wcache.core.checks`: the plan rules and the per-stage contract checks,
  each a function returning its violations;
* :mod:`~wcache.core.runner`: Plan, BoundPlan, the fold and its step;
* :mod:`~wcache.core.guard`: fingerprints, byte-range checksums, RestoreGuard;
* :mod:`~wcache.core.host`: the host queries behind :meth:`Target.detect`.

Nothing here touches an ``nn.Module``: :mod:`wcache.shell` reads a module into a
state, runs the fold and installs the result (``load_``, ``prepare_``,
``restore_``). This package imports no vLLM and nothing of wcache but the errors.
"""

from __future__ import annotations

from wcache.core.checks import plan_problems
from wcache.core.guard import (
    CHECKSUM_WORD_BYTES,
    ByteRange,
    RestoreGuard,
    TensorFingerprint,
    fingerprint,
    guard_snapshot,
    layer_ranges,
    range_sums,
    tensor_checksum,
)
from wcache.core.registry import (
    STAGE_NAME,
    STAGE_VERBS,
    StageDef,
    registered_stages,
    stage,
    stage_name_problem,
)
from wcache.core.runner import DEVICE_TYPES, BoundPlan, Plan, StepGuard
from wcache.core.values import (
    LOAD_TAGS,
    PREPARE_TAGS,
    RESTORE_TAGS,
    TARGET_ENV_DEFAULTS,
    TARGET_ENV_VARS,
    LayerConfig,
    LayerState,
    MoeShape,
    ParamOutcome,
    Prepared,
    QuantSpec,
    Reregistration,
    Stage,
    StageFn,
    StageOut,
    Tag,
    Target,
)

# The errors live in their own module (the layers below core use them without
# importing core); core re-exports them.
from wcache.errors import (
    NoPlan,
    PlanInvalid,
    RecordedMismatch,
    RestoreIncomplete,
    RestoreWroteSharedTensor,
    StageContractError,
    WcacheError,
)

__all__ = [
    "Tag",
    "Reregistration",
    "ParamOutcome",
    "Target",
    "QuantSpec",
    "MoeShape",
    "LayerConfig",
    "StageOut",
    "StageFn",
    "Stage",
    "StageDef",
    "DEVICE_TYPES",
    "Plan",
    "BoundPlan",
    "StepGuard",
    "LayerState",
    "Prepared",
    "TensorFingerprint",
    "WcacheError",
    "NoPlan",
    "PlanInvalid",
    "StageContractError",
    "RestoreWroteSharedTensor",
    "RecordedMismatch",
    "RestoreIncomplete",
    "stage",
    "registered_stages",
    "STAGE_NAME",
    "STAGE_VERBS",
    "stage_name_problem",
    "plan_problems",
    "guard_snapshot",
    "fingerprint",
    "CHECKSUM_WORD_BYTES",
    "RestoreGuard",
    "ByteRange",
    "layer_ranges",
    "range_sums",
    "tensor_checksum",
    "LOAD_TAGS",
    "PREPARE_TAGS",
    "RESTORE_TAGS",
    "TARGET_ENV_VARS",
    "TARGET_ENV_DEFAULTS",
]
