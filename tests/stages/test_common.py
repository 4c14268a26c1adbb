"""wcache/stages/common.py: the shared stage helpers (the kernel-op check)."""

from __future__ import annotations

import pytest
import torch

from wcache.stages import (
    common,
)

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("vllm_world")


def test_require_op_raises_when_missing():
    """A native op that is not registered raises OpUnavailable (a WcacheError)."""
    with pytest.raises(common.OpUnavailable, match="not registered"):
        common.require_op("_C", "no_such_op_wcache")
    assert common.require_op("_C", "onednn_mm") is torch.ops._C.onednn_mm
