"""The engine template ("zygote"): a process that imported torch, vLLM and what a
vLLM engine imports, has not initialised CUDA, and forks an engine on demand, so a
restart pays no import (issue 48, docs/template.md).

``wcache template start`` starts it beside the daemon (its socket in the same
socket directory); ``wcache run -- CMD ARGS`` runs CMD's Python entry in a forked
child of it (or directly, saying why); ``wcache template status | stop``.

Modules: :mod:`~wcache.template.server` (the template process and its children),
:mod:`~wcache.template.client` (``wcache run`` and the lifecycle commands),
:mod:`~wcache.template.entry` (which Python entry a command runs),
:mod:`~wcache.template.versions` (what a template is keyed on),
:mod:`~wcache.template.errors`. None imports torch or vLLM at module level.
"""
