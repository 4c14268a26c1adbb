"""Tests of wcache/stages/: one module per stage family (tests/README.md)."""
