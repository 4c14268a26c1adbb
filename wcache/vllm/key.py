"""The cache key and device id, computed identically by the daemon and the engine."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

import wcache
from wcache.core import Target
from wcache.store import CacheKey, checkpoint_digest


def parallel_layout() -> dict[str, int]:
    """This rank's TP/PP/DP sizes and ranks from vLLM's initialized groups."""
    from vllm.distributed import parallel_state as ps  # noqa: PLC0415

    tp = ps.get_tp_group()
    pp = ps.get_pp_group()
    out = {"tp_size": tp.world_size, "tp_rank": tp.rank_in_group,
           "pp_size": pp.world_size, "pp_rank": pp.rank_in_group}
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


def job_digest(model_config: Any, layout: dict[str, int], job: str = "") -> str:
    """What separates two jobs on one host: architecture, dtype, quantization and
    parallel sizes (not the path, so a changed copy of a checkpoint reaches the
    daemon and is refused with ``key-mismatch`` naming ``checkpoint``)."""
    parts = {"arch": list(getattr(model_config.hf_config, "architectures", None) or []),
             "dtype": str(model_config.dtype), "quantization": model_config.quantization,
             "tp": layout["tp_size"], "pp": layout["pp_size"], "dp": layout["dp_size"],
             "job": job}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def device_id(device: torch.device, model_config: Any, layout: dict[str, int], job: str = "") -> str:
    """The socket's device id: the GPU UUID on CUDA; on CPU the rank and the job digest."""
    digest = job_digest(model_config, layout, job)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(idx).uuid)
        return f"cuda-{uuid}-{digest}"
    return (f"cpu-tp{layout['tp_rank']}of{layout['tp_size']}-"
            f"pp{layout['pp_rank']}of{layout['pp_size']}-{digest}")


def build_key(model_config: Any, layout: dict[str, int], plans: Iterable[str],
              target: Target) -> CacheKey:
    """Everything that decides the exported bytes and their meaning.

    Fields: checkpoint content digests (per file, blake3; cached by stat so the
    engine only stats), architecture, dtype, quantization and its config,
    revision, parallel layout, every plan id with stage versions, the Target,
    and the wcache/vLLM/torch versions.
    """
    import vllm  # noqa: PLC0415

    fields = {
        "checkpoint": checkpoint_digest(model_config.model),
        "model_arch": list(getattr(model_config.hf_config, "architectures", None) or []),
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "quant_config": _quant_config_json(model_config),
        "revision": model_config.revision,
        "parallel": dict(layout),
        "plans": list(plans),
        "target": target.to_json(),
        "versions": {"wcache": wcache.__version__, "vllm": vllm.__version__,
                     "torch": torch.__version__},
    }
    return CacheKey(fields)
