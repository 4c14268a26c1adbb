"""The layout blocks of docs/design.md (section 2) and README.md ("Layout") match the tree.

A block line that starts in column 0 with a path (``wcache/store/``, ``wcache/cli.py``,
``tests/``) is an entry; its description runs on over the indented lines below it.
Every entry exists, every file a directory entry's description names (``server.py``,
``bench-restore.sh``) is in that directory, and every package under ``wcache/`` and
every top-level module of ``wcache/`` has an entry.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: (file, the heading the block follows)
BLOCKS = (("docs/design.md", "## 2. Layout"), ("README.md", "## Layout"))
#: A file name in a description: a module or a script.
FILE_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|sh))\b")


def layout_entries(text: str, heading: str) -> dict[str, str]:
    """``{path: description}`` of the first fenced block after ``heading`` in ``text``."""
    start = text.index(heading)
    open_ = text.index("```", start)
    block = text[text.index("\n", open_) + 1 : text.index("```", open_ + 3)]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line[:1].strip() and "/" in line.split()[0]:
            current, _, desc = line.partition(" ")
            entries[current] = desc.strip()
        elif line.startswith(" ") and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None  # a blank line or a prose line ends the entry
    return entries


@pytest.fixture(scope="module", params=BLOCKS, ids=[b[0] for b in BLOCKS])
def entries(request) -> dict[str, str]:
    path, heading = request.param
    return layout_entries((ROOT / path).read_text(), heading)


def test_every_named_path_exists(entries):
    """Each entry is a directory (named with a trailing /) or a file of the tree."""
    missing = [
        p for p in entries if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())
    ]
    assert [] == missing


def test_every_file_a_directory_entry_names_is_in_it(entries):
    """``server.py`` in wcache/store/'s description is wcache/store/server.py, and so on."""
    missing = [
        f"{d}{name}"
        for d, desc in entries.items()
        if d.endswith("/")
        for name in FILE_NAME.findall(desc)
        if not (ROOT / d / name).is_file()
    ]
    assert [] == missing


def test_every_package_and_top_level_module_is_named(entries):
    """Every package under wcache/ (a directory with __init__.py) and every module
    directly in wcache/ has an entry."""
    wcache = ROOT / "wcache"
    packages = {
        f"{p.parent.relative_to(ROOT)}/" for p in wcache.rglob("__init__.py") if p.parent != wcache
    }
    modules = {str(p.relative_to(ROOT)) for p in wcache.glob("*.py") if p.name != "__init__.py"}
    assert [] == sorted((packages | modules) - set(entries))


def test_the_parser_reads_entries_and_their_continuations():
    """A column-0 path starts an entry, indented lines continue it, prose ends it."""
    text = (
        "## L\n```\nwcache/store/   daemon (server.py),\n                client\n"
        "tests/\n\nimports run one way: a/b\n```\n"
    )
    assert {"wcache/store/": "daemon (server.py), client", "tests/": ""} == layout_entries(
        text, "## L"
    )


#: Code directories whose modules each have a test module ``tests/<dir>/test_<module>.py``.
MIRRORED = ("wcache/stages", "wcache/plans")
#: Modules of a mirrored directory without a mirror test module, and where they are tested.
#: None today: every stage family and plan module has its own (``__init__.py`` is not a
#: module to mirror). A module added here must say why it has nothing to test on its own.
NOT_MIRRORED: dict[str, str] = {}


def unmirrored(root: Path) -> list[str]:
    """Modules of the MIRRORED directories under ``root`` without ``test_<module>.py``."""
    return sorted(
        str(p.relative_to(root))
        for d in MIRRORED
        for p in (root / d).glob("*.py")
        if p.name != "__init__.py"
        and not (root / "tests" / Path(d).name / f"test_{p.name}").is_file()
    )


def test_every_stage_family_and_plan_module_has_its_test_module():
    """wcache/stages/<family>.py has tests/stages/test_<family>.py, and wcache/plans/<m>.py
    has tests/plans/test_<m>.py, or is in NOT_MIRRORED with where it is tested; no
    NOT_MIRRORED entry is stale (its mirror exists or its module is gone)."""
    assert sorted(NOT_MIRRORED) == unmirrored(ROOT)


def test_the_mirror_check_finds_a_module_without_tests(tmp_path):
    """A module without a test module is listed; one with its test module is not."""
    (tmp_path / "wcache" / "stages").mkdir(parents=True)
    (tmp_path / "wcache" / "plans").mkdir(parents=True)
    (tmp_path / "tests" / "stages").mkdir(parents=True)
    for name in ("__init__.py", "fp8.py", "marlin.py"):
        (tmp_path / "wcache" / "stages" / name).write_text("")
    (tmp_path / "tests" / "stages" / "test_fp8.py").write_text("")
    assert ["wcache/stages/marlin.py"] == unmirrored(tmp_path)
