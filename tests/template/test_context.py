"""What a template child takes of its caller's process context
(:mod:`wcache.template.context`), and what the template refuses before forking: the
rules on their own, without a template (tests/template/test_template.py runs them
through one)."""

from __future__ import annotations

import os
import resource

import pytest

from wcache.template import context

#: A hybrid host's mounts (cgroup v1 controllers, v2 under unified/) and one whose v1
#: memory hierarchy is mounted from a sub-cgroup (a container's view).
MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 /ctr /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
OWN = "9:name=systemd:/\n4:memory:/ctr\n1:cpu:/\n0::/\n"


def test_the_same_cgroups_need_no_move():
    """A client in the template's cgroups: nothing to write, nothing refused."""
    assert context.cgroup_targets(OWN, OWN, MOUNTINFO) == ([], [])


def test_each_differing_hierarchy_is_found_under_its_mount(monkeypatch):
    """A client in other cgroups is moved in each hierarchy that differs: v2 under its
    cgroup2 mount, v1 by controller (``name=`` too), a mount's root taken off the path."""
    monkeypatch.setattr(context.os.path, "isfile", lambda p: True)
    monkeypatch.setattr(context.os, "access", lambda p, mode: True)
    client = "9:name=systemd:/unit\n4:memory:/ctr/job\n1:cpu:/\n0::/unit\n"
    files, problems = context.cgroup_targets(client, OWN, MOUNTINFO)
    assert problems == []
    assert files == [
        "/sys/fs/cgroup/unified/unit/cgroup.procs",
        "/sys/fs/cgroup/memory/job/cgroup.procs",
        "/sys/fs/cgroup/systemd/unit/cgroup.procs",
    ]


def test_an_unreachable_cgroup_is_named(monkeypatch):
    """A hierarchy not mounted here, a path outside its mount or a missing cgroup is a
    problem naming it (the template refuses before forking)."""
    client = "9:name=systemd:/\n4:memory:/elsewhere\n1:cpu:/\n0::/gone\n3:pids:/x\n"
    files, problems = context.cgroup_targets(client, OWN, MOUNTINFO)
    assert files == []
    assert problems == [
        "cgroup v2:/gone: no /sys/fs/cgroup/unified/gone/cgroup.procs",
        "cgroup memory:/elsewhere is not mounted here",
        "cgroup pids:/x is not mounted here",
    ]


def test_this_process_context_is_accepted():
    """``gather()`` of this process is a context its own child can take."""
    ctx = context.gather()
    assert context.refusal(ctx) is None
    assert ctx["umask"] == os.umask(ctx["umask"])  # read without changing it
    assert ctx["affinity"] == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "change, said",
    [
        (
            lambda c: c["rlimits"].__setitem__("RLIMIT_NOFILE", [1024, 1 << 40]),
            "RLIMIT_NOFILE hard limit 1099511627776 is above the template's",
        ),
        (lambda c: c.__setitem__("nice", -5), "niceness -5 is below the template's"),
        (
            lambda c: c["rlimits"].__setitem__("RLIMIT_AS", [1 << 20, -1]),
            "RLIMIT_AS 1048576 bytes is below the",
        ),
        (lambda c: c.__setitem__("umask", None), "no umask given"),
    ],
    ids=["hard-limit", "nice", "address-space", "no-umask"],
)
def test_a_context_the_template_may_not_give_is_refused(monkeypatch, change, said):
    """Without CAP_SYS_RESOURCE / CAP_SYS_NICE (an unprivileged template), a hard limit
    above the template's or a lower niceness is refused before the fork, and so is an
    address-space limit below what the template maps, naming the field."""
    monkeypatch.setattr(context, "_has_capability", lambda cap: False)
    ctx = context.gather()
    ctx["rlimits"]["RLIMIT_NICE"] = [0, 0]
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_NOFILE is unlimited here: no hard limit is above it")
    change(ctx)
    reason = context.refusal(ctx)
    assert reason is not None and said in reason, reason
