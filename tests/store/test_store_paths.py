"""Socket naming, socket dir defaults, process identity and the device lock."""

import errno
import os
import subprocess
import sys

import pytest

from wcache.store import DaemonBusy, StoreError, default_socket_dir, paths, socket_path


def test_socket_path_per_device_id():
    """Each device id gets its own socket name in the dir."""
    assert "/d/wcache-cpu-rank0-ab12.sock" == socket_path("/d", "cpu-rank0-ab12")
    assert "/d/wcache-GPU-8a1e2f3c-0000-1111-2222-333344445555.sock" == socket_path(
        "/d", "GPU-8a1e2f3c-0000-1111-2222-333344445555"
    )


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a b", "-lead", "x" * 65, None])
def test_socket_path_refuses_bad_device_ids(bad):
    """Device ids that could escape the dir or are empty/too long are refused."""
    with pytest.raises(StoreError):
        socket_path("/d", bad)


def test_socket_path_refuses_paths_longer_than_sun_path():
    """A path that would not fit a sun_path is refused with advice instead of failing at bind."""
    with pytest.raises(StoreError, match="exceeds"):
        socket_path("/" + "d" * 100, "cpu")


def test_default_socket_dir(monkeypatch, tmp_path):
    """$XDG_RUNTIME_DIR/wcache when the runtime dir exists, else /tmp/wcache-<uid>."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert str(tmp_path / "wcache") == default_socket_dir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert f"/tmp/wcache-{os.getuid()}" == default_socket_dir()


def test_ensure_socket_dir_creates_0700(tmp_path):
    """A missing socket dir is created with mode 0700."""
    d = paths.ensure_socket_dir(str(tmp_path / "a" / "wcache"))
    assert 0o700 == os.stat(d).st_mode & 0o777


@pytest.mark.parametrize(
    ("files", "advice"),
    [
        ([], "chmod 700"),
        (["wcache-cpu-tp0of1-pp0of1-ab.sock.pid", "template.log"], "chmod 700"),
        (["passwd", "hosts"], "holds other files, so its mode is not wcache's to change"),
    ],
)
def test_an_open_socket_dir_gets_chmod_only_when_it_is_wcaches_own(tmp_path, files, advice):
    """A socket dir open to group/other is refused; the fix is `chmod 700` for a
    directory of wcache's own (empty, or only wcache's files), and a private directory
    of its own for any other (`--socket-dir /etc` was told "chmod 700 /etc")."""
    d = tmp_path / "d"
    d.mkdir()
    for name in files:
        (d / name).write_text("")
    d.chmod(0o755)
    with pytest.raises(paths.UnsafePath) as info:
        paths.ensure_socket_dir(str(d), create=False)
    assert f"socket dir {d} has mode 755; it must be 0700." in str(info.value)
    assert advice in str(info.value)
    assert ("chmod" in str(info.value)) == (advice == "chmod 700")
    if advice != "chmod 700":
        assert "`mkdir -m 700 DIR`, then --socket-dir DIR / socket_dir=DIR" in str(info.value)


def test_process_start_time_tells_pid_reuse():
    """Start time is stable for a live process, None once it is reaped; owner_alive follows it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t = paths.process_start_time(child.pid)
        assert t is not None and t == paths.process_start_time(child.pid)
        assert paths.owner_alive({"pid": child.pid, "start_time": t})
        assert not paths.owner_alive({"pid": child.pid, "start_time": t + 1})
    finally:
        child.kill()
        child.wait()
    assert paths.process_start_time(child.pid) is None
    assert not paths.owner_alive({"pid": child.pid, "start_time": t})


def test_device_lock_is_exclusive_and_freed_by_close(tmp_path):
    """A second lock on the same socket raises DaemonBusy; after the holder closes, it succeeds."""
    sock = str(tmp_path / "wcache-cpu.sock")
    fd = paths.acquire_device_lock(sock)
    with pytest.raises(DaemonBusy):
        paths.acquire_device_lock(sock)
    os.close(fd)
    os.close(paths.acquire_device_lock(sock))


def test_parse_device():
    """cpu, cuda and cuda:<i> parse; anything else is refused."""
    assert [("cpu", None), ("cuda", None), ("cuda", 3)] == [
        paths.parse_device(d) for d in ("cpu", "cuda", "cuda:3")
    ]
    with pytest.raises(StoreError):
        paths.parse_device("cuda:x")


def test_a_pid_file_that_cannot_be_written_leaves_no_tmp_file(tmp_path, monkeypatch):
    """A full disk fails the pid file's write: the error goes up and its
    ``*.pid.PID.tmp`` is removed (it stayed, beside later starts: break pass 11 #6)."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(paths.json, "dump", full)
    target = paths.pid_path(str(tmp_path / "x.sock"))
    with pytest.raises(OSError) as info:
        paths.write_pid_file(target)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(
    "make, creates, said",
    [
        (lambda t: str(t / "afile" / "sock"), (True, False), "a component of the path is a file"),
        (lambda t: "/proc/wcache-test-sock", (True,), "cannot be created ("),
        (lambda t: str(t / "afile"), (True, False), "is not a directory"),
    ],
    ids=["file-on-path", "proc", "a-file"],
)
def test_a_socket_dir_that_cannot_be_made_is_refused_with_a_fix(tmp_path, make, creates, said):
    """A file on the path, a directory /proc cannot hold or a file in its place is
    unsafe-path naming the cause and a fix (was an OSError traceback: break12 #1)."""
    (tmp_path / "afile").write_text("")
    for create in creates:
        with pytest.raises(paths.UnsafePath) as info:
            paths.ensure_socket_dir(make(tmp_path), create=create)
        assert said in str(info.value)
        assert "Fix: pass a --socket-dir (socket_dir=...) you can create and write" in str(
            info.value
        )


@pytest.mark.parametrize(
    ("mount", "said"),
    [
        # a read-only mount: root's mode checks pass it (break12 #2)
        ("mount --bind {d} {d} && mount -o remount,ro,bind {d}", "(Read-only file system)"),
        # a full file system: the dir's mkdir passes, a new entry does not (break13 #1)
        (
            "mount -t tmpfs -o size=16k tmpfs {d} && "
            "(dd if=/dev/zero of={d}/fill bs=4k count=100 2>/dev/null; true) && mkdir -m 700 {d}/s",
            "(No space left on device)",
        ),
    ],
    ids=["read-only", "full"],
)
def test_a_socket_dir_that_takes_no_file_is_refused_before_a_load(tmp_path, mount, said):
    """A socket dir on a read-only mount or a full file system is refused at once by a
    caller that will write there (a daemon found it only after the model's load, as
    load-failed or a bind error); a reader (create=False) may still use it."""
    d = tmp_path / "m"
    d.mkdir(mode=0o700)
    sock_dir = d / "s" if "tmpfs" in mount else d
    probe = (
        "import sys; from wcache.store import paths\n"
        "print(paths.ensure_socket_dir(sys.argv[1], create=False))\n"
        "try:\n"
        "    paths.ensure_socket_dir(sys.argv[1])\n"
        "except paths.UnsafePath as e:\n"
        "    print(e.code, e)\n"
    )
    r = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'{mount.format(d=d)} && exec "$0" -c "$1" {sock_dir}',
            sys.executable,
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0 and ("unshare" in r.stderr or "mount" in r.stderr):
        pytest.skip(f"no private mount here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(sock_dir)
    assert lines[1].startswith(f"unsafe-path socket dir {sock_dir} is not writable by this process")
    assert said in lines[1]
