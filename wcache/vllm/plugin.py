"""vLLM general plugin: registers wcache's load formats.

vLLM runs ``vllm.general_plugins`` entry points in the main process, the engine
core and every worker (CPU workers are spawned), so registering here is what
makes ``load_format="wcache"`` resolvable where the model is actually loaded.
"""


def register() -> None:
    import wcache.vllm.loader  # noqa: F401  (decorators register the formats)
