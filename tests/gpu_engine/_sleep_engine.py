"""One vLLM CUDA engine with sleep mode that sleeps and wakes ``--cycles`` times at
``--level`` and prints one JSON line: the greedy tokens after the load and after each
wake, the device memory this process uses (NVML where it lists this process; else
what the process's allocators hold) and the process's host RSS after each wake (bytes),
or the refusal's reason code when the load refuses sleep mode.

Run by tests/gpu_engine/test_sleep_engines.py:

    python tests/gpu_engine/_sleep_engine.py --model DIR --load-format wcache \
        --extra '{...}' --level 1|2 --cycles 20

Level 1: ``sleep(level=1)`` (weights offloaded to pinned host memory, KV cache
discarded), ``wake_up()``. Level 2: ``sleep(level=2)`` (weights discarded),
``wake_up(tags=["weights"])``, ``reload_weights()`` (the loader's
``get_all_weights``: the checkpoint read back from disk), ``wake_up(tags=["kv_cache"])``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))

from _update_engine import MAX_TOKENS, PROMPTS, _engine_kwargs  # found through the path above


def _error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if code:
        return str(code)
    text = str(exc)
    for known in ("update-unsupported", "restore-error"):
        if known in text:
            return known
    return type(exc).__name__


def _process_device_bytes(pid: int) -> int | None:
    """Device memory NVML charges to process ``pid`` on GPU 0 (bytes), or None where
    NVML is missing or does not list it: the driver reports host PIDs, so a process in
    a PID namespace (a container, the gVisor sandbox of the one-GPU H200 kind) is
    never found by its own PID (NVIDIA/nvidia-docker#1483)."""
    try:
        import pynvml  # nvidia-ml-py: the H200 image has it; the bundle does not carry it
    except ImportError:
        try:
            from vllm.third_party import pynvml  # vLLM 0.33's own copy of nvidia-ml-py
        except ImportError:
            return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except pynvml.NVMLError:
        return None
    return None


def _allocator_device_bytes() -> int:
    """Device memory this process's allocators hold (bytes): torch's reserved segments
    (vLLM's sleep-mode CuMem pools are torch MemPools, so counted there) less the CuMem
    allocations asleep (unmapped by ``sleep``, which torch's allocator does not see).
    Leaves out the CUDA context and memory no torch allocator made (constant per process).

    Source: vllm/device_allocator/cumem.py::CuMemAllocator.sleep, ``pointer_to_data``
        (``AllocationData.handle[1]``: the mapped size, ``is_asleep``), 0.33.0.
    """
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator

    asleep = sum(
        d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.is_asleep
    )
    return torch.cuda.memory_reserved() - asleep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--mode", choices=("eager", "graphs", "compiled"), default="graphs")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import psutil
    import torch
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(
            model=args.model,
            dtype="bfloat16",
            load_format=args.load_format,
            model_loader_extra_config=json.loads(args.extra),
            max_model_len=512,
            max_num_seqs=1,
            seed=0,
            enable_sleep_mode=True,
            **_engine_kwargs("cuda", args.mode),
        )
    except Exception as exc:  # noqa: BLE001  (a refused load: its code is the result)
        print(f"load refused: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        print(json.dumps({"refused": _error_code(exc), "message": str(exc)[:400]}), flush=True)
        return 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    proc = psutil.Process()

    def generate() -> list[list[int]]:
        outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def measure() -> dict:
        free, total = torch.cuda.mem_get_info()
        mine = _process_device_bytes(os.getpid())
        held = _allocator_device_bytes()
        return {
            # this process's device memory, so other work on the GPU cannot move it:
            # NVML's figure where it lists the process, else the allocators' own
            "device_used": held if mine is None else mine,
            "device_scope": "allocator" if mine is None else "process",
            "device_allocator": held,
            "device_total_used": total - free,
            "host_rss": proc.memory_info().rss,
        }

    out: dict = {"first": generate(), "cycles": []}
    out["loaded"] = measure()
    for _ in range(args.cycles):
        llm.sleep(level=args.level)
        asleep = measure()
        if args.level == 1:
            llm.wake_up()
        else:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        llm.reset_prefix_cache()
        out["cycles"].append({"tokens": generate(), "asleep": asleep, "awake": measure()})
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
