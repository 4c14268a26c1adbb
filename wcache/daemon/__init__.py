"""Daemon orchestration: ``wcache serve``, readiness, and the child processes around it.

- ``wcache.daemon.serve``: the ``wcache serve`` flow: one process per rank, each
  ready from the checkpoint, a snapshot or a peer, then serving; ``--http``.
- ``wcache.daemon.ready``: ``wcache status --wait-ready`` and ``--http``'s probe:
  whether every rank of the daemon for these engine arguments serves.
- ``wcache.daemon.process``: ``wcache serve`` daemons, engines and vLLM's API
  server in child processes (the demo, the e2e tests and the benchmarks).

Nothing here imports vLLM: the model build, vLLM's engine-argument parser and its
distributed set-up are :mod:`wcache.vllm.build`, which these modules call
(``tests/vllm/test_one_door.py``).
"""
