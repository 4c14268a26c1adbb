"""Test-only escape hatches around the plan rules (never used by wcache itself).

The production :class:`~wcache.core.Plan` rejects every invalid plan at
construction and :func:`~wcache.core.stage` refuses to bind a second function to
a registered name. Guard and runner tests need exactly those invalid things, to
prove the run-time checks catch what a broken plan would do; they build them here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from attrs import frozen

from wcache.core import Plan, Stage, StageFn, Tag

__all__ = ["UncheckedPlan", "unregistered_stage"]


@frozen
class UncheckedPlan(Plan):
    """A :class:`~wcache.core.Plan` built without the construction-time rules (the
    runner and the restore guard still check everything at run time)."""

    def __attrs_post_init__(self) -> None:
        """Skip :func:`wcache.core.checks.plan_problems` (tests of the run-time checks only)."""


def unregistered_stage(
    name: str,
    tag: Tag,
    *,
    reads: Iterable[str] = (),
    writes: Iterable[str] = (),
    attrs: Iterable[str] = (),
    optional: Iterable[str] = (),
    drops: Iterable[str] = (),
    version: int = 1,
    source: str = "test",
) -> Callable[[StageFn], Stage]:
    """Like :func:`wcache.core.stage`, without the registry and the name/tag checks:
    a test may rebind a real stage's name to a broken function, or give a stage a
    bad tag or name to prove the plan rules reject it."""

    def wrap(fn: StageFn) -> Stage:
        return Stage(
            name=name,
            tag=tag,
            fn=fn,
            reads=tuple(reads),
            writes=tuple(writes),
            attrs=tuple(attrs),
            optional=frozenset(optional),
            drops=tuple(drops),
            version=version,
            source=source,
        )

    return wrap
