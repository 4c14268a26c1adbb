"""Per-user socket directory, socket naming, the per-device lock and the pid
file that tells a live daemon from a stale socket.

Layout in the socket dir (0700, owned by the user)::

    wcache-<device_id>.sock        the daemon's Unix socket (0600)
    wcache-<device_id>.sock.lock   exclusive flock held for the daemon's lifetime
    wcache-<device_id>.sock.pid    JSON {"pid", "start_time"} of the socket's owner

A socket is judged by its owner, never by its existence: it is replaced only
when the pid in the pid file is dead or now belongs to another process (its
start time, field 22 of /proc/<pid>/stat, differs), or, without a pid file,
when nothing accepts connections on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import tempfile
from typing import TypeGuard

from wcache.store.errors import DaemonBusy, ShmTooSmall, StoreError, UnsafePath

__all__ = [
    "default_socket_dir",
    "ensure_socket_dir",
    "socket_path",
    "lock_path",
    "pid_path",
    "check_socket_file",
    "process_start_time",
    "proc_stat_fields",
    "read_pid_file",
    "claim_socket_path",
    "write_pid_file",
    "owner_alive",
    "acquire_device_lock",
    "socket_accepts",
    "default_device_id",
    "list_sockets",
    "registry_dir",
    "register_daemon",
    "unregister_daemon",
    "registered_daemons",
    "parse_device",
    "cuda_device_uuid",
    "SOCKET_PREFIX",
    "SOCKET_SUFFIX",
    "check_dev_shm",
    "DEV_SHM",
    "DEV_SHM_COLLECTIVES_BYTES",
    "DEV_SHM_REFCOUNT_BYTES",
]

# A sun_path holds 108 bytes including the terminating NUL (Linux <sys/un.h>).
MAX_SOCKET_PATH_BYTES = 107
SOCKET_PREFIX = "wcache-"
SOCKET_SUFFIX = ".sock"
DIR_MODE = 0o700
FILE_MODE = 0o600
#: The name start of :func:`ensure_socket_dir`'s write probe (removed at once).
PROBE_PREFIX = ".wcache-probe-"
# Group/other bits that would let another user replace or read our files.
_FOREIGN_BITS = stat.S_IRWXG | stat.S_IRWXO
_DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Connecting to probe a pid-less socket: a live daemon accepts at once.
PROBE_TIMEOUT_S = 1.0
DEV_SHM = "/dev/shm"
#: Free /dev/shm that collectives wcache starts need (bytes): NCCL's SHM transport
#: and proxies extend segments of ~9 MiB per peer and channel there, and vLLM's
#: CPU shared-memory all-reduce (TP/PP groups on CPU) maps buffers per rank and
#: thread; Docker's default 64 MiB /dev/shm is what the public "No space left on
#: device" / SIGBUS reports run into, so twice that is asked for.
DEV_SHM_COLLECTIVES_BYTES = 128 << 20
#: Free /dev/shm that torch's CUDA IPC ref-counter files need (bytes): one small
#: file per exported storage; a full or zero-sized /dev/shm is what fails.
DEV_SHM_REFCOUNT_BYTES = 1 << 20


def _usable_runtime_dir(path: str | None) -> TypeGuard[str]:
    """An ``$XDG_RUNTIME_DIR`` we may use: an existing directory of ours that we
    can write to (tmp cleaners do not age it; the session owns it)."""
    if not path or not os.path.isabs(path):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and os.access(path, os.W_OK | os.X_OK)
    )


def default_socket_dir() -> str:
    """``$XDG_RUNTIME_DIR/wcache`` when that runtime dir is set and usable (ours,
    writable), else ``/tmp/wcache-<uid>`` (which tmp cleaners may empty: the
    daemon re-binds a vanished socket, and the registry below still lists it)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if _usable_runtime_dir(runtime):
        return os.path.join(runtime, "wcache")
    return f"/tmp/wcache-{os.getuid()}"


def resolve_socket_dir(socket_dir: str | None) -> str:
    """The absolute socket dir: ``socket_dir``, or :func:`default_socket_dir` when None.
    Every socket path and every listing of a socket dir starts here."""
    return os.path.abspath(socket_dir or default_socket_dir())


def registry_dir() -> str:
    """Where every live daemon of this user records itself, whatever its socket
    dir: ``$XDG_RUNTIME_DIR/wcache-daemons`` when usable, else
    ``$XDG_STATE_HOME/wcache/daemons`` (default ``~/.local/state``), never /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if _usable_runtime_dir(runtime):
        return os.path.join(runtime, "wcache-daemons")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "wcache", "daemons")


def _registry_file(pid: int, device_id: str) -> str:
    return os.path.join(registry_dir(), f"{pid}-{device_id}.json")


def register_daemon(sock: str, device_id: str) -> str:
    """Record this process as the daemon of ``sock`` in :func:`registry_dir`;
    returns the record's path (remove it with :func:`unregister_daemon`)."""
    ensure_socket_dir(registry_dir())
    path = _registry_file(os.getpid(), device_id)
    rec = {
        "pid": os.getpid(),
        "start_time": process_start_time(os.getpid()),
        "socket": sock,
        "device_id": device_id,
    }
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)
    return path


def unregister_daemon(path: str) -> None:
    """Remove a record written by :func:`register_daemon` (no error when gone)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def registered_daemons() -> list[dict]:
    """Records of this user's live daemons (pid alive with the recorded start
    time); records of dead daemons are removed."""
    d = registry_dir()
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        rec = read_pid_file(path)
        if rec is None or not isinstance(rec.get("socket"), str):
            continue
        if owner_alive(rec):
            out.append(rec)
        else:
            unregister_daemon(path)
    return out


def default_device_id(device: str = "cpu", index: int | None = None) -> str:
    """The device id used when a caller gives none: ``"cpu"``, or the GPU's UUID
    (``"GPU-<uuid>"``) for CUDA, so two GPUs never share a socket."""
    if device == "cpu":
        return "cpu"
    return cuda_device_uuid(cuda_index(index))


def cuda_index(index: int | None) -> int:
    """``index``, or the current CUDA device's index when it is None (``"cuda"``)."""
    if index is not None:
        return index
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    return torch.cuda.current_device()


def _unreadable(path: str, what: str, exc: OSError) -> UnsafePath:
    """The refusal of a path this user may not even inspect (another user's)."""
    return UnsafePath(
        f"{what} {path} cannot be inspected ({exc.strerror}): it belongs to another "
        f"user. Use a socket dir of your own (socket_dir=... / --socket-dir), or "
        f"run as the daemon's user."
    )


def _check_owned(st: os.stat_result, path: str, what: str) -> None:
    if st.st_uid != os.getuid():
        raise UnsafePath(
            f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
            "refusing it. Use a socket dir of your own (socket_dir=...)."
        )


def ensure_socket_dir(path: str | None = None, *, create: bool = True) -> str:
    """Return a safe socket dir: a real directory (not a symlink), owned by the
    current user, with no group/other permission bits. Creates it 0700 (and its
    parents) when missing and ``create`` is true; with ``create`` (a daemon or
    template that will make its socket, lock and log there) it must also be
    writable, checked now rather than after a model's load.

    Raises:
        UnsafePath: symlink, foreign owner, not a directory, or group/other bits;
            a path that cannot be inspected (permission denied, a file on its
            path) or created, or (``create``) a directory this process cannot
            write (a read-only mount); each names the cause and a fix.
        FileNotFoundError: the dir is missing and ``create`` is false.
    """
    path = resolve_socket_dir(path)
    try:
        st = os.lstat(path)
    except PermissionError as e:
        raise _unreadable(path, "socket dir", e) from None
    except FileNotFoundError:
        if not create:
            raise
        st = _make_socket_dir(path)
    except NotADirectoryError:
        raise UnsafePath(
            f"socket dir {path}: a component of the path is a file, not a directory. {_other_dir()}"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(
            f"socket dir {path} is a symlink; refusing it. Remove it or pass a real directory."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"socket dir {path} is not a directory. {_other_dir()}")
    _check_owned(st, path, "socket dir")
    if st.st_mode & _FOREIGN_BITS:
        raise UnsafePath(
            f"socket dir {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0700. "
            + _mode_fix(path)
        )
    if create:
        _probe_writable(path)
    return path


def _probe_writable(path: str) -> None:
    """Create, write and remove a small file in the socket dir ``path``: what the
    daemon's socket, lock and pid files need, checked before any load. A mode check
    alone passes a read-only mount's directory to root, and a full file system's
    (its pid file's write failed there, after the model's load: break13 #1).

    Raises:
        UnsafePath: the file cannot be created (the errno's reason) with the fix.
    """
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=path)
        try:
            os.write(fd, b"{}\n" * 32)  # a pid file's size: a full file system fails here
        finally:
            os.close(fd)
    except OSError as e:
        raise UnsafePath(
            f"socket dir {path} is not writable by this process ({e.strerror}): the "
            f"daemon's socket, lock and pid files go there. {_other_dir()}"
        ) from None
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)


def _other_dir() -> str:
    """The fix for a socket dir that cannot be used at all."""
    return (
        f"Fix: pass a --socket-dir (socket_dir=...) you can create and write, or none "
        f"for the default, {default_socket_dir()}."
    )


def _make_socket_dir(path: str) -> os.stat_result:
    """Create the missing socket dir ``path`` 0700 (its parents with the umask's
    mode) and stat it.

    Raises:
        UnsafePath: it cannot be created (the errno's reason, e.g. a read-only file
            system, permission denied, a file on its path, ``/proc`` or ``/sys``).
    """
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
        return os.lstat(path)
    except OSError as e:
        raise UnsafePath(
            f"socket dir {path} cannot be created ({e.strerror}). {_other_dir()}"
        ) from None


def _wcache_own_dir(path: str) -> bool:
    """Whether ``path`` looks like a directory for wcache alone: the default socket
    dir, or one holding nothing but wcache's own files (sockets, their lock and pid
    files, the template's socket and log), or nothing."""
    if path == resolve_socket_dir(None):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(n.startswith((SOCKET_PREFIX, "template.", PROBE_PREFIX)) for n in names)


def _mode_fix(path: str) -> str:
    """The fix for a socket dir open to group/other: ``chmod 700`` for a directory of
    wcache's own; for any other (``/etc``, ``/tmp``, a home directory), whose mode
    other programs and users rely on, a private directory instead."""
    if _wcache_own_dir(path):
        return f"Fix: chmod 700 {path}."
    return (
        f"{path} holds other files, so its mode is not wcache's to change: give a "
        f"private directory of wcache's own instead (`mkdir -m 700 DIR`, then "
        f"--socket-dir DIR / socket_dir=DIR), or leave the option out for the default, "
        f"{resolve_socket_dir(None)}, which wcache makes with mode 700."
    )


def socket_path(socket_dir: str | None, device_id: str) -> str:
    """The socket of the daemon for one physical device.

    Args:
        socket_dir: the per-user dir (None: :func:`default_socket_dir`).
        device_id: e.g. ``"cpu-rank0-<jobdigest>"`` or a GPU UUID string;
            letters, digits, ``.``, ``_``, ``-``, at most 64 characters.

    Raises:
        StoreError: a bad device id, or a path longer than a sun_path holds.
    """
    if not isinstance(device_id, str) or not _DEVICE_ID_RE.match(device_id):
        raise StoreError(f"device id {device_id!r} must match {_DEVICE_ID_RE.pattern}")
    path = os.path.join(
        resolve_socket_dir(socket_dir), f"{SOCKET_PREFIX}{device_id}{SOCKET_SUFFIX}"
    )
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise StoreError(
            f"socket path {path} exceeds {MAX_SOCKET_PATH_BYTES} bytes; "
            "use a shorter socket_dir or device id."
        )
    return path


def lock_path(sock: str) -> str:
    return sock + ".lock"


def pid_path(sock: str) -> str:
    return sock + ".pid"


def list_sockets(socket_dir: str) -> list[str]:
    """Socket paths (wcache-*.sock) in a socket dir, sorted."""
    try:
        names = os.listdir(socket_dir)
    except FileNotFoundError:
        return []
    except PermissionError as e:
        raise _unreadable(socket_dir, "socket dir", e) from None
    return sorted(
        os.path.join(socket_dir, n)
        for n in names
        if n.startswith(SOCKET_PREFIX) and n.endswith(SOCKET_SUFFIX)
    )


def check_socket_file(path: str) -> None:
    """Refuse a socket path that is a symlink, not a socket, or foreign-owned.

    Raises:
        FileNotFoundError: nothing there.
        UnsafePath: symlink, not a socket, or another user's.
    """
    try:
        st = os.lstat(path)
    except PermissionError as e:
        raise _unreadable(path, "socket", e) from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"socket {path} is a symlink; refusing it.")
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePath(f"{path} is not a socket; refusing it.")
    _check_owned(st, path, "socket")


def proc_stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from field 3 (state) on, so proc(5)'s field
    N is item ``N - 3``; None when the process is gone or its file unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and parentheses; the fields after it follow the last ')'.
    return data[data.rindex(b")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of
    /proc/<pid>/stat), or None when the process does not exist (or is a zombie)."""
    rest = proc_stat_fields(pid)
    if rest is None or rest[0] == b"Z":  # field 3: state; a zombie is dead for our purposes
        return None
    return int(rest[22 - 3])


def write_pid_file(path: str, pid: int | None = None) -> None:
    """Atomically write the owner record (pid, start time) next to a socket."""
    pid = os.getpid() if pid is None else pid
    rec = {"pid": pid, "start_time": process_start_time(pid)}
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
    except BaseException:
        # a full disk fails the write or the close: leave no *.pid.PID.tmp behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_pid_file(path: str) -> dict | None:
    """The owner record, or None when missing or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(fd, "r") as f:
            fd = -1
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if not (
        isinstance(rec, dict)
        and isinstance(rec.get("pid"), int)
        and isinstance(rec.get("start_time"), (int, type(None)))
    ):
        return None
    return rec


def owner_alive(rec: dict | None) -> bool:
    """True when the recorded process still runs (same pid, same start time)."""
    if rec is None:
        return False
    start = process_start_time(rec["pid"])
    return start is not None and start == rec["start_time"]


def socket_accepts(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when something accepts a connection on the socket (a live listener)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        return True
    except TimeoutError:
        return True  # a listener with a full backlog is alive
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        s.close()


def acquire_device_lock(
    sock: str, *, holder: str = "a daemon", stop_with: str = "wcache stop"
) -> int:
    """Take the exclusive, non-blocking flock on ``<sock>.lock``; return its fd.

    The kernel drops the lock when the holder dies, so a dead daemon never
    blocks a new one. The caller keeps the fd open for its lifetime.

    Args:
        holder: what holds such a lock (``"a daemon"``, ``"a template"``), and
        stop_with: the command that stops it, both for the DaemonBusy message.

    Raises:
        DaemonBusy: another process holds the lock (names its pid when known).
        UnsafePath: the lock file is a symlink or another user's.
    """
    path = lock_path(sock)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"lock file {path} is a symlink; refusing it.") from e
        raise
    try:
        st = os.fstat(fd)
        _check_owned(st, path, "lock file")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"lock file {path} is not a regular file.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            rec = read_pid_file(pid_path(sock))
            who = f"pid {rec['pid']}" if rec else "another process"
            raise DaemonBusy(
                f"{holder} ({who}) already serves {sock}; stop it with "
                f"`{stop_with}` before starting another"
            ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def claim_socket_path(sock: str) -> None:
    """Make ``sock`` free for binding, with the device lock already held.

    An existing socket is removed only when its owner is dead: the pid file's
    process is gone or has another start time; without a pid file, when nothing
    accepts connections on it.

    Raises:
        DaemonBusy: the socket's owner still runs.
        UnsafePath: the path is a symlink, not a socket, or another user's.
    """
    try:
        check_socket_file(sock)
    except FileNotFoundError:
        return
    rec = read_pid_file(pid_path(sock))
    if rec is not None:
        if owner_alive(rec):
            raise DaemonBusy(f"socket {sock} belongs to live pid {rec['pid']}; stop it first.")
    elif socket_accepts(sock):
        raise DaemonBusy(
            f"socket {sock} has no pid file but accepts connections; stop its owner first."
        )
    os.unlink(sock)


def parse_device(device: str) -> tuple[str, int | None]:
    """``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", None); ``"cuda:1"`` -> ("cuda", 1).

    Raises:
        StoreError: any other device string.
    """
    kind, _, index = str(device).partition(":")
    if kind == "cpu" and not index:
        return "cpu", None
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index) if index else None
    raise StoreError(f"device {device!r} is not 'cpu', 'cuda' or 'cuda:<index>'")


def cuda_device_uuid(index: int) -> str:
    """``"GPU-<uuid>"`` of a local CUDA device index."""
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def check_dev_shm(need_bytes: int, purpose: str, path: str = DEV_SHM) -> int:
    """Refuse to start ``purpose`` when ``path`` (``/dev/shm``) has less than
    ``need_bytes`` free, before any work.

    Args:
        need_bytes: free bytes ``purpose`` needs there.
        purpose: what needs it (named in the message), e.g. ``"seeding over NCCL"``.
        path: the shared-memory filesystem (tests pass another).

    Returns:
        The free bytes found.

    Raises:
        ShmTooSmall: missing, not inspectable, or too small; names the sizes and
            the fix (``docker run --shm-size=1g`` / ``--ipc=host``, a Kubernetes
            ``emptyDir: {medium: Memory}`` on /dev/shm).
    """
    fix = (
        f"give the container a larger {path} (docker run --shm-size=1g or --ipc=host; "
        f"Kubernetes: an emptyDir with medium: Memory mounted on {path})"
    )
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise ShmTooSmall(
            f"{purpose} needs {path}, which cannot be used ({e.strerror}); {fix}"
        ) from None
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise ShmTooSmall(
            f"{purpose} needs {need_bytes / 2**20:.0f} MiB free in {path}, which "
            f"has {free / 2**20:.1f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.1f}"
            f" MiB; {fix}"
        )
    return free
