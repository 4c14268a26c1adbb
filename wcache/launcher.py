"""The ``wcache`` console script. ``wcache run`` goes straight to
:mod:`wcache.template.run_cli` (no torch import: a restart through the template starts
in about 0.2 s); every other command goes to :mod:`wcache.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch the console script's arguments; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["run"]:
        from wcache.template.run_cli import main as run_main  # noqa: PLC0415 (only for `run`)

        return run_main(args[1:])
    from wcache.cli import main as cli_main  # noqa: PLC0415 (torch ~1.5 s: not for `run`)

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
