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
