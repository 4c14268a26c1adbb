"""Argument checks the wcache command lines share (``wcache bench``, its ``--phases``,
the architecture sweep): comma-separated values, the refusal of an unknown or
missing one, and a parser's reason as argparse's usage error. Imports nothing from
wcache, so any command line can use it."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["csv_values", "job_without_socket_dir", "reasoned", "refuse_unknown_or_missing"]

T = TypeVar("T")


def job_without_socket_dir(job: str) -> str:
    """``wcache verify``'s refusal of ``--job`` (or the engine's ``job`` option) given
    without the daemon's directory, where the job would be ignored: one text for its
    command line's check before vLLM's import and for
    :func:`wcache.vllm.verify.engine_restore_options`."""
    return (
        f"--job {job!r} names a daemon's job: give the --socket-dir it serves in too "
        f"(or socket_dir in --model-loader-extra-config); without one verify builds "
        f"its own arena"
    )


def csv_values(value: str) -> tuple[str, ...]:
    """A comma-separated option's values, in order, blanks dropped (an argparse ``type``)."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def reasoned(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` (which raises ValueError saying why) as an argparse ``type`` whose
    refusal is that reason: ``error: argument --timeout: 'nan' is not a finite number
    of seconds >= 0`` (exit status 2), where argparse itself says only ``invalid
    parse_seconds value``."""

    @functools.wraps(parse)
    def parse_argument(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_argument


def refuse_unknown_or_missing(
    parser: argparse.ArgumentParser,
    flags: str,
    unknown: Sequence[str],
    missing: bool,
    choices: str,
) -> None:
    """End the command through ``parser.error`` (exit status 2, before any work) when
    ``flags`` named ``unknown`` values or none at all (``missing``); the message names
    them and ``choices`` (the values taken, e.g. ``"rows: disk-eager, ..."``).

    Raises:
        SystemExit: status 2, from ``parser.error``.
    """
    if unknown or missing:
        parser.error(
            f"unknown or missing in {flags}: {', '.join(unknown) or 'none given'}; {choices}"
        )
