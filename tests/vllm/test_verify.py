"""`wcache verify` (issue 17): a restore equals vLLM's own load on this host, and a
wrong plan is named layer by layer.

Every verify here runs in this one process (vLLM's load, prepare, an in-process
daemon, the engine's loader): verify undoes vLLM's process-wide registrations
after each build, so the formats run one after another without an engine start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile

import attrs
import pytest
import torch

from wcache.core import StageOut, Tag
from wcache.daemon.process import ENGINE_ARGS
from wcache.testing.fixtures import FORMATS
from wcache.testing.plans import unregistered_stage
from wcache.vllm import VLLM_QUIET

pytestmark = pytest.mark.slow

#: SmolLM2-135M: 30 decoder layers x (qkv, o, gate_up, down) linears, the
#: embedding, lm_head, and 30 attention layers.
SMOLLM2_PLANNED_LAYERS = 30 * 4 + 2 + 30
#: The layer the planted faults hit.
PLANTED_LAYER = "model.layers.3.mlp.down_proj"


@pytest.fixture(scope="module")
def host_kernels() -> dict[str, str]:
    """The kernel decisions vLLM makes in this process (what verify runs under)."""
    from wcache.vllm.probe import host_target

    return dict(host_target("cpu").kernels)


def _fixture(fmt: str, host_kernels: dict[str, str]) -> str:
    from wcache.testing.fixtures import build
    from wcache.testing.isa import unservable_reason

    reason = unservable_reason(fmt, host_kernels)
    if reason is not None:
        pytest.skip(reason)
    return str(build(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_passes_on_every_servable_fixture(fmt, host_kernels):
    """Every planned layer, every other module with state, the ties, each module's
    forward output and the logits of the restore equal vLLM's own load."""
    from wcache.vllm.verify import verify

    report = verify(_fixture(fmt, host_kernels), ENGINE_ARGS, progress=False)
    assert [] == [(r.layer, r.difference) for r in report.failures]
    assert report.ok and report.logits_equal
    assert SMOLLM2_PLANNED_LAYERS == sum(r.plan != "-" for r in report.rows)
    assert ["(ties)", "(forward)", "(logits)"] == [r.layer for r in report.rows[-3:]]
    assert "in-process" == report.mode


@unregistered_stage(
    "test.convert_weight_off_by_one", Tag.TRANSFORM, reads=("weight",), writes=("weight",)
)
def _perturb_weight(tensors, config, target, recorded):
    """A wrong TRANSFORM: adds 1 to the first weight element."""
    weight = tensors["weight"].clone()
    weight.view(-1)[0] += 1
    return StageOut(tensors={"weight": weight})


def _plant(monkeypatch, change):
    """Resolve ``change(plan)`` instead of the real plan for PLANTED_LAYER (on both
    sides, as a wrong plan in wcache would be)."""
    import wcache.vllm.model as model_mod

    real = model_mod.plan_for

    def plan_for(config, *, target, **kwargs):
        bound = real(config, target=target, **kwargs)
        return (
            attrs.evolve(bound, plan=change(bound.plan)) if config.name == PLANTED_LAYER else bound
        )

    monkeypatch.setattr(model_mod, "plan_for", plan_for)


def test_planted_wrong_transform_fails_naming_the_layer(monkeypatch, capsys, host_kernels):
    """`wcache verify` exits 1 when one layer's plan perturbs its weight: the row of
    that layer and the forward name it; every other row is OK; ``--no-progress``
    shows no progress bar, and the environment is left as it was. The row names the
    weight's checksum where vLLM keeps the weight (the F.linear branch, e.g. bf16 on
    AVX2) and the forward output where it releases it after a oneDNN prepack."""
    from wcache.cli import main

    path = _fixture("bf16", host_kernels)
    _plant(monkeypatch, lambda plan: attrs.evolve(plan, stages=(_perturb_weight, *plan.stages)))
    for name in VLLM_QUIET:
        monkeypatch.delenv(name, raising=False)
    code = main(["verify", "--model", path, *ENGINE_ARGS, "--no-progress", "--only-failures"])
    out, err = capsys.readouterr()
    assert 1 == code
    # vLLM's logs were quiet for the run only: the caller's environment is as it was
    # (engines this process starts later log as before, and match the suite's template)
    assert not set(VLLM_QUIET) & set(os.environ)
    # --no-progress: no bar of wcache's, nor vLLM's checkpoint-shards bar (both loads)
    assert "Loading safetensors checkpoint shards" not in err, err[-2000:]
    assert "wcache prepare" not in err
    failing = [line.split()[0] for line in out.splitlines() if "DIFFERS:" in line]
    assert [PLANTED_LAYER, "(forward)", "(logits)"] == failing
    assert f"first differing output: {PLANTED_LAYER} (checksum" in out
    branch = host_kernels["unquantized_gemm[bfloat16]"]
    why = "weight checksum" if branch == "torch_linear" else "forward output differs"
    assert re.search(
        rf"^{re.escape(PLANTED_LAYER)}\s+unquantized/{branch}@1\s+\w+\s+DIFFERS: "
        rf"{why}",
        out,
        re.MULTILINE,
    )
    assert "wcache verify: FAILED (in-process): 3 of" in out


def test_planted_missing_metadata_stage_names_the_attribute(monkeypatch, host_kernels):
    """An AWQ plan without its METADATA stage cpu_wna16.set_isa_hint restores a layer
    without ``isa_hint``: that layer's row names the attribute with vLLM's value and
    the restore's (absent), and the restored forward's error is reported, not raised."""
    from wcache.vllm.verify import verify

    path = _fixture("awq", host_kernels)
    # the w4a16 layout (the one with isa_hint) on every host: AMX with bf16 takes w4a8
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    _plant(
        monkeypatch,
        lambda plan: attrs.evolve(
            plan, stages=tuple(s for s in plan.stages if s.name != "cpu_wna16.set_isa_hint")
        ),
    )
    report = verify(path, ENGINE_ARGS, progress=False)
    rows = {r.layer: r for r in report.failures}
    assert [PLANTED_LAYER, "(forward)", "(logits)"] == list(rows)
    layer = rows[PLANTED_LAYER]
    assert ("awq/cpu_wna16@1", "cpu_wna16") == (layer.plan, layer.kernel)
    assert re.fullmatch(r"~isa_hint: '\w+' != '<absent>'", layer.difference)
    assert "restore: AttributeError" in rows["(forward)"].difference
    assert "isa_hint" in rows["(forward)"].difference
    assert not report.logits_equal


def _daemon_in_process(cfg, sockets: str):
    """A daemon server for ``cfg`` in this process, built as `wcache serve` builds it,
    on ``sockets`` (not yet serving: enter it)."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.build import build_server, prepare_platform
    from wcache.vllm.key import device_id, parallel_layout
    from wcache.vllm.verify import _ensure_world

    with prepare_platform(cfg), set_current_vllm_config(cfg):
        _ensure_world(cfg)
        dev = device_id(torch.device("cpu"), cfg.model_config, parallel_layout())
        return build_server(cfg, socket_dir=sockets, device_id=dev, progress=False)


def test_socket_dir_mode_checks_a_running_daemon(host_kernels, monkeypatch):
    """With socket_dir, verify restores from the daemon serving there (here one in this
    process, built as `wcache serve` builds it) and finds it equal to vLLM's load, also
    for engine arguments without --enforce-eager, and with the engine's own
    `--load-format wcache --model-loader-extra-config` (its socket_dir names the daemon,
    its mode reaches the restore: break16 #5, they were dropped); once that daemon is
    gone it raises RestoreFailed [daemon-missing]."""
    from wcache.vllm.build import engine_config
    from wcache.vllm.loader import RestoreFailed, WcacheModelLoader
    from wcache.vllm.verify import verify

    extras = []
    init = WcacheModelLoader.__init__

    def spy(self, load_config):
        extras.append(dict(load_config.model_loader_extra_config))
        init(self, load_config)

    monkeypatch.setattr(WcacheModelLoader, "__init__", spy)

    path = _fixture("bf16", host_kernels)
    cfg = engine_config(path, list(ENGINE_ARGS))
    sockets = tempfile.mkdtemp(prefix="wcv-")  # short: a socket path holds <= 107 bytes
    try:
        server = _daemon_in_process(cfg, sockets)
        with server:  # no --enforce-eager: verify adds it; it is not part of the key
            compiled = [a for a in ENGINE_ARGS if a != "--enforce-eager"]
            report = verify(path, compiled, socket_dir=sockets, progress=False)
            engines = [
                *ENGINE_ARGS,
                "--load-format",
                "wcache",
                "--model-loader-extra-config",
                json.dumps({"socket_dir": sockets, "mode": "copy", "fallback": True}),
            ]
            own = verify(path, engines, progress=False)
        with pytest.raises(RestoreFailed, match=r"no daemon socket at") as err:
            verify(path, ENGINE_ARGS, socket_dir=sockets, progress=False)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    assert [] == [(r.layer, r.difference) for r in report.failures]
    assert f"daemon {sockets}" == report.mode
    assert own.ok and f"daemon {sockets}; mode=copy" == own.mode
    assert (sockets, "copy", False) == tuple(
        extras[1].get(k) for k in ("socket_dir", "mode", "fallback")
    )
    assert "" == report.note  # the daemon still answered after the comparison
    assert "daemon-missing" == err.value.code
    # verify's own wording, not the engine's ("fallback=false, so no disk load")
    assert str(err.value).startswith(f"the restored side could not be built from {sockets}")
    assert "fallback" not in str(err.value)


def test_socket_dir_mode_refuses_a_wrong_checkpoint_or_job_before_vllms_load(
    monkeypatch, tmp_path, host_kernels
):
    """With socket_dir, the daemon's key is checked before vLLM's load (seconds, where
    that load and its forward take minutes on a large model): a checkpoint whose bytes
    changed since the daemon loaded it is key-mismatch naming the checkpoint field, and
    another --job is daemon-missing naming the job (no daemon serves that job; it was
    key-mismatch, whose text said the keys were equal: break16 #8); vLLM's loader never
    runs (break pass 8: it learned of both only after the load and forward)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from wcache.vllm.build import engine_config
    from wcache.vllm.loader import RestoreFailed
    from wcache.vllm.verify import verify

    model = tmp_path / "model"
    shutil.copytree(_fixture("bf16", host_kernels), model)
    cfg = engine_config(str(model), list(ENGINE_ARGS))
    sockets = tempfile.mkdtemp(prefix="wcv-")  # short: a socket path holds <= 107 bytes
    try:
        server = _daemon_in_process(cfg, sockets)
        monkeypatch.setattr(
            DefaultModelLoader,
            "load_model",
            lambda *a, **k: pytest.fail("vLLM's load ran before the daemon's key was checked"),
        )
        with server:
            with pytest.raises(RestoreFailed, match="under another job") as other_job:
                verify(str(model), ENGINE_ARGS, socket_dir=sockets, job="other", progress=False)
            weights = model / "model.safetensors"
            with open(weights, "r+b") as f:  # one byte of the last tensor's data
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            with pytest.raises(RestoreFailed, match="serves another key: checkpoint") as changed:
                verify(str(model), ENGINE_ARGS, socket_dir=sockets, progress=False)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    for err, code in ((other_job, "daemon-missing"), (changed, "key-mismatch")):
        assert code == err.value.code
        assert str(err.value).startswith(f"the restored side could not be built from {sockets}")


def test_socket_dir_mode_says_when_the_daemon_exited_after_the_attach(monkeypatch, host_kernels):
    """A daemon that exits after the restore attached (the sealed memory stays mapped)
    still gives the verdict on the bytes compared, and the summary says the daemon is
    gone and that no engine can attach now (break pass 8: a bare `OK (daemon S)`)."""
    import wcache.vllm.verify as verify_mod
    from wcache.vllm.build import engine_config

    path = _fixture("bf16", host_kernels)
    cfg = engine_config(path, list(ENGINE_ARGS))
    sockets = tempfile.mkdtemp(prefix="wcv-")  # short: a socket path holds <= 107 bytes
    try:
        server = _daemon_in_process(cfg, sockets)
        compare = verify_mod._compare

        def compare_after_the_daemon_stops(*args):
            server.stop()
            return compare(*args)

        monkeypatch.setattr(verify_mod, "_compare", compare_after_the_daemon_stops)
        with server:
            report = verify_mod.verify(path, ENGINE_ARGS, socket_dir=sockets, progress=False)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    assert report.ok, report.summary()
    assert report.summary().startswith(f"wcache verify: OK (daemon {sockets}): ")
    assert "Note: the daemon has exited since the restore attached" in report.summary()
    assert "start `wcache serve` again" in report.note


def test_a_model_no_engine_restores_is_refused_before_vllms_load(monkeypatch):
    """In-process verify of BLOOM (its build reads tensor values: no engine builds it on
    the meta device to restore it) is refused with meta-build before vLLM's load and
    forward run (break pass 9: both ran first)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from wcache.errors import MetaBuildUnsupported
    from wcache.testing.tiny_models import build_arch
    from wcache.vllm.verify import verify

    monkeypatch.setattr(
        DefaultModelLoader,
        "load_model",
        lambda *a, **k: pytest.fail("vLLM's load ran before the meta build was checked"),
    )
    with pytest.raises(MetaBuildUnsupported, match="BloomForCausalLM reads tensor values"):
        verify(str(build_arch("bloom")), ENGINE_ARGS, progress=False)


def test_too_little_memory_is_refused_before_loading(monkeypatch, capsys, host_kernels):
    """A host without memory for two copies is refused (insufficient-memory) with the
    memory note, before any weight is read; `wcache verify` then exits 2 (could not
    compare), not 1 (a layer differs)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import wcache.vllm.verify as verify_mod
    from wcache.cli import main

    path = _fixture("bf16", host_kernels)
    monkeypatch.setattr(verify_mod, "available_bytes", lambda device: 2**20)
    monkeypatch.setattr(
        DefaultModelLoader,
        "load_model",
        lambda *a, **k: pytest.fail("weights loaded despite the refusal"),
    )
    with pytest.raises(
        verify_mod.VerifyRefused,
        match=r"holds two copies.*0\.00 GiB available.*"
        r"not enough memory",
    ) as err:
        verify_mod.verify(path, ENGINE_ARGS, progress=False, out=sys.stderr)
    assert "insufficient-memory" == err.value.code
    capsys.readouterr()
    assert 2 == main(["verify", "--model", path, *ENGINE_ARGS, "--no-progress"])
    assert "wcache verify: error [insufficient-memory]: " in capsys.readouterr().err


@pytest.mark.parametrize("error", [NotImplementedError, RuntimeError, ValueError])
def test_vllms_own_load_failing_here_is_exit_2_not_a_difference(
    monkeypatch, capsys, host_kernels, error
):
    """vLLM's own disk load raising on this host (no CPU kernel for the format: "No
    WNA16 MoE backend supports ...") is `load-failed`, exit 2 (could not compare),
    naming vLLM's error: it was exit 1 ("a layer differs") or a traceback (break19 D1)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from wcache.cli import main

    path = _fixture("bf16", host_kernels)

    def no_kernel(*args, **kwargs):
        raise error("No WNA16 MoE backend supports the deployment configuration.")

    monkeypatch.setattr(DefaultModelLoader, "load_model", no_kernel)
    assert 2 == main(["verify", "--model", path, *ENGINE_ARGS, "--no-progress"])
    err = capsys.readouterr().err
    assert "wcache verify: error [load-failed]: vLLM's own load of " in err
    assert f"({error.__name__}: No WNA16 MoE backend" in err
    assert "in no_kernel" not in err  # no traceback of vLLM's error (a logging one may be)


def test_the_engines_restore_options_are_honoured_or_refused_by_name():
    """`--load-format wcache --model-loader-extra-config` is the engine's restore: its
    socket_dir and job name the daemon, its other options go to verify's restore, and
    fallback/strict stay verify's; what contradicts --socket-dir/--job, what the loader
    refuses, and another load format are refused by name (break16 #5: all were
    dropped without a word)."""
    from wcache.errors import VerifyRefused
    from wcache.vllm.verify import engine_restore_options

    def options(extra, socket_dir=None, job="", load_format="wcache"):
        return engine_restore_options(load_format, extra, socket_dir, job)

    given = '{"socket_dir": "/s", "job": "a", "mode": "copy", "fallback": true}'
    assert ({"mode": "copy"}, "/s", "a") == options(given)
    assert ({"share_prepacks": False}, "/s", "a") == options(
        {"share_prepacks": False}, socket_dir="/s", job="a"
    )
    assert ({}, None, "") == options({"mode": "copy"}, load_format="auto")  # disk: none
    assert ({}, "/s", "") == options({"socket_dir": ""}, socket_dir="/s")  # "" is none
    engine_files = {"timing_file": "/t", "profile_file": "/p", "artifacts_record": "/a"}
    assert ({}, "/s", "") == options({**engine_files, "socket_dir": "/s"})  # never written
    assert ({}, "/s", "j") == options({"socket_dir": "/s"}, job="j")
    for extra, kwargs, said in (
        ({"socket_dir": "/s"}, {"socket_dir": "/t"}, "name two daemons' directories"),
        ({"job": "a"}, {"job": "b"}, "name two daemons"),
        ({"mode": "mmap"}, {}, "mode must be"),
        ({"nope": 1}, {}, "unknown model_loader_extra_config keys"),
        ("{not json", {}, "not valid JSON"),
        ({}, {"load_format": "dummy"}, "--load-format dummy"),
        ({"job": "a"}, {}, "names a daemon's job: give the --socket-dir"),
        ({"socket_dir": ""}, {"job": "a"}, "names a daemon's job: give the --socket-dir"),
    ):
        with pytest.raises(VerifyRefused, match=said) as err:
            options(extra, **kwargs)
        assert "config-invalid" == err.value.code


def test_a_daemons_socket_given_as_socket_dir_means_its_directory(tmp_path, capsys, monkeypatch):
    """`wcache verify --socket-dir` given the socket `wcache status` prints compares
    against the daemon in that socket's directory, saying so (break16 #8: it was
    unsafe-path with a fix that did not apply)."""
    import socket as socket_mod

    import wcache.vllm.verify as verify_mod
    from wcache.cli import main

    seen = []
    monkeypatch.setattr(verify_mod, "main", lambda args, rest: seen.append(args.socket_dir) or 0)
    monkeypatch.setattr("wcache.cli.check_checkpoint_dir", lambda path: None)
    sock = tmp_path / "wcache-cpu-x.sock"
    listener = socket_mod.socket(socket_mod.AF_UNIX)
    listener.bind(str(sock))
    try:
        assert 0 == main(["verify", "--model", str(tmp_path), "--socket-dir", str(sock)])
    finally:
        listener.close()
    assert [str(tmp_path)] == seen
    assert f"is a daemon's socket; comparing against the daemon in {tmp_path}" in (
        capsys.readouterr().err
    )


def test_engine_arguments_vllm_refuses_exit_2_naming_verify(capsys, host_kernels):
    """Engine arguments vLLM's config refuses (AWQ on a bf16 checkpoint; a flag vLLM
    does not know) mean verify could not compare: exit 2 with the reason, never 1
    ("a layer differs"), and the messages name ``wcache verify``, not another command."""
    from wcache.cli import main

    path = _fixture("bf16", host_kernels)
    assert 2 == main(["verify", "--model", path, *ENGINE_ARGS, "--quantization", "awq"])
    err = capsys.readouterr().err
    assert "wcache verify: error [config-invalid]: " in err and "vLLM refused it" in err
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--model", path, *ENGINE_ARGS, "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "wcache verify: error:" in err and "wcache serve" not in err


@pytest.mark.parametrize(
    "loaded, restored, expected",
    [
        (
            {"weight": ("param", (2, 3), "torch.bfloat16", (3, 1), "aa")},
            {"weight": ("param", (2, 3), "torch.bfloat16", (1, 2), "aa")},
            "weight stride: (3, 1) != (1, 2)",
        ),
        (
            {"weight": ("param", (2, 3), "torch.bfloat16", (3, 1), "aa"), "@isa_hint": "vec"},
            {"weight": ("param", (2, 3), "torch.bfloat16", (3, 1), "bb"), "@isa_hint": "amx"},
            "weight checksum: 'aa' != 'bb'",
        ),
        ({"@use_w4a8": True, "~x": 1}, {"@use_w4a8": True, "~x": 2}, "~x: 1 != 2"),
        ({"bias": ("param", None)}, {}, "bias: ('param', None) != '<absent>'"),
        ({"~a": 1}, {"~a": 1}, None),
    ],
)
def test_first_difference_names_the_field_and_both_values(loaded, restored, expected):
    """Tensors are compared before attributes, and a tensor's differing part is named."""
    from wcache.vllm.verify import first_difference

    assert expected == first_difference(loaded, restored)


def test_parameter_flags_compare_a_weight_loader_by_its_functions_name():
    """A parameter's loader compares by its function's name, through a partial and a
    bound method: vLLM's AWQ no-op loader and a layer's weight_loader_v2 differ
    (break18 D2: both were "<callable>", and verify passed a restore whose
    load_weights raised), two closures of one name are equal; a bound method's
    layer class counts (break19 N1)."""
    import functools

    from wcache.stages.awq import CONVERTED_PARAM_ATTRS
    from wcache.vllm.verify import parameter_flags

    class Layer(torch.nn.Module):
        def weight_loader_v2(self, param, loaded):
            pass

    def _noop_loader(*args, **kwargs):  # vLLM's, a closure of the conversion
        pass

    def flags(loader):
        layer = Layer()
        layer.w = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        layer.w.weight_loader = loader
        return dict(parameter_flags(layer)["%w"][2])["weight_loader"]

    class Other(Layer):
        pass

    layer = Layer()
    assert flags(layer.weight_loader_v2) == "<callable Layer.weight_loader_v2>"
    assert flags(functools.partial(layer.weight_loader_v2, shard_id=0)) == flags(
        Layer().weight_loader_v2
    )
    assert flags(Other().weight_loader_v2) != flags(layer.weight_loader_v2)  # break19 N1
    assert flags(_noop_loader) == flags(CONVERTED_PARAM_ATTRS["qweight"]["_weight_loader"])
    assert flags(_noop_loader) != flags(layer.weight_loader_v2)


def test_verify_forward_gives_the_process_vllms_workspace_manager():
    """vLLM's fused-MoE kernels assert a workspace manager exists (an engine's model runner
    makes it); verify's forward runs outside an engine, so compat makes one, once."""
    import subprocess
    import sys

    code = (
        "import torch; from vllm.v1.worker import workspace; from wcache.vllm import compat; "
        "d = torch.device('cpu'); print(workspace.is_workspace_manager_initialized(), "
        "compat.init_workspace_manager_(d), compat.init_workspace_manager_(d), "
        "workspace.is_workspace_manager_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-4:] == ["False", "True", "False", "True"], out.stderr[-2000:]


def test_forgetting_a_build_trims_the_moe_layer_list_it_appended():
    """vLLM appends each fused-MoE layer's name to ``static_all_moe_layers`` (its forward
    context indexes it): forgetting a build removes exactly the names it appended."""
    import types

    from wcache.vllm import compat

    cc = types.SimpleNamespace(static_forward_context={"a": 1}, static_all_moe_layers=["m0"])
    cfg = types.SimpleNamespace(compilation_config=cc)
    before = compat.registrations(cfg)
    cc.static_forward_context.update({"l0": 2, "l1": 3})
    cc.static_all_moe_layers.extend(["l0", "l1"])
    compat.forget_registrations_(cfg, before)
    assert (cc.static_forward_context, cc.static_all_moe_layers) == ({"a": 1}, ["m0"])


def test_vllm_logs_quiet_sets_only_what_the_environment_leaves_unset(monkeypatch):
    """`wcache status --wait-ready` builds vLLM's engine config in its own process: while
    it does, vLLM logs to stderr at WARNING (stdout carries the verdict), a variable the
    user set is kept, and what was added is removed after."""
    from wcache.vllm import VLLM_QUIET, vllm_logs_quiet

    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with vllm_logs_quiet():
        assert os.environ["VLLM_LOGGING_STREAM"] == VLLM_QUIET["VLLM_LOGGING_STREAM"]
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "VLLM_LOGGING_STREAM" not in os.environ
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_damaged_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    """A truncated safetensors file or a missing config.json means verify could not
    compare: exit 2 with one [checkpoint-corrupt] / [config-invalid] line naming the
    file, as `wcache serve` refuses them; it was vLLM's traceback mid-load and exit 1
    ("a layer differs")."""
    from safetensors.torch import save_file

    from wcache.cli import main

    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    assert 2 == main(["verify", "--model", str(tmp_path), "--no-progress"])
    assert f"wcache verify: error [config-invalid]: {tmp_path / 'config.json'}: missing" in (
        capsys.readouterr().err
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert 2 == main(["verify", "--model", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert f"wcache verify: error [checkpoint-corrupt]: {tmp_path / 'model.safetensors'}: " in err
    assert "truncated" in err and "Traceback" not in err


def test_verdict_names_a_broken_vllm_load_as_the_likely_cause():
    """When vLLM's own load gives non-finite logits (a MoE config.json whose checkpoint
    lacks the experts' tensors: vLLM's loader leaves them torch.empty, so each build's
    expert bytes differ), the FAILED verdict says the differences may be vLLM's own and
    what to check; it blamed only the first differing expert checksum. Without such
    logits the verdict is as before."""
    from wcache.vllm.verify import NONFINITE_LOGITS, NONFINITE_LOGITS_CAUSE, Row, VerifyReport

    experts = Row(
        "model.layers.0.mlp.experts.routed_experts",
        "unquantized_moe/cpu_amx@1",
        "cpu_amx",
        "w13_weight checksum: 'aa' != 'bb'",
    )
    logits = Row("(logits)", "-", "-", NONFINITE_LOGITS)
    broken = VerifyReport((experts, logits), "in-process", {}, True).summary()
    assert broken == (
        "wcache verify: FAILED (in-process): 2 of 2 checks differ; first: "
        "model.layers.0.mlp.experts.routed_experts: w13_weight checksum: 'aa' != 'bb' "
        f"({NONFINITE_LOGITS_CAUSE})"
    )
    assert "experts' tensors" in NONFINITE_LOGITS_CAUSE
    plain = VerifyReport((experts, Row("(logits)", "-", "-")), "in-process", {}, True)
    assert plain.summary().endswith("w13_weight checksum: 'aa' != 'bb'")


def test_daemon_note_tells_a_stalled_daemon_from_an_exited_one(monkeypatch, tmp_path):
    """After the comparison a daemon that does not answer is "exited" only when its
    socket takes no connection; one that still listens (stopped by SIGSTOP, overloaded)
    is said not to have answered, not to be gone (break pass 9: `kill -STOP` read
    "exited ... start wcache serve again" while it held its socket)."""
    import socket

    import wcache.store as store
    import wcache.vllm.verify as verify_mod
    from wcache.store import DaemonMissing

    sock = str(tmp_path / "d.sock")
    monkeypatch.setattr(verify_mod, "_daemon_socket", lambda *a: sock)

    def silent(path, *a, **k):
        raise DaemonMissing(f"daemon on {path} did not answer 'hello' within 5.0 s")

    monkeypatch.setattr(store, "daemon_status", silent)
    gone = verify_mod._daemon_gone_note(None, None, str(tmp_path), "")
    assert gone.startswith("Note: the daemon has exited since the restore attached")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(sock)
        listener.listen(1)  # listens and never answers: a stopped daemon
        stalled = verify_mod._daemon_gone_note(None, None, str(tmp_path), "")
    assert stalled.startswith("Note: the daemon did not answer after the comparison")
    assert "exited" not in stalled
