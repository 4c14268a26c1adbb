"""``wcache run`` and ``wcache template start | status | stop``: the client side of
the template (:mod:`wcache.template.server`). Imports neither torch nor vLLM.

``wcache run -- CMD ARGS...`` sends the template CMD's Python entry, argv,
environment, cwd and process context (:mod:`wcache.template.context`: CPU affinity,
resource limits, umask, niceness, cgroups), with its own stdin, stdout and stderr
(``SCM_RIGHTS``); the
template forks a child that runs it. This process then forwards the signals a
shell would deliver to CMD (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2)
and ends as the child ended: the same exit code, or killed by the same signal
(a shell shows 128+N, Python's subprocess -N). When no template answers, or it
is stale, unsafe to fork, or CMD is not a Python entry of its interpreter, it
says why on stderr (``wcache run: running directly [code]: ...``) and execs CMD
itself; ``--no-fallback`` exits :data:`REFUSED_EXIT` instead.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from wcache.errors import ConnectionClosed, PeerRefused, ProtocolError, StoreError
from wcache.store import paths
from wcache.store.protocol import recv_frame, send_frame
from wcache.store.server import peer_credentials
from wcache.template import context, versions
from wcache.template.entry import resolve_entry
from wcache.template.errors import (
    TemplateError,
    TemplateMissing,
    TemplateStale,
    TemplateStartFailed,
    TemplateUnsafe,
    TemplateUnsupported,
)
from wcache.template.server import (
    FORWARDED_SIGNALS,
    LOG_NAME,
    TEMPLATE_PROTOCOL,
    socket_file,
)
from wcache.template.started import process_start_epoch

__all__ = [
    "run_command",
    "start_template",
    "template_status",
    "stop_template",
    "REFUSED_EXIT",
    "NOT_RUNNING_EXIT",
    "DEFAULT_START_TIMEOUT_S",
    "LOST_EXIT",
]

#: ``wcache run --no-fallback`` when the template cannot run the command (the
#: "not running" code of ``wcache status``).
REFUSED_EXIT = 3
#: ``wcache template status`` / ``stop`` when no template runs.
NOT_RUNNING_EXIT = 3
#: ``wcache run`` when the template vanished before reporting the child's end
#: (EX_SOFTWARE: the child's own status is unknown).
LOST_EXIT = 70
#: ``wcache template start`` waits this long for the imports (seconds): torch +
#: vLLM take ~10 s on 2 idle CPU cores and 21-25 s on the H200 host; a loaded
#: machine or a cold page cache can take several times that.
DEFAULT_START_TIMEOUT_S = 300.0
#: Connecting and the template's first answer (seconds): it answers from its loop
#: at once; a template busy importing has no socket yet.
CONNECT_TIMEOUT_S = 5.0
#: ``wcache template stop`` waits this long for the template to exit (seconds) when
#: no child runs (with children it drains: stop returns once it stopped accepting).
STOP_WAIT_S = 10.0
POLL_S = 0.1
#: ``wcache template status`` names this many of the slowest preloads' import times
#: (``--json`` has every one): where a template's start goes, on one line.
SLOWEST_PRELOADS = 5
#: The most the template's status pipe carries (bytes): its one-line ready or
#: failure record, well under the pipe's buffer.
STATUS_MAX_BYTES = 65536
#: The descriptors a command gets from ``wcache run``: stdin, stdout, stderr.
STDIO = (0, 1, 2)
#: Signals that would make the dying client write a core file of its own.
_CORE_SIGNALS = frozenset(
    {
        signal.SIGQUIT,
        signal.SIGILL,
        signal.SIGABRT,
        signal.SIGFPE,
        signal.SIGSEGV,
        signal.SIGBUS,
        signal.SIGSYS,
        signal.SIGTRAP,
    }
)


def _connect(socket_dir: str | None) -> socket.socket:
    """A connection to the template, its uid checked (SO_PEERCRED), as the daemon's
    clients do.

    Raises:
        TemplateMissing: no socket, or nothing accepts on it.
        UnsafePath / PeerRefused: the dir, the socket or the peer is another user's.
    """
    path = socket_file(socket_dir)
    try:
        paths.ensure_socket_dir(os.path.dirname(path), create=False)
        paths.check_socket_file(path)
    except FileNotFoundError:
        raise TemplateMissing(
            f"no template socket at {path}; start one with `wcache template start`"
        ) from None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CONNECT_TIMEOUT_S)
    try:
        s.connect(path)
    except OSError as e:
        s.close()
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT) or isinstance(e, socket.timeout):
            raise TemplateMissing(
                f"no template answers on {path} ({e}); start one with `wcache template start`"
            ) from None
        raise
    pid, uid, _ = peer_credentials(s)
    if uid != os.getuid():
        s.close()
        raise PeerRefused(
            f"the process on {path} (pid {pid}) runs as uid {uid}, not as you "
            f"(uid {os.getuid()}); refusing it"
        )
    return s


def _ask(socket_dir: str | None, frame: dict[str, Any]) -> dict[str, Any]:
    s = _connect(socket_dir)
    try:
        send_frame(s, frame)
        reply, _ = recv_frame(s, frame_timeout_s=CONNECT_TIMEOUT_S)
    except (ConnectionClosed, ProtocolError, OSError) as e:
        raise TemplateMissing(f"the template did not answer: {e}") from None
    finally:
        s.close()
    return reply


def _stdio_fds() -> tuple[list[int], list[int]]:
    """This process's fds 0-2 to send, with /dev/null in place of a closed one
    (CPython then has ``sys.stdin`` None; the child gets an empty stream); the
    second list holds the ones opened here, to close after sending."""
    out, opened = [], []
    for fd in STDIO:
        try:
            os.fstat(fd)
            out.append(fd)
        except OSError:
            nul = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            out.append(nul)
            opened.append(nul)
    return out, opened


def _ignored_signals() -> list[int]:
    """The forwarded signals this process ignores: a SIG_IGN it inherited (``nohup``
    ignores SIGHUP, a non-interactive shell's background job SIGINT and SIGQUIT),
    which exec keeps, so a direct start of the command would ignore them too."""
    return [int(sig) for sig in FORWARDED_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]


def _request(argv: list[str], socket_dir: str | None) -> tuple[socket.socket, int]:
    """Ask the template to run ``argv``; the connection and the child's pid.

    Raises:
        TemplateError: (a subclass) why the template cannot run it.
    """
    env = dict(os.environ)
    try:
        cwd = os.getcwd()
    except FileNotFoundError as exc:
        # a deleted working directory: a direct start runs there (exec keeps it), a
        # template child could not chdir into it
        raise TemplateUnsupported(
            f"the current directory was deleted ({exc.strerror}); a template child cannot enter it"
        ) from None
    entry = resolve_entry(argv, env, cwd)
    frame = {
        "op": "run",
        "protocol": TEMPLATE_PROTOCOL,
        "argv": list(argv),
        "env": env,
        "cwd": cwd,
        "entry": entry,
        "wcache": versions.own_wcache_stamp(),
        # dispositions exec would keep: the child ignores what this process ignores
        "ignored_signals": _ignored_signals(),
        # where a direct start's timer would start: this client's launch
        "client_start": process_start_epoch(),
        # what exec would keep and a fork of the template would not: affinity, limits,
        # umask, niceness, cgroups (the child takes them, or the command runs directly)
        "context": context.gather(),
    }
    # stdio first: with fd 0, 1 or 2 closed the connection would take that number and
    # be sent as the child's stdin/stdout/stderr (a read hung, a print went into the
    # template's connection); /dev/null holds a closed one's place meanwhile
    fds, opened = _stdio_fds()
    try:
        s = _connect(socket_dir)
        try:
            send_frame(s, frame, tuple(fds))
            reply, _ = recv_frame(s, frame_timeout_s=CONNECT_TIMEOUT_S)
        except (ConnectionClosed, ProtocolError, OSError) as e:
            s.close()
            raise TemplateMissing(f"the template did not answer the run request: {e}") from None
    finally:
        for fd in opened:
            os.close(fd)
    if not reply.get("ok"):
        s.close()
        code, message = reply.get("code"), str(reply.get("message", ""))
        # keyed by object: the reply's code is whatever the template sent (or None)
        by_code: dict[object, type[TemplateError]] = {
            c.code: c for c in (TemplateStale, TemplateUnsafe, TemplateUnsupported)
        }
        cls = by_code.get(code, TemplateError)
        if cls is TemplateStale:
            raise TemplateStale(message, tuple(reply.get("fields") or ()))
        raise cls(message)
    return s, int(reply["pid"])


def _die_like(exitcode: int) -> int:
    """Return a child's exit code, or end this process by the signal that ended it
    (``exitcode`` -N), without a core file of our own."""
    if exitcode >= 0:
        return exitcode
    sig = -exitcode
    if sig in _CORE_SIGNALS:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.stdout.flush()
    sys.stderr.flush()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # their disposition cannot be changed
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    return 128 + sig  # a signal whose default is to continue (not forwarded from a child)


def _relay(s: socket.socket, child: int, mask: set[int | signal.Signals]) -> int:
    """Forward signals to the child until the template reports its end; its exit code.

    ``mask`` is this process's signal mask from before :func:`run_command` blocked the
    forwarded signals for the request: it is restored once the forwarding handlers
    are in place, so a signal that came while the child was being forked (the child can
    run, and print, before the template's reply arrives) is forwarded now, not lost and
    not fatal to this process."""

    def forward(signum: int, frame: Any) -> None:
        try:
            send_frame(s, {"op": "signal", "signum": int(signum)})
        except OSError:
            pass

    # every one, ignored ones too: the child starts with them ignored (as exec keeps
    # SIG_IGN), but the command may install a handler of its own (uvicorn does for
    # SIGINT and SIGTERM), which a direct start would then run
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending signal is forwarded here
    s.settimeout(None)
    while True:
        try:
            frame, _ = recv_frame(s)
        except (ConnectionClosed, ProtocolError, OSError) as e:
            print(
                f"wcache run: the template stopped before reporting child {child}'s end "
                f"({e}); the child may still run, unsupervised (it is in its own session: "
                f"`kill -- -{child}` stops it and what it started)",
                file=sys.stderr,
            )
            return LOST_EXIT
        if frame.get("op") == "exit" and isinstance(frame.get("exitcode"), int):
            s.close()
            return frame["exitcode"]


def run_command(
    argv: list[str], socket_dir: str | None = None, *, fallback: bool = True, verbose: bool = False
) -> int:
    """``wcache run -- argv``: run ``argv`` in a child of the template, else directly.

    Returns:
        The command's exit code; this process is killed by the same signal when
        the command was. With a fallback this process execs ``argv`` (never returns).
    """
    if not argv:
        print(
            "wcache run: give the command after --, e.g. `wcache run -- python script.py`",
            file=sys.stderr,
        )
        return 2
    # blocked from the request on: the child may run before the reply names it, and a
    # signal then must wait for the forwarding handlers (_relay), not kill this process
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        try:
            s, child = _request(argv, socket_dir)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a direct run gets the mask it had
            raise
    # StoreError: the socket dir or socket is unsafe (a symlink, group/world access, not
    # a socket: UnsafePath) or the peer is another user's (PeerRefused); the template
    # is as unusable as a missing one, so the command runs directly all the same.
    except (TemplateError, StoreError) as exc:
        if not fallback:
            print(f"wcache run: error [{exc.code}]: {exc}", file=sys.stderr)
            return REFUSED_EXIT
        print(f"wcache run: running directly [{exc.code}]: {exc}", file=sys.stderr, flush=True)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:  # as a shell: 127 not found, 126 not executable
            print(f"wcache run: {argv[0]}: {e.strerror}", file=sys.stderr)
            return 127 if e.errno == errno.ENOENT else 126
    if verbose:
        print(f"wcache run: template child {child} runs {argv[0]}", file=sys.stderr, flush=True)
    return _die_like(_relay(s, child, mask))


# ---------------------------------------------------------------------- template lifecycle


def template_status(socket_dir: str | None = None) -> dict[str, Any]:
    """The running template's status.

    Raises:
        TemplateMissing: none answers.
    """
    return _ask(socket_dir, {"op": "status"})


def start_template(
    socket_dir: str | None = None,
    preload: list[str] | None = None,
    platform_preload: bool = True,
    timeout_s: float = DEFAULT_START_TIMEOUT_S,
    foreground: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start the template in the background (its own session, output in
    ``template.log`` beside its socket) and return its ready record once it listens.
    With ``foreground`` this process becomes the template (never returns). ``env``
    is its environment (default this process's): the import-time variables of the
    commands it will run must equal it (docs/template.md, Staleness).

    Raises:
        TemplateStartFailed: it exited or did not listen within ``timeout_s``
            (the message holds its reason, which it also reports on a pipe in case
            its log cannot be written, and its log's tail), or its log cannot be
            opened; the code is the template's own where it gave one.
    """
    d = paths.ensure_socket_dir(socket_dir)
    # no -P, whose sys.flags.safe_path every child would keep and replay into its
    # subprocesses: wcache/template/__main__.py drops the cwd -m puts on sys.path
    cmd = [sys.executable, "-m", "wcache.template", "--socket-dir", d]
    for mod in preload or ():
        cmd += ["--preload", mod]
    if not platform_preload:
        cmd.append("--no-platform-preload")
    if foreground:
        if env is not None:
            os.execve(sys.executable, cmd, env)
        os.execv(sys.executable, cmd)
    log_path = os.path.join(d, LOG_NAME)
    try:
        fd = os.open(
            log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, paths.FILE_MODE
        )
    except OSError as exc:
        raise TemplateStartFailed(f"cannot open the template's log {log_path}: {exc}") from None
    # the template's ready or failure record also comes on this pipe: a full disk can
    # leave its log empty (break pass 11 #6)
    status_r, status_w = os.pipe()
    try:
        with os.fdopen(fd, "ab") as logf:
            offset = logf.tell()
            proc = subprocess.Popen(
                [*cmd, "--status-fd", str(status_w)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                cwd="/",
                close_fds=True,
                pass_fds=(status_w,),
                env=env,
            )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    try:
        return _wait_ready(proc, d, log_path, offset, status_r, timeout_s)
    finally:
        os.close(status_r)


def _wait_ready(
    proc: subprocess.Popen[bytes],
    d: str,
    log_path: str,
    offset: int,
    status_r: int,
    timeout_s: float,
) -> dict[str, Any]:
    """:func:`start_template`'s wait: the template's status once it listens.

    Raises:
        TemplateStartFailed: it exited or did not listen within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while time.monotonic() < deadline:
        rc = proc.poll()
        try:
            st = template_status(d)
            if st.get("pid") == proc.pid:
                return st
        except TemplateError:
            pass
        if rc is not None:
            break
        time.sleep(POLL_S)
    else:
        timed_out = True  # killed below: its -9 is ours, not the reason
        proc.kill()
        proc.wait()
    with open(log_path, "rb") as f:
        f.seek(offset)
        tail = f.read().decode("utf-8", "replace").splitlines()[-20:]
    os.set_blocking(status_r, False)
    try:
        reported = os.read(status_r, STATUS_MAX_BYTES).decode("utf-8", "replace")
    except BlockingIOError:  # killed by the timeout, or died before reporting
        reported = ""
    record = _last_record(reported.splitlines()) or _last_record(tail)
    reason = record.get("message")
    if not reason and not tail:
        reason = _no_space(d)
    # the record's message is said once, above the log's other lines
    rest = [ln for ln in tail if not ln.startswith("{")] if reason else tail
    raise TemplateStartFailed(
        f"the template (pid {proc.pid}) "
        + (
            f"did not listen within {timeout_s:g} s (--timeout) and was killed"
            if timed_out
            else f"exited with {proc.returncode}"
        )
        + (f": {str(reason).rstrip('.')}" if reason else "")
        + (f"; its log {log_path} ends:\n" + "\n".join(rest) if rest else f" (log: {log_path})"),
        # the template's own reason code where it gave one (template-preload-failed, ...)
        code=str(record.get("code") or TemplateStartFailed.code),
    )


def _no_space(d: str) -> str | None:
    """Why a template that reported nothing and left an empty log may have failed:
    ``d``'s filesystem is full, or None."""
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    if st.f_bavail == 0 or st.f_favail == 0:
        return f"the filesystem of {d} is full (no space or inodes left), so its log is empty"
    return None


def _last_record(lines: list[str]) -> dict[str, Any]:
    """The last JSON object line among ``lines`` (the template's ready or failure
    record), or ``{}``."""
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                return record
    return {}


def stop_template(socket_dir: str | None = None, wait_s: float = STOP_WAIT_S) -> dict[str, Any]:
    """Ask the template to stop: it stops accepting at once and exits once its
    running children have exited (they keep serving their clients).

    Raises:
        TemplateMissing: none answers.
    """
    reply = _ask(socket_dir, {"op": "stop"})
    pid = reply.get("pid")
    if isinstance(pid, int) and not reply.get("children"):
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and paths.process_start_time(pid) is not None:
            time.sleep(POLL_S)
    return reply


def stale_fields(st: dict[str, Any]) -> tuple[str, ...]:
    """What a ``wcache run`` from this process's environment (its interpreter) would be
    refused ``template-stale`` for by the template whose status is ``st``: the fields
    that differ, in the words of the refusal; empty when none."""
    fp = st.get("fingerprint", {})
    if not fp:
        return ()
    return versions.stale_fields(
        fp,
        st.get("changed_packages") or [],
        versions.interpreter_identity(sys.executable),
        os.environ,
        versions.own_wcache_stamp(),
    )


def format_status(st: dict[str, Any]) -> str:
    """``wcache template status``'s text."""
    fp = st.get("fingerprint", {})
    pk = fp.get("packages", {})
    lines = [
        f"template pid {st['pid']} on {st['socket']}: up {st['uptime_s']} s, imported "
        f"{st['modules']} modules in {st['import_s']} s, RSS {st['rss_kib'] / 1024:.0f} MiB, "
        f"threads {st['threads']['os']} (after imports {st['threads']['baseline']}), "
        f"CUDA initialised: {st['cuda_initialized']}"
        + (" [stopping]" if st.get("stopping") else ""),
        "  versions: "
        + ", ".join(f"{n} {p.get('version')}" for n, p in pk.items())
        + f", python {fp.get('python', {}).get('version', '').split()[0]}",
    ]
    times = st.get("import_times_s") or {}
    if times:
        slowest = sorted(times.items(), key=lambda kv: -kv[1])[:SLOWEST_PRELOADS]
        lines.append(
            f"  slowest preloads ({len(slowest)} of {len(times)}; --json lists each): "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in slowest)
        )
    if st.get("skipped"):
        lines.append(
            "  preloads skipped: " + "; ".join(f"{k} ({v})" for k, v in st["skipped"].items())
        )
    # what a `wcache run` from this environment would be refused for (its interpreter:
    # this one), in the words of its refusal
    stale = stale_fields(st)
    if stale:
        lines.append(
            f"  STALE [template-stale]: {versions.stale_reason(stale, 'this environment')}; "
            f"until then every `wcache run` from here runs directly"
        )
    for c in st.get("children", []):
        lines.append(f"  child {c['pid']} running {c['running_s']} s: {' '.join(c['argv'])}")
    return "\n".join(lines)
