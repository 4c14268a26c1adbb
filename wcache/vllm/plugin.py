"""vLLM general plugin: registers wcache's load formats.

vLLM runs ``vllm.general_plugins`` entry points in the main process, the engine
core and every worker (CPU workers are spawned), so registering here is what
makes ``load_format="wcache"`` resolvable where the model is actually loaded.

On a vLLM version or build wcache does not support
(:data:`wcache.vllm.compat.SUPPORTED_VLLM`) the formats are registered as
loaders that refuse with :class:`~wcache.vllm.compat.UntestedVllm`, naming the
installed version and build and listing the supported ones (override:
``WCACHE_ALLOW_UNTESTED_VLLM=1``): wcache's plans mirror each supported release's
post-load code, and a changed step would be restored wrongly instead of refused. vLLM
itself keeps working for every other load format (the plugin runs in every vLLM
process, with wcache in use or not).
"""

import logging

logger = logging.getLogger("vllm.wcache")

#: The load formats wcache registers (``wcache.vllm.loader``).
LOAD_FORMATS = ("wcache", "wcache_timed_auto")


def register() -> None:
    """Register the load formats, or refusing stand-ins on an unsupported vLLM."""
    from wcache.vllm.compat import UntestedVllm, check_vllm_version  # noqa: PLC0415 (torch import ~2 s: only when called)

    try:
        check_vllm_version()
    except UntestedVllm as exc:
        logger.warning("wcache: load formats %s disabled: %s", list(LOAD_FORMATS), exc)
        register_refusals(exc)
        return
    import wcache.vllm.loader  # noqa: PLC0415, F401 (torch import ~2 s, vLLM import ~6 s: only when called)


def register_refusals(exc: Exception) -> None:
    """Register every wcache load format as a loader whose construction raises ``exc``
    (only vLLM's public loader registry is touched)."""
    from vllm.model_executor.model_loader import register_model_loader  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    class RefusingLoader(BaseModelLoader):
        """Stands in for wcache's loaders on an unsupported vLLM."""

        def __init__(self, load_config):
            raise exc

        def download_model(self, model_config):  # pragma: no cover  (never constructed)
            raise exc

        def load_weights(self, model, model_config):  # pragma: no cover
            raise exc

    for name in LOAD_FORMATS:
        register_model_loader(name)(RefusingLoader)
