"""The benchmark code ``wcache bench`` runs, inside the package so an installed
``wcache bench`` works without a source checkout.

- :mod:`wcache.benchmarks.synthetic`: Llama-shaped synthetic layer stacks.
- :mod:`wcache.benchmarks.bench_restore`: ordinary load vs restore vs per-tensor IPC.
- :mod:`wcache.benchmarks.bench_attach`: one arena vs N per-tensor handles.
- :mod:`wcache.benchmarks.plot`: the restore-cost curve (needs matplotlib).
- :mod:`wcache.benchmarks.bench_server`: ``wcache bench --server``, vLLM's API server
  start to its first completion, from disk vs from a daemon.
- :mod:`wcache.benchmarks.gpu_costs`: where a GPU restore's time goes (the guard's
  content check, its cold start, each step of a cuda_vmm attach); ``python -m``.
- :mod:`wcache.benchmarks.daemon_memory`: the daemon's device memory after its arena
  build, and vLLM's start-up memory check with the loader's answer; ``python -m``.

The measured results stay in the checkout's ``benchmarks/`` folder.
"""
