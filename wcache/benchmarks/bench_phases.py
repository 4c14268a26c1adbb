"""`wcache bench --phases`: where the time of a whole engine start goes, phase by phase.

For one model, each row is one vLLM engine started in its own process
(:func:`wcache.daemon.process.run_engine`), timed from process start to the first
token of its first request, and split into the phases of
:data:`wcache.benchmarks.phases.PHASES`: process start, vLLM import, model build,
weights, compile, graph capture, KV-cache profiling/other engine init, other, first
token (how each is measured: :mod:`wcache.benchmarks.phases`). The rows (run in
this order, whatever order ``--rows`` gives):

  disk-eager            weights from disk, enforce_eager
  daemon-eager          weights from a `wcache serve` daemon, enforce_eager
  disk-compiled-cold    from disk, torch.compile (+ CUDA graphs), empty compile caches
  disk-compiled-warm    the same on the caches the cold row left (a restart)
  daemon-compiled-cold  from the daemon, compiled, empty caches
  daemon-compiled-warm  the same on the caches its cold row left
  fresh-node            empty caches, against a daemon started --from-snapshot of a
                        snapshot written by a daemon started with --prime-compile (it
                        carries vLLM's compile artifacts; the engine installs them at
                        attach), the engine forked from an engine template started
                        beside that daemon (`wcache run --no-fallback -- python -m
                        wcache.vllm.run_engine ...`, docs/template.md): timed from the
                        launch of `wcache run`; the template's own start (its imports)
                        is reported apart (``template``), as it is paid before the
                        restart; reported as not run when `wcache serve` has no
                        --prime-compile
  fresh-node-direct     the same fresh node, the engine started directly (no template)

Pairs (``--pairs N``): the rows asked for run N times in turn, each time on new cache
roots, new daemons and a new template; the primed snapshot is made once (and kept under
--root, named by a key of what it depends on, for later calls). Each pair of
disk-compiled-cold and fresh-node from one run gives one ratio; the target judges the
median of at least :data:`MIN_PAIRS` of them. Pairs from several calls' JSON merge
(``--from-json``): every pair counts once.

Caches: every "node" is one root of :func:`wcache.testing.caches.cache_env`
(vLLM's torch.compile cache, Triton, Inductor, the CUDA JIT cache). A cold row gets
an empty root; a warm row the root its cold row filled (or one filled by an
unrecorded warm-up start when its cold row is not asked for). Eager rows each get an
empty root too. A fresh node's row records the Triton cache entries its engine holds
beyond those its start-up bundle carried (``triton``: by kernel name; a kernel the
bundle carried under another key is a missed entry, its metadata difference named and
both entries' metadata and TTIR kept in ``LOG_DIR/ROW.triton/``), and the table says so.

Model: on CUDA the 8B-shaped bf16 Llama of
:mod:`wcache.benchmarks.bench_engine_cuda` (written once under --root), production
defaults (vLLM's max_model_len and max_num_seqs, so its CUDA graph sizes; KV cache by
profiling 0.3 of the GPU, as the other 8B benchmarks, with the daemon's copy beside
it; attention TRITON_ATTN); on CPU the SmolLM2-135M bf16 fixture with the small-host
settings of wcache.vllm.run_engine (max_model_len 512, one sequence).

Output: JSON (--out: every row, phase, figure, command, versions, device), a markdown
table (stdout, and --markdown) with the ratio disk-compiled-cold / fresh-node for the
target and the phases that remain, and a PNG of stacked bars (--plot; matplotlib).
Timings come from one run; nothing asserts them.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from wcache.benchmarks.host import (
    QUIET_PENDING_MIB,
    QUIET_TIMEOUT_S,
    cpu_shares,
    cpu_times,
    describe,
    quiet_host,
)
from wcache.benchmarks.phases import (
    NEGLIGIBLE_S,
    PHASES,
    breakdown,
    parse_log,
    phase_lines,
    total_s,
)
from wcache.benchmarks.plot import pyplot_for
from wcache.cli_args import csv_values, reasoned, refuse_unknown_or_missing
from wcache.daemon.process import engine_failure_cause, template_launcher
from wcache.store.protocol import parse_seconds
from wcache.testing.caches import (
    CACHE_ENV_DIRS,
    cache_env,
    cache_states,
    cache_writes,
    carried_triton_keys,
    host_cache_dirs,
    triton_compiled,
)
from wcache.testing.engine_acceptance import source_revision
from wcache.vllm import VLLM_LOG_TO_STDERR
from wcache.vllm.run_engine import vllm_engine_args

__all__ = [
    "ROWS",
    "Row",
    "run",
    "table",
    "plot_phases",
    "main",
    "merge_results",
    "prime_compile_supported",
]

HELP_EPILOG = """\
target (issue 48; docs/benchmarks.md records what was reached):
  8B-shaped, production defaults: on a fresh node (empty compile cache) an engine
  forked from the engine template against a daemon seeded from a snapshot reaches its
  first token at least 8x faster than the same engine from disk: the median of
  disk-compiled-cold / fresh-node over at least 3 pairs, each pair measured in one run.

examples:
  wcache bench --phases                                   # every row; cuda if present
  wcache bench --phases --rows disk-eager,daemon-eager --model-kind tiny
  wcache bench --phases --device cuda --out $OUT/phases.json --plot $OUT/phases.png
  wcache bench --phases --rows disk-compiled-cold,fresh-node --pairs 3 --out p.json
  wcache bench --phases --rows disk-compiled-cold,fresh-node --pairs 3 --model-kind moe30b-fp8
  wcache bench --phases --from-json a.json b.json --out all.json --markdown all.md
"""


@attrs.frozen
class Row:
    """One row of the benchmark.

    Attributes:
        name: the row's id (``--rows``).
        source: ``disk``, ``daemon`` (a `wcache serve` from the checkpoint) or
            ``snapshot`` (the fresh node: a daemon --from-snapshot of a primed one).
        compiled: torch.compile and CUDA graphs (run_engine ``--compile``).
        caches: ``cold`` (an empty cache root) or ``warm`` (the root of its cold row).
        template: the engine is forked from an engine template (``wcache run``).
    """

    name: str
    source: str
    compiled: bool
    caches: str
    template: bool = False

    @property
    def node(self) -> str:
        """The cache root's name: a warm row shares its cold row's."""
        return f"{self.source}-{'compiled' if self.compiled else 'eager'}"


ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        Row("disk-eager", "disk", False, "cold"),
        Row("daemon-eager", "daemon", False, "cold"),
        Row("disk-compiled-cold", "disk", True, "cold"),
        Row("disk-compiled-warm", "disk", True, "warm"),
        Row("daemon-compiled-cold", "daemon", True, "cold"),
        Row("daemon-compiled-warm", "daemon", True, "warm"),
        Row("fresh-node", "snapshot", True, "cold", template=True),
        Row("fresh-node-direct", "snapshot", True, "cold"),
    )
}
#: The target's two rows and its ratio (issue 48: 8x; issue 24's was 3x).
TARGET_DISK_ROW, TARGET_ROW, TARGET_RATIO = "disk-compiled-cold", "fresh-node", 8.0
#: Pairs the target's median needs (issue 48: one run's ratio moved by +-0.3x
#: between calls, so one pair does not judge it).
MIN_PAIRS = 3
#: Where run_engine's process-start mark comes from in a template child (the
#: launch of `wcache run`, wcache.template.started).
TEMPLATE_START_SOURCE = "wcache-run-client"
#: Seconds `wcache template start` may take on the H200 (torch + vLLM ~25 s there).
TEMPLATE_START_TIMEOUT_S = 300.0
#: The closest measured row when the fresh node cannot run (said so in the table).
SUBSTITUTE_ROW = "daemon-compiled-warm"
PROMPT = "The capital of France is"
#: Tokens generated after the first-token request (the same for every row, compared).
MAX_TOKENS = 8
#: The `wcache serve` option the fresh-node row needs (the prime-compile branch).
PRIME_COMPILE_FLAG = "--prime-compile"
#: One engine start with a cold Inductor compile: minutes on 2 CPU cores, ~75 s for
#: the 8B shape on the H200; room for a busy machine.
ENGINE_TIMEOUT_S = 1800.0
#: `wcache serve --help` answers in a few seconds (it imports no vLLM).
HELP_TIMEOUT_S = 120.0
#: Share of the H200 an 8B engine may claim (bench_engine_cuda's, with the daemon's copy).
CUDA_GPU_MEMORY_UTILIZATION = 0.3
CUDA_ATTENTION_BACKEND = "TRITON_ATTN"
#: CPU engines: run_engine's small-host defaults (the daemon's ENGINE_ARGS match them).
CPU_MAX_MODEL_LEN = 512
#: run_engine's value for "vLLM's default" (max_num_seqs).
VLLM_DEFAULT = 0
MODEL_KINDS = ("8b", "moe30b-fp8", "smol", "tiny")
#: Decoder layers of the moe30b-fp8 checkpoint (of Qwen3-30B-A3B's 48), as the MoE
#: benchmarks write it (wcache.testing.moe_bench.DEFAULT_LAYERS: ~0.6 GB of experts a
#: layer; the checkpoint, its snapshot and the cache roots share the GPU machine's disk).
MOE_LAYERS = 12
#: Qwen3-30B-A3B's depth: the most layers --moe-layers takes.
MOE_MAX_LAYERS = 48
#: Figure size (inches) and resolution of the PNG: readable at GitHub's page width.
FIGSIZE_IN = (8.0, 4.2)
DPI = 150
#: The meta fields two runs' JSON must share to be merged into one table.
COMPARABLE_META = (
    "device_name",
    "vllm",
    "torch",
    "model_kind",
    "engine_args",
    "serve_args",
    "engine_env",
    "stack_samples_s",
)
#: The primed snapshot kept under --root: ``{SNAPSHOT_PREFIX}{key}`` and its record.
SNAPSHOT_PREFIX = "snapshot-primed-"
#: Hex digits of the snapshot's key (64 bits: names, not a security boundary).
SNAPSHOT_KEY_CHARS = 16
#: The directory --stack-samples puts first on the engines' PYTHONPATH (its sitecustomize).
STACK_SAMPLER_DIR = str(Path(__file__).resolve().parent / "_stack_sampler")


def _log(msg: str) -> None:
    print(f"wcache bench --phases: {msg}", file=sys.stderr, flush=True)


def prime_compile_supported() -> tuple[bool, str]:
    """Whether `wcache serve` knows :data:`PRIME_COMPILE_FLAG` (from its ``--help``).

    Returns:
        ``(supported, reason)``; ``reason`` says why not.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "wcache.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    if PRIME_COMPILE_FLAG in proc.stdout:
        return True, ""
    return False, (
        f"`wcache serve` has no {PRIME_COMPILE_FLAG} option on this checkout (the "
        f"prime-compile branch is not merged): the fresh-node row needs a snapshot "
        f"that carries vLLM's compile artifacts"
    )


def model_setup(
    kind: str, device: str, root: Path, model: str | None = None, moe_layers: int = MOE_LAYERS
) -> tuple[Path, list[str], list[str]]:
    """The checkpoint, the run_engine options and the `wcache serve` options of a kind.

    Kinds (:data:`MODEL_KINDS`): ``8b`` (bench_engine_cuda's Llama-3-8B-shaped bf16
    Llama), ``moe30b-fp8`` (wcache.testing.moe_bench's Qwen3-30B-A3B-shaped MoE in block
    FP8 128x128, as Qwen/Qwen3-30B-A3B-FP8 ships it, with ``moe_layers`` of its 48
    decoder layers), ``smol`` (the SmolLM2-135M bf16 fixture), ``tiny`` (a 2-layer bf16
    Llama); each written under ``root`` once (a complete one is reused).

    Returns:
        ``(checkpoint, engine_args, serve_args)``; both argument lists set the same
        max_model_len (it is part of the cache key).

    Raises:
        ValueError: an unknown ``kind`` (without ``model``).
    """
    from wcache.testing.fixtures import build  # noqa: PLC0415 (torch import ~2 s: only when called)

    if model is not None:
        path = Path(model)
    elif kind == "8b":
        from wcache.benchmarks.bench_engine_cuda import write_llama_checkpoint  # noqa: PLC0415 (torch import ~2 s: only when called)

        path = write_llama_checkpoint(root / "llama-8b-bf16", "bf16", Path(build("bf16")))
    elif kind == "moe30b-fp8":
        from wcache.testing.moe_bench import write_under  # noqa: PLC0415 (torch import ~2 s: only when called)

        path = write_under(root, "fp8_block", moe_layers)
    elif kind == "tiny":
        from wcache.testing.tiny import build_tiny  # noqa: PLC0415 (torch import ~2 s: only when called)

        path = Path(build_tiny("bf16"))
    elif kind == "smol":
        path = Path(build("bf16"))
    else:
        raise ValueError(f"unknown model kind {kind!r}; choose from {', '.join(MODEL_KINDS)}")
    if device == "cuda":
        cfg = json.loads((path / "config.json").read_text())
        max_len = str(cfg["max_position_embeddings"])  # vLLM's default for the model
        engine = [
            "--attention-backend",
            CUDA_ATTENTION_BACKEND,
            "--gpu-memory-utilization",
            str(CUDA_GPU_MEMORY_UTILIZATION),
            "--max-model-len",
            max_len,
            "--max-num-seqs",
            str(VLLM_DEFAULT),
        ]
        serve = ["--attention-backend", CUDA_ATTENTION_BACKEND, "--max-model-len", max_len]
    else:
        engine = ["--max-model-len", str(CPU_MAX_MODEL_LEN)]
        serve = []
    return path, engine, serve


def _error_lines(exc: BaseException) -> list[str]:

    lines = [ln.strip() for ln in engine_failure_cause(exc).splitlines() if ln.strip()]
    return lines[-6:]


class _Runner:
    """Runs the rows: owns the cache roots, the daemons and the engine calls."""

    def __init__(
        self,
        ckpt: Path,
        engine_args: Sequence[str],
        serve_args: Sequence[str],
        device: str,
        work: Path,
        log: Callable[[str], None],
        log_dir: Path | None = None,
        stack_samples_s: float = 0.0,
        engine_env: Mapping[str, str] | None = None,
        snapshot_root: Path | None = None,
        quiet_timeout_s: float = QUIET_TIMEOUT_S,
    ):
        self.ckpt, self.device, self.work, self.log = ckpt, device, work, log
        #: the longest wait for the host's writeback before each timed engine start
        self.quiet_timeout_s = quiet_timeout_s
        #: where the primed snapshot is kept for later runs (default: ``work``, gone
        #: with it)
        self.snapshot_root = snapshot_root or work
        self._primed: tuple[Path, dict[str, Any]] | None = None
        self.log_dir, self.stack_samples_s = log_dir, stack_samples_s
        self.engine_env = dict(engine_env or {})
        self.engine_args, self.serve_args = list(engine_args), list(serve_args)
        self.nodes: dict[str, Path] = {}
        self.warmed: set[str] = set()
        self.daemon: Any = None
        self.daemon_info: dict[str, Any] = {}
        self.fresh = 0

    def node(self, name: str, fresh: bool) -> Path:
        """The cache root of ``name``: a new empty one when ``fresh``."""

        if fresh or name not in self.nodes:
            self.fresh += 1
            root = self.work / f"node-{self.fresh}-{name}"
            shutil.rmtree(root, ignore_errors=True)
            cache_env(root)
            self.nodes[name] = root
        return self.nodes[name]

    def env_of(self, root: Path, name: str) -> dict[str, str]:
        """What run_engine adds to the environment of row ``name``'s engine on the
        cache root ``root`` (a template for it starts with the same)."""
        return {
            **cache_env(root),
            **VLLM_LOG_TO_STDERR,
            **self.engine_env,
            **self._sampler_env(name),
        }

    def engine(
        self,
        load_format: str,
        extra: dict,
        compiled: bool,
        root: Path,
        name: str,
        launcher: Sequence[str] = (),
    ) -> dict:
        """One engine of row ``name`` (``launcher`` before its command: ``wcache run``);
        its whole log goes to ``log_dir/name.log``, what it wrote into each cache (its
        node's and the host's) to ``res["cache_writes"]``."""
        from wcache.daemon.process import run_engine  # noqa: PLC0415 (imported at call time: tests patch run_engine)

        args = self.engine_args + (["--compile"] if compiled else [])
        watched = {
            **{f"node/{sub}": root / sub for sub in CACHE_ENV_DIRS.values()},
            **host_cache_dirs(),
        }
        # the previous row's writes (a checkpoint, a snapshot, cache roots) flushed
        # before this row's clock starts, and the host's state recorded (wcache.benchmarks.host)
        host = quiet_host(timeout_s=self.quiet_timeout_s)
        if host.get("quiet") is False:
            self.log(f"{name}: the host is not quiet before the start: {describe(host)}")
        before = cache_states(watched)
        cpu0 = cpu_times()
        t0 = time.time()
        try:
            res = run_engine(
                self.ckpt,
                load_format,
                extra,
                prompts=[PROMPT],
                max_tokens=MAX_TOKENS,
                env=self.env_of(root, name),
                timeout_s=ENGINE_TIMEOUT_S,
                engine_args=args,
                launcher=list(launcher),
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out = getattr(exc, "output", None)
            self._keep_log(
                name, (out.decode(errors="replace") if isinstance(out, bytes) else out) or str(exc)
            )
            raise
        cpu1 = cpu_times()  # the start's window ends here, before this process's own work
        self._keep_log(name, res.get("output") or res.get("log") or "")
        res["wall_s"] = time.time() - t0
        res["cache_writes"] = cache_writes(before, cache_states(watched))
        res["spawn_time"] = t0
        res["host"] = {**host, "during": cpu_shares(cpu0, cpu1)}
        res["command"] = {
            "launcher": list(launcher),
            "module": "wcache.vllm.run_engine",
            "model": str(self.ckpt),
            "load_format": load_format,
            "extra": extra,
            "engine_args": args,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "env": {**cache_env(root), **self.engine_env},
        }
        return res

    def _sampler_env(self, name: str) -> dict[str, str]:
        """With --stack-samples: the environment that makes every Python process of the
        engine sample its stacks into ``log_dir/name.stacks.{pid}``
        (wcache/benchmarks/_stack_sampler, read by wcache.benchmarks.stacks)."""
        if not self.stack_samples_s or self.log_dir is None:
            return {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONPATH": STACK_SAMPLER_DIR + (os.pathsep + path if path else ""),
            "WCACHE_STACK_SAMPLES": str(self.log_dir / f"{name}.stacks"),
            "WCACHE_STACK_SAMPLE_S": str(self.stack_samples_s),
        }

    def _keep_log(self, name: str, text: str) -> None:
        """The engine's whole output (stdout and stderr) in ``log_dir/name.log``."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{name}.log").write_text(text)

    def disk_format(self) -> str:
        # CPU: vLLM's default loader timed by wcache (vLLM's CPU model runner logs no
        # "Model loading took"); CUDA: plain "auto", timed by vLLM's own line
        return "wcache_timed_auto" if self.device == "cpu" else "auto"

    def daemon_socket(self) -> str:
        from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

        if self.daemon is None:
            sock = tempfile.mkdtemp(prefix="wcb-phases-")
            self.daemon = DaemonProcess(
                self.ckpt,
                sock,
                extra_args=self.serve_args,
                env=cache_env(self.node("daemon", fresh=True)),
            )
            self.daemon.start()
            self.daemon_info = {
                "ready_s": self.daemon.ready_s,
                "command": self.daemon.args,
                "ready_line": self.daemon.ready_lines[-1:],
            }
            self.log(f"daemon ready in {self.daemon.ready_s:.1f} s")
        return self.daemon.socket_dir

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            shutil.rmtree(self.daemon.socket_dir, ignore_errors=True)
            self.daemon = None

    def snapshot_key(self) -> str:
        """What the primed snapshot depends on, hashed: the checkpoint (path, config
        mtime), the serve and engine arguments, the engines' environment switches (the
        benchmark's own and the ``VLLM_*``, ``TORCH*`` and ``PYTORCH_*`` variables this
        process passes on, e.g. ``VLLM_USE_AOT_COMPILE``, a vLLM compile factor: a
        bundle primed under another value is stale to the engine, which then compiles
        in full) and the wcache, vLLM and torch installs (the template's stamps: a
        changed file of any of them makes a new snapshot, never a reused stale one).
        The cache roots (:data:`CACHE_ENV_DIRS`) are left out: every node sets its own."""
        import importlib.util  # noqa: PLC0415 (only the fresh-node rows need it)

        from wcache.template import versions  # noqa: PLC0415 (only the fresh-node rows need it)

        stamps = {}
        for name in versions.KEYED_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin:
                stamps[name] = versions.package_stamp(os.path.dirname(spec.origin), name)
        cfg = self.ckpt / "config.json"
        basis = {
            "checkpoint": str(self.ckpt),
            "config_mtime_ns": cfg.stat().st_mtime_ns if cfg.exists() else None,
            "serve_args": self.serve_args,
            "engine_args": self.engine_args,
            "engine_env": self.engine_env,
            "inherited_env": {
                k: v
                for k, v in sorted(os.environ.items())
                if k.startswith(("VLLM_", "TORCH", "PYTORCH_")) and k not in CACHE_ENV_DIRS
            },
            "packages": stamps,
        }
        return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[
            :SNAPSHOT_KEY_CHARS
        ]

    def primed_snapshot(self) -> tuple[Path, dict[str, Any]]:
        """The snapshot of a daemon primed with vLLM's compile artifacts, and how it was
        made: made once per run, kept under ``snapshot_root`` as
        ``snapshot-primed-KEY`` (:meth:`snapshot_key`) with ``snapshot-primed-KEY.json``
        written last (its priming record), so a later run on the same machine reuses a
        complete one of the same key (``reused``) and removes the others."""
        from wcache.daemon.process import DaemonProcess  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

        if self._primed is not None:
            return self._primed
        key = self.snapshot_key()
        snap = self.snapshot_root / f"{SNAPSHOT_PREFIX}{key}"
        record = snap.with_name(snap.name + ".json")
        if snap.is_dir() and record.is_file():
            kept = {**json.loads(record.read_text()), "reused": True, "snapshot": str(snap)}
            self.log(f"reusing the primed snapshot {snap} (key {key})")
            self._primed = (snap, kept)
            return self._primed
        for old in self.snapshot_root.glob(f"{SNAPSHOT_PREFIX}*"):  # other keys: stale
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        info: dict[str, Any] = {"key": key, "reused": False, "snapshot": str(snap)}
        with tempfile.TemporaryDirectory(prefix="wcb-prime-") as sock:
            # the priming engine is built from the serve's arguments: give it the
            # engines' (vLLM's compile key covers max_model_len and max_num_seqs; the
            # memory share lets it start beside the daemon)
            prime = DaemonProcess(
                self.ckpt,
                sock,
                # the engines' switches too: the priming engine compiles what they load
                # (vLLM's compile key covers VLLM_USE_MEGA_AOT_ARTIFACT)
                env={**cache_env(self.node("prime", True)), **self.engine_env},
                extra_args=[
                    *self.serve_args,
                    *vllm_engine_args(list(self.engine_args)),
                    # its engines are run_engine's LLM()
                    PRIME_COMPILE_FLAG,
                    "llm",
                    "--snapshot",
                    str(snap),
                ],
            )
            with prime:
                t0 = time.time()
                info["prime_daemon"] = {
                    "ready_s": prime.ready_s,
                    "command": prime.args,
                    "primed": prime.wait_primed(),
                    "priming_s": time.time() - t0,
                }
        record.write_text(json.dumps(info, default=str))
        self._primed = (snap, info)
        return self._primed

    def start_template(self, sock: str, env: Mapping[str, str]) -> dict[str, Any]:
        """An engine template in ``sock`` started with ``env`` (the engine's whole
        environment); its ready record, with ``ready_s`` (from the start to listening)."""
        from wcache.template.client import start_template  # noqa: PLC0415 (imported at call time: tests patch it)

        t0 = time.time()
        st = start_template(sock, env=dict(env), timeout_s=TEMPLATE_START_TIMEOUT_S)
        keep = ("pid", "import_s", "modules", "rss_kib", "threads", "cuda_initialized")
        return {
            "ready_s": time.time() - t0,
            **{k: st.get(k) for k in keep},
            "import_times_s": st.get("import_times_s", {}),
            "skipped": st.get("skipped", {}),
            "versions": {
                n: p.get("version")
                for n, p in st.get("fingerprint", {}).get("packages", {}).items()
            },
        }

    @staticmethod
    def stop_template(sock: str) -> None:
        from wcache.template.client import stop_template  # noqa: PLC0415 (imported at call time: tests patch it)
        from wcache.template.errors import TemplateError  # noqa: PLC0415 (as above)

        try:
            stop_template(sock)
        except TemplateError:
            pass  # none runs (its start failed): nothing to stop

    def fresh_node(self, row: Row, label: str) -> dict[str, Any]:
        """The fresh-node rows: the primed snapshot, a daemon --from-snapshot on an
        empty cache root and an engine; with ``row.template`` a template started
        beside that daemon (both before the restart) forks the engine."""
        from wcache.daemon.process import DaemonProcess, engine_environment  # noqa: PLC0415 (imported at call time: tests patch DaemonProcess)

        ok, reason = prime_compile_supported()
        if not ok:
            return {"not_run": reason}
        snap, prime_info = self.primed_snapshot()
        info: dict[str, Any] = {"prime": prime_info}
        root = self.node(row.node, fresh=True)
        with tempfile.TemporaryDirectory(prefix="wcb-fresh-") as sock:
            served = DaemonProcess(
                self.ckpt,
                sock,
                env=cache_env(root),
                extra_args=[*self.serve_args, "--from-snapshot", str(snap)],
            )
            pool = ThreadPoolExecutor(max_workers=1) if row.template else None
            template = (
                pool.submit(self.start_template, sock, engine_environment(self.env_of(root, label)))
                if pool is not None
                else None
            )
            try:
                with served:
                    info["snapshot_daemon"] = {
                        "ready_s": served.ready_s,
                        "command": served.args,
                        "ready_line": served.ready_lines[-1:],
                    }
                    launcher: list[str] = []
                    if template is not None:
                        info["template"] = template.result()
                        self.log(f"{label}: template ready in {info['template']['ready_s']:.1f} s")
                        launcher = template_launcher(sock, fallback=False)
                    res = self.engine(
                        "wcache",
                        {"socket_dir": sock, "fallback": False},
                        True,
                        root,
                        label,
                        launcher=launcher,
                    )
                    info["triton"] = triton_compiled(
                        root / CACHE_ENV_DIRS["TRITON_CACHE_DIR"],
                        carried_triton_keys(snap),
                        keep=self.log_dir / f"{label}.triton" if self.log_dir else None,
                    )
            finally:
                if pool is not None:
                    pool.shutdown(wait=True)  # a start still importing ends before the stop
                    self.stop_template(sock)
        return {**info, "result": res, "cache_root": str(root)}

    def row(self, row: Row, pair: int = 0) -> dict[str, Any]:
        """One row's result; engines of a later ``pair`` keep their logs as
        ``ROW.pN.log`` (N = pair + 1)."""
        label = row.name if pair == 0 else f"{row.name}.p{pair + 1}"
        out: dict[str, Any] = {
            "row": row.name,
            "source": row.source,
            "compiled": row.compiled,
            "caches": row.caches,
        }
        try:
            if row.source == "snapshot":
                got = self.fresh_node(row, label)
                if "not_run" in got:
                    return {**out, **got}
                res = got.pop("result")
                out.update(got)
            else:
                warm = row.caches == "warm"
                root = self.node(row.node, fresh=not warm)
                extra = (
                    {"socket_dir": self.daemon_socket(), "fallback": False}
                    if row.source == "daemon"
                    else {}
                )
                fmt = "wcache" if row.source == "daemon" else self.disk_format()
                if warm and row.node not in self.warmed:
                    self.log(f"{row.name}: warming its caches with one unrecorded start")
                    out["warmup_wall_s"] = self.engine(
                        fmt, extra, row.compiled, root, f"{label}-warmup"
                    )["wall_s"]
                res = self.engine(fmt, extra, row.compiled, root, label)
                out["cache_root"] = str(root)
                if row.compiled:
                    self.warmed.add(row.node)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out["error"] = _error_lines(exc) if isinstance(exc, RuntimeError) else [str(exc)]
            return out
        loads = res.get("load") or []
        if row.source != "disk" and not any(r.get("phase") == "restore" for r in loads):
            out["error"] = [f"the engine did not restore from the daemon (load records: {loads})"]
            return out
        started = res["phases"].get("process_start_source")
        if row.template and started != TEMPLATE_START_SOURCE:
            out["error"] = [
                f"the engine did not run in a template child (its start mark came from "
                f"{started!r}, not {TEMPLATE_START_SOURCE!r})"
            ]
            return out
        out.update(
            {
                **_phase_fields(
                    res["phases"]["marks"], res["log"], loads, row.compiled, self.device
                ),
                "wall_s": res["wall_s"],
                "marks": res["phases"]["marks"],
                "log_lines": phase_lines(res["log"]),
                "process_start_source": res["phases"]["process_start_source"],
                "load": loads,
                "token_ids": res["token_ids"],
                "command": res["command"],
                "cache_writes": res.get("cache_writes"),
                "host": res.get("host"),
            }
        )
        return out


def _phase_fields(
    marks: Mapping[str, float],
    log: str,
    loads: Sequence[Mapping[str, Any]],
    compiled: bool,
    device: str,
) -> dict[str, Any]:
    """A row's ``phases``, ``total_s`` and ``figures`` from its evidence (run_engine's
    marks, vLLM's log or its phase lines, the loader's records)."""
    phases = breakdown(marks, log, loads, compiled=compiled, device=device)
    return {
        "phases": [p.to_json() for p in phases],
        "total_s": total_s(phases),
        "figures": parse_log(log),
    }


def _same_tokens(row: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> bool | None:
    """Whether ``row`` gave the tokens of the first of ``earlier`` that has any (None
    when none has: ``row`` is the first)."""
    first = next((r for r in earlier if "token_ids" in r), None)
    return None if first is None else first["token_ids"] == row["token_ids"]


def run(
    rows: Sequence[str],
    ckpt: Path,
    engine_args: Sequence[str],
    serve_args: Sequence[str],
    device: str,
    work: Path,
    log: Callable[[str], None] = _log,
    on_row: Callable[[list[dict[str, Any]], Mapping[str, Any]], None] = lambda rows, daemon: None,
    log_dir: Path | None = None,
    stack_samples_s: float = 0.0,
    engine_env: Mapping[str, str] | None = None,
    pairs: int = 1,
    snapshot_root: Path | None = None,
    quiet_timeout_s: float = QUIET_TIMEOUT_S,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``rows`` (names of :data:`ROWS`) in :data:`ROWS` order, ``pairs`` times in
    turn (each time on new cache roots; each result names its ``pair``, 0-based).
    After each row ``on_row`` gets the rows so far and the shared daemon's info
    (results survive a timeout); with ``log_dir`` every engine's whole output is kept
    there (``ROW.log``, ``ROW.pN.log`` from the second pair on), and with
    ``stack_samples_s`` > 0 its processes' stack samples (every that many seconds).
    ``engine_env`` goes into every engine's environment and the priming daemon's
    (``--startup-plan``, ``--mega-aot-artifact``). The
    fresh-node rows' primed snapshot is made once, kept under ``snapshot_root``
    (default ``work``) and reused there by a later run of the same key. Before each
    timed engine start the host's dirty pages are flushed and its writeback awaited
    (up to ``quiet_timeout_s``; :func:`wcache.benchmarks.host.quiet_host`), and each
    row records the host's state then (``host``).

    Returns:
        ``(results, daemon)``: one dict per row and pair (``phases``, ``total_s``,
        ``figures``, ``command``, ``pair``, ...; or ``error``; or ``not_run`` with the
        reason), and the shared daemon's ready time and command (empty when no daemon
        row ran).

    Raises:
        ValueError: an unknown row, or ``pairs`` below 1.
    """
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, not {pairs}")
    runner = _Runner(
        ckpt,
        engine_args,
        serve_args,
        device,
        work,
        log,
        log_dir,
        stack_samples_s,
        engine_env,
        snapshot_root,
        quiet_timeout_s,
    )
    results: list[dict[str, Any]] = []
    order = [(k, n) for k in range(pairs) for n in ROWS if n in rows]
    try:
        for pair, name in order:
            log(f"{name} (pair {pair + 1}/{pairs}): starting")
            res = {**runner.row(ROWS[name], pair), "pair": pair}
            if "total_s" in res:
                res["same_tokens_as_first_row"] = _same_tokens(res, results)
                log(
                    f"{name}: first token at {res['total_s']:.2f} s ("
                    + ", ".join(f"{p['name']} {p['seconds']:.2f}" for p in res["phases"])
                    + ")"
                )
            else:
                log(f"{name}: {res.get('error') or res.get('not_run')}")
            results.append(res)
            mine = [p for p in _pairs(results) if p["pair"] == pair and name == TARGET_ROW]
            if mine:
                log(f"pair {pair + 1}: {TARGET_DISK_ROW} / {TARGET_ROW} = {mine[0]['ratio']:.2f}x")
            on_row(results, runner.daemon_info)
    finally:
        runner.stop()
    return results, runner.daemon_info


# --------------------------------------------------------------------------- rendering


def _read_results(path: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """One ``--out`` file's runs, each checked for what :func:`merge_results` reads of it:
    a JSON object with ``meta.device`` and a ``rows`` list whose every row names its
    ``row``, one of :data:`ROWS`. An ``--out`` file holds one run; a file of the older
    layout ``{"meta", "runs": [run, ...]}`` (benchmarks/results-cpu-phases.json,
    2026-12-01) holds several, named ``PATH#runs[i]``.

    Returns:
        ``[(name, run), ...]``: ``path`` itself, or each of its ``runs``.

    Raises:
        ValueError: naming ``path`` (or the run in it): not JSON (where it breaks off:
            a copy cut short), JSON of another shape, or a row this bench does not
            know (named).
        OSError: ``path`` cannot be read.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is not JSON ({exc}): a copy cut short or another file; give the "
            f"whole --out file of a `wcache bench --phases` run"
        ) from exc
    if isinstance(data, dict) and "rows" not in data and isinstance(data.get("runs"), list):
        parts = [(f"{path}#runs[{i}]", run_) for i, run_ in enumerate(data["runs"])]
    else:
        parts = [(str(path), data)]
    for name, run_ in parts:
        _check_run(name, run_)
    return parts


def _check_run(name: str, data: Any) -> None:
    """Raise ValueError naming ``name`` unless ``data`` is one run's results
    (:func:`_read_results`)."""
    rows = data.get("rows") if isinstance(data, dict) else None
    meta = data.get("meta") if isinstance(data, dict) else None
    if not (
        isinstance(meta, dict)
        and "device" in meta
        and isinstance(rows, list)
        and all(isinstance(r, dict) and "row" in r for r in rows)
    ):
        raise ValueError(
            f"{name} is not the --out file of a `wcache bench --phases` run (it needs "
            f"meta.device and a rows list whose every row names its row)"
        )
    unknown = sorted(
        {str(r["row"]) for r in rows if not (isinstance(r["row"], str) and r["row"] in ROWS)}
    )
    if unknown:
        raise ValueError(
            f"{name} has rows this bench does not know ({', '.join(unknown)}; its rows: "
            f"{', '.join(ROWS)}): a hand-edited file, or one of another benchmark"
        )


def _refuse_repeated_runs(leaves: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a device call given twice (its file twice, or its file and a merged file
    that holds it): its pairs would count twice towards the median and the pair count.
    A call is known by its ``date``, ``git`` and ``command``; one without a date (an
    older file) is not compared.

    Raises:
        ValueError: naming the call and where it was given.
    """
    where: dict[tuple[str, str, str], list[str]] = {}
    for leaf in leaves:
        if leaf.get("date"):
            ident = (leaf["date"], str(leaf.get("git")), json.dumps(leaf.get("command")))
            where.setdefault(ident, []).append(str(leaf.get("path")))
    for (date, _, _), paths in where.items():
        if len(paths) > 1:
            raise ValueError(
                f"merge_results: the run of {date} is given {len(paths)} times "
                f"({', '.join(paths)}): give each device call's --out once (a merged "
                f"file already holds its runs)"
            )


def merge_results(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """Several runs' JSON (``--out`` of one device call each) as one result.

    A row that ran is recomputed from the evidence it saved (its marks, vLLM's phase
    lines and the loader's records), so a later fix of the parser applies to an
    earlier run. Where files hold the same row, the last file's wins, unless it did
    not run (an error, not run) and an earlier one did; rows come in :data:`ROWS`
    order.

    A file of the older several-runs layout contributes each of its runs
    (:func:`_read_results`). A file that is itself a merge contributes its own runs, so
    merges nest: ``meta.runs`` lists every device call once, and each row's ``run`` is
    the index in it of the call that measured the row (None for a row of a merge written
    before rows recorded it).

    Returns:
        ``{"meta", "daemon", "rows", "target"}`` as :func:`main` writes; ``meta`` is
        the first file's, with ``runs`` (each run's path, date, git and command) and
        ``measured`` (how one run was measured: its device and that it is one run).

    Raises:
        ValueError: no file given, a file that is not a finished run's ``--out``
            (not JSON, e.g. cut short, or without ``meta.device`` and its ``rows``;
            the message names the file), one device call given twice (its file
            twice, or its file and a merged file holding it), or the files differ in
            one of :data:`COMPARABLE_META` (their rows do not compare).
        OSError: a file cannot be read.
    """
    named = [part for p in paths for part in _read_results(p)]
    runs = [run_ for _, run_ in named]
    if not runs:
        raise ValueError("merge_results: no results file given")
    seen = {
        json.dumps({k: _meta_value(r["meta"], k) for k in COMPARABLE_META}, sort_keys=True)
        for r in runs
    }
    if len(seen) > 1:
        raise ValueError(
            f"merge_results: the files differ in {', '.join(COMPARABLE_META)} "
            f"({sorted(seen)}): rows of different setups do not compare"
        )
    device = runs[0]["meta"]["device"]
    # (row,) for a row of a run from before --pairs, else (row, run, pair)
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    daemon_of: dict[tuple[Any, ...], Mapping[str, Any]] = {}  # row -> its file's shared daemon
    leaves: list[dict[str, Any]] = []  # every device call, once (a merged file's own runs)
    for path, run_ in named:
        offset = len(leaves)
        own = run_["meta"].get("runs")
        leaves += (
            own
            if own
            else [
                {
                    "path": str(path),
                    **{k: run_["meta"].get(k) for k in ("date", "git", "git_dirty", "command")},
                }
            ]
        )
        for r in run_["rows"]:
            paired = r.get("pair") is not None
            if not paired and "marks" not in r and "marks" in rows.get((r["row"],), {}):
                continue  # a later failed or skipped try does not hide a row that ran
            if "marks" in r:
                r = {
                    **r,
                    **_phase_fields(
                        r["marks"],
                        "\n".join(r["log_lines"]),
                        r.get("load") or [],
                        r["compiled"],
                        device,
                    ),
                }
            known = r.get("run") if own else 0
            run_index = None if known is None else offset + known
            # a pair's row is one measurement of its own; an unpaired row (a run from
            # before --pairs) is the row, the last file's winning
            key = (r["row"], run_index, r["pair"]) if paired else (r["row"],)
            rows[key] = {**r, "run": run_index}
            daemon_of[key] = run_.get("daemon") or {}
    _refuse_repeated_runs(leaves)
    rank = {n: i for i, n in enumerate(ROWS)}
    keys = sorted(  # every row names one of ROWS (_read_results refuses others)
        rows,
        key=lambda k: (
            len(k) > 1,
            -1 if len(k) == 1 or k[1] is None else k[1],
            k[2] if len(k) > 1 else 0,
            rank[k[0]],
        ),
    )
    ordered = [rows[k] for k in keys]
    for i, r in enumerate(ordered):  # as run() sets it, in the merged order
        if "token_ids" in r:
            r["same_tokens_as_first_row"] = _same_tokens(r, ordered[:i])
    meta = {**runs[0]["meta"], "runs": leaves, "measured": _measured(runs[0]["meta"])}
    meta["provenance"] = (
        f"merged from {len(leaves)} runs of wcache.benchmarks.bench_phases "
        f"(meta.runs); each row measured in one of them (its run); "
        f"{meta['measured']}"
    )
    daemon = next(
        (daemon_of[k] for k in keys if rows[k].get("source") == "daemon" and daemon_of[k]),
        {},
    )
    return {"meta": meta, "daemon": daemon, "rows": ordered, "target": target_summary(ordered)}


def _measured(meta: Mapping[str, Any]) -> str:
    """How one run of ``meta`` was measured: its ``measured`` (a merge), else its
    provenance less any "merged from ..." prefixes (a merge written before ``measured``)."""
    if meta.get("measured"):
        return str(meta["measured"])
    return str(meta.get("provenance", "")).rsplit("each row measured in one of them; ", 1)[-1]


def startup_plan_env() -> dict[str, str]:
    """The engines' environment of --startup-plan: vLLM's switch
    (:data:`wcache.vllm.startup.STARTUP_PLAN_ENV`) on."""
    from wcache.vllm.startup import STARTUP_PLAN_ENV  # noqa: PLC0415 (torch import ~2 s: only when called)

    return {STARTUP_PLAN_ENV: "1"}


def mega_aot_env() -> dict[str, str]:
    """The engines' environment of --mega-aot-artifact: vLLM's mega AOT artifact
    (:data:`wcache.vllm.startup.MEGA_AOT_ENV`) on, as vLLM's default has it from
    torch 2.12."""
    from wcache.vllm.startup import MEGA_AOT_ENV  # noqa: PLC0415 (torch import ~2 s: only when called)

    return {MEGA_AOT_ENV: "1"}


def _meta_value(meta: Mapping[str, Any], key: str) -> Any:
    """``meta[key]`` for the comparison of merged runs; a run from before --startup-plan
    or --stack-samples has no ``engine_env`` / ``stack_samples_s``: it set none (the
    sampler runs inside the timed processes, so sampled rows do not merge with others)."""
    value = meta.get(key)
    if value is None:  # written before the field existed: the default
        return {"engine_env": {}, "stack_samples_s": 0.0}.get(key)
    return value


def _by_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {r["row"]: r for r in rows}


def _pairs(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The target's pairs: a :data:`TARGET_DISK_ROW` and a :data:`TARGET_ROW` that ran
    in the same run (``run``; 0 in a run's own result) and pair (``pair``; None in a
    run from before --pairs), in (run, pair) order, each with its ``ratio``."""
    groups: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        run_ = r.get("run", 0)
        if r.get("row") in (TARGET_DISK_ROW, TARGET_ROW) and r.get("total_s") and run_ is not None:
            groups.setdefault((run_, r.get("pair") or 0), {})[r["row"]] = r
    out = []
    for (run_, pair), g in sorted(groups.items()):
        if TARGET_DISK_ROW in g and TARGET_ROW in g:
            disk, fresh = g[TARGET_DISK_ROW]["total_s"], g[TARGET_ROW]["total_s"]
            out.append(
                {
                    "run": run_,
                    "pair": pair,
                    "disk_s": disk,
                    "fresh_s": fresh,
                    "ratio": disk / fresh,
                    "fresh_row": g[TARGET_ROW],
                }
            )
    return out


def _remaining(fresh_rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """The fresh node's phases above :data:`NEGLIGIBLE_S`, longest first: each phase's
    median over ``fresh_rows``."""
    med = {
        name: statistics.median(
            next(p["seconds"] for p in r["phases"] if p["name"] == name) for r in fresh_rows
        )
        for name in PHASES
    }
    return [[n, v] for n, v in sorted(med.items(), key=lambda t: -t[1]) if v > NEGLIGIBLE_S]


def target_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The target's figures.

    With pairs (:func:`_pairs`: both rows from one run): ``pairs`` (each one's run,
    pair, totals and ratio), ``n_pairs``, ``ratio`` = ``median`` of their ratios,
    ``min``, ``max``, ``one_run`` True, ``reached`` (the median is at least
    :data:`TARGET_RATIO` over at least :data:`MIN_PAIRS` pairs) and ``remaining``
    (the fresh node's phases, each the median over the pairs, longest first).

    Without a pair but with both rows from different runs (a merge): their ``ratio``,
    ``one_run`` False, ``reached`` False, ``n_pairs`` 0. Without both: ``ratio`` None,
    ``why_not``, and when :data:`SUBSTITUTE_ROW` ran, the same against it
    (``substitute_ratio``; not the target's row).
    """
    by = _by_row(rows)
    disk = by.get(TARGET_DISK_ROW, {}).get("total_s")
    out: dict[str, Any] = {
        "disk_row": TARGET_DISK_ROW,
        "row": TARGET_ROW,
        "target_ratio": TARGET_RATIO,
        "min_pairs": MIN_PAIRS,
        "ratio": None,
        "reached": None,
        "n_pairs": 0,
    }
    pairs = _pairs(rows)
    fresh = by.get(TARGET_ROW, {})
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        out.update(
            pairs=[{k: v for k, v in p.items() if k != "fresh_row"} for p in pairs],
            n_pairs=len(pairs),
            ratio=statistics.median(ratios),
            median=statistics.median(ratios),
            min=min(ratios),
            max=max(ratios),
            one_run=True,
            remaining=_remaining([p["fresh_row"] for p in pairs]),
        )
        out["reached"] = out["median"] >= TARGET_RATIO and len(pairs) >= MIN_PAIRS
    elif fresh.get("total_s") and disk:
        out.update(
            ratio=disk / fresh["total_s"],
            one_run=False,  # both ran, but not in one run (else they would be a pair)
            reached=False,
            remaining=_remaining([fresh]),
        )
    else:
        out["why_not"] = (
            fresh.get("not_run")
            or (fresh.get("error") and "fresh-node failed: " + " ".join(fresh["error"]))
            or ("not requested" if not fresh else "")
            or f"{TARGET_DISK_ROW} did not run"
        )
        sub = by.get(SUBSTITUTE_ROW, {})
        if sub.get("total_s") and disk:
            out["substitute_row"] = SUBSTITUTE_ROW
            out["substitute_ratio"] = disk / sub["total_s"]
            out["substitute_remaining"] = _remaining([sub])
    return out


def _labels(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each row's name in the table and the plot: with more than one pair, ``ROW #N``
    (N numbers the (run, pair) groups in order, from 1)."""
    groups = sorted({(r.get("run") or 0, r["pair"]) for r in rows if r.get("pair") is not None})
    if len(groups) < 2:
        return [r["row"] for r in rows]
    number = {g: i + 1 for i, g in enumerate(groups)}
    return [
        r["row"]
        if r.get("pair") is None
        else f"{r['row']} #{number[(r.get('run') or 0, r['pair'])]}"
        for r in rows
    ]


def _fmt_remaining(remaining: Sequence[Sequence[Any]]) -> str:
    return ", ".join(f"{n} {v:.2f} s" for n, v in remaining)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per row, one column per phase (seconds), the total to the first
    token and the compile cache; then the target's ratio (the median over the pairs,
    with each pair's), the phases that remain, each template's start (paid before
    the restart, so in no row's time) and the host's state before each timed start."""
    head = ["row", *PHASES, "to first token", "compile cache"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(PHASES) + 1) + "---|"]
    labels = _labels(rows)
    for r, label in zip(rows, labels):
        if "phases" not in r:
            why = r.get("not_run") or "failed: " + " ".join(r.get("error", []))
            out.append(f"| {label} | not run: {why[:300]} |" + " |" * (len(PHASES) + 1))
            continue
        secs = {p["name"]: p["seconds"] for p in r["phases"]}
        cells = [f"{secs[n]:.2f}" for n in PHASES]
        cache = r["figures"].get("compile_cache", "none") if r["compiled"] else "-"
        cache = "not logged" if cache == "none" else cache  # vLLM CPU logs no compile lines
        out.append(f"| {label} | " + " | ".join(cells) + f" | **{r['total_s']:.2f}** | {cache} |")
    s = target_summary(rows)
    out.append("")
    rule = (
        f"target: the median >= {TARGET_RATIO:.0f}x over at least {MIN_PAIRS} pairs, "
        f"each pair measured in one run"
    )
    if s["n_pairs"]:
        verdict = "reached" if s["reached"] else "NOT reached"
        if s["n_pairs"] < MIN_PAIRS:
            verdict += f": {s['n_pairs']} pair{'s' if s['n_pairs'] > 1 else ''} measured"
        out.append(
            f"Target: {TARGET_DISK_ROW} / {TARGET_ROW} = **{s['median']:.2f}x**, the median "
            f"of {s['n_pairs']} pair{'s' if s['n_pairs'] > 1 else ''} [min "
            f"{s['min']:.2f}x, max {s['max']:.2f}x] (pairs: "
            + ", ".join(
                f"{p['disk_s']:.2f} / {p['fresh_s']:.2f} s = {p['ratio']:.2f}x" for p in s["pairs"]
            )
            + f"; {rule}: {verdict}). Phases that remain on the fresh node"
            + (" (each the median over the pairs)" if s["n_pairs"] > 1 else "")
            + ": "
            + _fmt_remaining(s["remaining"])
            + "."
        )
    elif s["ratio"] is not None:
        out.append(
            f"Target: {TARGET_DISK_ROW} / {TARGET_ROW} = **{s['ratio']:.2f}x** ({rule}: NOT "
            "reached; the two rows were measured in different runs (meta.runs), and "
            "a pair is one run's). Phases that remain on the fresh node: "
            + _fmt_remaining(s["remaining"])
            + "."
        )
    else:
        out.append(
            f"Target ({TARGET_DISK_ROW} / {TARGET_ROW}; {rule}): not measured: {s['why_not']}."
        )
        if "substitute_ratio" in s:
            out.append(
                f"For scale only (not the target's row): {TARGET_DISK_ROW} / "
                f"{SUBSTITUTE_ROW} = {s['substitute_ratio']:.2f}x; its phases: "
                + _fmt_remaining(s["substitute_remaining"])
                + "."
            )
    for r, label in zip(rows, labels):
        t = r.get("template")
        if isinstance(t, Mapping) and t.get("ready_s") is not None:
            sd = (r.get("snapshot_daemon") or {}).get("ready_s")
            out.append(
                f"- Template of {label}: ready in {t['ready_s']:.1f} s ({t.get('modules')} "
                f"modules imported in {t.get('import_s')} s, RSS "
                f"{(t.get('rss_kib') or 0) / 1024:.0f} MiB, "
                f"{(t.get('threads') or {}).get('os')} OS threads, CUDA initialised: "
                f"{t.get('cuda_initialized')}), started beside its snapshot daemon"
                + (f" (ready in {sd:.1f} s)" if isinstance(sd, (int, float)) else "")
                + ": before the restart, so in no row's time."
            )
    for r, label in zip(rows, labels):
        if (line := _triton_line(r.get("triton"), label)) is not None:
            out.append(line)
    hosts = [
        f"{label}: {describe(r['host'])}"
        for r, label in zip(rows, labels)
        if isinstance(r.get("host"), Mapping)
    ]
    if hosts:
        out.append(
            "- The host before each timed start (its writes flushed, outside the row's "
            "time): " + "; ".join(hosts) + "."
        )
    return "\n".join(out) + "\n"


def _triton_line(tr: Any, label: str) -> str | None:
    """The markdown line on a fresh node's Triton cache (:func:`triton_compiled`):
    None when it wrote no entry beyond what its start-up bundle carried."""
    if not isinstance(tr, Mapping) or not tr.get("compiled"):
        return None
    compiled = tr["compiled"]
    line = (
        f"- Triton on {label}: {sum(compiled.values())} cache entries beyond the "
        f"{tr.get('carried')} its start-up bundle carried ("
        + ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(compiled.items()))
        + ")"
    )
    twins = tr.get("twins") or {}
    if twins:
        parts = []
        for name, t in sorted(twins.items()):
            diff = t.get("metadata_differs") or {}
            if diff:
                why = f"metadata differs in {', '.join(sorted(diff))}"
            elif t.get("ptx_same") and t.get("cubin_same") is False:
                why = "same metadata and PTX, another cubin: compiled by another ptxas"
            else:
                why = (
                    "same metadata: the key differs outside it (the kernel's source, "
                    "constants or specialisation, or the ptxas version)"
                )
            parts.append(f"{name} ({why})")
        line += (
            f"; {len(twins)} of them a carried kernel under another key, so the carried "
            "entry was missed: " + "; ".join(parts)
        )
    return line + "."


def plot_phases(results: Mapping[str, Any], png: str | Path) -> Path:
    """Stacked horizontal bars: one bar per row that ran, one segment per phase.

    Args:
        results: what :func:`main` writes as JSON (``rows`` and ``meta``).
        png: output path; parent dirs are created.

    Returns:
        The path written.
    """

    plt, png = pyplot_for(png)
    ran = [r for r in results["rows"] if "phases" in r][::-1]  # first row on top
    names = _labels(ran)
    fig, ax = plt.subplots(figsize=FIGSIZE_IN)
    colors = plt.get_cmap("tab10").colors
    left = [0.0] * len(ran)
    for i, name in enumerate(PHASES):
        widths = [next(p["seconds"] for p in r["phases"] if p["name"] == name) for r in ran]
        ax.barh(names, widths, left=left, color=colors[i % len(colors)], label=name)
        left = [a + b for a, b in zip(left, widths)]
    for y, (r, x) in enumerate(zip(ran, left)):
        ax.annotate(
            f"{r['total_s']:.1f} s", (x, y), textcoords="offset points", xytext=(3, -3), fontsize=7
        )
    meta = results.get("meta", {})
    ax.set_xlabel("seconds from process start to the first token")
    ax.set_title(
        f"engine start by phase: {meta.get('model_kind', '')} on "
        f"{meta.get('device_name', meta.get('device', ''))}, vLLM "
        f"{meta.get('vllm', '?')}",
        fontsize=9,
    )
    ax.set_xlim(0, max(left, default=1.0) * 1.12)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wcache bench --phases",
        description=__doc__,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda (the engines' vLLM CUDA build) or cpu (vLLM-CPU). Default: cuda "
        "when torch sees a GPU, else cpu.",
    )
    p.add_argument(
        "--rows",
        type=csv_values,
        default=tuple(ROWS),
        help=f"comma-separated subset of {','.join(ROWS)} (default: all; always "
        "run in that order).",
    )
    p.add_argument(
        "--model-kind",
        choices=MODEL_KINDS,
        default=None,
        help="8b (bench_engine_cuda's 8B-shaped bf16 Llama, written under --root; "
        "default on cuda), moe30b-fp8 (a Qwen3-30B-A3B-shaped MoE in block FP8 128x128, "
        "--moe-layers of its 48 layers, written under --root), smol (the SmolLM2-135M "
        "bf16 fixture; default on cpu) or tiny (wcache.testing.tiny's 2-layer bf16 Llama; "
        "tests).",
    )
    p.add_argument(
        "--moe-layers",
        type=int,
        default=None,
        metavar="N",
        help=f"decoder layers of the moe30b-fp8 checkpoint (1-{MOE_MAX_LAYERS}; default {MOE_LAYERS}: "
        "~0.6 GB of FP8 experts a layer, and the checkpoint, its snapshot and the cache "
        "roots share the disk)",
    )
    p.add_argument(
        "--model", default=None, help="a bf16 checkpoint directory instead of --model-kind's"
    )
    p.add_argument(
        "--root",
        default=os.environ.get("WCACHE_BENCH_DIR", "/tmp/wcache-phases"),
        help="work dir: the 8B checkpoint (~16 GB), cache roots, the snapshot "
        "(default $WCACHE_BENCH_DIR or /tmp/wcache-phases)",
    )
    p.add_argument("--out", default=None, help="JSON results (rewritten after every row)")
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.add_argument("--plot", default=None, help="PNG of the stacked phases (matplotlib)")
    p.add_argument(
        "--startup-plan",
        action="store_true",
        help="set VLLM_ENABLE_STARTUP_PLAN=1 on every engine (vLLM 0.33+, off by "
        "default): a warm cache root or a fresh node's start-up artifacts then "
        "give the KV-cache memory its profiling arrived at, and the engine "
        "skips that profiling. Recorded in the JSON (meta.engine_env)",
    )
    p.add_argument(
        "--mega-aot-artifact",
        action="store_true",
        help="set VLLM_USE_MEGA_AOT_ARTIFACT=1 on every engine and the priming engine "
        "(vLLM's default from torch 2.12; off with torch 2.11): the AOT artifact then "
        "holds Inductor's compiled pieces, and its load rebuilds the compiled model from "
        "them without re-running vLLM's backend over the graph. A compile-cache factor: "
        "the primed snapshot is made with it. Recorded in the JSON (meta.engine_env)",
    )
    p.add_argument(
        "--stack-samples",
        type=reasoned(functools.partial(parse_seconds, zero=True)),
        default=0.0,
        metavar="SECONDS",
        help="a diagnostic: every SECONDS, sample the Python stacks of every "
        "engine process into {--out}.logs/ROW.stacks.PID (needs --out; read "
        "them with python -m wcache.benchmarks.stacks). Default 0: off",
    )
    p.add_argument(
        "--quiet-host-timeout",
        type=reasoned(functools.partial(parse_seconds, zero=True)),
        default=QUIET_TIMEOUT_S,
        metavar="S",
        help="before each timed engine start, flush the host's dirty pages (os.sync) and "
        f"wait until its Dirty + Writeback fall under {QUIET_PENDING_MIB:.0f} MiB, for at "
        "most S seconds in all "
        "(default %(default)s; 0: neither, only the record), so a row does not inherit the "
        "previous row's "
        "writeback (a checkpoint, a snapshot); each row records the host's load and "
        "pending writes then, and its CPUs' busy/iowait/steal shares during the start "
        "(rows[].host, a line under the table)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        metavar="N",
        help="run the rows N times in turn, each time on new cache roots, daemons and "
        f"template (default 1); the target is the median of at least {MIN_PAIRS} "
        "disk-compiled-cold / fresh-node pairs. The primed snapshot is made once and "
        "kept under --root for later runs of the same key",
    )
    p.add_argument(
        "--prime-only",
        action="store_true",
        help="run no row: make (or find) the fresh-node rows' primed snapshot under "
        "--root for these arguments, print its record and exit, so the priming can be "
        "a device call of its own before the timed pairs (a later run of the same "
        "arguments and --root reuses it: 'reusing the primed snapshot'). Give the "
        "priming the GPU alone: with --startup-plan its engine records the free "
        "memory the fresh nodes' plan starts from",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: merge these --out files (rows split over device "
        "calls; the last file's row wins unless it failed; a file holding several runs, "
        "as benchmarks/results-cpu-phases.json does, gives each), recompute each row's "
        "phases from its saved evidence, and write --out/--markdown/--plot",
    )
    return p


def _meta(device: str, kind: str, ckpt: Path, argv: Sequence[str]) -> dict[str, Any]:

    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.vllm.compat import vllm_version  # noqa: PLC0415 (torch import ~2 s: only when called)

    meta = {
        "device": device,
        "model_kind": kind,
        "checkpoint": str(ckpt),
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "command": ["wcache", "bench", "--phases", *argv],
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "provenance": (
            "measured by wcache.benchmarks.bench_phases in one run; "
            f"{'a CUDA GPU' if device == 'cuda' else 'CPU only, no GPU'}"
        ),
    }
    if device == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(0)
    else:
        meta["device_name"] = f"CPU ({os.cpu_count()} cores)"
    meta.update(source_revision())
    return meta


#: The options that choose or shape the rows a run makes (argparse dests): with
#: ``--from-json`` (nothing runs) each is refused rather than silently ignored.
RUN_ONLY_OPTIONS = (
    "device",
    "rows",
    "model_kind",
    "moe_layers",
    "model",
    "root",
    "startup_plan",
    "mega_aot_artifact",
    "stack_samples",
    "quiet_host_timeout",
    "pairs",
    "prime_only",
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (`wcache bench --phases ...`); returns 0 unless a row failed (exit
    status 2 for ``--rows`` naming no row or an unknown one, for ``--from-json``
    files that cannot be merged, and for ``--from-json`` beside an option of
    :data:`RUN_ONLY_OPTIONS`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_json:
        given = [
            "--" + dest.replace("_", "-")
            for dest in RUN_ONLY_OPTIONS
            if getattr(args, dest) != parser.get_default(dest)
        ]
        if given:
            parser.error(
                f"--from-json runs nothing and merges every row of its files: "
                f"{', '.join(given)} would change nothing; leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        return _write_merged(args, parser)
    refuse_unknown_or_missing(
        parser,
        "--rows",
        [r for r in args.rows if r not in ROWS],
        not args.rows,
        f"rows: {', '.join(ROWS)}",
    )
    if args.pairs < 1:
        parser.error("--pairs: give at least 1")
    if args.moe_layers is not None and args.model_kind != "moe30b-fp8":
        parser.error("--moe-layers: only for --model-kind moe30b-fp8")
    moe_layers = MOE_LAYERS if args.moe_layers is None else args.moe_layers
    if not 1 <= moe_layers <= MOE_MAX_LAYERS:
        parser.error(f"--moe-layers: give 1 to {MOE_MAX_LAYERS} (Qwen3-30B-A3B's depth)")
    if args.stack_samples and not args.out:
        parser.error("--stack-samples: give --out too (the samples go to {--out}.logs/)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        # each row's engine and daemon would fail on it in turn, minutes for every row
        parser.error(
            f"--model {args.model}: not a checkpoint directory (no config.json in it); "
            "give a local bf16 checkpoint's directory"
        )
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.model_kind == "moe30b-fp8" and device != "cuda":
        parser.error(
            "--model-kind moe30b-fp8 needs --device cuda: block-FP8 MoE has no kernels in "
            "vLLM's CPU build; on CPU use smol or tiny"
        )
    kind = args.model_kind or ("8b" if device == "cuda" else "smol")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    ckpt, engine_args, serve_args = model_setup(kind, device, root, args.model, moe_layers)
    shown = f"{kind} ({moe_layers} layers)" if kind == "moe30b-fp8" else kind
    meta = _meta(device, shown if args.model is None else "custom", ckpt, argv)
    engine_env = {
        **(startup_plan_env() if args.startup_plan else {}),
        **(mega_aot_env() if args.mega_aot_artifact else {}),
    }
    meta.update(
        engine_args=engine_args,
        serve_args=serve_args,
        engine_env=engine_env,
        stack_samples_s=args.stack_samples,
        pairs=args.pairs,
    )

    if args.prime_only:
        return prime_only(ckpt, engine_args, serve_args, device, root, engine_env)

    def results(rows: list[dict[str, Any]], daemon: Mapping[str, Any]) -> dict[str, Any]:
        return {"meta": meta, "daemon": dict(daemon), "rows": rows, "target": target_summary(rows)}

    with tempfile.TemporaryDirectory(prefix="nodes-", dir=root) as work:
        rows, daemon = run(
            args.rows,
            ckpt,
            engine_args,
            serve_args,
            device,
            Path(work),
            on_row=lambda rows, daemon: _save(args.out, results(rows, daemon)),
            log_dir=_log_dir(args.out),
            stack_samples_s=args.stack_samples,
            engine_env=engine_env,
            pairs=args.pairs,
            snapshot_root=root,
            quiet_timeout_s=args.quiet_host_timeout,
        )
    return _write_outputs(args, results(rows, daemon))


def prime_only(
    ckpt: Path,
    engine_args: Sequence[str],
    serve_args: Sequence[str],
    device: str,
    root: Path,
    engine_env: Mapping[str, str],
    log: Callable[[str], None] = _log,
) -> int:
    """``--prime-only``: the primed snapshot the fresh-node rows of a run with these
    arguments would use, made under ``root`` (or found there, complete, with the same
    key: :meth:`_Runner.primed_snapshot`), its record printed as JSON on stdout.
    It times nothing, but should have the GPU alone: its engine's startup plan (with
    ``VLLM_ENABLE_STARTUP_PLAN``) records the free memory the fresh nodes start from.

    Returns:
        0 with the snapshot made or reused; 2 (the reason logged) where `wcache serve`
        has no ``--prime-compile``.
    """
    ok, reason = prime_compile_supported()
    if not ok:
        log(f"--prime-only: {reason}")
        return 2
    with tempfile.TemporaryDirectory(prefix="nodes-", dir=root) as work:
        runner = _Runner(
            ckpt,
            engine_args,
            serve_args,
            device,
            Path(work),
            log,
            engine_env=engine_env,
            snapshot_root=root,
        )
        snap, info = runner.primed_snapshot()
    log(f"--prime-only: the primed snapshot is {snap}")
    print(json.dumps(info, default=str))
    return 0


def _save(out: str | None, results: Mapping[str, Any]) -> None:
    """``results`` as JSON at ``out`` (nothing without --out)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str))


def _write_outputs(args: argparse.Namespace, results: Mapping[str, Any]) -> int:
    """--out, the table (stdout and --markdown) and --plot of ``results``; returns 0
    unless a row failed."""
    _save(args.out, results)
    text = table(results["rows"])
    sys.stdout.write(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot:
        _log(f"phases written to {plot_phases(results, args.plot)}")
    return 1 if any("error" in r for r in results["rows"]) else 0


def _log_dir(out: str | None) -> Path | None:
    """Where the engines' whole output goes: ``{--out without its suffix}.logs/ROW.log``
    (none without --out). The JSON keeps only vLLM's phase lines; a phase nobody
    expected needs the rest."""
    return None if not out else Path(out).with_name(Path(out).stem + ".logs")


def _write_merged(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--from-json``: merge the files and write the outputs; a file that cannot be
    read or merged ends the command through ``parser.error`` (exit status 2) with
    the reason, naming the file."""
    try:
        merged = merge_results(args.from_json)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--from-json: {exc}")
    return _write_outputs(args, merged)


if __name__ == "__main__":
    sys.exit(main())
