"""Which Python entry a command runs, read from its argv the way the kernel and
CPython would (no import of torch or vLLM).

``wcache run -- CMD ARGS...`` runs CMD inside a forked child of the template only
when CMD is a Python program of the template's own interpreter:

* ``python[3[.X]] [-u] SCRIPT ARGS`` / ``-m MODULE ARGS`` / ``-c CODE ARGS``;
* a script whose ``#!`` line names such an interpreter, e.g. a console script
  pip wrote (``vllm``, ``wcache``): it is run as ``python SCRIPT ARGS``, as the
  kernel would.

Anything else (another interpreter, interpreter options the child cannot replay
such as ``-X``, ``-W``, ``-O``, ``-E``, ``-I``, a binary, ``python`` reading
stdin) is :class:`~wcache.template.errors.TemplateUnsupported`, and ``wcache run``
runs the command directly.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

from wcache.template.errors import TemplateUnsupported

__all__ = ["resolve_entry", "sys_path0", "ENTRY_KINDS", "PYTHON_NAME"]

#: What the child runs: a script file, ``-m`` module, ``-c`` code.
ENTRY_KINDS = ("script", "module", "code")
#: Interpreter names taken as CPython (``python``, ``python3``, ``python3.11``).
PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
#: The ``#!`` line is at most this long (Linux BINPRM_BUF_SIZE is 256 bytes).
SHEBANG_MAX_BYTES = 256
#: Single-letter interpreter options the child replays: ``-u`` (unbuffered stdio).
REPLAYED_OPTIONS = frozenset("u")


def _which(cmd: str, env: Mapping[str, str], cwd: str) -> str:
    """The file ``cmd`` names, found as a shell would (``PATH`` unless it holds ``/``).

    Raises:
        TemplateUnsupported: not found or not executable.
    """
    if "/" in cmd:
        path = os.path.join(cwd, cmd)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
        raise TemplateUnsupported(f"{cmd}: no such executable")
    found = shutil.which(cmd, path=env.get("PATH", os.defpath))
    if found is None:
        raise TemplateUnsupported(f"{cmd}: not found on PATH")
    return os.path.abspath(os.path.join(cwd, found))


def _shebang(path: str) -> list[str] | None:
    """The ``#!`` line of ``path`` split into words, or None (a binary, no line)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SHEBANG_MAX_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    return line.split() or None


def _python_args(interpreter: str, args: Sequence[str], argv0: str) -> dict[str, Any]:
    """Parse ``python``'s own command line (after the interpreter) into an entry."""
    unbuffered = False
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(args):
                raise TemplateUnsupported(f"python {a} needs an argument")
            kind = "module" if a == "-m" else "code"
            return {
                "interpreter": interpreter,
                "kind": kind,
                "target": args[i + 1],
                "args": list(args[i + 2 :]),
                "unbuffered": unbuffered,
            }
        if a.startswith(("-m", "-c")) and len(a) > 2:
            kind = "module" if a[1] == "m" else "code"
            return {
                "interpreter": interpreter,
                "kind": kind,
                "target": a[2:],
                "args": list(args[i + 1 :]),
                "unbuffered": unbuffered,
            }
        if a == "-" or a == "--":
            raise TemplateUnsupported("python reading its program from stdin runs directly")
        if a.startswith("-"):
            letters = a[1:]
            if not letters or set(letters) - REPLAYED_OPTIONS:
                raise TemplateUnsupported(
                    f"python option {a} is not replayed in a template child (only -u is)"
                )
            unbuffered = True
            i += 1
            continue
        return {
            "interpreter": interpreter,
            "kind": "script",
            "target": a,
            "argv0": a,
            "args": list(args[i + 1 :]),
            "unbuffered": unbuffered,
        }
    raise TemplateUnsupported("an interactive python (no script, -m or -c) runs directly")


def resolve_entry(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> dict[str, Any]:
    """The Python entry ``argv`` runs, as a wire-ready dict: ``interpreter`` (absolute
    path), ``kind`` (:data:`ENTRY_KINDS`), ``target`` (script path as given, module
    name or code), ``args`` (``sys.argv[1:]``), ``unbuffered`` (``-u``), and for a
    script ``argv0`` (``sys.argv[0]``).

    Raises:
        TemplateUnsupported: not a Python entry of a CPython interpreter (see the
            module docstring), naming why.
    """
    if not argv:
        raise TemplateUnsupported("no command given")
    exe = _which(argv[0], env, cwd)
    if PYTHON_NAME.match(os.path.basename(argv[0])):
        return _python_args(exe, argv[1:], argv[0])
    words = _shebang(exe)
    if words is None:
        raise TemplateUnsupported(f"{argv[0]} is not a Python script (no #! line)")
    interp, extra = words[0], words[1:]
    if os.path.basename(interp) == "env" and extra:  # #!/usr/bin/env python3
        interp, extra = _which(extra[0], env, cwd), extra[1:]
    if not PYTHON_NAME.match(os.path.basename(interp)):
        raise TemplateUnsupported(f"{argv[0]} runs {interp}, not a Python interpreter")
    if extra:
        raise TemplateUnsupported(f"{argv[0]}'s #! line passes options ({' '.join(extra)})")
    # the kernel runs INTERP SCRIPT ARGS with SCRIPT the path it found: sys.argv[0]
    return {
        "interpreter": os.path.abspath(interp),
        "kind": "script",
        "target": exe,
        "argv0": exe,
        "args": list(argv[1:]),
        "unbuffered": False,
    }


def sys_path0(entry: Mapping[str, Any], cwd: str) -> str | None:
    """The directory CPython puts first on ``sys.path`` for ``entry`` (a
    :func:`resolve_entry` record) started in ``cwd``: a script's own directory
    (symlinks resolved), a script that is itself a directory, or ``cwd`` for ``-m``
    and ``-c``; None for a zip (its members are not files to list).

    Source: CPython's Modules/main.c ``pymain_run_python`` (``sys.path[0]``).
    """
    if entry.get("kind") != "script":
        return cwd
    path = os.path.join(cwd, str(entry.get("target")))
    if os.path.isdir(path):
        return path
    if zipfile.is_zipfile(path):
        return None
    return os.path.dirname(os.path.realpath(path))
