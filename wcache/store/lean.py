"""The lean serving process: once a CPU daemon is ready, it ``execve``'s a server
that imports neither torch nor vLLM (issue 28, docs/benchmarks.md "CPU: what a
ready daemon holds resident beyond its arena").

:func:`handoff` (called by ``wcache serve`` after the rank is ready and its
snapshot written) pauses the accept thread (new clients wait in the listen
backlog), waits up to :data:`HANDOFF_DRAIN_S` for open connections to end,
writes the state the server needs (key, manifest dict, counters, origin,
snapshot state) to a private file, clears ``FD_CLOEXEC`` on the sealed memfd,
the bound listening socket, the device lock and any ``--http`` listener, and
``execve``'s ``python -m wcache.store.lean STATE``. The pid is the same under
exec, so the pid file, the registry entry and the stale-socket check
(:func:`wcache.store.paths.claim_socket_path`) stay valid, and the parent (a
shell, a supervisor, ``wcache serve -tp N``'s ``multiprocessing`` parent) sees
the same child.

Where it cannot apply, :func:`handoff` returns the reason and the caller keeps
serving in the full process: a CUDA transport (VMM handles or a CUDA context
live in the process), a TCP seeding listener (``--seed-listen``: ``seed``
needs torch.distributed), ``--no-lean``, connections that do not end in time,
a lean server that does not import, or an ``execve`` that fails. The lean
server answers every command; ``seed`` starts a helper process with torch that
attaches like any client and sends the arena (:class:`LeanSeedSource`,
:mod:`wcache.store.seed_helper`): at most :data:`MAX_CONCURRENT_SEEDS` at once
(a further ``seed`` is refused ``seed-unavailable``), each killed when the lean
server stops, and run under the operator's own ``MALLOC_ARENA_MAX``, not the
lean server's. A stop asked or an invalidation during the
hand-off calls it off (the full process then stops as usual).

Once exec'd, the process cannot go back: a lean server that fails to start logs
why, removes its socket, pid file and registry entry (so the next daemon
starts cleanly) and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from wcache.errors import SeedFailed, SeedUnavailable
from wcache.store import paths
from wcache.store.artifacts import Bundle
from wcache.store.http import OpsServer
from wcache.store.manifest import CacheKey, Manifest
from wcache.store.protocol import SEED_CHUNK_BYTES, check_seed_request
from wcache.store.server import DaemonServer
from wcache.store.transport_shm import ShmServing

__all__ = [
    "handoff",
    "lean_refusal",
    "main",
    "HANDOFF_DRAIN_S",
    "LeanSeedSource",
    "lean_environ",
    "helper_environ",
    "LEAN_EXEC_ENV",
    "LEAN_LINE",
    "NO_LEAN_ENV",
    "MAX_CONCURRENT_SEEDS",
    "HELPER_STOP_GRACE_S",
]

log = logging.getLogger("wcache.store")

#: How long the hand-off waits for connections opened before it (``status
#: --wait-ready`` probes: one exchange each) to end (seconds); an engine that
#: attached meanwhile holds its connection, and the daemon then stays full.
HANDOFF_DRAIN_S = 5.0
#: How long the import check of the lean server may take (seconds): a cold
#: interpreter importing the store modules takes ~0.2 s.
PREFLIGHT_TIMEOUT_S = 30.0
#: The interpreter to exec (default ``sys.executable``); tests point it elsewhere
#: to prove that a failed exec leaves the full process serving.
LEAN_EXEC_ENV = "WCACHE_LEAN_EXECUTABLE"
#: Set to ``1`` to keep the full process: ``wcache serve --no-lean`` sets it, so that
#: every rank process of a ``-tp N`` daemon sees it.
NO_LEAN_ENV = "WCACHE_NO_LEAN"
#: The state file's name in the socket dir (``.lean-XXXX.pickle``, 0600, removed once read).
STATE_PREFIX = ".lean-"
#: What the lean process prints (stdout, flushed) once it serves.
LEAN_LINE = "wcache: serving: lean (torch-free, pid same)"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: glibc malloc arenas of the lean server (``MALLOC_ARENA_MAX``). By default glibc
#: gives a thread that allocates while the others hold theirs a new arena, up to
#: 8 per core, and each keeps ~130-270 KiB resident (its heap's top is not given
#: back): with one handler thread per connection, every new high of concurrent
#: connections (a status probe, a killed client's connection closing late) added
#: one, long after a warm-up (docs/benchmarks.md, the soak). The handlers run
#: Python under the GIL, so more arenas buy no parallelism here.
MALLOC_ARENAS = 1
#: The environment variable :data:`MALLOC_ARENAS` is given by.
MALLOC_ARENA_ENV = "MALLOC_ARENA_MAX"
#: How long a ``seed`` request waits for the seeding helper to report its store
#: (seconds): a torch import and one attach, ~3-5 s on an idle 2-core host and
#: several times that under load; under the receiver's reply timeout
#: (:data:`wcache.store.client.REPLY_TIMEOUT_S`, 60 s).
SEED_HELPER_START_S = 45.0
#: Where the helper's seeding store listens: the lean server answers ``seed`` only
#: on its Unix socket (a TCP ``--seed-listen`` keeps the full process), so the
#: receiver is on this host.
SEED_HOST = "127.0.0.1"
#: Seeding helpers a lean daemon runs at once; a further ``seed`` is refused
#: (``seed-unavailable``: the receiver fails with ``seed-failed`` naming it and can
#: be started again). Each helper is a full torch process (~300 MiB resident beyond
#: the arena it maps) that sends the whole arena, so an unbounded number could take
#: more memory than the lean hand-off saved; two let a second peer (another job's
#: daemon starting alongside) seed without waiting.
MAX_CONCURRENT_SEEDS = 2
#: How long a helper has to exit after SIGTERM when the lean daemon stops, before
#: SIGKILL (seconds). The helper installs no handler, so SIGTERM ends it at once;
#: the grace bounds the daemon's stop should a helper not end on SIGTERM (a handler
#: a library installed), and is short next to the stop's own joins (5 s each).
HELPER_STOP_GRACE_S = 2.0


class LeanSeedSource:
    """The lean server's ``seed`` handler. Seeding needs torch.distributed, which
    this process does not import: each request starts a helper (``python -m
    wcache.store.seed_helper``) that attaches to this daemon like any client, opens
    the seeding store and sends the arena; the reply names the helper's store.
    ``seeds_done`` counts the helpers that exited 0 (the receiver has the arena).

    At most :data:`MAX_CONCURRENT_SEEDS` helpers run at once; :meth:`close_` (called
    by :meth:`wcache.store.server.DaemonServer.stop`: SIGTERM, ``shutdown``) kills
    the ones still running, so none outlives the daemon holding an attachment and
    the arena's mapping for up to the seeding timeout
    (:func:`wcache.store.seed.seed_timeout_s`: a receiver that took the reply and
    never joined).

    Args:
        server: the lean :class:`wcache.store.server.DaemonServer`.
        seeds_done: the count carried over from the full process.
        malloc_arena_max: the operator's ``MALLOC_ARENA_MAX`` before the hand-off
            (None: unset), which the helpers get instead of the lean server's
            (:func:`helper_environ`).
    """

    def __init__(self, server: Any, seeds_done: int | None, malloc_arena_max: str | None = None):
        self.server = server
        self.seeds_done = seeds_done or 0
        self.malloc_arena_max = malloc_arena_max
        self._lock = threading.Lock()
        #: the helpers started and not yet reaped
        self._helpers: set[subprocess.Popen] = set()
        self._closed = False

    @property
    def helpers(self) -> tuple[subprocess.Popen, ...]:
        """The helpers running now (started and not yet reaped)."""
        with self._lock:
            return tuple(self._helpers)

    def handle(self, req: dict[str, Any], state: dict) -> dict[str, Any]:
        """Check the request, start a helper, return the reply naming its store.

        Raises:
            SeedUnavailable: :data:`MAX_CONCURRENT_SEEDS` helpers already run, or
                the daemon is stopping.
            SeedFailed: the helper could not start or did not report its store.
        """
        mismatch, backend = check_seed_request(req, self.server)
        if mismatch is not None:
            return mismatch
        server = self.server
        exe = os.environ.get(LEAN_EXEC_ENV) or sys.executable
        with (
            self._lock
        ):  # the check and the start together: two requests cannot both take the last slot
            if self._closed:
                raise SeedUnavailable(
                    "this daemon is stopping; seed from another daemon of this key, "
                    "or start from the checkpoint or a snapshot"
                )
            if len(self._helpers) >= MAX_CONCURRENT_SEEDS:
                raise SeedUnavailable(
                    f"this lean daemon already sends {len(self._helpers)} seeding(s), at most "
                    f"{MAX_CONCURRENT_SEEDS} at once (each through a helper process with torch); "
                    f"start the receiver again once one is done, or from the checkpoint or a snapshot"
                )
            try:
                proc = subprocess.Popen(
                    [exe, "-m", "wcache.store.seed_helper"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=helper_environ(os.environ, self.malloc_arena_max),
                )
            except OSError as e:
                raise SeedFailed(
                    f"this lean daemon cannot start its seeding helper ({e}); start the "
                    f"source daemon with --no-lean to seed from it"
                ) from None
            self._helpers.add(proc)
        # narrowing: both are pipes (Popen(stdin=PIPE, stdout=PIPE) above)
        assert proc.stdin is not None and proc.stdout is not None
        ready: list[IO[str]] = []
        started = None
        try:
            proc.stdin.write(
                json.dumps(
                    {
                        "socket_dir": server.socket_dir,
                        "device_id": server.device_id,
                        "key": server.key.canonical,
                        "backend": backend,
                        "host": SEED_HOST,
                        "pid": state.get("pid"),
                        "log_level": logging.getLogger().getEffectiveLevel(),
                    }
                )
                + "\n"
            )
            proc.stdin.close()
            ready, _, _ = select.select([proc.stdout], [], [], SEED_HELPER_START_S)
            if not ready:
                raise TimeoutError(f"no answer in {SEED_HELPER_START_S:.0f} s")
            started = json.loads(proc.stdout.readline())
            port, token = int(started["port"]), str(started["token"])
        except (OSError, ValueError, TypeError, KeyError) as e:
            proc.kill()
            proc.wait()
            self._forget(proc)
            why = (
                f"{type(e).__name__}: {e}"
                if started is not None or ready
                else f"no answer in {SEED_HELPER_START_S:.0f} s"
            )
            log.warning(
                "seeding pid %s from this lean daemon failed: its helper pid %d did not "
                "start (%s); still serving",
                state.get("pid"),
                proc.pid,
                why,
            )
            raise SeedFailed(
                f"this lean daemon's seeding helper did not start ({why}; its log is "
                f"in this daemon's stderr); start the source daemon with --no-lean "
                f"to seed from it"
            ) from None
        threading.Thread(
            target=self._reap, args=(proc, state.get("pid")), name="wcache-seed-helper", daemon=True
        ).start()
        return {
            "ok": True,
            "manifest": server._manifest_dict,
            "backend": backend,
            "host": SEED_HOST,
            "port": port,
            "token": token,
            "chunk_bytes": SEED_CHUNK_BYTES,
        }

    def close_(self) -> None:
        """Refuse every later ``seed`` and end the running helpers: SIGTERM, then
        SIGKILL to those still running after :data:`HELPER_STOP_GRACE_S`; returns
        once all are reaped. Idempotent."""
        with self._lock:
            self._closed = True
            procs = tuple(self._helpers)
        for proc in procs:
            if proc.poll() is None:
                log.warning(
                    "stopping: ending seeding helper pid %d (its receiver does not get the arena)",
                    proc.pid,
                )
                proc.terminate()
        deadline = time.monotonic() + HELPER_STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "seeding helper pid %d still runs %.1f s after SIGTERM; killing it",
                    proc.pid,
                    HELPER_STOP_GRACE_S,
                )
                proc.kill()
                proc.wait()
            self._forget(proc)

    def _forget(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._helpers.discard(proc)

    def _reap(self, proc: subprocess.Popen, pid: Any) -> None:
        rc = proc.wait()
        with self._lock:
            self._helpers.discard(proc)
            closed = self._closed
            if rc == 0:
                self.seeds_done += 1
        if rc != 0 and closed:
            log.info("seeding pid %s from this lean daemon called off: the daemon stops", pid)
        elif rc != 0:
            log.error(
                "seeding pid %s from this lean daemon failed (helper exit %s); still serving",
                pid,
                rc,
            )


def lean_refusal(server: Any, *, enabled: bool = True) -> str | None:
    """Why ``server`` cannot hand off to the lean process (None: it can)."""

    if not enabled:
        return "--no-lean"
    if (
        server.device_type != "cpu"
        or server.transport != "shm"
        or not isinstance(getattr(server._serving, "fd", None), int)
    ):
        return f"{server.transport} transport: its handles live in this process"
    if getattr(server, "_seed_listener", None) is not None:
        return "--seed-listen: seeding needs torch.distributed"
    for ops in OpsServer.running:
        try:
            pickle.dumps(ops.probe)
        except Exception as e:  # noqa: BLE001  (any pickling failure means: keep it here)
            return f"the --http probe cannot be carried over ({type(e).__name__})"
    return None


def _preflight(exe: str) -> str | None:
    """None when ``exe -m wcache.store.lean --check`` imports the lean server
    without torch, else why not."""
    try:
        done = subprocess.run(
            [exe, "-m", "wcache.store.lean", "--check"],
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"the lean server cannot start: {type(e).__name__}: {e}"
    if done.returncode != 0:
        return f"the lean server does not import: {done.stderr.strip()[-300:]}"
    return None


def handoff(server: Any, *, enabled: bool | None = None) -> str:
    """Replace this process image with the lean server; returns only when it
    stays full, with the reason (logged, and printed as ``wcache: serving: full
    (reason)``).

    Args:
        server: the ready, started :class:`wcache.store.server.DaemonServer`.
        enabled: False for ``--no-lean`` (default: unless :data:`NO_LEAN_ENV` is set).
    """
    if enabled is None:
        enabled = os.environ.get(NO_LEAN_ENV, "") != "1"
    reason = lean_refusal(server, enabled=enabled)
    exe = os.environ.get(LEAN_EXEC_ENV) or sys.executable
    if reason is None:
        reason = _preflight(exe) if exe == sys.executable else None
    if reason is None:
        reason = _exec_lean(server, exe)
    log.info("serving: full (%s)", reason)
    print(f"wcache: serving: full ({reason}) pid={os.getpid()}", flush=True)
    return reason


def _exec_lean(server: Any, exe: str) -> str:

    server.pause_accepting_()
    deadline = time.monotonic() + HANDOFF_DRAIN_S
    while server.connections_open and time.monotonic() < deadline:
        time.sleep(0.05)
    if server.connections_open:
        server.resume_accepting_()
        return f"{server.connections_open} connection(s) still open after {HANDOFF_DRAIN_S:.1f} s"
    stopping = _stopping(server)
    if stopping:
        if not server.stopping.is_set():
            server.resume_accepting_()  # serve_forever then sees the request and stops
        return stopping
    ops_list = list(OpsServer.running)
    for ops in ops_list:
        ops.pause()
    bundle = getattr(server, "artifacts", None)  # the start-up artifact bundle's sealed memfd
    fds = [
        server._serving.fd,
        server._listener.fileno(),
        server._lock_fd,
        *(o.fileno() for o in ops_list),
        *([bundle.fd] if bundle is not None else []),
    ]
    state_path = None
    old_mask = None
    try:
        state = {
            "key": server.key.canonical,
            "manifest": server._manifest_dict,
            "transport": server.transport,
            "device_id": server.device_id,
            "socket_dir": server.socket_dir,
            "socket_ino": server._socket_ino,
            "registry_path": server._registry_path,
            "allowed_uid": server.allowed_uid,
            "memfd": fds[0],
            "nbytes": server.nbytes,
            "listener": fds[1],
            "lock_fd": fds[2],
            "http": [(o.fileno(), *o.address, o.probe) for o in ops_list],
            "origin": getattr(server, "origin", None),
            "job": getattr(server, "job", None),
            "snapshot": getattr(server, "snapshot_state", None),
            "seeds_done": getattr(getattr(server, "seed_source", None), "seeds_done", None),
            "uptime_s": time.monotonic() - server._started_at,
            "attachments_total": server.attachments_total,
            "releases": dict(server.releases),
            "refusals": dict(server.refusals),
            "log_level": logging.getLogger().getEffectiveLevel(),
            "malloc_arena_max": os.environ.get(
                MALLOC_ARENA_ENV
            ),  # the operator's, for the seeding helpers
            "artifacts": {
                "fd": bundle.fd if bundle is not None else None,
                "manifest": dict(bundle.manifest) if bundle is not None else None,
                "state": getattr(server, "artifacts_state", None),
                "error": getattr(server, "artifacts_error", None),
            },
        }
        fd, state_path = tempfile.mkstemp(
            prefix=STATE_PREFIX, suffix=".pickle", dir=server.socket_dir
        )
        with os.fdopen(fd, "wb") as f:
            pickle.dump(state, f)
        # SIGTERM/SIGINT stay pending across exec until the lean server's handlers are in
        # place (this thread's mask; a signal another thread takes in the exec's few ms is lost)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        # a SIGTERM, `shutdown` or `invalidate` that came during the drain or the state
        # write: stay full and let serve_forever act on it (the exec would drop it)
        stopping = _stopping(server)
        if stopping is None:
            for each in fds:
                os.set_inheritable(each, True)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(exe, [exe, "-m", "wcache.store.lean", state_path], lean_environ(os.environ))
        reason = stopping or "execve returned"  # execve does not return
    except Exception as e:  # noqa: BLE001  (whatever failed, the full process serves on)
        reason = (
            f"exec {exe} failed: {e}"
            if isinstance(e, OSError) and old_mask is not None
            else f"the hand-off failed: {type(e).__name__}: {e}"
        )
    for each in fds:
        os.set_inheritable(each, False)
    if old_mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a pending SIGTERM lands now
    if state_path is not None:
        os.unlink(state_path)
    if not server.stopping.is_set():
        for ops in ops_list:
            ops.start()
        server.resume_accepting_()
    return reason


def lean_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The lean server's environment: ``environ`` with glibc's malloc held to one
    arena (:data:`MALLOC_ARENAS`; a ``MALLOC_ARENA_MAX`` already set is kept)."""
    return {MALLOC_ARENA_ENV: str(MALLOC_ARENAS), **environ}


def helper_environ(environ: Mapping[str, str], malloc_arena_max: str | None) -> dict[str, str]:
    """A seeding helper's environment: the lean server's ``environ`` with
    ``MALLOC_ARENA_MAX`` back to the operator's ``malloc_arena_max`` (removed when
    None). One arena suits the lean server's GIL-bound handler threads
    (:data:`MALLOC_ARENAS`), not torch and gloo's native threads, which would all
    contend for its lock."""
    out = {k: v for k, v in environ.items() if k != MALLOC_ARENA_ENV}
    if malloc_arena_max is not None:
        out[MALLOC_ARENA_ENV] = malloc_arena_max
    return out


def _stopping(server: Any) -> str | None:
    """Why ``server`` must not be handed off now: a stop was asked (SIGTERM, the
    ``shutdown`` command) or a client invalidated its arena (the full process exits
    with status 75 as usual); None otherwise."""
    if server.stopping.is_set() or server._shutdown_requested.is_set():
        return "stopping"
    if server.invalidated:
        return f"arena invalidated [{server.invalidated.get('code')}]"
    return None


def _cleanup_failed(state: dict) -> None:
    """The lean server could not start: remove what names this pid as serving."""
    sock = paths.socket_path(state["socket_dir"], state["device_id"])
    try:
        if os.lstat(sock).st_ino == state["socket_ino"]:
            os.unlink(sock)
    except OSError:
        pass
    rec = paths.read_pid_file(paths.pid_path(sock))
    if rec is not None and rec["pid"] == os.getpid():
        try:
            os.unlink(paths.pid_path(sock))
        except OSError:
            pass
    if state.get("registry_path"):
        paths.unregister_daemon(state["registry_path"])


def _serve(state: dict) -> int:

    server = DaemonServer.adopt(
        key=CacheKey.from_json(state["key"]),
        manifest=Manifest.from_dict(state["manifest"]),
        serving=ShmServing(state["memfd"], state["nbytes"]),
        transport=state["transport"],
        device_id=state["device_id"],
        socket_dir=state["socket_dir"],
        lock_fd=state["lock_fd"],
        listener=socket.socket(fileno=state["listener"]),
        socket_ino=state["socket_ino"],
        registry_path=state["registry_path"],
        allowed_uid=state["allowed_uid"],
    )
    server.serving_mode = "lean"
    server.origin, server.snapshot_state = state["origin"], state["snapshot"]
    server.job = state.get("job")
    server.seed_source = LeanSeedSource(server, state["seeds_done"], state.get("malloc_arena_max"))
    server.attachments_total = state["attachments_total"]
    server.releases.update(state["releases"])
    server.refusals.update(state["refusals"])
    server._started_at = time.monotonic() - state["uptime_s"]
    art = state.get("artifacts") or {}
    if art.get("fd") is not None:
        server.artifacts = Bundle(art["fd"], art["manifest"])
    server.artifacts_state, server.artifacts_error = art.get("state"), art.get("error")
    for sig in _SIGNALS:
        signal.signal(sig, lambda *_: server.request_shutdown())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    ops_list = [
        OpsServer(host, port, probe, listen_fd=fd).start()
        for fd, host, port, probe in state["http"]
    ]
    server.start()
    print(f"{LEAN_LINE} pid={os.getpid()} socket={server.socket_path}", flush=True)
    try:
        server.serve_forever()
    finally:
        for ops in ops_list:
            ops.stop()
    return server.exit_code


def main(argv: list[str]) -> int:
    """``python -m wcache.store.lean STATE`` (exec'd by :func:`handoff`), or
    ``--check``: import what serving needs and fail if torch came with it."""
    if argv == ["--check"]:
        import wcache.store.http  # noqa: PLC0415 (the check itself: import what serving needs)
        import wcache.store.server  # noqa: PLC0415 (the check itself: import what serving needs)
        import wcache.store.transport_shm  # noqa: F401, PLC0415 (the check itself: import what serving needs)

        return 1 if "torch" in sys.modules else 0
    state = None
    try:
        try:
            with open(argv[0], "rb") as f:
                state = pickle.load(f)  # noqa: S301 (our own 0600 file in our 0700 socket dir, read once)
        finally:
            os.unlink(argv[0])
        logging.basicConfig(level=state["log_level"], format="%(asctime)s %(name)s %(message)s")
        _close_inherited_fds(state)
        return _serve(state)
    except Exception as e:  # noqa: BLE001  (exec'd: no full process to go back to)
        logging.basicConfig()
        log.error(
            "the lean server could not start (%s: %s); this daemon exits and a restart "
            "builds it again",
            type(e).__name__,
            e,
        )
        if state is not None:
            _cleanup_failed(state)
        return 1


def _close_inherited_fds(state: dict) -> None:
    """Close every fd but stdio and the ones ``state`` names: a descriptor the full
    process's C++ libraries opened without ``O_CLOEXEC`` (gloo or TCPStore sockets,
    shared-memory segments) would otherwise stay open, keeping its port or segment
    alive, for as long as this daemon serves."""
    keep = {
        0,
        1,
        2,
        state["memfd"],
        state["listener"],
        state["lock_fd"],
        *(fd for fd, *_ in state["http"]),
    }
    if (state.get("artifacts") or {}).get("fd") is not None:
        keep.add(state["artifacts"]["fd"])
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the fd listdir itself held, already closed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
