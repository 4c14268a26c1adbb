"""Stack samples of every Python process of an engine start (`wcache bench --phases
--stack-samples S`, a diagnostic; :mod:`wcache.benchmarks.stacks` reads them).

This directory goes first on ``PYTHONPATH`` only for the engines of that run, so
Python imports this module at start-up in the engine's process and in each process
it spawns; forked children re-arm through ``os.register_at_fork``. With
``WCACHE_STACK_SAMPLES=PREFIX`` set, a daemon thread wakes every
``WCACHE_STACK_SAMPLE_S`` seconds (default 0.5) and appends one line per other
thread to ``PREFIX.{pid}``::

    {unix time, s} {thread name} {outermost frame};...;{innermost frame}

each frame ``path:line:function`` (the collapsed-stack format flame-graph tools
read). A thread that holds the GIL in C for longer than the interval shows as a gap
in the samples. A child forked to exec another program (``subprocess`` with
``preexec_fn``) writes a header before it execs, and a Python program it execs one
more: such a file holds more than one header. The engine template (``python -m
wcache.template``, docs/template.md) starts no thread of its own (its tripwire would
refuse to fork it): there the module only arms the fork hook, so each child the
template forks samples itself. Then the ``sitecustomize`` this module shadows, if
any, runs.
"""

import importlib.machinery
import importlib.util
import os
import sys
import threading
import time

#: Seconds between samples when ``WCACHE_STACK_SAMPLE_S`` is not set.
DEFAULT_INTERVAL_S = 0.5


def _start() -> None:

    prefix = os.environ.get("WCACHE_STACK_SAMPLES")
    if not prefix:
        return
    try:
        interval = float(os.environ.get("WCACHE_STACK_SAMPLE_S") or DEFAULT_INTERVAL_S)
        out = open(f"{prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (open for the whole process)
    except (OSError, ValueError):
        return
    argv = getattr(sys, "orig_argv", None) or getattr(sys, "argv", None)  # argv is not set yet
    out.write(
        f"# pid={os.getpid()} ppid={os.getppid()} start={time.time():.3f} "
        f"interval={interval} argv={argv!r}\n"
    )

    def frame_text(frame) -> str:
        parts = []
        while frame is not None:
            code = frame.f_code
            parts.append(f"{code.co_filename}:{frame.f_lineno or 0}:{code.co_name}")
            frame = frame.f_back
        return ";".join(reversed(parts))

    def loop() -> None:
        me = threading.get_ident()
        while True:
            time.sleep(interval)
            try:
                names = {t.ident: t.name.replace(" ", "_") for t in threading.enumerate()}
                now = time.time()
                out.write(
                    "".join(
                        f"{now:.2f} {names.get(tid, tid)} {frame_text(f)}\n"
                        for tid, f in sys._current_frames().items()
                        if tid != me
                    )
                )
            except Exception:  # noqa: BLE001  (interpreter shutting down: stop sampling)
                return

    threading.Thread(target=loop, name="wcache-stack-sampler", daemon=True).start()


def _in_engine_template() -> bool:
    """True in the engine template's process (``python -m wcache.template``): a
    process that forks engines must not start a thread before it does."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    return any(
        a == "-mwcache.template" or (a == "-m" and argv[i + 1 : i + 2] == ["wcache.template"])
        for i, a in enumerate(argv)
    )


if os.environ.get("WCACHE_STACK_SAMPLES"):
    if not _in_engine_template():
        _start()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_start)


def _chain() -> None:
    """Run the ``sitecustomize`` later on ``sys.path`` that this one shadows."""
    here = os.path.realpath(os.path.dirname(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
