"""The stack sampler of `wcache bench --phases --stack-samples` and its reader, on real
Python processes: a parent, a forked child and a spawned one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from wcache.benchmarks import stacks
from wcache.benchmarks.bench_phases import STACK_SAMPLER_DIR

PROGRAM = textwrap.dedent("""
    import multiprocessing as mp, os, time

    def spin(seconds):
        t = time.time()
        while time.time() - t < seconds:
            sum(range(1000))

    def in_the_child():
        spin(0.6)

    def in_the_spawned():
        spin(0.6)

    if __name__ == "__main__":
        spin(0.6)
        pid = os.fork()
        if pid == 0:
            in_the_child()
            os._exit(0)
        os.waitpid(pid, 0)
        p = mp.get_context("spawn").Process(target=in_the_spawned)
        p.start()
        p.join()
""")


def test_every_process_samples_its_stacks_and_the_reader_attributes_them(tmp_path):
    """A parent, its forked child and a spawned process each write their own samples,
    and the reader puts each spin in its process."""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    prefix = tmp_path / "row.stacks"
    env = {
        **os.environ,
        "PYTHONPATH": f"{STACK_SAMPLER_DIR}{os.pathsep}{os.getcwd()}",
        "WCACHE_STACK_SAMPLES": str(prefix),
        "WCACHE_STACK_SAMPLE_S": "0.05",
    }
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120, cwd=tmp_path)
    procs = stacks.read_samples(str(prefix))
    by_function = {}
    for proc in procs:
        for key, seconds in stacks.hot_frames(proc, package=tmp_path.name):
            by_function.setdefault(key.rsplit(":", 1)[-1], []).append((proc.pid, seconds))
    # each of the three spins was seen, each in its own process
    assert {"spin"} <= set(by_function)
    pids = {pid for pid, _ in by_function["spin"]}
    assert len(pids) == 3, by_function
    assert all(seconds >= 0.1 for _, seconds in by_function["spin"])  # >= 2 samples each
    parent = procs[0]
    lines = stacks.timeline(parent, package=tmp_path.name)
    assert any("spin" in key for _a, _b, key in lines)
    assert stacks.main([str(prefix), "--package", tmp_path.name, "--timeline"]) == 0


def test_without_the_variable_nothing_is_sampled(tmp_path):
    """On PYTHONPATH without WCACHE_STACK_SAMPLES the sampler starts no thread (and with
    it, it does: the check can tell)."""
    code = (
        "import threading; print(any(t.name == 'wcache-stack-sampler' "
        "for t in threading.enumerate()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "WCACHE_STACK_SAMPLES"}
    env["PYTHONPATH"] = STACK_SAMPLER_DIR
    off = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        check=True,
        timeout=60,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    on = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        cwd=tmp_path,
        env={**env, "WCACHE_STACK_SAMPLES": str(tmp_path / "s")},
        capture_output=True,
        text=True,
    )
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


def test_the_shadowed_sitecustomize_still_runs(tmp_path):
    """The sitecustomize later on sys.path, which this one shadows, still runs."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    env = {**os.environ, "PYTHONPATH": f"{STACK_SAMPLER_DIR}{os.pathsep}{other}"}
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('SHADOWED_RAN'))"],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "1"


def test_reader_skips_cut_off_lines(tmp_path):
    """A sample cut off by the process's exit is dropped; the others are attributed."""
    path = tmp_path / "r.stacks.7"
    path.write_text(
        "# pid=7 ppid=1 start=100.0 interval=0.5 argv=['x']\n"
        "100.5 MainThread /a/vllm/x.py:3:f;/a/vllm/y.py:9:g\n"
        "101.0 MainThread /a/vllm/x.py:3:f;/a/vllm/y.py:9:g\n"
        "101.5 MainThread /a/vllm/x.py:3:f;/a/vl\n"
    )
    (proc,) = stacks.read_samples(str(tmp_path / "r.stacks"))
    assert len(proc.samples) == 2
    assert stacks.hot_frames(proc) == [("vllm/y.py:g", 1.0)]
    assert stacks.timeline(proc) == [(0.5, 1.0, "vllm/y.py:g < vllm/x.py:f")]
