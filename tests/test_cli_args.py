"""wcache.cli_args: the argument checks the command lines share."""

import argparse

import pytest

from wcache.cli_args import csv_values, reasoned, refuse_unknown_or_missing
from wcache.store.protocol import parse_seconds


def test_csv_values_keep_order_and_drop_blanks():
    assert ("a", "b", "a") == csv_values(" a, ,b,a,")
    assert () == csv_values(",")


@pytest.mark.parametrize(
    ("unknown", "missing", "named"),
    [(["x", "y"], False, "x, y"), ([], True, "none given"), (["x"], True, "x")],
)
def test_refusal_exits_2_naming_the_values_and_the_choices(unknown, missing, named, capsys):
    parser = argparse.ArgumentParser(prog="p")
    with pytest.raises(SystemExit) as info:
        refuse_unknown_or_missing(parser, "--rows", unknown, missing, "rows: a, b")
    assert 2 == info.value.code
    assert f"p: error: unknown or missing in --rows: {named}; rows: a, b" in capsys.readouterr().err


def test_nothing_unknown_or_missing_passes():
    refuse_unknown_or_missing(argparse.ArgumentParser(), "--rows", [], False, "rows: a")


def test_reasoned_type_refuses_with_the_parsers_reason(capsys):
    """A ``reasoned`` type's ValueError is argparse's usage error (exit 2) with its text,
    not argparse's bare "invalid value"; a good value passes through."""
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--t", type=reasoned(parse_seconds))
    assert 1.5 == parser.parse_args(["--t", "1.5"]).t
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--t", "nan"])
    assert 2 == info.value.code
    assert "p: error: argument --t: 'nan' is not a positive number of seconds" in (
        capsys.readouterr().err
    )
