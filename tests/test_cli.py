"""The ``wcache`` command's own behaviour (the subcommands are tested with their features)."""

from __future__ import annotations

import io
import os

from wcache import cli


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
