"""The engine side of start-up artifacts (wcache.vllm.startup) and the priming
command (wcache.daemon.prime): which bundle fits which engine, with the exact
reason a stale one is refused, and what the priming engine is started with."""

from __future__ import annotations

import json

import pytest

from wcache.daemon import prime
from wcache.store import artifacts as art
from wcache.vllm import startup

FACTORS = {"vllm": "0.32.0", "torch": "2.13.0", "triton": None, "device": "cpu:x86_64",
           "capability": None, "env_hash": "e" * 64, "config_hash": "c" * 10,
           "aot_enabled": True, "compile_mode": "VLLM_COMPILE"}


@pytest.mark.parametrize("field, value, reason", [
    ("vllm", "0.33.0", "vllm: bundle='0.32.0' engine='0.33.0'"),
    ("torch", "2.11.0", "torch: bundle='2.13.0' engine='2.11.0'"),
    ("triton", "3.5.0", "triton: bundle=None engine='3.5.0'"),
    ("device", "NVIDIA H200", "device: bundle='cpu:x86_64' engine='NVIDIA H200'"),
    ("capability", "9.0", "capability: bundle=None engine='9.0'"),
    ("env_hash", "f" * 64, f"env_hash: bundle='{'e' * 64}' engine='{'f' * 64}'"),
    ("config_hash", "d" * 10, f"config_hash: bundle='{'c' * 10}' engine='{'d' * 10}'"),
])
def test_stale_reason_names_the_first_differing_factor(field, value, reason):
    """A bundle differing in one factor is stale with exactly that factor and both values named."""
    assert startup.stale_reason(FACTORS, {**FACTORS, field: value}) == reason


def test_informational_fields_do_not_make_a_bundle_stale():
    """Only FACTOR_ORDER decides: a differing AOT switch or compile mode is for the record."""
    assert startup.stale_reason(FACTORS, {**FACTORS, "aot_enabled": False,
                                          "compile_mode": "NONE"}) is None


def test_compile_dirs_names_what_vllm_wrote():
    """compile_dirs(): the bundle's vllm entries under torch_compile_cache, nothing else."""
    manifest = {"entries": [{"root": "vllm", "path": "torch_compile_cache/torch_aot_compile/ab"},
                            {"root": "vllm", "path": "torch_compile_cache/0123456789"},
                            {"root": "vllm", "path": "modelinfos/llama.json"},
                            {"root": "triton", "path": "XYZ"}]}
    assert startup.compile_dirs(manifest) == ["torch_compile_cache/torch_aot_compile/ab",
                                              "torch_compile_cache/0123456789"]


def test_versions_are_named_before_hashes():
    """When versions and hashes differ, the version comes first (it explains the hashes)."""
    mine = {**FACTORS, "vllm": "0.33.0", "config_hash": "x"}
    assert startup.stale_reason(FACTORS, mine).startswith("vllm:")


def test_a_matching_bundle_is_fresh_and_informational_fields_do_not_matter():
    """Equal factors are fresh; aot_enabled/compile_mode are recorded but not compared."""
    assert startup.stale_reason(FACTORS, {**FACTORS, "compile_mode": "NONE"}) is None


def test_collect_entries_finds_hash_dirs_model_infos_and_kernel_caches(tmp_path):
    """A priming run's caches give one entry per AOT hash dir, non-AOT hash dir, model-info file and Triton entry."""
    v = tmp_path / "vllm"
    (v / startup.AOT_DIR / "h1" / "rank_0_0").mkdir(parents=True)
    (v / startup.COMPILE_DIR / "abcdef0123").mkdir(parents=True)
    (v / "modelinfos").mkdir()
    (v / "modelinfos" / "m.json").write_text("{}")
    (tmp_path / "triton" / "k1").mkdir(parents=True)
    dirs = {"vllm": v, "triton": tmp_path / "triton", "inductor": tmp_path / "none"}
    assert startup.collect_entries(dirs) == [
        ("vllm", f"{startup.AOT_DIR}/h1"), ("vllm", f"{startup.COMPILE_DIR}/abcdef0123"),
        ("vllm", "modelinfos/m.json"), ("triton", "k1")]


def test_pack_primed_without_a_compile_artifact_is_artifacts_missing(tmp_path):
    """A priming run that compiled nothing (e.g. eager) yields artifacts-missing, not an empty bundle."""
    (tmp_path / "vllm" / "modelinfos").mkdir(parents=True)
    (tmp_path / "vllm" / "modelinfos" / "m.json").write_text("{}")
    with pytest.raises(art.ArtifactsMissing, match="no torch.compile artifact"):
        startup.pack_primed({"vllm": tmp_path / "vllm"}, FACTORS)


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
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "v"), "TRITON_CACHE_DIR": str(tmp_path / "t"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i")}
    assert startup.cache_dirs(env) == {"vllm": tmp_path / "v", "triton": tmp_path / "t",
                                       "inductor": tmp_path / "i"}


def test_priming_command_runs_one_compiled_wcache_engine_without_fallback():
    """The priming engine is prime_engine against this daemon (fallback off, factors recorded) with the serve's vLLM arguments verbatim, less --enforce-eager."""
    cmd = prime.priming_command(
        "/m", ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512",
               "--max-num-seqs", "8", "--seed", "3"], socket_dir="/s", job="j", record="/r")
    assert cmd[1:5] == ["-m", "wcache.vllm.prime_engine", "--model", "/m"]
    assert json.loads(cmd[cmd.index("--extra") + 1]) == \
        {"fallback": False, "socket_dir": "/s", "job": "j", "artifacts_record": "/r"}
    assert cmd[cmd.index("--") + 1:] == ["--dtype", "bfloat16", "--max-model-len", "512",
                                         "--max-num-seqs", "8", "--seed", "3"]


def test_prime_engine_kwargs_are_the_serve_arguments_vllm_parses():
    """prime_engine.engine_kwargs: vLLM's own parser turns the serve's arguments into the
    EngineArgs fields that differ from its defaults (what LLM() is given), model included."""
    from wcache.vllm.prime_engine import engine_kwargs

    got = engine_kwargs("/m", ["--dtype", "bfloat16", "--max-model-len", "512",
                               "--max-num-seqs", "8"])
    assert got == {"model": "/m", "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 8}


def test_priming_refuses_more_than_one_rank():
    """Priming runs one rank's engine; TP=2 is refused with priming-failed's reason."""
    with pytest.raises(prime.PrimingFailed, match="TP=2 x PP=1"):
        prime.priming_command("/m", ["--tensor-parallel-size", "2"], socket_dir=None, job="",
                              record="/r")
