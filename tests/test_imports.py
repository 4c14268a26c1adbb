"""Imports run one way (docs/design.md section 2), read from the code with ``ast``.

``core`` <- ``stages`` <- ``plans``; ``store`` <- ``core``; ``vllm`` <- ``daemon``;
``daemon``, ``cli``, ``bench`` <- everything. Nothing under ``core``, ``stages``,
``plans`` or ``store`` imports ``wcache.vllm``, and nothing under ``wcache.vllm``
imports ``wcache.daemon`` (lazily inside a function included); no module of wcache
is in an import cycle (lazy imports included); imports only under
``if TYPE_CHECKING:`` are annotations, not edges. Production modules (the core, the
store, the engine's loader side, ``wcache serve``) never load the benchmark suite,
the test fixtures or the demo when they are imported.
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
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "wcache"
        ):
            # ``from pkg import submodule`` is an edge to the submodule (the package's
            # own __init__ runs first for any import; it is an edge only when a name
            # comes from it)
            folder = WCACHE.parent / node.module.replace(".", "/")
            subs = {
                a.name
                for a in node.names
                if (folder / a.name).is_dir() or (folder / f"{a.name}.py").is_file()
            }
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
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in _graph().items()
        if _layer(mod) in ALLOWED
        for dep in deps
        if _layer(dep) != _layer(mod) and _layer(dep) not in ALLOWED[_layer(mod)]
    )
    assert [] == bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` (module -> modules it imports) closes,
    each as the path ``[a, b, ..., a]``."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                walk(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_no_import_cycle_anywhere():
    """The graph of every module and package of wcache/ has no cycle, counting every
    import (a lazy one inside a function too: it hides a circle, it does not remove it)."""
    graph = {m: {d for d in deps if d != m} for m, deps in _graph().items()}
    assert len(graph) > 100  # every module, not a few packages
    assert [] == import_cycles(graph)


def test_the_cycle_walker_finds_a_circle_through_a_lazy_import():
    """A lazy import closing a circle (ready -> serve at the top, serve -> ready inside a
    function) is found."""
    ready = ast.parse("from wcache.daemon.serve import local_ranks\n")
    serve = ast.parse("def main():\n    from wcache.daemon import ready\n")
    graph = {"wcache.daemon.ready": _imports(ready), "wcache.daemon.serve": _imports(serve)}
    assert [["wcache.daemon.ready", "wcache.daemon.serve", "wcache.daemon.ready"]] == import_cycles(
        graph
    )


def test_vllm_never_imports_the_daemon():
    """The vLLM integration is below the daemon's orchestration: no module of
    wcache/vllm imports wcache.daemon (the daemon calls wcache.vllm.build)."""
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in _graph().items()
        if _layer(mod) == "vllm"
        for dep in deps
        if _layer(dep) == "daemon"
    )
    assert [] == bad


def test_the_checker_sees_a_vllm_import():
    """The walker finds a lazy import inside a function and ignores TYPE_CHECKING."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from wcache.vllm import model\n"
        "def f():\n    from wcache.vllm.adapter import layer_config\n"
    )
    assert {"wcache.vllm.adapter"} == _imports(tree)


# --------------------------------------------------------------------------- production vs benchmarks

#: What production runs (the engine's load format, the daemon, the functional core):
#: a module name, or a package prefix ending in ``.``. ``wcache.core.`` covers core
#: once it is a package.
PRODUCTION = (
    "wcache.core",
    "wcache.core.",
    "wcache.stages.",
    "wcache.plans.",
    "wcache.store.",
    "wcache.shell",
    "wcache.errors",
    "wcache.checkpoint",
    "wcache.cli",
    "wcache.vllm.plugin",
    "wcache.vllm.loader",
    "wcache.vllm.adapter",
    "wcache.vllm.compat",
    "wcache.vllm.model",
    "wcache.vllm.key",
    "wcache.vllm.probe",
    "wcache.vllm.build",
    "wcache.daemon.serve",
    "wcache.daemon.ready",
)
#: What production must never load: the benchmark suite, test fixtures and the demo.
NOT_PRODUCTION = ("wcache.benchmarks", "wcache.testing", "wcache.demo", "wcache.bench")
#: ``wcache serve``'s functions in cli.py: their lazy imports are part of the serve path.
CLI_SERVE_PATH = (
    "main",
    "build_parser",
    "_cmd_serve",
    "_check_snapshot_arg",
    "_check_seed_args",
    "_check_http_arg",
)


def _is(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n if n.endswith(".") else f"{n}.") for n in names)


def _module_level_imports(tree: ast.Module, functions: tuple[str, ...] = ()) -> set[str]:
    """The ``wcache`` modules ``tree`` imports when it is imported: top-level statements
    (inside ``if``/``try`` too, not TYPE_CHECKING), plus the bodies of ``functions``."""
    top = ast.Module(body=[], type_ignores=[])

    def keep(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top.body.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in functions:
                    top.body.append(node)
            elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                keep(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, ()):
                        keep(child.body if isinstance(child, ast.ExceptHandler) else [child])

    keep(tree.body)
    return _imports(top)


def _loaded_by(module: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every wcache module importing ``module`` loads, each with the module that imported it."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for dep in graph.get(mod, set()) | {".".join(parts[:i]) for i in range(1, len(parts))}:
            if dep in graph and dep not in seen:
                seen[dep] = mod
                todo.append(dep)
    return seen


def _module_graph() -> dict[str, set[str]]:
    graph = {}
    for path in WCACHE.rglob("*.py"):
        mod = _module(path)
        graph[mod] = _module_level_imports(
            ast.parse(path.read_text()), CLI_SERVE_PATH if mod == "wcache.cli" else ()
        )
    return graph


def test_production_never_loads_benchmarks_fixtures_or_the_demo():
    """Importing a production module (cli's serve path included) never loads, at module
    level and transitively, wcache.benchmarks, wcache.testing, wcache.demo or wcache.bench."""
    graph = _module_graph()
    production = sorted(m for m in graph if _is(m, PRODUCTION))
    assert {"wcache.cli", "wcache.vllm.loader", "wcache.store.server"} <= set(production)
    bad = sorted(
        f"{mod} loads {dep} (imported by {via})"
        for mod in production
        for dep, via in _loaded_by(mod, graph).items()
        if _is(dep, NOT_PRODUCTION)
    )
    assert [] == bad


def test_the_production_checker_sees_a_module_level_import():
    """A top-level import (inside try/if too) and an import in a listed function count;
    a lazy import in any other function and a TYPE_CHECKING import do not."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\ntry:\n    import wcache.demo\nexcept ImportError:\n"
        "    pass\nif TYPE_CHECKING:\n    from wcache import bench\n"
        "def serve():\n    from wcache.testing import fixtures\n"
        "def other():\n    from wcache.benchmarks import synthetic\n"
    )
    assert {"wcache.demo", "wcache.testing.fixtures"} == _module_level_imports(tree, ("serve",))


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
    return sorted(
        m
        for m in _every_import(tree)
        if any(m == f or m.startswith(f + ".") for f in CORE_FORBIDDEN)
    )


def test_core_imports_nothing_from_shell_vllm_or_store():
    """No module of wcache/core imports wcache.shell, wcache.vllm, wcache.store or vllm."""
    core = sorted((WCACHE / "core").rglob("*.py"))
    assert len(core) > 1, "wcache/core is a package"
    bad = {str(p.relative_to(WCACHE)): _forbidden_in(ast.parse(p.read_text())) for p in core}
    assert {} == {k: v for k, v in bad.items() if v}


def test_the_core_check_sees_every_forbidden_import():
    """The core check finds a shell import, a lazy vllm import and a store import."""
    tree = ast.parse(
        "from wcache.shell import apply_state_\n"
        "def f():\n    import vllm.envs\n"
        "from wcache import store\nimport torch\n"
    )
    assert [
        "vllm.envs",
        "wcache.shell",
        "wcache.shell.apply_state_",
        "wcache.store",
    ] == _forbidden_in(tree)


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
