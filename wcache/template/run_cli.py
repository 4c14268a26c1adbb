"""``wcache run``'s own command line, kept apart from :mod:`wcache.cli`: the console
script answers ``wcache run`` from here (:mod:`wcache.launcher`) without importing
``wcache.cli``, whose plan registry imports torch (about 1.5 s on a 2-core host), so a
restart through the template pays that import nowhere."""

from __future__ import annotations

import argparse
import sys

from wcache.template import client as template_client

DESCRIPTION = (
    "wcache run -- CMD ARGS...: run CMD (python SCRIPT | python -m MOD | "
    "python -c CODE | a console script such as vllm) in a child forked from the "
    "running template, with this process's argv, environment, cwd and stdio; "
    "signals are forwarded and the exit code (or the signal) is the command's. "
    "Without a usable template it says why on stderr and runs CMD directly. "
    "Exit status: the command's own (a command ended by signal N ends this process "
    "by N, as a shell shows 128+N; after an uncaught Ctrl-C, 1 or SIGINT by CPython's "
    "rule over the child's exit sequence, which runs the handlers of the template's "
    "pre-imports: docs/template.md); 3 with --no-fallback when the template cannot "
    "run it (the reason code on stderr); 70 when the template died before reporting "
    "the child's end (the child may still run: its pid is named)."
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``wcache run`` (shared by :mod:`wcache.cli`'s subparser)."""
    p.add_argument("--socket-dir", help="socket directory of the template (default: the daemons')")
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="exit 3 naming the reason instead of running the command directly",
    )
    p.add_argument("--verbose", action="store_true", help="say which child runs the command")
    p.add_argument("command_argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the parsed ``wcache run`` command; returns its exit code (2 for an option
    of its own it does not know: the command and everything after it is
    ``command_argv``, so ``rest`` holds only what came before the command)."""
    if rest:
        # a misspelt option (--no-fallbak) was appended to the command's own arguments
        print(
            f"wcache run: unrecognized arguments: {' '.join(rest)} (its options are "
            f"--socket-dir, --no-fallback and --verbose; the command follows `--`)",
            file=sys.stderr,
        )
        return 2
    command = list(args.command_argv or [])
    if command[:1] == ["--"]:
        command = command[1:]
    return template_client.run_command(
        command, args.socket_dir, fallback=not args.no_fallback, verbose=args.verbose
    )


def main(argv: list[str]) -> int:
    """``wcache run ARGS`` (``argv`` without ``run``)."""
    parser = argparse.ArgumentParser(prog="wcache run", description=DESCRIPTION)
    add_run_arguments(parser)
    args, rest = parser.parse_known_args(argv)
    return run(args, rest)
