"""The benchmark code ``wcache bench`` runs, inside the package so an installed
``wcache bench`` works without a source checkout.

- :mod:`wcache.benchmarks.synthetic`: Llama-shaped synthetic layer stacks.
- :mod:`wcache.benchmarks.bench_restore`: ordinary load vs restore vs per-tensor IPC.
- :mod:`wcache.benchmarks.bench_attach`: one arena vs N per-tensor handles.
- :mod:`wcache.benchmarks.plot`: the restore-cost curve (needs matplotlib).

The measured results stay in the checkout's ``benchmarks/`` folder.
"""
