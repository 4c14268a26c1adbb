"""``wcache serve`` with the ``cuda_ipc`` transport forced (one rank): this host's
``cuda_vmm`` support is reported missing, so the daemon takes its own fallback
(:func:`wcache.store.server.build_cuda_serving`), as on a driver without POSIX-fd
VMM handles. Used by tests/gpu_engine/test_weight_updates_graphs.py:

    python tests/gpu_engine/_serve_cuda_ipc.py serve --model DIR ...
"""

from __future__ import annotations

import sys

from wcache.store import transport_vmm

#: Why cuda_vmm is "unavailable" (the daemon logs it and shows it in status).
FORCED = "forced off by tests/gpu_engine/_serve_cuda_ipc.py: serving over cuda_ipc"


def _unavailable(device_index: int) -> tuple[bool, str]:
    return False, FORCED


if __name__ == "__main__":
    transport_vmm.available = _unavailable
    from wcache.cli import main

    sys.exit(main(sys.argv[1:]))
