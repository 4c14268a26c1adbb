"""Which of vLLM's weight-mutation paths a restored engine refuses at load
(``update-unsupported``, before the daemon is contacted): sleep mode on CUDA
``zero_copy`` only, expert rebalancing everywhere (it needs expert parallelism over
several ranks, which a restore does not build)."""

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
        ("cpu", "zero_copy", False, True, None),  # CPU: copy-on-write pages take every write
        ("cuda", "copy", False, True, None),  # a private copy, inside the engine's pools
        ("cuda", "zero_copy", False, False, None),
        ("cuda", "zero_copy", False, True, "sleep mode cannot offload or free"),
        ("cuda", "zero_copy", True, False, "expert rebalancing (enable_eplb)"),
        ("cuda", "copy", True, False, "expert rebalancing (enable_eplb)"),
        ("cpu", "zero_copy", True, True, "expert rebalancing (enable_eplb)"),
    ],
)
def test_update_refusal_table(device, mode, eplb, sleep, refused):
    """_update_refusal names sleep mode on CUDA zero_copy (with mode='copy' as the fix)
    and expert rebalancing on every device and mode (with disk, or dropping it, as
    the fix), nothing else."""
    from wcache.vllm.loader import LoaderOptions, _update_refusal

    reason = _update_refusal(_config(eplb, sleep), torch.device(device), LoaderOptions(mode=mode))
    if refused is None:
        assert reason is None
    elif eplb:
        assert reason.startswith(refused) and "load_format='auto'" in reason
        assert "mode='copy'" not in reason  # a private copy does not make it restorable
    else:
        assert refused in reason and "mode='copy'" in reason
