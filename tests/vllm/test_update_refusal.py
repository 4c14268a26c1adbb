"""Which of vLLM's weight-mutation paths a restored engine refuses at load
(``update-unsupported``, before the daemon is contacted): sleep mode and expert
rebalancing on CUDA ``zero_copy`` only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _config(eplb: bool = False, sleep: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(enable_eplb=eplb),
        model_config=SimpleNamespace(enable_sleep_mode=sleep),
    )


@pytest.mark.parametrize(
    "device,mode,eplb,sleep,refused",
    [
        ("cpu", "zero_copy", True, True, None),  # CPU: copy-on-write pages take every write
        ("cuda", "copy", True, True, None),  # a private copy, inside the engine's pools
        ("cuda", "zero_copy", False, False, None),
        ("cuda", "zero_copy", True, False, "expert rebalancing (enable_eplb)"),
        ("cuda", "zero_copy", False, True, "sleep mode cannot offload or free"),
    ],
)
def test_update_refusal_table(device, mode, eplb, sleep, refused):
    """_update_refusal names EPLB and sleep mode on CUDA zero_copy (with mode='copy' as the fix), nothing else."""
    from wcache.vllm.loader import LoaderOptions, _update_refusal

    reason = _update_refusal(_config(eplb, sleep), torch.device(device), LoaderOptions(mode=mode))
    if refused is None:
        assert reason is None
    else:
        assert refused in reason and "mode='copy'" in reason
