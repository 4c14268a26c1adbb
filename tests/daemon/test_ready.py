"""`wcache status --wait-ready`: every rank of the daemon for the engine arguments serves, or
a reason code (in-process daemons on a private socket dir; no vLLM engine)."""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path

import pytest
import torch

from wcache import cli
from wcache.daemon import ready
from wcache.daemon.ready import Readiness, ReadySpec, check_ready, wait_ready
from wcache.store import CacheKey, DaemonServer, Export, checkpoint_digest

DIGEST = "0123456789ab"
FIELDS = (
    ("model_arch", ["LlamaForCausalLM"]),
    ("dtype", "torch.bfloat16"),
    ("quantization", None),
    ("tp_size", 2),
    ("pp_size", 1),
)
SPEC = ReadySpec(DIGEST, [(1, 0), (0, 0)], FIELDS)


@pytest.fixture
def daemons():
    started: list[DaemonServer] = []

    def start(
        sock_dir: str,
        tp_rank: int,
        digest: str = DIGEST,
        dtype: str = "torch.bfloat16",
        tp_size: int = 2,
        extra: dict | None = None,
    ) -> DaemonServer:
        key = CacheKey(
            {
                **(extra or {}),
                "model_arch": ["LlamaForCausalLM"],
                "dtype": dtype,
                "quantization": None,
                "parallel": {
                    "tp_size": tp_size,
                    "tp_rank": tp_rank,
                    "pp_size": 1,
                    "pp_rank": 0,
                    "dp_size": 1,
                    "dp_rank": 0,
                },
            }
        )
        export = Export({"w": torch.arange(8, dtype=torch.float32)}, {"w": "param"})
        dev_id = f"cpu-tp{tp_rank}of{tp_size}-pp0of1-{digest}"
        server = DaemonServer(export, key, socket_dir=sock_dir, device_id=dev_id).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_missing_socket_dir_is_daemon_missing(sock_dir):
    """A socket dir that does not exist means no daemon: not ready, daemon-missing."""
    result = check_ready(os.path.join(sock_dir, "absent"), SPEC)
    assert (result.ok, result.code) == (False, "daemon-missing")
    assert "does not exist" in result.message


def test_ready_only_when_every_rank_serves(sock_dir, daemons):
    """With one of two ranks up the missing rank is named; with both up it is ready."""
    daemons(sock_dir, 0)
    partial = check_ready(sock_dir, SPEC)
    assert (partial.ok, partial.code, partial.serving) == (False, "daemon-missing", ((0, 0),))
    assert "tp_rank=1 pp_rank=0" in partial.message and "1/2 ranks serve" in partial.message
    daemons(sock_dir, 1)
    full = check_ready(sock_dir, SPEC)
    assert (full.ok, full.code, full.serving) == (True, None, ((0, 0), (1, 0)))


def test_another_configuration_is_key_mismatch_naming_the_field(sock_dir, daemons):
    """Only a float16 daemon (another digest) answers: key-mismatch naming dtype with
    the engine's value and the daemon's."""
    daemons(sock_dir, 0, digest="ba9876543210", dtype="torch.float16")
    result = check_ready(sock_dir, SPEC)
    assert (result.ok, result.code) == (False, "key-mismatch")
    assert f"dtype: engine={dict(FIELDS)['dtype']!r} daemon='torch.float16'" in result.message
    assert "model_arch" not in result.message


def test_daemon_of_other_engine_arguments_on_the_socket_is_key_mismatch(sock_dir, daemons):
    """A daemon on the digest's socket whose key differs in a field the engine arguments
    decide (here max_model_len, outside the socket's digest) is not ready: the engine
    would be refused with key-mismatch, so the probe says key-mismatch naming the
    field and both values; with the same value it is ready."""
    spec = ReadySpec(
        DIGEST, [(0, 0)], FIELDS, (("model_config.max_model_len", "8192"), ("revision", "null"))
    )
    server = daemons(sock_dir, 0, extra={"model_config.max_model_len": 512, "revision": None})
    result = check_ready(sock_dir, spec)
    assert (result.ok, result.code, result.serving) == (False, "key-mismatch", ())
    assert "model_config.max_model_len: engine=8192 daemon=512" in result.message
    assert "tp_rank=0 pp_rank=0" in result.message and "revision" not in result.message
    server.stop()
    daemons(sock_dir, 0, extra={"model_config.max_model_len": 8192, "revision": None})
    assert check_ready(sock_dir, spec).ok


def test_stopped_daemon_is_not_ready(sock_dir, daemons):
    """A rank whose daemon stopped no longer counts as serving."""
    spec = ReadySpec(DIGEST, [(0, 0)], FIELDS)
    server = daemons(sock_dir, 0)
    assert check_ready(sock_dir, spec).ok
    server.stop()
    assert check_ready(sock_dir, spec).code == "daemon-missing"


def test_wait_ready_returns_once_the_last_rank_serves(sock_dir, daemons):
    """wait_ready polls until a late rank starts, well before its timeout."""
    daemons(sock_dir, 0)
    timer = threading.Timer(0.3, daemons, args=(sock_dir, 1))
    timer.start()
    try:
        result = wait_ready(sock_dir, SPEC, timeout_s=30.0, poll_s=0.05)
    finally:
        timer.join()
    assert result.ok and result.serving == ((0, 0), (1, 0))


def test_wait_ready_timeout_zero_checks_once(sock_dir, monkeypatch):
    """--timeout 0 is one check (a readiness probe), not a wait."""
    calls = []
    monkeypatch.setattr(
        ready,
        "check_ready",
        lambda d, s: calls.append(d) or Readiness(False, "daemon-missing", "x"),
    )
    assert wait_ready(sock_dir, SPEC, timeout_s=0).code == "daemon-missing"
    assert calls == [sock_dir]


def _probe_argv(sock_dir: str, model, *more: str) -> list[str]:
    """``wcache status --wait-ready`` checking once (``--timeout 0``) for ``model`` in
    ``sock_dir``, then ``more``."""
    return [
        "status",
        "--socket-dir",
        sock_dir,
        "--wait-ready",
        "--timeout",
        "0",
        "--model",
        str(model),
        *more,
    ]


def test_cli_exit_codes_and_reason(sock_dir, daemons, monkeypatch, capsys, tmp_path):
    """`wcache status --wait-ready` exits 3 with the code while a rank is missing, then 0."""
    seen = {}

    def spec(model, rest, **kw):
        seen.update(model=model, rest=rest, **kw)
        return SPEC

    monkeypatch.setattr(ready, "engine_ready_spec", spec)
    argv = _probe_argv(sock_dir, tmp_path, "-tp", "2", "--dtype", "bfloat16")
    daemons(sock_dir, 0)
    assert cli.main(argv) == cli.NOT_READY_EXIT
    assert capsys.readouterr().out.startswith(
        "wcache: not ready [daemon-missing]: no daemon serves tp_rank=1 pp_rank=0"
    )
    daemons(sock_dir, 1)
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("wcache: ready: all 2 rank(s)")
    assert seen == {
        "model": str(tmp_path),
        "rest": ["--dtype", "bfloat16"],
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "nnodes": 1,
        "node_rank": 0,
        "job": "",
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["status", "--wait-ready"], "--wait-ready needs --model"),
        (["status", "--dtype", "bfloat16"], "engine arguments are read with --wait-ready only"),
        (
            ["status", "--wait-ready", "--model", "/m", "-tp", "0"],
            "--tensor-parallel-size 0 and --pipeline-parallel-size 1: each must be >= 1",
        ),
        (
            ["status", "--wait-ready", "--model", "/m", "--nnodes", "2", "--node-rank", "5"],
            "wcache status: --nnodes 2: 1 ranks (TP x PP) cannot be split over 2 nodes",
        ),
        (
            ["status", "--wait-ready", "--model", "/m", "-tp", "2", "--nnodes", "2"]
            + ["--node-rank", "5"],
            "wcache status: --node-rank 5 is outside 0..1 (--nnodes 2)",
        ),
        (["status", "--model", "/m"], "--model is read with --wait-ready only"),
        (["status", "--timeout", "5"], "--timeout is read with --wait-ready only"),
        (["status", "-tp", "2"], "--tensor-parallel-size is read with --wait-ready only"),
        (["status", "-pp", "1"], "--pipeline-parallel-size is read with --wait-ready only"),
        (
            ["status", "--nnodes", "2", "--node-rank", "1", "--job", "j"],
            "--nnodes, --node-rank, --job are read with --wait-ready only",
        ),
        (
            ["status", "--wait-ready", "--model", "/nonexistent", "--timeout", "0"],
            "wcache status: --model '/nonexistent' is not a local checkpoint directory",
        ),
    ],
)
def test_cli_refuses_bad_arguments(argv, message, capsys):
    """Bad --wait-ready invocations, and its options without it, exit 2 with one line
    saying what is wrong."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert 1 == len(err.splitlines())


@pytest.mark.slow
def test_cli_unknown_engine_argument_names_status(tmp_path, capsys):
    """An argument neither wcache nor vLLM knows ends `wcache status --wait-ready` with
    exit 2 and a short usage error naming `wcache status` and the argument (vLLM's parser)."""
    argv = ["status", "--wait-ready", "--model", str(tmp_path), "--timeout", "0", "--bogus", "1"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert 2 == exc.value.code
    err = capsys.readouterr().err.splitlines()
    assert "wcache status: error: unrecognized arguments: --bogus 1" == err[-1]
    assert err[-2].startswith("usage: wcache status ") and len(err) <= 3


def test_cli_unsafe_socket_dir_exits_1_with_code(sock_dir, monkeypatch, capsys, tmp_path):
    """A group-readable socket dir is refused (exit 1, unsafe-path), not reported as not ready."""
    monkeypatch.setattr(ready, "engine_ready_spec", lambda *a, **k: SPEC)
    os.chmod(sock_dir, 0o750)
    assert cli.main(_probe_argv(sock_dir, tmp_path)) == 1
    assert "[unsafe-path]" in capsys.readouterr().err


@pytest.mark.slow
def test_engine_spec_ranks_of_one_node():
    """vLLM's config gives the digest; node 1 of 2 hosts pipeline stage 1 of TP=2 x PP=2."""
    from wcache.testing.fixtures import build

    spec = ready.engine_ready_spec(
        str(build("bf16")),
        ["--dtype", "bfloat16"],
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        nnodes=2,
        node_rank=1,
    )
    assert spec.ranks == ((0, 1), (1, 1))
    assert dict(spec.fields) == {
        "model_arch": ["LlamaForCausalLM"],
        "dtype": "torch.bfloat16",
        "quantization": None,
        "tp_size": 2,
        "pp_size": 2,
    }
    assert len(spec.digest) == 12
    # vLLM builds no engine config for a layout this host cannot run (4 ranks here):
    # the probe then compares only the digest's fields (and the checkpoint's files)
    assert spec.config == ()
    config = dict(ready.engine_ready_spec(str(build("bf16")), ["--dtype", "bfloat16"]).config)
    # the fields the engine arguments decide, as the key holds them (canonical JSON)
    assert config["model_config.max_model_len"] == "8192"
    assert config["quant_config"] == "null"
    # and the checkpoint, digested once a daemon answers
    assert ready.engine_ready_spec(str(build("bf16")), ["--dtype", "bfloat16"]).checkpoint
    own = ready.engine_ready_spec(str(build("bf16")), ["--dtype", "bfloat16"], checkpoint=False)
    assert own.checkpoint == ""  # the daemon's /health: its own load digests the files


@pytest.mark.slow
def test_engine_spec_compares_the_daemons_post_init_config(tmp_path):
    """A checkpoint whose config ties the word embeddings but that ships an lm_head:
    vLLM's VllmConfig post-init unties them (ModelConfig.maybe_untie_word_embeddings),
    rewriting hf_config and word_embeddings_untied_by_checkpoint, so the model config
    alone differs from the daemon's. The probe builds the whole engine config as the
    daemon does and finds no difference (a daemon of these very arguments is ready)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from wcache.testing.fixtures import build
    from wcache.vllm.build import engine_config, engine_model_config
    from wcache.vllm.key import config_key_fields

    src = Path(build("bf16"))
    ckpt = tmp_path / "tied-with-lm-head"
    shutil.copytree(src, ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    args = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512"]
    spec = ready.engine_ready_spec(str(ckpt), args, checkpoint=False)
    daemon = config_key_fields(engine_config(str(ckpt), args).model_config)
    assert ready.config_differences(spec, daemon) == []
    # what the model config alone would have compared (the false key-mismatch)
    alone = config_key_fields(engine_model_config(str(ckpt), args, prog="t"))
    assert alone["model_config.word_embeddings_untied_by_checkpoint"] is False
    assert daemon["model_config.word_embeddings_untied_by_checkpoint"] is True
    # a difference inside a mapping names the entry, not a cut prefix of the whole
    other = {**daemon, "model_config.hf_config": {**daemon["model_config.hf_config"], "x": 1}}
    diffs = ready.config_differences(spec, other)
    assert diffs == ["model_config.hf_config.x: engine=null daemon=1"]


def test_a_daemon_of_files_changed_in_place_is_not_ready(sock_dir, daemons, tmp_path):
    """The checkpoint's files were rewritten in place after the daemon loaded them:
    every engine refuses it (key-mismatch on the digests), so the probe does too,
    saying the files changed and to restart the daemon (it said ready: break14 #1).
    The files are digested only once a daemon answers; a file the probe cannot read
    compares the config only."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"new weights")
    files = checkpoint_digest(str(model))
    old = {**files, "model.safetensors": "0" * 64}
    spec = ReadySpec(DIGEST, [(0, 0)], FIELDS, checkpoint=str(model))
    server = daemons(sock_dir, 0, extra={"checkpoint": old})
    result = check_ready(sock_dir, spec)
    assert (result.ok, result.code) == (False, "key-mismatch")
    assert "serves the checkpoint's files as they were when it loaded them" in result.message
    assert (
        f'checkpoint.model.safetensors: engine="{files["model.safetensors"]}" daemon="{"0" * 64}"'
    ) in result.message
    assert "config.json" not in result.message  # unchanged
    assert "Restart the daemon (`wcache stop`, then `wcache serve`" in result.message
    server.stop()
    daemons(sock_dir, 0, extra={"checkpoint": files})
    assert check_ready(sock_dir, spec).ok
    unreadable = ReadySpec(DIGEST, [(0, 0)], FIELDS, checkpoint=str(tmp_path / "absent"))
    assert check_ready(sock_dir, unreadable).ok
    # a file the engine's digest fails on too (a dangling symlink): not ready, by
    # its reason (it was taken for "not mounted here" and said ready: break15 #1)
    (model / "extra.safetensors").symlink_to(tmp_path / "gone.safetensors")
    result = check_ready(sock_dir, spec)
    assert (result.ok, result.code) == (False, "key-mismatch")
    assert "checkpoint: [checkpoint-changed]" in result.message, result.message


def test_the_checkpoint_is_digested_only_once_a_daemon_answers(sock_dir, monkeypatch):
    """A probe started beside a loading daemon does not read the checkpoint a second
    time: no daemon on the rank's socket, no digest taken."""

    def digest(model):
        raise AssertionError("digested with no daemon answering")

    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    monkeypatch.setattr("wcache.store.checkpoint_digest", digest)
    spec = ready.engine_ready_spec(model, ["--dtype", "bfloat16"])
    assert spec.checkpoint == model
    assert check_ready(sock_dir, spec).code == "daemon-missing"


def test_a_daemon_of_another_checkpoint_is_named_so_with_the_job_fix(sock_dir, daemons):
    """Two models of one architecture, dtype and layout share a socket name: a daemon
    whose key differs in the checkpoint's own config (hf_config) serves another
    checkpoint, and the message says so and gives the fix (a job per model), not
    "restart wcache serve with the engine's arguments" (which are right)."""
    spec = ReadySpec(DIGEST, [(0, 0)], FIELDS, (("model_config.hf_config", '{"hidden_size":576}'),))
    server = daemons(sock_dir, 0, extra={"model_config.hf_config": {"hidden_size": 64}})
    result = check_ready(sock_dir, spec)
    assert (result.ok, result.code) == (False, "key-mismatch")
    assert "serves another checkpoint (its config differs: " in result.message
    assert "model_config.hf_config.hidden_size: engine=576 daemon=64" in result.message
    assert "`wcache serve --job NAME`" in result.message
    assert "Restart `wcache serve`" not in result.message
    server.stop()


def test_invalidated_rank_is_not_ready(sock_dir, daemons):
    """A rank whose arena was invalidated (still answering) is not ready: arena-invalidated
    with the client's reason, as `wcache serve --http`'s /health reports it."""
    from wcache.store import invalidate_daemon

    spec = ReadySpec(DIGEST, [(0, 0)], FIELDS)
    server = daemons(sock_dir, 0)
    assert check_ready(sock_dir, spec).ok
    assert invalidate_daemon(server.socket_path, server.key, "guard-failed", "checksum differs")
    result = check_ready(sock_dir, spec)
    assert (result.ok, result.code, result.serving) == (False, "arena-invalidated", ())
    assert (
        "tp_rank=0 pp_rank=0" in result.message
        and "[guard-failed]: checksum differs" in result.message
    )


def test_the_daemon_gives_its_unused_cuda_cache_back_before_it_is_ready(monkeypatch):
    """release_device_cache empties the CUDA caching allocator (the digest's and the
    load's temporaries) and says how much it freed; without a CUDA context it does
    nothing (a CPU daemon)."""
    import torch

    from wcache.daemon import serve

    reserved = [512 << 20]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: reserved[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: reserved.__setitem__(0, 128 << 20))
    assert serve.release_device_cache() == 384 << 20
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("no CUDA context to empty"))
    assert serve.release_device_cache() == 0
    # it runs right before the ready line
    src = inspect.getsource(serve._serve_prepared_rank)
    assert src.index("release_device_cache()") < src.index('f"wcache: ready rank=')
