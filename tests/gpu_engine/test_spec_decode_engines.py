"""Speculative decoding on restored CUDA engines (H200, vLLM 0.33.0): issue 44, item 3.

Target SmolLM2 bf16 from ``wcache serve``; the draft (the tiny Llama: SmolLM2's
vocabulary and tokenizer) from a second daemon (``--job draft``, the loader's
``draft_job``). Engines run tests/e2e/_spec_engine.py with fallback off:

* ``draft_model`` (eager): target and draft restored; only the target restored
  (``draft='disk'``); a disk engine with the same ``speculative_config``;
* ``eagle`` (CUDA graphs on: cudagraph_mode FULL, no compile): a random EAGLE-1 head
  (wcache.testing.spec_decode) without embed_tokens and lm_head, restored target vs
  a disk engine;
* ``ngram`` (CUDA graphs on): no drafter weights, the target restored vs a disk engine.

For ``eagle``, one engine each beyond the default (``cuda_vmm``, zero-copy): the target
restored with ``mode=copy`` from the same daemon, and from a second target daemon
forced onto the ``cuda_ipc`` transport (tests/gpu_engine/_serve_cuda_ipc.py): the
quickstart table's ``copy`` and ``cuda_ipc`` cells.

Greedy speculative decoding gives the target's greedy tokens, so each restored
engine's tokens equal the disk engine's. The EAGLE head's embed_tokens and lm_head
are the target's modules, their weights inside the target's mapped arena (mapped once);
after the engines exit, each daemon saw every attachment released once. The drafter
gets the tier's attention backend (``speculative_config.attention_backend``: vLLM
0.33 otherwise autoselects one for it). Each engine has :data:`SPEC_ENGINE_TIMEOUT_S`;
a disk engine that fails or hangs is vLLM's own problem: its cases are recorded
``not-runnable`` with that reason and skipped. One row per case goes to
:func:`wcache.testing.engine_acceptance.record_result`.

Run on the H200: ``bash tools/gpu/run-tier.sh -k spec_decode`` or, after
``source tools/gpu/env.sh``, ``python -m pytest tests/gpu_engine/test_spec_decode_engines.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from wcache.daemon.process import DaemonProcess, first_traceback

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "_spec_engine.py"
#: The daemon builds the model's attention layers too (wcache.testing.engine_acceptance).
SERVE_ARGS = ("--attention-backend", "TRITON_ATTN")
#: One engine's start and 2x12 greedy tokens: ~30-40 s on the H200 eager, a few more
#: with graph capture, more with six engines starting side by side; one that needs more
#: is hung (the earlier manual try of a draft-model engine from disk hung in its first
#: generate for minutes).
SPEC_ENGINE_TIMEOUT_S = 300.0
#: Engines run side by side (the disk engines, then the restored ones): ten engine starts
#: one after another took ~10 min on an H100 (2026-12-05, 523 s for eight).
SPEC_PARALLEL = int(os.environ.get("WCACHE_SPEC_PARALLEL", "6"))
NUM_SPEC_TOKENS = 3
DRAFT_JOB = "draft"
#: Per method: the graph mode of its engines (eager for draft_model, graphs on for eagle).
MODES = {"draft_model": "eager", "eagle": "graphs", "ngram": "graphs"}
#: ``wcache serve`` with cuda_vmm reported missing: the daemon serves over cuda_ipc.
IPC_SERVE = Path(__file__).with_name("_serve_cuda_ipc.py")


class EngineFailed(Exception):
    """An engine exited non-zero, printed no result, or ran past its timeout."""


def _engine(model: str, spec: dict, load_format: str, extra: dict, mode: str) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    cmd = [sys.executable, str(SCRIPT), "--model", model, "--spec", json.dumps(spec)]
    cmd += ["--load-format", load_format, "--extra", json.dumps(extra)]
    cmd += ["--device", "cuda", "--mode", mode]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=SPEC_ENGINE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        raise EngineFailed(
            f"{load_format} engine ran past {SPEC_ENGINE_TIMEOUT_S:.0f} s (hung); last lines:\n"
            + "\n".join(out.splitlines()[-15:])
        ) from exc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        out = proc.stdout + proc.stderr
        raise EngineFailed(
            f"{load_format} engine exited {proc.returncode}\n"
            f"{first_traceback(out) or ''}\n" + "\n".join(out.splitlines()[-25:])
        )
    return json.loads(lines[-1])


def _socket(daemon: DaemonProcess) -> str:
    found = [m.group(1) for ln in daemon.ready_lines if (m := re.search(r"socket=(\S+)", ln))]
    assert found, daemon.ready_lines
    return found[-1]


def _try(out: dict, name: str, *args) -> None:
    try:
        out[name] = _engine(*args)
    except EngineFailed as exc:
        out[name] = {"error": str(exc)}


def _wave(jobs: list[tuple[dict, str, tuple]]) -> None:
    """Run each ``(out, name, engine args)`` job's engine, :data:`SPEC_PARALLEL` at a
    time (each a process of its own with a fixed KV cache, as the tier's workers), and
    wait for all: a failure other than the engine's own is raised."""
    with ThreadPoolExecutor(max_workers=SPEC_PARALLEL) as pool:
        for done in [pool.submit(_try, out, name, *args) for out, name, args in jobs]:
            done.result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from wcache.store import daemon_status
    from wcache.testing.engine_acceptance import ATTENTION_BACKEND
    from wcache.testing.fixtures import build
    from wcache.testing.spec_decode import write_random_eagle_head
    from wcache.testing.tiny_models import build_arch

    target, draft = str(build("bf16")), str(build_arch("llama"))
    head = write_random_eagle_head(target, str(tmp_path_factory.mktemp("eagle")))
    common = {"num_speculative_tokens": NUM_SPEC_TOKENS, "attention_backend": ATTENTION_BACKEND}
    specs = {
        "draft_model": {"method": "draft_model", "model": draft, **common},
        "eagle": {"method": "eagle", "model": head, **common},
        # no drafter weights; vLLM points its draft config at the target's own
        "ngram": {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1, **common},
    }
    out: dict = {}
    ipc: dict = {}
    with (
        tempfile.TemporaryDirectory(prefix="wc-spec-gpu-") as sock,
        tempfile.TemporaryDirectory(prefix="wc-spec-ipc-") as ipc_sock,
    ):
        ipc_daemon = DaemonProcess(target, ipc_sock, extra_args=SERVE_ARGS)
        ipc_daemon.args[1:3] = [str(IPC_SERVE)]  # [python, -m, wcache.cli, ...] -> wrapper
        with (
            DaemonProcess(target, sock, extra_args=SERVE_ARGS) as tgt_daemon,
            DaemonProcess(draft, sock, extra_args=(*SERVE_ARGS, "--job", DRAFT_JOB)) as dd,
            ipc_daemon,
        ):
            extra = {"socket_dir": sock, "fallback": False}
            _wave(
                [
                    (out, f"{method}.disk", (target, spec, "auto", {}, MODES[method]))
                    for method, spec in specs.items()
                ]
            )
            restored: list[tuple[dict, str, tuple]] = []
            for method, spec in specs.items():
                if "error" in out[f"{method}.disk"]:
                    continue  # vLLM's own failure: no restored engine to compare
                mode = MODES[method]
                restored.append((out, f"{method}.restored", (target, spec, "wcache", extra, mode)))
                if method == "draft_model":
                    only_target = {**extra, "draft": "disk"}
                    restored.append(
                        (out, f"{method}.target_only", (target, spec, "wcache", only_target, mode))
                    )
                if method == "eagle":
                    copy = {**extra, "mode": "copy"}
                    restored.append((out, f"{method}.copy", (target, spec, "wcache", copy, mode)))
                    ipc_extra = {"socket_dir": ipc_sock, "fallback": False}
                    restored.append(
                        (ipc, "eagle.cuda_ipc", (target, spec, "wcache", ipc_extra, mode))
                    )
            _wave(restored)
            out["status"] = {
                name: daemon_status(_socket(d))
                for name, d in (("target", tgt_daemon), ("draft", dd))
            }
    if ipc:
        out["ipc"] = ipc
    return out


def _record(case: str, outcome: str, **info) -> None:
    from wcache.testing.engine_acceptance import record_result

    record_result({"case": f"spec_decode/{case}", "outcome": outcome, **info})


def _disk(runs: dict, method: str) -> dict:
    disk = runs[f"{method}.disk"]
    if "error" in disk:
        _record(method, "not-runnable", reason=disk["error"][-2000:], mode=MODES[method])
        pytest.skip(
            f"the disk {method} engine itself failed (vLLM, not wcache): {disk['error'][:300]}"
        )
    return disk


def _restored_equals_disk(runs: dict, method: str, case: str) -> dict:
    """The ``method.case`` engine against the disk engine (its row recorded): no error,
    the disk engine's tokens, the target mapped over a CUDA transport; returns its run."""
    disk = _disk(runs, method)
    got = runs[f"{method}.{case}"]
    target = got.get("target")
    mapped = target is not None and target["transport"].startswith("cuda")
    ok = "error" not in got and got["tokens"] == disk["tokens"] and mapped
    _record(
        f"{method}.{case}",
        "pass" if ok else "fail",
        mode=MODES[method],
        error=got.get("error", "")[-2000:],
        tokens=got.get("tokens"),
        disk_tokens=disk["tokens"],
    )
    assert "error" not in got, got.get("error")
    assert got["tokens"] == disk["tokens"]
    assert mapped, target
    return got


@pytest.mark.parametrize("case", ["restored", "target_only"])
def test_draft_model_tokens_equal_disk(runs, case):
    """draft_model, target and draft restored (or only the target), gives the disk engine's tokens (eager)."""
    got = _restored_equals_disk(runs, "draft_model", case)
    if case == "restored":
        t, d = got["target"], got["draft"]
        assert d is not None and (d["hi"] <= t["lo"] or t["hi"] <= d["lo"])
    else:
        assert got["draft"] is None


def test_eagle_head_shares_target_mapped_tensors(runs):
    """The EAGLE engine (graphs on) gives the disk tokens; the head's embed_tokens/lm_head are the target's, inside its arena."""
    disk = _disk(runs, "eagle")
    got = runs["eagle.restored"]
    shared = got.get("shared", {})
    ok = (
        "error" not in got
        and got["tokens"] == disk["tokens"]
        and all(s and s["same_module"] and s["in_target_arena"] for s in shared.values())
    )
    _record(
        "eagle.restored",
        "pass" if ok else "fail",
        mode=MODES["eagle"],
        error=got.get("error", "")[-2000:],
        shared=shared,
    )
    assert "error" not in got, got.get("error")
    assert got["tokens"] == disk["tokens"]
    assert "sharing_error" not in got, got["sharing_error"]  # the engine script's probe
    assert got["drafter"] == "EagleLlamaForCausalLM" and got["draft"] is None
    for name in ("embed_tokens", "lm_head"):
        assert shared[name]["same_module"] is True, name
        assert shared[name]["draft_ptr"] == shared[name]["target_ptr"], name
        assert shared[name]["in_target_arena"] is True, name


def test_ngram_restores_the_target(runs):
    """ngram (graphs on, no drafter weights): the target maps its daemon's arena and
    gives the disk engine's tokens (break18 D1: its target once loaded from disk)."""
    got = _restored_equals_disk(runs, "ngram", "restored")
    assert got["drafter"] is None and got["draft"] is None


def test_every_attachment_released_once(runs):
    """After the engines exit each daemon has no attachment left, and released each one once."""
    attached = {"target": 0, "draft": 0}
    for name, res in runs.items():
        if name in ("status", "ipc") or "error" in res:
            continue
        if name == "eagle.copy":  # attached, copied, released: the attachment may be gone
            attached["target"] += 1
            continue
        if res.get("target") is None:
            continue
        attached["target"] += 1
        attached["draft"] += res.get("draft") is not None
    for name, status in runs["status"].items():
        assert status["attachments_active"] == 0, name
        assert status["attachments_total"] == attached[name], name
        assert sum(status["releases"].values()) == attached[name], name


@pytest.mark.parametrize("variant", ["copy", "cuda_ipc"])
def test_eagle_on_copy_and_cuda_ipc_equals_disk(runs, variant):
    """EAGLE (graphs on) with the target restored by mode=copy, or from a cuda_ipc
    daemon, gives the disk engine's tokens; the head's embed_tokens/lm_head are the
    target's modules (cuda_ipc: inside its mapped arena)."""
    disk = _disk(runs, "eagle")
    got = runs["ipc"]["eagle.cuda_ipc"] if variant == "cuda_ipc" else runs["eagle.copy"]
    _record(
        f"eagle.{variant}",
        "pass" if "error" not in got and got["tokens"] == disk["tokens"] else "fail",
        mode=MODES["eagle"],
        error=got.get("error", "")[-2000:],
    )
    assert "error" not in got, got.get("error")
    assert got["tokens"] == disk["tokens"]
    assert "sharing_error" not in got, got["sharing_error"]
    for name in ("embed_tokens", "lm_head"):
        assert got["shared"][name]["same_module"] is True, name
        assert got["shared"][name]["draft_ptr"] == got["shared"][name]["target_ptr"], name
    if variant == "cuda_ipc":
        assert got["target"]["transport"] == "cuda_ipc"
        assert all(got["shared"][n]["in_target_arena"] for n in ("embed_tokens", "lm_head"))
