"""Tests of wcache/plans/: one module per plan module (tests/README.md)."""
