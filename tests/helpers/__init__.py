"""Helpers shared by several test files, imported as ``tests.helpers.<module>``
(pyproject.toml puts the repository root on the path): vLLM layer builders
(``vllm_layers``), reference kernels (``reference_kernels``), plan cases
(``cpu_cases``, ``cuda_cases``), the in-process loader (``vllm_loader``), a fake
stalled daemon (``stalled_daemon``) and the order xdist hands modules out in
(``suite_order``, tests/conftest.py). Helpers the tests' child processes import
too live in :mod:`wcache.testing` (``wcache.testing.store``)."""
