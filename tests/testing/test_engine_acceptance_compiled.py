"""The compiled mode of the GPU acceptance harness (run_case with EngineCase(compile=True)),
its flow and checks, with fakes for the engines and the daemon (CPU; no engine, no GPU:
this is not a run of the GPU tier)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from tests.helpers.compile_artifacts import artifact_path, write_artifact
from wcache.testing import engine_acceptance as ea

#: Collecting the GPU tier (imports torch and the tier's conftest) takes ~10 s here.
COLLECT_TIMEOUT_S = 120

GRAPH = "def forward(self, arg0_1: 'bf16[s72, 576]'):\n    mm = torch.mm(arg0_1, w)\n"


class _FakeDaemon:
    """Stands in for DaemonProcess: starts at once, records that it ran."""

    started: ClassVar[list[str]] = []

    def __init__(self, model, socket_dir, extra_args=(), env=None):
        self.socket_dir, self.proc, self.ready_s = socket_dir, None, 0.5

    def start(self):
        _FakeDaemon.started.append(self.socket_dir)
        return self

    def stop(self):
        pass


def _fake_engines(monkeypatch, graph_of=lambda load_format: GRAPH, can_load=True):
    """Fake run_engine: on a cache root with an artifact it logs a hit (``can_load``)
    or a load failure and a save; on a cold root it writes ``graph_of(load_format)``."""
    calls = []

    def run_engine(model, load_format, extra, prompts, max_tokens, env, engine_args):
        root = env.get("VLLM_CACHE_ROOT")
        calls.append((load_format, dict(extra), root, tuple(engine_args)))
        log = []
        if root is not None:
            art = artifact_path(Path(root))
            if art.exists() and can_load:
                log.append(
                    f"INFO [decorators.py:320] Directly load AOT compilation from path {art}"
                )
            else:
                if art.exists():
                    log.append(
                        f"WARNING Compiling model again due to a load failure from "
                        f"{art}, reason: boom"
                    )
                write_artifact(art, graph_of(load_format), f"# {root}/k.so")
                log.append(f"INFO saved AOT compiled function to {art}")
            log.append("INFO torch.compile took 2.50 s in total")
        phase = (
            [{"phase": "fallback", "reason": "daemon-missing"}]
            if extra.get("fallback")
            else [{"phase": "restore", "seconds": 0.1}]
            if load_format == "wcache"
            else []
        )
        return {"texts": ["x"], "token_ids": [[1, 2, 3]], "load": phase, "log": "\n".join(log)}

    monkeypatch.setattr(ea, "run_engine", run_engine)
    monkeypatch.setattr(ea, "DaemonProcess", _FakeDaemon)
    monkeypatch.setattr(
        "wcache.store.daemon_status",
        lambda sock: {"key_fields": {"plans": ["unquantized:1"]}, "transport": "shm"},
    )
    monkeypatch.setattr("wcache.store.paths.list_sockets", lambda d: [f"{d}/s.sock"])
    return calls


def _run(case):
    return ea.run_case(case, Path("/model"), prompts=("p",), verify=False)


def test_compiled_case_runs_five_loads_over_two_roots(monkeypatch):
    """Compiled: disk, fallback, daemon on root A, second and disk_b on root B, all with
    --compile; hits where expected, equal graphs: restored."""
    calls = _fake_engines(monkeypatch)
    row = _run(ea.EngineCase("bf16-compiled", "bf16", compile=True))
    assert row["outcome"] == "restored", row["reason"]
    roots = [Path(c[2]).parent.name for c in calls]
    assert [(c[0], r) for c, r in zip(calls, roots)] == [
        ("auto", "A"),
        ("wcache", "A"),
        ("wcache", "A"),
        ("wcache", "B"),
        ("auto", "B"),
    ]
    assert all("--compile" in c[3] for c in calls)
    assert row["compile_hits"] == {
        "disk": False,
        "fallback": True,
        "daemon": True,
        "second": False,
        "disk_b": True,
    }
    assert row["graphs_equal"] is True and list(row["loads"]) == [
        "disk",
        "fallback",
        "daemon",
        "second",
        "disk_b",
    ]
    assert row["loads"]["disk"]["compile"]["compile_s"] == (2.5,)


def test_progress_names_each_load_as_it_happens(monkeypatch, tmp_path):
    """With the results file set, every load's start and end (its seconds and hit) and
    the case's outcome are appended to RESULTS.progress while the case runs."""
    _fake_engines(monkeypatch)
    monkeypatch.setenv(ea.RESULTS_ENV, str(tmp_path / "results.jsonl"))
    row = _run(ea.EngineCase("bf16-compiled", "bf16", compile=True))
    lines = (tmp_path / "results.jsonl.progress").read_text().splitlines()
    done = [ln.split()[2].rstrip(":") for ln in lines if "engine done" in ln]
    assert done == ["disk", "fallback", "daemon", "second", "disk_b"]
    assert "bf16-compiled disk_b: engine done in" in lines[-2]
    assert "compile-cache hit True" in lines[-2]
    assert lines[-1].endswith(f"bf16-compiled case: {row['outcome']}: {row['reason']}")
    assert all(ln.split()[0].endswith("Z") for ln in lines)  # UTC, as the rows


def test_progress_of_a_case_that_ends_early_and_a_missing_folder(monkeypatch, tmp_path):
    """A case whose disk load fails still ends with its case line; the results file's
    folder is created (a diagnostic never fails the case)."""
    _fake_engines(monkeypatch)

    def failing(*a, **kw):
        raise RuntimeError("engine (auto) failed with exit 1.\nboom")

    monkeypatch.setattr(ea, "run_engine", failing)
    monkeypatch.setenv(ea.RESULTS_ENV, str(tmp_path / "new" / "results.jsonl"))
    row = _run(ea.EngineCase("bf16-compiled", "bf16", compile=True))
    assert row["outcome"] == "not-runnable"
    lines = (tmp_path / "new" / "results.jsonl.progress").read_text().splitlines()
    assert "bf16-compiled disk: engine failed after" in lines[-2] and "boom" in lines[-2]
    assert "bf16-compiled case: not-runnable" in lines[-1]


def test_compiled_case_fails_on_differing_graphs(monkeypatch):
    """A wcache engine that traces another graph fails the row, with the diff in it."""
    _fake_engines(
        monkeypatch,
        graph_of=lambda lf: GRAPH if lf == "auto" else GRAPH.replace("torch.mm", "torch.addmm"),
    )
    row = _run(ea.EngineCase("bf16-compiled", "bf16", compile=True))
    assert row["outcome"] == "failed" and row["graphs_equal"] is False
    assert "differ" in row["reason"]
    assert "+    mm = torch.addmm(arg0_1, w)" in row["graph_diff"]


def test_compiled_case_fails_on_a_missed_hit(monkeypatch):
    """An engine that compiles again where the other format's cache should be read
    fails the row, naming each load that missed."""
    _fake_engines(monkeypatch, can_load=False)
    row = _run(ea.EngineCase("bf16-compiled", "bf16", compile=True))
    assert row["outcome"] == "failed"
    missed = [
        n
        for n in ("fallback", "daemon", "disk_b")
        if f"{n}: expected a compile-cache hit" in row["reason"]
    ]
    assert missed == ["fallback", "daemon", "disk_b"]


def test_eager_case_keeps_four_loads_and_no_cache_roots(monkeypatch):
    """Without compile: four loads, no --compile, no cache roots, no compile fields."""
    calls = _fake_engines(monkeypatch)
    row = _run(ea.EngineCase("bf16", "bf16"))
    assert row["outcome"] == "restored", row["reason"]
    assert [c[0] for c in calls] == ["auto", "wcache", "wcache", "wcache"]
    assert all(c[2] is None and "--compile" not in c[3] for c in calls)
    assert "compile_hits" not in row and list(row["loads"]) == [
        "disk",
        "fallback",
        "daemon",
        "second",
    ]


def test_moe_backend_reaches_the_daemon_every_engine_and_the_row(monkeypatch):
    """EngineCase(moe_backend="marlin"): ``--moe-backend marlin`` is in the daemon's vLLM
    arguments (``wcache serve``, hence its layout and key) and in every engine's, and the
    row records it; a case without it passes neither."""
    calls = _fake_engines(monkeypatch)
    daemons = []
    real_init = _FakeDaemon.__init__

    def init(self, model, socket_dir, extra_args=(), env=None):
        daemons.append(tuple(extra_args))
        real_init(self, model, socket_dir, extra_args, env)

    monkeypatch.setattr(_FakeDaemon, "__init__", init)
    row = _run(ea.EngineCase("moe-fp8-b-marlin", "fp8", moe_backend="marlin"))
    assert row["outcome"] == "restored", row["reason"]
    assert row["moe_backend"] == "marlin"
    assert len(calls) == 4 and daemons
    for args in [c[3] for c in calls] + daemons:
        i = args.index("--moe-backend")
        assert args[i + 1] == "marlin"
    plain = ea.EngineCase("fp8", "fp8")
    assert "--moe-backend" not in plain.serve_args + plain.engine_args


def test_run_engine_passes_moe_backend_to_vllm():
    """run_engine's ``--moe-backend`` is a vLLM engine argument of the same name (what a
    priming ``wcache serve`` is given too)."""
    from wcache.vllm.run_engine import vllm_engine_args

    got = vllm_engine_args(["--moe-backend", "marlin"])
    i = got.index("--moe-backend")
    assert got[i + 1] == "marlin"


def test_gpu_tier_selects_the_compiled_cases_by_id():
    """pytest -k compiled on the GPU tier collects exactly the compiled cases: the dense
    formats', the fused-MoE ones and the compiled weight-update engine."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/gpu_engine",
            "-k",
            "compiled",
        ],
        capture_output=True,
        text=True,
        timeout=COLLECT_TIMEOUT_S,
    ).stdout
    ids = sorted(ln.split("[")[1].rstrip("]") for ln in out.splitlines() if "::" in ln)
    assert ids == sorted(
        [
            "awq-marlin-compiled",
            "bf16-compiled",
            "compiled",
            "fp8-compiled",
            "moe-gpt_oss-mxfp4-b-marlin-compiled",
            "moe-qwen3_moe-awq-compiled",
            "moe-qwen3_moe-bf16-compiled",
            "moe-qwen3_moe-ct_w4a16-compiled",
            "moe-qwen3_moe-fp8-b-marlin-compiled",
            "moe-qwen3_moe-gptq-compiled",
            "moe-qwen3_moe_128-fp8_block-b-marlin-compiled",
            "moe-qwen3_moe_128-fp8_block-compiled",
            "moe-qwen3_moe_128-mxfp4-compiled",
            "moe-qwen3_moe_128-nvfp4-compiled",
            "mxfp8-compiled",
            "nvfp4-compiled",
        ]
    )


def test_an_engine_side_refusal_is_refused_without_a_daemon(monkeypatch):
    """A fallback load taken for an engine-side refusal (meta-build), not a missing daemon,
    makes the case refused: no daemon starts, and the reason says the engine refused it
    and that `wcache serve` does not (it serves such a model: only engines fall back)."""
    calls = _fake_engines(monkeypatch)
    plain = ea.run_engine

    def refusing(model, load_format, extra, *rest, **kw):
        out = plain(model, load_format, extra, *rest, **kw)
        if extra.get("fallback"):
            out["load"] = [{"phase": "fallback", "reason": "meta-build"}]
        return out

    monkeypatch.setattr(ea, "run_engine", refusing)
    monkeypatch.setattr(ea, "DaemonProcess", None)  # starting one fails the test
    row = _run(ea.EngineCase("bf16", "bf16"))
    assert row["outcome"] == "refused", row
    assert "[meta-build]" in row["reason"] and "meta device" in row["reason"]
    assert row["reason"].startswith("the engine's load refuses it [meta-build]")
    assert "(`wcache serve` refuses it too)" in row["reason"]
    assert [c[0] for c in calls] == ["auto", "wcache"]


def test_a_failure_names_the_missing_module_behind_an_inspection_error():
    """A load that fails with vLLM's "failed to be inspected" names the module its class could not import."""
    out = "\n".join(
        [
            "ERROR inspecting",
            '  File "x.py", line 20, in <module>',
            "ModuleNotFoundError: No module named 'torchvision'",
            "Traceback (most recent call last):",
            '  File "a.py", line 1, in f',
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        ]
    )
    row = ea._failure(RuntimeError(out))
    assert row["reason"].startswith("pydantic_core._pydantic_core.ValidationError")
    assert "No module named 'torchvision'" in row["reason"]


def _verify_says(monkeypatch, table):
    monkeypatch.setattr(ea, "_verify", lambda model, case, sock: {"exit": 1, "table": table})


def test_nonfinite_vllm_logits_make_the_case_not_runnable(monkeypatch):
    """verify's (logits) row saying vLLM's own load gave non-finite logits (GPT-OSS in
    online FP8 on vLLM 0.33, the H100 sweep of 2026-12-05) is vLLM's failure, not the
    restore's: not-runnable, the reason naming it and verify's own summary."""
    from wcache.vllm.verify import NONFINITE_LOGITS

    assert ea.NONFINITE_LOGITS == NONFINITE_LOGITS
    _fake_engines(monkeypatch)
    _verify_says(
        monkeypatch,
        [
            "m.experts  fp8/triton@1  triton  DIFFERS: w13_bias checksum: 'a' != 'b'",
            f"(logits)   -  -  DIFFERS: {NONFINITE_LOGITS}",
            "wcache verify: FAILED (daemon d): 2 of 20 checks differ; first: m.experts: w13_bias",
        ],
    )
    row = ea.run_case(ea.EngineCase("bf16", "bf16"), Path("/model"), prompts=("p",))
    assert row["outcome"] == "not-runnable"
    assert row["reason"].startswith("vLLM's own load gives non-finite logits")
    assert "FAILED (daemon d): 2 of 20 checks differ" in row["reason"]


def test_verify_differing_with_finite_logits_still_fails(monkeypatch):
    """Any other verify difference (the logits finite) stays a failure."""
    _fake_engines(monkeypatch)
    _verify_says(
        monkeypatch,
        [
            "m.norm  -  -  DIFFERS: %weight: a != b",
            "(logits)   -  -  OK",
            "wcache verify: FAILED (daemon d): 1 of 20 checks differ; first: m.norm",
        ],
    )
    row = ea.run_case(ea.EngineCase("bf16", "bf16"), Path("/model"), prompts=("p",))
    assert row["outcome"] == "failed"
    assert row["reason"] == "wcache verify exited 1"


def test_one_process_loads_run_vllm_in_the_engine_process_and_no_other(monkeypatch):
    """The loads a case names in ``one_process_loads`` get
    VLLM_ENABLE_V1_MULTIPROCESSING=0; the others keep vLLM's default layout (no such
    variable), and the row says which were which."""
    envs = {}
    _fake_engines(monkeypatch)
    fake = ea.run_engine

    def recording(model, load_format, extra, prompts, max_tokens, env, engine_args):
        name = "fallback" if extra.get("fallback") else load_format
        envs.setdefault(name, []).append(env.get("VLLM_ENABLE_V1_MULTIPROCESSING"))
        return fake(model, load_format, extra, prompts, max_tokens, env, engine_args)

    monkeypatch.setattr(ea, "run_engine", recording)
    case = ea.EngineCase("bf16", "bf16", one_process_loads=("disk", "fallback", "second"))
    row = _run(case)
    assert row["outcome"] == "restored", row["reason"]
    # the two daemon loads in order: "daemon" (default layout), then "second"
    assert envs == {"auto": ["0"], "fallback": ["0"], "wcache": [None, "0"]}
    assert row["one_process_loads"] == ["disk", "fallback", "second"]
    assert "one_process_loads" not in _run(ea.EngineCase("bf16", "bf16"))
