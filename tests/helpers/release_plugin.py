"""A pytest plugin for the per-release runs of tests/test_vllm_releases.py: before
any test it checks that the vLLM the run imports is the release it was asked for
(``WCACHE_EXPECT_VLLM``), and writes which vLLM it imported, as which distribution
and from where, to the JSON file ``WCACHE_RELEASE_REPORT`` for the parent test."""

from __future__ import annotations

import json
import os

#: The environment variable naming the vLLM version the run must import.
EXPECT_ENV = "WCACHE_EXPECT_VLLM"
#: The environment variable naming the JSON file the plugin writes.
REPORT_ENV = "WCACHE_RELEASE_REPORT"


def _without_amx_when_no_kernels() -> bool:
    """A release tree holds vLLM's Python only: its native CPU ops (the AMX SGL kernels'
    ``convert_weight_packed`` among them) are absent, so on an AMX host vLLM's dispatch
    would fail inside every unquantized linear. Those runs check wcache against the
    release's Python, not kernels: there the host is treated as one without AMX (the
    branch vLLM takes without the ops); returns whether it was."""
    import torch

    if not torch.cpu._is_amx_tile_supported() or hasattr(torch.ops._C, "convert_weight_packed"):
        return False
    torch.cpu._is_amx_tile_supported = lambda: False
    return True


def pytest_sessionstart(session) -> None:
    """Refuse to run under another vLLM; record the imported one."""
    import vllm

    from wcache.vllm import compat

    without_amx = _without_amx_when_no_kernels()

    want = os.environ[EXPECT_ENV]
    if vllm.__version__ != want:
        raise RuntimeError(
            f"the release run for vLLM {want} imports vLLM {vllm.__version__} from {vllm.__file__}"
        )
    with open(os.environ[REPORT_ENV], "w") as f:
        json.dump(
            {
                "version": vllm.__version__,
                "distribution": compat.vllm_distribution(),
                "package": os.path.dirname(os.path.realpath(vllm.__file__)),
                "amx_hidden": without_amx,
            },
            f,
        )
