"""Imports run one way (docs/design.md section 2), read from the code with ``ast``.

``core`` <- ``stages`` <- ``plans``; ``store`` <- ``core``; ``vllm``, ``cli``,
``bench`` <- everything. Nothing under ``core``, ``stages``, ``plans`` or ``store``
imports ``wcache.vllm`` (lazily inside a function included); imports only under
``if TYPE_CHECKING:`` are annotations, not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

WCACHE = Path(__file__).resolve().parents[1] / "wcache"

#: The lower layers and what each may import (``wcache`` is the package root, for
#: ``__version__``). errors imports nothing from wcache, core only the errors, and
#: the shell (the one module that touches nn.Modules) core and the errors.
ALLOWED = {
    "errors": set(),
    "core": {"errors"},
    "shell": {"core", "errors"},
    "stages": {"core", "errors"},
    "plans": {"core", "errors", "stages"},
    "store": {"core", "errors", "wcache"},
}


def _layer(module: str) -> str:
    """``wcache.stages.awq`` -> ``stages``; ``wcache`` -> ``wcache``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "wcache"


def _module(path: Path) -> str:
    rel = path.relative_to(WCACHE.parent).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(tree: ast.AST) -> set[str]:
    """Every ``wcache`` module imported anywhere in ``tree`` outside TYPE_CHECKING."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "wcache")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "wcache":
            # ``from pkg import submodule`` is an edge to the submodule (the package's
            # own __init__ runs first for any import; it is an edge only when a name
            # comes from it)
            folder = WCACHE.parent / node.module.replace(".", "/")
            subs = {a.name for a in node.names
                    if (folder / a.name).is_dir() or (folder / f"{a.name}.py").is_file()}
            out.update(f"{node.module}.{name}" for name in subs)
            if len(subs) < len(node.names):
                out.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(ast.parse(p.read_text())) for p in WCACHE.rglob("*.py")}


def test_lower_layers_import_only_downwards():
    """core/stages/plans/store import only the layers below them, never wcache.vllm."""
    bad = sorted(f"{mod} imports {dep}" for mod, deps in _graph().items()
                 if _layer(mod) in ALLOWED for dep in deps
                 if _layer(dep) != _layer(mod) and _layer(dep) not in ALLOWED[_layer(mod)])
    assert [] == bad


def test_no_import_cycle_among_lower_modules():
    """The module graph of core, errors, shell, stages, plans and store has no cycle."""
    graph = {m: {d for d in deps if _layer(d) in ALLOWED and d != m}
             for m, deps in _graph().items() if _layer(m) in ALLOWED}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                walk(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert [] == cycles


def test_the_checker_sees_a_vllm_import():
    """The walker finds a lazy import inside a function and ignores TYPE_CHECKING."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from wcache.vllm import model\n"
                     "def f():\n    from wcache.vllm.adapter import layer_config\n")
    assert {"wcache.vllm.adapter"} == _imports(tree)


#: What the functional core must never import: the shell that mutates modules, the
#: vLLM integration, the store, and vLLM itself (issue 25).
CORE_FORBIDDEN = ("wcache.shell", "wcache.vllm", "wcache.store", "vllm")


def _every_import(tree: ast.AST) -> set[str]:
    """Every module named by an import anywhere in ``tree`` (lazy ones included,
    ``TYPE_CHECKING`` blocks too: the core needs none of these even for types)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _forbidden_in(tree: ast.AST) -> list[str]:
    return sorted(m for m in _every_import(tree)
                  if any(m == f or m.startswith(f + ".") for f in CORE_FORBIDDEN))


def test_core_imports_nothing_from_shell_vllm_or_store():
    """No module of wcache/core imports wcache.shell, wcache.vllm, wcache.store or vllm."""
    core = sorted((WCACHE / "core").rglob("*.py"))
    assert len(core) > 1, "wcache/core is a package"
    bad = {str(p.relative_to(WCACHE)): _forbidden_in(ast.parse(p.read_text())) for p in core}
    assert {} == {k: v for k, v in bad.items() if v}


def test_the_core_check_sees_every_forbidden_import():
    """The core check finds a shell import, a lazy vllm import and a store import."""
    tree = ast.parse("from wcache.shell import apply_state_\n"
                     "def f():\n    import vllm.envs\n"
                     "from wcache import store\nimport torch\n")
    assert ["vllm.envs", "wcache.shell", "wcache.shell.apply_state_", "wcache.store"] == \
        _forbidden_in(tree)


def test_core_takes_no_module():
    """No function in wcache/core annotates an argument as an nn.Module (the module-touching
    entry points live in wcache.shell)."""
    hits = []
    for path in sorted((WCACHE / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.annotation is not None and "Module" in ast.unparse(arg.annotation):
                        hits.append(f"{path.name}:{node.name}({arg.arg})")
    assert [] == hits
