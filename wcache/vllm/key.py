"""The cache key and device id, computed identically by the daemon and the engine."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

import wcache
from wcache.core import Target
from wcache.store import CacheKey, checkpoint_digest
from wcache.vllm import compat


def parallel_layout() -> dict[str, int]:
    """This rank's TP/PP/DP sizes and ranks from vLLM's initialized groups."""
    from vllm.distributed import parallel_state as ps  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    tp = ps.get_tp_group()
    pp = ps.get_pp_group()
    out = {
        "tp_size": tp.world_size,
        "tp_rank": tp.rank_in_group,
        "pp_size": pp.world_size,
        "pp_rank": pp.rank_in_group,
    }
    try:
        dp = ps.get_dp_group()
        out.update(dp_size=dp.world_size, dp_rank=dp.rank_in_group)
    except (AssertionError, AttributeError):
        out.update(dp_size=1, dp_rank=0)
    return out


def _quant_config_json(model_config: Any) -> str | None:
    qc = getattr(model_config.hf_config, "quantization_config", None)
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    return json.dumps(qc, sort_keys=True, default=str)


def non_weight_factors() -> frozenset[str]:
    """The installed vLLM release's ModelConfig hash factors that do not shape the
    weights (``compat.release().non_weight_factors``): paths (the checkpoint's
    *content* is the ``checkpoint`` field, so a copy at another path matches) and
    run-time options (sleep mode, logprobs, generation defaults, multimodal prompt
    limits). Every other factor, including any vLLM adds later, is part of the key."""
    return compat.release().non_weight_factors


#: Factors vLLM's own hash leaves out but that shape the weights. ``hf_overrides``
#: already reaches the hash through ``hf_config``; it is kept by name so that a
#: mismatch names the override, not only the (large) resulting config.
WEIGHT_FACTORS_VLLM_IGNORES = ("hf_overrides",)
#: Prefix of the key fields that hold vLLM's ModelConfig factors.
MODEL_FACTOR_PREFIX = "model_config."


#: A speculative draft's ModelConfig, as vLLM builds it, differs from the one a
#: ``wcache serve`` of the draft's checkpoint builds in two factors that do not shape
#: its weights: ``runner`` is ``"draft"`` (the daemon's: vLLM's default ``"auto"``),
#: and ``hf_overrides`` is vLLM's draft composition (``SpeculativeConfig.
#: hf_config_override``, a no-op for a plain model), whose effect is in ``hf_config``
#: anyway. A draft's key takes the served values (Source: vllm/config/speculative.py::
#: SpeculativeConfig.__post_init__, ``compose_draft_hf_overrides``; 0.32 and 0.33).
DRAFT_RUNNER, SERVED_RUNNER = "draft", "auto"
DRAFT_HF_OVERRIDE = "SpeculativeConfig.hf_config_override"


def _is_draft_hf_override(raw: Any) -> bool:
    """``raw`` is vLLM's no-op draft composition: the bare static method (0.32) or
    ``functools.partial(SpeculativeConfig.hf_config_override,
    transformers_mtp_overrides=None)`` (0.33, picklable for spawned engine cores).
    A partial that composes a target's own callable override or MTP overrides is not."""
    if isinstance(raw, functools.partial):
        if raw.args or any(v is not None for v in raw.keywords.values()):
            return False
        raw = raw.func
    return callable(raw) and getattr(raw, "__qualname__", None) == DRAFT_HF_OVERRIDE


def model_config_factors(model_config: Any, *, draft: bool = False) -> dict[str, Any]:
    """vLLM's ModelConfig hash factors that shape the weights, as JSON values, one
    key field per factor (``model_config.<factor>``) so a mismatch names it.

    ``hf_config`` / ``hf_text_config`` (vLLM hashes their JSON text) are parsed back
    into objects so key diffs stay readable. With ``draft`` (a speculative draft's
    ModelConfig), the factors a daemon serving the draft's checkpoint has
    (:data:`DRAFT_RUNNER`, :data:`DRAFT_HF_OVERRIDE`).
    """
    from vllm.config.utils import normalize_value  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    factors = compat.model_config_hash_factors(model_config)
    if draft and factors.get("runner") == DRAFT_RUNNER:
        factors["runner"] = SERVED_RUNNER
    for name in WEIGHT_FACTORS_VLLM_IGNORES:
        raw = getattr(model_config, name, None)
        if draft and _is_draft_hf_override(raw):
            raw = {}  # ModelConfig.hf_overrides' default (a daemon's, 0.32 and 0.33)
        factors[name] = raw if isinstance(raw, (dict, type(None))) else normalize_value(raw)
    out = {}
    skip = non_weight_factors()
    for name, value in sorted(factors.items()):
        if name in skip:
            continue
        if isinstance(value, str) and name.startswith("hf_") and value.startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[MODEL_FACTOR_PREFIX + name] = json.loads(json.dumps(value, sort_keys=True, default=str))
    return out


def config_key_fields(model_config: Any, *, draft: bool = False) -> dict[str, Any]:
    """The key fields the engine arguments alone decide (no weight read, no model
    built): vLLM's weight-shaping ModelConfig factors (:func:`model_config_factors`,
    ``max_model_len`` among them), ``quant_config`` (the checkpoint's quantization
    config as JSON text, or None) and ``revision``. :func:`build_key` holds them;
    ``wcache status --wait-ready`` compares them with a serving daemon's key."""
    return {
        **model_config_factors(model_config, draft=draft),
        "quant_config": _quant_config_json(model_config),
        "revision": model_config.revision,
    }


def job_digest(model_config: Any, layout: dict[str, int], job: str = "") -> str:
    """What separates two jobs on one host: architecture, dtype, quantization and
    parallel sizes (not the path, so a changed copy of a checkpoint reaches the
    daemon and is refused with ``key-mismatch`` naming ``checkpoint``)."""
    parts = {
        "arch": list(getattr(model_config.hf_config, "architectures", None) or []),
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "tp": layout["tp_size"],
        "pp": layout["pp_size"],
        "dp": layout["dp_size"],
        "job": job,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def device_id(
    device: torch.device, model_config: Any, layout: dict[str, int], job: str = ""
) -> str:
    """The socket's device id: the GPU UUID on CUDA; on CPU the rank and the job digest."""
    digest = job_digest(model_config, layout, job)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(idx).uuid)
        return f"cuda-{uuid}-{digest}"
    return (
        f"cpu-tp{layout['tp_rank']}of{layout['tp_size']}-"
        f"pp{layout['pp_rank']}of{layout['pp_size']}-{digest}"
    )


def build_key(
    model_config: Any,
    layout: dict[str, int],
    plans: Iterable[str],
    target: Target,
    *,
    checkpoint: dict[str, str] | None = None,
    draft: bool = False,
) -> CacheKey:
    """Everything that decides the exported bytes and their meaning.

    Fields: checkpoint content digests (per file, blake3; cached by stat so the
    engine only stats), architecture, dtype, quantization and its config,
    revision, every vLLM ModelConfig hash factor that shapes the weights
    (:func:`model_config_factors`: ``hf_overrides``, ``hf_config``,
    ``max_model_len``, ...), parallel layout, every plan id with stage versions,
    the Target, and the wcache/vLLM/torch versions.

    Args:
        checkpoint: per-file digests already taken (the daemon takes them before
            it loads); None computes them now.
        draft: ``model_config`` is a speculative draft's: the key a daemon serving
            its checkpoint has (:func:`model_config_factors`).
    """
    fields = {
        **config_key_fields(model_config, draft=draft),
        "checkpoint": checkpoint
        if checkpoint is not None
        else checkpoint_digest(model_config.model),
        "model_arch": list(getattr(model_config.hf_config, "architectures", None) or []),
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "parallel": dict(layout),
        "plans": list(plans),
        "target": target.to_json(),
        "versions": {
            "wcache": wcache.__version__,
            "vllm": compat.vllm_version(),
            "torch": torch.__version__,
        },
    }
    return CacheKey(fields)
