"""One error hierarchy (CONTRIBUTING.md, issue 25): every error class in the package is a
``WcacheError`` and a builtin exception, and has a reason code of its own.

Every module of the package is imported (vLLM's included: a few seconds), then the
subclasses of ``WcacheError`` are walked, so a class defined anywhere is seen.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from pathlib import Path

import pytest

import wcache
from wcache import errors
from wcache.errors import WcacheError
from wcache.store import errors as store_errors
from wcache.store import protocol, seed, snapshot

#: Modules the walk does not import: a ``sitecustomize`` for a child interpreter.
NOT_IMPORTED = ("wcache.testing.avx2_site",)

#: Codes users see (docs/quickstart.md, the fallback log, the refusal counters):
#: they must keep their class. RecordedMismatch, which shared ``key-mismatch``,
#: got ``recorded-mismatch`` (docs/quickstart.md).
USER_VISIBLE = {
    "daemon-missing": "DaemonMissing",
    "key-mismatch": "KeyMismatch",
    "plan-missing": "NoPlan",
    "transport-failed": "TransportFailed",
    "guard-failed": "RestoreWroteSharedTensor",
    "checkpoint-changed": "CheckpointChanged",
    "model-mismatch": "ModelMismatch",
    "arena-invalidated": "ArenaInvalidated",
    "recorded-mismatch": "RecordedMismatch",
    "update-unsupported": "UpdateUnsupported",
    "spec-unsupported": "SpecDecodeUnsupported",
}


def _all_error_classes() -> list[type]:
    for mod in pkgutil.walk_packages(wcache.__path__, "wcache."):
        if not mod.name.startswith(NOT_IMPORTED):
            importlib.import_module(mod.name)
    found, todo = set(), [WcacheError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("wcache.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


@pytest.fixture(scope="module")
def classes() -> list[type]:
    return _all_error_classes()


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def code_table(classes: list[type]) -> dict[str, type]:
    """code -> the one class that declares it (raises AssertionError on a clash)."""
    table: dict[str, type] = {}
    for cls in classes:
        code = cls.__dict__.get("code")
        if code is None:
            continue
        assert code not in table, f"{code!r} declared by {_name(table[code])} and {_name(cls)}"
        table[code] = cls
    return table


def test_codes_are_unique(classes):
    """No two error classes declare the same reason code, and the root's code is its own."""
    table = code_table([WcacheError, *classes])
    assert WcacheError is table["wcache-error"]
    assert len(table) >= 40  # every module's errors were found, not just a few


def test_every_class_has_a_code(classes):
    """Every error class has a code other than the root's: declared, or refined from a
    parent that declares one (UnplannedLayers is a plan-missing)."""
    missing = [_name(c) for c in classes if c.code == WcacheError.code]
    assert [] == missing


def test_restore_failed_carries_the_failed_steps_code():
    """RestoreFailed has a class code of its own, and an instance raised with the
    failed step's code carries that one (what fallback=false users see)."""
    assert "restore-failed" == errors.RestoreFailed("x").code
    assert "daemon-missing" == errors.RestoreFailed("x", code="daemon-missing").code
    assert "restore-failed" == errors.RestoreFailed.code


def test_every_class_is_also_a_builtin_exception(classes):
    """Each class subclasses a builtin exception besides WcacheError's Exception
    (ValueError, RuntimeError, OSError, ...), so callers can catch it either way."""

    def builtin(cls):
        return [
            b
            for b in cls.__mro__
            if b.__module__ == "builtins" and b not in (Exception, BaseException, object)
        ]

    assert [] == [_name(c) for c in classes if not builtin(c)]


def test_user_visible_codes_keep_their_class(classes):
    """The reason codes users see map to the class that has always raised them."""
    table = code_table(classes)
    assert USER_VISIBLE == {code: table[code].__name__ for code in USER_VISIBLE}


def test_errors_module_holds_every_gathered_class(classes):
    """wcache.errors exports every class defined there, and the old homes re-export the
    same objects (so ``except`` clauses keep matching)."""
    defined = {c.__name__ for c in classes if c.__module__ == "wcache.errors"}
    assert defined <= set(errors.__all__)
    assert store_errors.KeyMismatch is errors.KeyMismatch
    model = importlib.import_module("wcache.vllm.model")  # imports vLLM
    loader = importlib.import_module("wcache.vllm.loader")
    assert (
        protocol.ConnectionClosed,
        seed.SeedFailed,
        snapshot.SnapshotStale,
        model.UnplannedLayers,
        loader.RestoreFailed,
    ) == (
        errors.ConnectionClosed,
        errors.SeedFailed,
        errors.SnapshotStale,
        errors.UnplannedLayers,
        errors.RestoreFailed,
    )


def test_no_error_class_outside_the_root():
    """Every exception class defined in the package is under WcacheError."""
    root = Path(wcache.__file__).parent
    builtin_errors = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    outside = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases and bases <= builtin_errors and node.name != "WcacheError":
                    outside.append(f"{path.relative_to(root.parent)}:{node.name}")
    assert [] == outside
