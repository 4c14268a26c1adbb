"""The template's errors: each a :class:`~wcache.errors.WcacheError` and a builtin,
with a reason code of its own (``wcache run`` prints the code of the reason it ran
the command directly)."""

from __future__ import annotations

from wcache.errors import WcacheError

__all__ = [
    "TemplateError",
    "TemplateMissing",
    "TemplateStale",
    "TemplateUnsafe",
    "TemplateUnsupported",
    "TemplateStartFailed",
]


class TemplateError(WcacheError, RuntimeError):
    """Root of the template's errors: the template cannot run this command."""

    code = "template-error"


class TemplateMissing(TemplateError, FileNotFoundError):
    """No template answers in the socket directory: start one with ``wcache template start``."""

    code = "template-missing"


class TemplateStale(TemplateError):
    """The template's installs or import-time environment differ from this command's:
    ``fields`` names each difference; restart it (``wcache template stop; wcache
    template start``)."""

    code = "template-stale"

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


class TemplateUnsafe(TemplateError):
    """Forking the template is not safe now: CUDA is initialised in it, or it runs
    more threads than after its imports (a fork would copy a held lock)."""

    code = "template-unsafe"


class TemplatePreloadFailed(TemplateError, ImportError):
    """A module named with ``--preload`` could not be imported: not installed (a typo,
    another environment's), or its import raised (a missing dependency, a syntax
    error, an empty or relative name). The template would start without it and every
    command would import it again. Only modules given explicitly are refused; a
    default preload that fails (another platform's) is skipped and listed."""

    code = "template-preload-failed"


class TemplateUnsupported(TemplateError, ValueError):
    """The command is not a Python entry the template can run (another interpreter,
    interpreter options it does not replay, a binary), or a template child cannot take
    its process context (a resource limit, niceness or cgroup the template may not
    give it, :mod:`wcache.template.context`)."""

    code = "template-unsupported"


class TemplateStartFailed(TemplateError):
    """``wcache template start``: the template process did not become ready."""

    code = "template-start-failed"
