"""The H200 harness scripts (tools/gpu) parse, and refuse bad use with a message,
on any machine (the GPU steps themselves run on the H200: docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"
SCRIPTS = sorted(TOOLS.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    """bash -n accepts every harness script."""
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_build_bundle_needs_a_version_and_its_pins(tmp_path):
    """build-bundle.sh without a version names the argument; with a version that has
    no pin list it says which file to write (before any download)."""
    script = str(TOOLS / "build-bundle.sh")
    none = subprocess.run(["bash", script], capture_output=True, text=True)
    assert none.returncode != 0 and "vLLM version" in none.stderr
    unknown = subprocess.run(
        ["bash", script, "9.9.9", str(tmp_path)], capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "deps-vllm-9.9.9.txt" in unknown.stderr


def test_device_setup_names_missing_chunks(tmp_path):
    """device-setup.sh on a machine that received no chunks says so and exits 2."""
    sha = tmp_path / "bundle.sha"
    sha.write_text("0" * 64 + "\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "WCACHE_GPU_SITE": str(tmp_path / "site"),
        "WCACHE_GPU_RECV": str(tmp_path / "recv"),
    }
    out = subprocess.run(
        ["bash", str(TOOLS / "device-setup.sh"), str(sha)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 2 and "no chunks" in out.stderr


def _bundle_site(tmp_path, versions=("0.32.0", "0.33.0")):
    site = tmp_path / "site"
    site.mkdir()
    (site / ".wcache-gpu-ready").write_text("".join(f"{v}\n" for v in versions))
    return site


def _source_env(site, version=None):
    env = {"PATH": "/usr/bin:/bin", "WCACHE_GPU_SITE": str(site)}
    if version:
        env["WCACHE_GPU_VLLM"] = version
    return subprocess.run(
        [
            "bash",
            "-c",
            f"source {TOOLS / 'env.sh'} || exit $?; echo "
            "$VLLM_USE_FLASHINFER_SAMPLER $NCCL_NVLS_ENABLE $WCACHE_GPU_VLLM "
            "$PYTHONPATH",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(site.parent),
    )  # $PWD: the checkout's place


def test_env_sets_what_the_bundle_needs(tmp_path):
    """env.sh turns off vLLM's FlashInfer sampler (the bundle has no FlashInfer: without
    it every engine failed at start on the H200), keeps NVLink multicast off, and puts
    the bundle's first vLLM version's tree on PYTHONPATH after the checkout."""
    site = _bundle_site(tmp_path)
    out = _source_env(site)
    assert out.stdout.split() == [
        "0",
        "0",
        "0.32.0",
        f"{tmp_path}:{tmp_path}/vllm-0.32.0:{site}:/tmp/wcache-dist",
    ]


def test_env_picks_the_asked_version_and_refuses_one_not_in_the_bundle(tmp_path):
    """WCACHE_GPU_VLLM picks a version the bundle holds; another, or no bundle at all, is
    refused naming what the bundle holds (exit 2), not left to a ModuleNotFoundError."""
    site = _bundle_site(tmp_path)
    assert _source_env(site, "0.33.0").stdout.split()[2:] == [
        "0.33.0",
        f"{tmp_path}:{tmp_path}/vllm-0.33.0:{site}:/tmp/wcache-dist",
    ]
    other = _source_env(site, "0.34.0")
    assert other.returncode == 2
    assert "vLLM 0.34.0 is not in the bundle (it holds: 0.32.0 0.33.0 )" in other.stderr
    missing = _source_env(tmp_path / "nothing")
    assert missing.returncode == 2 and "no vLLM bundle installed" in missing.stderr


def test_run_features_refuses_an_unknown_module_before_setup():
    """run-features.sh names the modules it knows and exits 2 on another one, before it
    needs the bundle."""
    out = subprocess.run(
        ["bash", str(TOOLS / "run-features.sh"), "spec", "eplb"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown module eplb (spec, sleep, lora, lora-tx)" in out.stderr


def test_poll_names_rows_not_restored_and_packs_the_run(tmp_path):
    """poll.sh lists each results row that is not `restored` with its reason and packs the
    run's folder (weights left out) into $OUT/run.tgz, so a poll brings the results back."""
    run = tmp_path / "gout"
    run.mkdir()
    rows = [
        {"case": "moe-a", "outcome": "restored"},
        {"case": "moe-b", "outcome": "failed", "reason": "verify exit 1"},
    ]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "model.safetensors").write_bytes(b"\0" * 64)
    (run / "phases.log").write_text(
        "wcache bench --phases: fresh-node (pair 1/3): starting\n"
        "wcache bench --phases: pair 1: disk-compiled-cold / fresh-node = 8.12x\n"
    )
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(run), "OUT": str(out)}
    res = subprocess.run(
        ["bash", str(TOOLS / "poll.sh"), "0"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "results.jsonl: 2 row(s)" in res.stdout
    assert "moe-b failed verify exit 1" in res.stdout and "moe-a" not in res.stdout
    assert "pair 1: disk-compiled-cold / fresh-node = 8.12x" in res.stdout
    with tarfile.open(out / "run.tgz") as tar:
        names = tar.getnames()
    assert "gout/results.jsonl" in names and "gout/model.safetensors" not in names


def test_poll_reports_at_once_when_the_pipeline_is_done(tmp_path):
    """A poll asked to wait 10 minutes returns as soon as pipe.log's last line says the
    pipeline is done (no device time held idle); a running pipeline is waited for."""
    run = tmp_path / "gout"
    run.mkdir()
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(run), "OUT": str(tmp_path / "out")}
    (run / "pipe.log").write_text("[pipe 20:03:13] stages: pairs=1\n[pipe 20:08:22] done\n")
    res = subprocess.run(
        ["bash", str(TOOLS / "poll.sh"), "600"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0 and "[pipe 20:08:22] done" in res.stdout
    (run / "pipe.log").write_text("[pipe 20:03:13] stages: pairs=1\n[pipe 20:03:26] pairs: start\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            ["bash", str(TOOLS / "poll.sh"), "600"], env=env, timeout=5, capture_output=True
        )


def _script_env(tmp_path, stub, out, **extra: str) -> dict[str, str]:
    """The environment of a tools/gpu script run here: the stubs in ``stub`` first on
    PATH, an installed bundle's marker (WCACHE_GPU_SITE, vLLM 0.33.0), OUT, and ``extra``."""
    return {
        "PATH": f"{stub}:/usr/bin:/bin",
        "WCACHE_GPU_SITE": str(_bundle_site(tmp_path, ("0.33.0",))),
        "OUT": str(out),
        "HOME": str(tmp_path),
        **extra,
    }


def test_poll_packs_the_run_while_it_waits(tmp_path):
    """While it waits on a running pipeline, poll.sh packs $OUT/run.tgz every
    POLL_PACK_S seconds: a call cut at the end of the device time (here: killed) still
    brings back what the run had written."""
    run, out = tmp_path / "gout", tmp_path / "out"
    run.mkdir()
    (run / "pipe.log").write_text("[pipe 20:03:13] stages: arch-all\n")
    (run / "arch-sweep-cuda.jsonl").write_text('{"case": "llama/bf16", "outcome": "restored"}\n')
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(run), "OUT": str(out), "POLL_PACK_S": "1"}
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            ["bash", str(TOOLS / "poll.sh"), "600"], env=env, timeout=6, capture_output=True
        )
    with tarfile.open(out / "run.tgz") as tar:
        assert "gout/arch-sweep-cuda.jsonl" in tar.getnames()


def test_run_features_parallel_runs_the_modules_side_by_side(tmp_path):
    """FEATURES_PARALLEL=1: every module's pytest starts before any ends, each with its
    own log, and the script waits for all; FIXTURE_FORMATS picks the fixtures it builds.
    python3 is a stub (a pytest call takes 2 s)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls.log"
    (stub / "python3").write_text(
        f'#!/bin/sh\necho "python3 $*" >> {calls}\n'
        'case "$*" in *"-m pytest"*) sleep 2; echo "1 passed";; esac\nexit 0\n'
    )
    (stub / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = _script_env(tmp_path, stub, out, FEATURES_PARALLEL="1", FIXTURE_FORMATS="bf16")
    res = subprocess.run(
        ["bash", str(TOOLS / "run-features.sh"), "spec", "lora-tx"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    # "[run-features] NAME: start HH:MM:SS" / "[run-features] NAME: exit 0 at HH:MM:SS"
    events = [
        ln.split(": ", 1)[1].split()[:2] for ln in (out / "features.log").read_text().splitlines()
    ]
    assert [e[0] for e in events] == ["start", "start", "exit", "exit"], events
    assert [e[1] for e in events[2:]] == ["0", "0"]
    assert "1 passed" in (out / "features-spec.log").read_text()
    assert "1 passed" in (out / "features-lora-transports.log").read_text()
    assert "python3 -m wcache.testing.fixtures --formats bf16\n" in calls.read_text()


def _run_pipeline(
    tmp_path,
    stages: str,
    gpu_name: str = "",
    env: dict[str, str] | None = None,
    slow_spec: bool = False,
) -> tuple[list[str], str]:
    """pipeline.sh STAGES with python3, nvidia-smi and pkill stubbed (nvidia-smi's
    `--query-gpu=name` answers ``gpu_name``; with ``slow_spec`` the stub takes 4 s over
    the speculative-decoding feature module) and ``env`` added, waited for until
    pipe.log says "done": pipe.log's messages and the stubs' calls."""
    import time

    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    calls = tmp_path / "calls.log"
    for name in ("python3", "nvidia-smi", "pkill"):
        answer = f'case "$*" in *query-gpu=name*) echo "{gpu_name}";; esac\n' if gpu_name else ""
        if slow_spec and name == "python3":
            answer += 'case "$*" in *test_spec_decode*) sleep 4;; esac\n'
        where = " [PYTHONPATH=$PYTHONPATH]" if name == "python3" else ""
        (stub / name).write_text(f'#!/bin/sh\necho "{name} $*{where}" >> {calls}\n{answer}exit 0\n')
        (stub / name).chmod(0o755)
    env = {
        "PATH": f"{stub}:/usr/bin:/bin",
        "WCACHE_GPU_SITE": str(_bundle_site(tmp_path, ("0.33.0",))),
        "WCACHE_PIPELINE_DIR": str(tmp_path / "wc"),
        "RUN_DIR": str(tmp_path / "gout"),
        "HOME": str(tmp_path),
        **(env or {}),
    }
    res = subprocess.run(
        ["bash", str(TOOLS / "pipeline.sh"), stages],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "started in the background" in res.stdout
    log = tmp_path / "gout" / "pipe.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "done" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    lines = [line.split("] ", 1)[1] for line in log.read_text().splitlines()]
    return lines, calls.read_text()


def test_pipeline_runs_its_stages_in_order_from_a_private_copy(tmp_path):
    """pipeline.sh copies the checkout, returns at once and runs the stages in the
    background in the order given (a side stage beside the next tier stage, the pairs
    alone after it), logging each stage's start and exit to pipe.log. python3,
    nvidia-smi and pkill are stubs here: the stages' commands are checked, not run."""
    import os

    lines, text = _run_pipeline(
        tmp_path, "features=spec:lora,moe-compiled,pairs=2,fresh-stacks,bogus"
    )
    wc, run = tmp_path / "wc", tmp_path / "gout"
    assert (wc / "tools" / "gpu" / "pipeline.sh").is_file() and not (wc / ".vx").exists()
    # the stubbed tier can end before the features script: then it is stopped, as designed
    steps = [
        s for s in lines if not s.startswith(("fixtures", "checkpoint ", "features still running"))
    ]
    assert steps[0] == (
        "stages: features=spec:lora,moe-compiled,pairs=2,fresh-stacks,bogus (vLLM 0.33.0)"
    )
    assert steps[1].startswith("features: started (session ") and steps[1].endswith(": spec lora")
    assert steps[2:5] == ["moe-compiled: start", "moe-compiled: exit 0", "pairs: start (2 pairs)"]
    assert steps[-5:] == [
        "pairs: exit 0",
        "fresh-stacks: start",
        "fresh-stacks: exit 0",
        "unknown stage bogus: skipped",
        "done",
    ]
    assert "checkpoint 8b exit 0" in lines  # written beside the first stage
    assert "--prime-only" not in text  # primed alone, by the pairs stage
    assert "-n 10 --dist load -k moe and compiled" in text
    assert "--rows disk-compiled-cold,fresh-node" in text and "--pairs 2" in text
    assert "--startup-plan" in text
    assert "--rows fresh-node --root" in text and "--stack-samples 0.1" in text
    assert os.path.isfile(run / "features-run.log")


def test_pipeline_wait_lets_the_features_outlive_the_tier_stages(tmp_path):
    """With `wait` in the list, a tier stage that ends before the feature modules no
    longer stops them: `wait` waits for them to end on their own. Without it the
    tier's end stops them (the default: no GPU held by features past their tier)."""
    lines, text = _run_pipeline(tmp_path / "a", "features=spec,dense,wait", slow_spec=True)
    steps = [s for s in lines if not s.startswith(("fixtures", "stages"))]
    assert steps[0].startswith("features: started (session ")
    assert steps[1:] == [
        "dense: start",
        "dense: exit 0",
        "wait: the side stages and features",
        "features: exit 0",
        "done",
    ]
    assert "test_spec_decode_engines.py" in text
    lines, _ = _run_pipeline(tmp_path / "b", "features=spec,dense", slow_spec=True)
    assert "features still running: stopped" in lines


def test_pipeline_builds_gemma3s_fixture_with_the_bundles_transformers(tmp_path):
    """The gemma3-270m stage builds the bf16 fixture first, with the bundle's own
    transformers first on PYTHONPATH (the image's 5.17 breaks Gemma 3's GGUF tokenizer),
    then its tier cases and its sweep rows."""
    lines, text = _run_pipeline(tmp_path, "gemma3-270m")
    steps = [s for s in lines if s.startswith("gemma3-270m")]
    assert steps == [
        "gemma3-270m fixture: start",
        "gemma3-270m fixture: exit 0",
        "gemma3-270m: start",
        "gemma3-270m: exit 0",
        "gemma3-270m sweep: start",
        "gemma3-270m sweep: exit 0",
    ]
    calls = text.splitlines()
    build = next(i for i, c in enumerate(calls) if "--model gemma3 --formats bf16" in c)
    tier = next(i for i, c in enumerate(calls) if "-k gemma3" in c)
    assert build < tier
    assert "[PYTHONPATH=" + str(tmp_path / "site-gguf-tokenizer") + ":" in calls[build]
    assert "site-gguf-tokenizer" not in calls[tier]  # the engines keep the image's


def test_pipeline_gemma3_sweep_runs_beside_the_tiny_sweep(tmp_path):
    """gemma3-sweep (a side stage) builds Gemma 3's bf16 fixture with the bundle's
    transformers, then runs its sweep rows alone into their own results file, no tier
    case; arch-all beside it runs the tiny architectures only, with ARCH_WORKERS; the
    feature modules (lora-tx: LoRA's transport cases) run until `wait`. Alone, arch-all
    runs every architecture, resuming over ARCH_RESUME's rows."""
    lines, text = _run_pipeline(
        tmp_path, "features=spec:lora-tx,gemma3-sweep,arch-all,wait", env={"ARCH_WORKERS": "12"}
    )
    assert (
        "gemma3-sweep: started" in lines and "arch-all: start (--archs tiny, 12 workers)" in lines
    )
    assert lines.index("gemma3-sweep fixture: start") < lines.index("gemma3-sweep fixture: exit 0")
    assert lines.index("gemma3-sweep rows: exit 0") < lines.index("done")
    calls = text.splitlines()
    build = next(i for i, c in enumerate(calls) if "--model gemma3 --formats bf16" in c)
    rows = next(i for i, c in enumerate(calls) if "--archs gemma3-270m" in c)
    assert build < rows and "site-gguf-tokenizer" in calls[build]
    assert "arch-sweep-gemma3.jsonl" in calls[rows] and "site-gguf-tokenizer" not in calls[rows]
    tiny = next(c for c in calls if "--archs tiny" in c)
    assert "--workers 12" in tiny and "arch-sweep-cuda.jsonl" in tiny
    assert "-k gemma3" not in text  # no tier case
    assert "-k copy_and_cuda_ipc" in text and "test_spec_decode_engines.py" in text
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text('{"case": "llama/bf16", "device": "cuda"}\n')
    lines, text = _run_pipeline(tmp_path / "alone", "arch-all", env={"ARCH_RESUME": str(earlier)})
    assert "arch-all: start (--archs all, 16 workers)" in lines and "--workers 16" in text
    assert f"arch-all: resumes over {earlier}" in lines
    out = tmp_path / "alone" / "gout" / "arch-sweep-cuda.jsonl"
    assert out.read_text() == earlier.read_text()  # its cases skipped by --resume


def test_pipeline_arch_which_and_fixture_formats(tmp_path):
    """ARCH_WHICH=tiny runs arch-all without the real models' rows (a bundle without
    Gemma 3); FIXTURE_FORMATS=bf16 builds only the bf16 fixture first."""
    lines, text = _run_pipeline(
        tmp_path, "arch-all", env={"ARCH_WHICH": "tiny", "FIXTURE_FORMATS": "bf16"}
    )
    assert "fixtures bf16" in lines and "arch-all: start (--archs tiny, 16 workers)" in lines
    assert "python3 -m wcache.testing.fixtures --formats bf16 " in text


def test_pipeline_stage_at_a_gpu_runs_only_on_that_gpu(tmp_path):
    """STAGE@GPU runs only where nvidia-smi's GPU name contains GPU (any case), and is
    logged as skipped, naming the GPU, elsewhere: one plan for a call that may land on
    an H100 or an H200."""
    lines, text = _run_pipeline(
        tmp_path, "pairs=2@H200,dense@H200,pairs=1@h100,arch-all", "NVIDIA H100 80GB HBM3"
    )
    steps = [s for s in lines if s.startswith(("pairs", "dense", "arch-all"))]
    assert steps == [
        "pairs=2: skipped (the GPU is NVIDIA H100 80GB HBM3, not 'H200')",
        "dense: skipped (the GPU is NVIDIA H100 80GB HBM3, not 'H200')",
        "pairs: start (1 pairs)",
        "pairs: exit 0",
        "arch-all: start (--archs all, 16 workers)",
        "arch-all: exit 0",
    ]
    assert "--pairs 1" in text and "--pairs 2" not in text
    assert "not moe and not lora" not in text  # the dense tier never started
    assert "checkpoint 8b exit 0" in lines  # the pairs that run here need it


def test_pipeline_gpu_names_match_whole_words_and_need_a_name(tmp_path):
    """@H20 is not an H200, and an empty or doubled @ matches no GPU."""
    lines, _ = _run_pipeline(tmp_path, "dense@H20,moe-compiled@,arch-all@H200@x", "NVIDIA H200")
    assert [s for s in lines if "skipped" in s] == [
        "dense: skipped (the GPU is NVIDIA H200, not 'H20')",
        "moe-compiled: skipped (the GPU is NVIDIA H200, not '')",
        "arch-all: skipped (the GPU is NVIDIA H200, not 'H200@x')",
    ]


def test_pipeline_writes_the_model_kinds_checkpoint(tmp_path):
    """MODEL_KIND / MOE_LAYERS reach the checkpoint written beside the first stage (the
    one the pairs' bench then reuses); without MOE_LAYERS the bench's default holds."""
    lines, text = _run_pipeline(
        tmp_path, "pairs=1", env={"MODEL_KIND": "moe30b-fp8", "MOE_LAYERS": "24"}
    )
    assert "checkpoint moe30b-fp8 exit 0" in lines
    assert "model_setup('moe30b-fp8', 'cuda'" in text and "moe_layers=24)" in text
    assert "--model-kind moe30b-fp8 --moe-layers 24" in text


def test_pipeline_writes_no_checkpoint_for_pairs_skipped_on_this_gpu(tmp_path):
    """The bench checkpoint (16 GB for the 8B) is written beside the first stage only
    when a pairs or fresh-stacks stage will run on this GPU."""
    lines, text = _run_pipeline(tmp_path, "pairs=3@H200,arch-all", "NVIDIA H100 80GB HBM3")
    assert not any(s.startswith("checkpoint ") for s in lines)
    assert "model_setup" not in text and "arch-all: exit 0" in lines


def test_bench_phases_passes_prime_only_and_the_startup_plan(tmp_path):
    """bench-phases.sh: PRIME_ONLY=1 adds --prime-only (the primed snapshot only, for a
    later call's pairs), STARTUP_PLAN=1 --startup-plan, MEGA_AOT=1 --mega-aot-artifact,
    MODEL_KIND / MOE_LAYERS --model-kind / --moe-layers; none is passed unasked.
    python3 and nvidia-smi are stubs: the command is checked, not run."""
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls.log"
    for name in ("python3", "nvidia-smi"):
        (stub / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 0\n')
        (stub / name).chmod(0o755)
    env = _script_env(tmp_path, stub, tmp_path / "out")

    def bench_call(extra: dict[str, str]) -> str:
        calls.write_text("")
        res = subprocess.run(
            ["bash", str(TOOLS / "bench-phases.sh"), "fresh-node"],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return next(ln for ln in calls.read_text().splitlines() if "bench --phases" in ln)

    primed = bench_call({"PRIME_ONLY": "1", "STARTUP_PLAN": "1", "MEGA_AOT": "1"})
    assert "--prime-only" in primed and "--startup-plan" in primed
    assert "--mega-aot-artifact" in primed
    plain = bench_call({})
    assert "--prime-only" not in plain and "--startup-plan" not in plain
    assert "--mega-aot-artifact" not in plain
    assert "--rows fresh-node" in plain
    assert "--model-kind" not in plain and "--moe-layers" not in plain
    moe = bench_call({"MODEL_KIND": "moe30b-fp8", "MOE_LAYERS": "24"})
    assert "--model-kind moe30b-fp8 --moe-layers 24" in moe


def test_bench_phases_keeps_a_gpu_monitor_beside_the_engine_logs(tmp_path):
    """bench-phases.sh polls nvidia-smi's utilization, clocks, power and clock-event
    reasons every GPU_MONITOR_MS ms (1000 by default) while the bench runs, into
    gpu-monitor.csv inside the packed engine logs, and stops the poll when the bench
    ends. python3 and nvidia-smi are stubs (the monitor stub prints one line and sleeps)."""
    import tarfile

    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "calls.log"
    pidfile = tmp_path / "monitor.pid"
    (stub / "python3").write_text(  # the bench waits (10 s at most) for the monitor's start
        f'#!/bin/sh\necho "python3 $*" >> {calls}\ncase "$*" in *"bench --phases"*) i=0; '
        f"while [ ! -s {pidfile} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done;; esac\n"
        "exit 0\n"
    )
    (stub / "nvidia-smi").write_text(
        f'#!/bin/sh\necho "nvidia-smi $*" >> {calls}\n'
        'case "$*" in *-lms*) echo "timestamp, utilization.gpu [%]"; '
        f"echo $$ > {pidfile}.new; mv {pidfile}.new {pidfile}; exec sleep 30;; esac\nexit 0\n"
    )
    for name in ("python3", "nvidia-smi"):
        (stub / name).chmod(0o755)
    out = tmp_path / "out"
    env = _script_env(tmp_path, stub, out, OUT_NAME="pairs", GPU_MONITOR_MS="500")
    res = subprocess.run(
        ["bash", str(TOOLS / "bench-phases.sh"), "fresh-node"],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
    )
    assert res.returncode == 0, res.stderr
    monitor = [ln for ln in calls.read_text().splitlines() if "-lms" in ln]
    assert len(monitor) == 1 and "-lms 500" in monitor[0]
    assert "--query-gpu=timestamp,utilization.gpu," in monitor[0]
    assert "clocks_event_reasons.active" in monitor[0]
    with tarfile.open(out / "pairs.logs.tgz") as tar:
        got = tar.extractfile("pairs.logs/gpu-monitor.csv").read().decode()
    assert got.startswith("timestamp, utilization.gpu")
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists(), "the monitor outlived the bench"
