"""The caller's process context, which a direct start inherits through fork and exec
and a template child would otherwise take from the template: CPU affinity (``taskset``,
``numactl --cpunodebind``), resource limits (``ulimit``), umask, niceness (``nice``)
and cgroups (a systemd unit's, ``systemd-run -p MemoryMax``, a job's).

``wcache run`` sends :func:`gather`'s record in its request. The template checks
before forking what it can (:func:`refusal`: a hard limit above its own without
``CAP_SYS_RESOURCE``, a lower niceness without ``CAP_SYS_NICE`` or ``RLIMIT_NICE``, an
address space already over the command's limit, a cgroup it cannot reach), and the
child applies the record (:func:`apply_`) before it runs anything of the command; a
step the kernel refuses there stops the child, and the command runs directly
(``template-unsupported``), never with the template's context in place of the caller's.
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Mapping
from typing import Any

__all__ = ["gather", "refusal", "apply_", "RLIMITS", "cgroup_targets"]

#: Every resource limit this Python knows, by name (``RLIMIT_OFILE``, an alias of
#: ``RLIMIT_NOFILE``, left out).
RLIMITS: dict[str, int] = {
    name: getattr(resource, name)
    for name in sorted(dir(resource))
    if name.startswith("RLIMIT_") and name != "RLIMIT_OFILE"
}
#: Capabilities (linux/capability.h) that let a process raise a hard limit and lower
#: its niceness.
CAP_SYS_NICE = 23
CAP_SYS_RESOURCE = 24
#: The highest niceness ``RLIMIT_NICE`` counts from (sched(7): the ceiling is 20 - rlim).
NICE_CEILING = 20
#: Limits checked against what the template's address space already holds, read from
#: ``/proc/self/status``: a child starts with the template's mappings, so a limit below
#: them fails its first allocations where a fresh process of the command may not.
SIZE_LIMITS = {"RLIMIT_AS": "VmSize", "RLIMIT_DATA": "VmData"}


def _umask() -> int:
    """This process's umask (set and restored: reading it means setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def gather() -> dict[str, Any]:
    """This process's context, as ``wcache run`` sends it: ``affinity`` (sorted CPU
    numbers), ``rlimits`` (``{name: [soft, hard]}``, -1 for unlimited), ``umask``,
    ``nice`` and ``cgroup`` (the text of ``/proc/self/cgroup``, None without it)."""
    return {
        "affinity": sorted(os.sched_getaffinity(0)),
        "rlimits": {name: list(resource.getrlimit(res)) for name, res in RLIMITS.items()},
        "umask": _umask(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cgroup": _read("/proc/self/cgroup"),
    }


def _limit(value: int) -> float:
    return math.inf if value == resource.RLIM_INFINITY else value


def _has_capability(cap: int) -> bool:
    """Whether this process holds ``cap`` in its effective set (``/proc/self/status``)."""
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & 2**cap)  # bit ``cap`` of the mask
    return False


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmSize``), 0 when absent."""
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cgroup_lines(text: str) -> dict[str, str]:
    """``/proc/PID/cgroup`` as ``{controllers: path}`` (``""`` is cgroup v2's line)."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, frozenset[str], str, str]]:
    """The cgroup mounts of ``/proc/self/mountinfo``: (fstype, controllers and
    ``name=`` options, the mount's root in the hierarchy, its mount point)."""
    out = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((rest[0], frozenset(rest[2].split(",")), fields[3], fields[4]))
    return out


def cgroup_targets(client: str, own: str, mountinfo: str) -> tuple[list[str], list[str]]:
    """Where a child must write its pid to be in the client's cgroups: the
    ``cgroup.procs`` files of each hierarchy whose path differs between the client's
    ``/proc/PID/cgroup`` text and the template's (``own``), and why any such hierarchy
    cannot be reached (not mounted here, outside the mount, no such cgroup).

    Returns:
        ``(files, problems)``; both empty when the cgroups are the template's.
    """
    mine, theirs = _cgroup_lines(own), _cgroup_lines(client)
    files: list[str] = []
    problems: list[str] = []
    for controllers, path in sorted(theirs.items()):
        if mine.get(controllers) == path:
            continue
        wanted = frozenset(controllers.split(",")) if controllers else frozenset()
        target = None
        for fstype, options, root, point in _cgroup_mounts(mountinfo):
            if (fstype == "cgroup2") != (not controllers) or not wanted <= options:
                continue
            if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
                rel = path if root == "/" else path[len(root) :]
                target = os.path.join(point, rel.lstrip("/"), "cgroup.procs")
                break
        name = f"cgroup {controllers or 'v2'}:{path}"
        if target is None:
            problems.append(f"{name} is not mounted here")
        elif not os.path.isfile(target):
            problems.append(f"{name}: no {target}")
        elif not os.access(target, os.W_OK):
            problems.append(f"{name}: {target} is not writable")
        else:
            files.append(target)
    return files, problems


def refusal(ctx: Mapping[str, Any]) -> str | None:
    """Why a child of this process could not take the context ``ctx`` (a
    :func:`gather` record), as far as can be told before the fork, or None.

    The hard limits above this process's need ``CAP_SYS_RESOURCE``; a niceness below
    this process's needs ``CAP_SYS_NICE`` or the command's ``RLIMIT_NICE``; an
    address-space or data limit below what this process already maps cannot hold the
    child; every cgroup the command is in must be reachable (:func:`cgroup_targets`).
    """
    problems = []
    rlimits = ctx.get("rlimits") or {}
    resource_cap = _has_capability(CAP_SYS_RESOURCE)
    for name, res in RLIMITS.items():
        soft, hard = rlimits.get(name, (None, None))
        if not isinstance(soft, int) or not isinstance(hard, int):
            problems.append(f"no {name} given")
            continue
        own_hard = resource.getrlimit(res)[1]
        if _limit(hard) > _limit(own_hard) and not resource_cap:
            problems.append(
                f"{name} hard limit {hard} is above the template's {own_hard} "
                f"(raising it needs CAP_SYS_RESOURCE)"
            )
        field = SIZE_LIMITS.get(name)
        if field is not None and _limit(soft) < _status_kib(field) * 1024:
            problems.append(
                f"{name} {soft} bytes is below the {_status_kib(field) * 1024} bytes the "
                f"template already maps ({field}), which a child starts with"
            )
    nice, own_nice = ctx.get("nice"), os.getpriority(os.PRIO_PROCESS, 0)
    if not isinstance(nice, int):
        problems.append("no niceness given")
    elif nice < own_nice and not _has_capability(CAP_SYS_NICE):
        nice_soft = (rlimits.get("RLIMIT_NICE") or (0, 0))[0]
        if not (_limit(nice_soft) >= NICE_CEILING - nice):
            problems.append(
                f"niceness {nice} is below the template's {own_nice} (lowering it needs "
                f"CAP_SYS_NICE or RLIMIT_NICE)"
            )
    if not isinstance(ctx.get("umask"), int):
        problems.append("no umask given")
    affinity = ctx.get("affinity")
    if not isinstance(affinity, list) or not affinity:
        problems.append("no CPU affinity given")
    client_cgroup, own_cgroup = ctx.get("cgroup"), _read("/proc/self/cgroup")
    if isinstance(client_cgroup, str) and own_cgroup is not None and client_cgroup != own_cgroup:
        problems += cgroup_targets(client_cgroup, own_cgroup, _read("/proc/self/mountinfo") or "")[
            1
        ]
    if not problems:
        return None
    return "the command's process context cannot be given to a template child: " + "; ".join(
        problems
    )


def apply_(ctx: Mapping[str, Any]) -> None:
    """Make this process (a template child, single-threaded, before the command runs)
    take the context ``ctx``: cgroups first (a cpuset move resets the affinity), then
    the resource limits, CPU affinity, niceness and umask.

    Raises:
        OSError: a step the kernel refused; the message names the step (the child
            must not run the command then).
    """
    client_cgroup, own_cgroup = ctx.get("cgroup"), _read("/proc/self/cgroup")
    if isinstance(client_cgroup, str) and own_cgroup is not None and client_cgroup != own_cgroup:
        files, problems = cgroup_targets(
            client_cgroup, own_cgroup, _read("/proc/self/mountinfo") or ""
        )
        if problems:
            raise OSError("; ".join(problems))
        for procs in files:
            try:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
            except OSError as exc:
                raise OSError(f"moving into {procs}: {exc}") from exc
    for name, (soft, hard) in (ctx.get("rlimits") or {}).items():
        res = RLIMITS.get(name)
        if res is None:
            continue
        try:
            resource.setrlimit(res, (int(soft), int(hard)))
        except (OSError, ValueError) as exc:
            raise OSError(f"{name} ({soft}, {hard}): {exc}") from exc
    steps = (
        ("CPU affinity", "affinity", lambda: os.sched_setaffinity(0, ctx["affinity"])),
        ("niceness", "nice", lambda: os.setpriority(os.PRIO_PROCESS, 0, int(ctx["nice"]))),
        ("umask", "umask", lambda: os.umask(int(ctx["umask"]))),
    )
    for what, key, step in steps:
        try:
            step()
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise OSError(f"{what} {ctx.get(key)!r}: {exc}") from exc
