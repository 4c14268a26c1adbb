"""Argument checks the wcache command lines share (``wcache bench``, its ``--phases``,
the architecture sweep): comma-separated values and the refusal of an unknown or
missing one. Imports nothing from wcache, so any command line can use it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["csv_values", "refuse_unknown_or_missing"]


def csv_values(value: str) -> tuple[str, ...]:
    """A comma-separated option's values, in order, blanks dropped (an argparse ``type``)."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


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
