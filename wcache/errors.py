"""Every wcache error: one root, each class also the matching builtin, each with a
reason code (STYLE.md). Imports nothing from wcache, so every layer can raise them.
"""

from __future__ import annotations

__all__ = ["WcacheError", "NoPlan", "PlanInvalid", "StageContractError",
           "RestoreWroteSharedTensor", "RecordedMismatch", "RestoreIncomplete",
           "ModelMismatch", "PlanArgumentError", "UpdateUnsupported",
           "CheckpointCorrupt", "ConfigInvalid", "LoadFailed"]


class WcacheError(Exception):
    """Root of every wcache error. ``code`` is a stable reason code (e.g.
    ``"plan-missing"``); the message says what happened and what to do."""

    code = "wcache-error"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class NoPlan(WcacheError, ValueError):
    """No plan matches a (method, layer, target); the message gives the reason."""

    code = "plan-missing"


class PlanInvalid(WcacheError, ValueError):
    """A plan violates the stage rules (docs/design.md section 3); lists every violation."""

    code = "plan-invalid"


class StageContractError(WcacheError, RuntimeError):
    """A stage returned something its declaration does not allow (an undeclared
    write, a missing read) or mutated an input."""

    code = "stage-contract"


class RestoreWroteSharedTensor(WcacheError, RuntimeError):
    """Restore changed a shared (mapped) tensor: pointer, shape, stride, dtype,
    version counter or content. Names the layer, tensor and stage."""

    code = "guard-failed"


class RecordedMismatch(WcacheError, RuntimeError):
    """A value recomputed during restore differs from the one the daemon recorded
    (e.g. ``use_w4a8`` on a host with a different ISA than the daemon's)."""

    code = "key-mismatch"


class RestoreIncomplete(WcacheError, RuntimeError):
    """Restore lacks a tensor or a recorded value the plan needs."""

    code = "restore-incomplete"


class ModelMismatch(WcacheError, RuntimeError):
    """The daemon's export does not fit the engine's model (an extra or missing tensor)."""

    code = "model-mismatch"


class PlanArgumentError(WcacheError, TypeError):
    """``plan_for`` was called with something it cannot resolve (no layer sizes, a
    vLLM object outside :mod:`wcache.vllm`, no Target); the message says what to pass."""

    code = "plan-argument"


class UpdateUnsupported(WcacheError, RuntimeError):
    """A vLLM weight-mutation path (sleep mode, expert rebalancing) cannot run on a
    restored model with this transport; refused before any tensor is touched. The
    message names the path and the setting that makes it work (``mode=copy``)."""

    code = "update-unsupported"


class CheckpointCorrupt(WcacheError, ValueError):
    """A checkpoint file cannot be what it claims (a truncated or damaged
    safetensors file); the message names the file and what is wrong with it."""

    code = "checkpoint-corrupt"


class ConfigInvalid(WcacheError, ValueError):
    """The checkpoint's ``config.json`` is missing, not JSON, or not a JSON object;
    the message names the file and the position of the problem."""

    code = "config-invalid"


class LoadFailed(WcacheError, RuntimeError):
    """The daemon's load (vLLM, transformers, safetensors) raised something wcache
    does not classify; the message names the checkpoint and the error, and the
    traceback is in the log (``--verbose``)."""

    code = "load-failed"


class PrepareFailed(WcacheError, RuntimeError):
    """A plan's prepare (the daemon's TRANSFORM stages) failed on what vLLM's loader
    handed over; the message names the layer, the plan, the stage error and the
    layer's tensors as vLLM left them. Nothing is served."""

    code = "prepare-failed"
