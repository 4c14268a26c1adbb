"""vLLM integration: the only wcache package that imports vLLM.

- ``wcache.vllm.plugin``: the ``vllm.general_plugins`` entry point (registers
  load formats ``wcache`` and ``wcache_timed_auto`` in every vLLM process).
- ``wcache.vllm.loader``: the engine-side restore loader.
- ``wcache.vllm.daemon``: ``wcache serve``.
- ``wcache.vllm.adapter``: vLLM quant method -> LayerConfig.
"""
