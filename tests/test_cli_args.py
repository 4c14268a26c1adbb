"""wcache.cli_args: the argument checks the command lines share."""

import argparse

import pytest

from wcache.cli_args import csv_values, refuse_unknown_or_missing


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
