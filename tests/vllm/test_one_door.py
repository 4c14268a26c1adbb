"""vLLM behind one door (issue 25, item 4): every vLLM private name, patch and write
onto a vLLM object is in the ``wcache/vllm/compat/`` package; the adapter covers
compat's class table; compat's patches are undone after their scope.

The scans read every module of the ``wcache`` package with ``ast``; each rule's
own test below feeds it a small offending source, so a rule that stopped finding
anything would fail there.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
from pathlib import Path

import pytest
import torch

WCACHE = Path(__file__).resolve().parents[2] / "wcache"
VLLM_PKG = WCACHE / "vllm"
COMPAT = VLLM_PKG / "compat"

#: (module, function, written expression) -> why the write stays outside compat.
#: Only what cannot move: each entry is checked to still exist (a stale entry fails).
ALLOWED_WRITES = {
    (
        "wcache/vllm/loader.py",
        "_clone_privatize_",
        "t.data",
    ): "torch's own API (Tensor.data) swapping a parameter's storage for a private "
    "copy, keeping the Parameter object vLLM's layers reference; a torch tensor, "
    "not a vLLM attribute",
}

#: torch.nn.Module / Tensor internals wcache may use by name (torch's, not vLLM's).
_TORCH_NAMES = frozenset(dir(torch.nn.Module())) | frozenset(dir(torch.Tensor))


def _py_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _in_compat(path: Path) -> bool:
    return COMPAT in path.parents


def _rel(path: Path) -> str:
    return path.relative_to(WCACHE.parent).as_posix()


def _is_vllm(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] == "vllm"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def vllm_imports(tree: ast.AST) -> list[str]:
    """Every import of vLLM in ``tree`` (top level or inside a function), and every
    ``importlib.import_module("vllm...")``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_vllm(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            found.append(node.module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and _is_vllm(str(node.args[0].value))
        ):
            found.append(str(node.args[0].value))
    return found


def _wcache_names() -> frozenset[str]:
    """Every name wcache itself defines (functions, classes, assigned names and
    attributes, arguments): a private name not among them comes from elsewhere."""
    names = set()
    for path in _py_files(WCACHE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return frozenset(names)


def private_reaches(tree: ast.AST, wcache_names: frozenset[str]) -> list[str]:
    """vLLM private names in ``tree``: imported (``from vllm.x import _y``,
    ``import vllm._y``), read off a name bound to a vLLM import, passed as a string
    to ``getattr``/``hasattr``/``setattr``/``delattr``, vLLM's op namespace
    ``torch.ops._C``, or any ``obj._name`` that neither wcache nor torch defines."""
    found = []
    vllm_bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_vllm(a.name):
                    vllm_bound.add(a.asname or a.name.split(".")[0])
                    if any(_private(part) for part in a.name.split(".")):
                        found.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            for a in node.names:
                vllm_bound.add(a.asname or a.name)
                if _private(a.name) or any(_private(p) for p in node.module.split(".")):
                    found.append(f"from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            text = ast.unparse(node)
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in vllm_bound:
                found.append(text)
            elif text.startswith("torch.ops._"):
                found.append(text)
            elif node.attr not in wcache_names and node.attr not in _TORCH_NAMES:
                found.append(text)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in wcache_names
        ):
            found.append(ast.unparse(node))
    return found


def _locally_built(func: ast.AST, module_names: set[str], wcache_imports: set[str]) -> set[str]:
    """Names that ``func`` binds to an object wcache builds itself: the result of
    calling a function/class of this module, of wcache, of torch or a builtin class
    (``RuntimeError(...)``; not ``getattr``, which returns an existing object)."""
    built = set()
    for node in ast.walk(func):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        callee = node.value.func
        while isinstance(callee, ast.Attribute):
            callee = callee.value
        if not isinstance(callee, ast.Name):
            continue
        if not (
            callee.id in module_names
            or callee.id in wcache_imports
            or callee.id == "torch"
            or isinstance(getattr(builtins, callee.id, None), type)
        ):
            continue
        for target in node.targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    built.add(sub.id)
    return built


def object_writes(tree: ast.AST, path: str) -> list[tuple[str, str, str]]:
    """Attribute writes in ``tree`` onto objects wcache did not build:
    ``obj.attr = ...``, ``del obj.attr``, ``setattr(obj, ...)``, ``delattr(obj, ...)``,
    except on ``self``/``cls`` and on names bound to an object wcache built in the
    same function (:func:`_locally_built`; a name is judged by the call that binds
    it, so an object reached through a helper of the same module counts as built).
    Returns ``(path, function, expression)``."""
    module_names = {
        n.name
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    wcache_imports = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "wcache"
        ):
            wcache_imports.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            wcache_imports.update(
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "wcache"
            )
    found = []

    def visit(node: ast.AST, func: ast.AST | None, func_name: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func, func_name = node, node.name
        exprs = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            exprs = [
                sub
                for t in targets
                for sub in ast.walk(t)
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
            ]
        elif isinstance(node, ast.Delete):
            exprs = [t for t in node.targets if isinstance(t, ast.Attribute)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            exprs = [node]
        for expr in exprs:
            base = expr.value if isinstance(expr, ast.Attribute) else expr.args[0]
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                continue
            built = _locally_built(func, module_names, wcache_imports) if func else set()
            if isinstance(base, ast.Name) and base.id in built:
                continue
            text = ast.unparse(expr.func if isinstance(expr, ast.Call) else expr)
            if isinstance(expr, ast.Call):
                text = f"{text}({ast.unparse(base)}, ...)"
            found.append((path, func_name, text))
        for child in ast.iter_child_nodes(node):
            visit(child, func, func_name)

    visit(tree, None, "<module>")
    return found


# ----------------------------------------------------------------------- the scans


def test_no_vllm_import_outside_wcache_vllm():
    """No module of wcache outside wcache/vllm/ imports vLLM (not even lazily)."""
    offenders = {
        _rel(p): vllm_imports(ast.parse(p.read_text()))
        for p in _py_files(WCACHE)
        if VLLM_PKG not in p.parents
    }
    assert {} == {k: v for k, v in offenders.items() if v}


def test_vllm_private_names_only_in_compat():
    """Inside wcache/vllm/, only compat/ imports or names a vLLM private name."""
    names = _wcache_names()
    offenders = {
        _rel(p): private_reaches(ast.parse(p.read_text()), names)
        for p in _py_files(VLLM_PKG)
        if not _in_compat(p)
    }
    assert {} == {k: v for k, v in offenders.items() if v}


def test_writes_onto_vllm_objects_only_in_compat():
    """Inside wcache/vllm/, only compat/ assigns, sets or deletes attributes of
    objects wcache did not build (vLLM's modules, classes, layers, kernels, configs),
    but for the explicit allow-list; every allow-list entry is still needed."""
    found = set()
    for p in _py_files(VLLM_PKG):
        if not _in_compat(p):
            found.update(object_writes(ast.parse(p.read_text()), _rel(p)))
    assert set() == found - set(ALLOWED_WRITES)
    assert set() == set(ALLOWED_WRITES) - found


def test_compat_holds_what_the_scans_forbid_elsewhere():
    """The rules find what they exist for: compat/ itself has private names,
    patches (module attribute writes) and writes onto vLLM objects."""
    names = _wcache_names()
    privates, writes = [], set()
    for p in _py_files(COMPAT):
        tree = ast.parse(p.read_text())
        privates += private_reaches(tree, names)
        writes |= {w[2] for w in object_writes(tree, _rel(p))}
    assert "rotary_embedding._ROPE_DICT" in privates
    assert any("_set_torch_accelerator_to_noop" in p for p in privates)
    assert {"hooked.load_weights", "engine_args.load_format", "delattr(module, ...)"} <= writes


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from vllm.model_executor.layers import rotary_embedding\n"
            "rotary_embedding._ROPE_DICT.clear()\n",
            ["rotary_embedding._ROPE_DICT"],
        ),
        (
            "from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop\n",
            ["from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop"],
        ),
        ("import vllm._custom_ops\n", ["import vllm._custom_ops"]),
        ("def f(m):\n    return m._expert_routing_tables()\n", ["m._expert_routing_tables"]),
        ("import torch\nok = hasattr(torch.ops._C, 'x')\n", ["torch.ops._C"]),
        (
            "def f(k):\n    return getattr(k, '_apply_weights_onednn')\n",
            ["getattr(k, '_apply_weights_onednn')"],
        ),
        ("def f(m):\n    return m._parameters\n", []),
    ],
)
def test_private_name_rule_finds_each_kind(source, expected):
    """The private-name rule flags each way of reaching a vLLM private name, and not
    torch's own module internals."""
    assert expected == private_reaches(ast.parse(source), frozenset({"f", "m", "k", "ok"}))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f(model):\n    model.load_weights = None\n", [("x.py", "f", "model.load_weights")]),
        ("def f(kernel):\n    setattr(kernel, 'a', 1)\n", [("x.py", "f", "setattr(kernel, ...)")]),
        ("def f(layer):\n    del layer.width\n", [("x.py", "f", "layer.width")]),
        (
            "from vllm.config import utils\nutils.hash_factors = None\n",
            [("x.py", "<module>", "utils.hash_factors")],
        ),
        ("def f():\n    err = RuntimeError('x')\n    err.output = 1\n", []),
        (
            "def f(q):\n    k = getattr(q, 'fp8_linear')\n    k.width = 1\n",
            [("x.py", "f", "k.width")],
        ),
        ("class A:\n    def f(self):\n        self.x = 1\n", []),
    ],
)
def test_write_rule_finds_each_kind(source, expected):
    """The write rule flags assignments, setattr and del on objects from elsewhere,
    and not on ``self`` or on an object the function built."""
    assert expected == object_writes(ast.parse(source), "x.py")


# ------------------------------------------------------------- the adapter registry


def _compat_method_classes() -> set[str]:
    """Names in compat's class table whose vLLM class is a concrete quant method or a
    compressed-tensors scheme (imported here, so every module is loaded)."""
    from wcache.vllm import compat

    base = importlib.import_module(
        compat.release().class_modules["QuantizeMethodBase"]
    ).QuantizeMethodBase
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsScheme,
    )

    out = set()
    for name, module in compat.release().class_modules.items():
        cls = getattr(importlib.import_module(module), name)
        if cls is not base and issubclass(cls, (base, CompressedTensorsScheme)):
            out.add(name)
    return out


def test_adapter_registry_covers_compat_class_table():
    """The adapter has a function for every quant method and scheme class of compat's
    class table, and every class it maps is in that table."""
    from wcache.vllm import adapter, compat

    covered = set(adapter.METHODS) | set(adapter.SCHEMES)
    assert set() == _compat_method_classes() - covered  # a class the adapter misses
    assert set() == covered - set(compat.release().class_modules)  # a class compat does not know
    assert set() == set(adapter.SCHEMES) & set(adapter.METHODS)


def test_adapter_registry_maps_methods_and_schemes_by_kind():
    """METHODS holds quant methods only and SCHEMES compressed-tensors schemes only."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsScheme,
    )

    from wcache.vllm import adapter, compat

    def cls(name):
        return getattr(importlib.import_module(compat.release().class_modules[name]), name)

    assert [] == [n for n in adapter.SCHEMES if not issubclass(cls(n), CompressedTensorsScheme)]
    assert [] == [n for n in adapter.METHODS if issubclass(cls(n), CompressedTensorsScheme)]


# ----------------------------------------------------------------------- the patches


def _patch_sites():
    """(context manager factory, owner, attribute) of each of compat's patches."""
    from vllm.config import utils as config_utils
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.quantization.utils import gptq_utils
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.reload import layerwise

    from wcache.vllm import compat

    return [
        (compat.without_reload_metadata, loader_utils, "record_metadata_for_reloading"),
        (compat.online_quantization_deferred, layerwise, "_layerwise_process"),
        (compat.captured_hash_factors, config_utils, "hash_factors"),
        (lambda: compat.attention_forward_replaced(lambda *a, **k: None), Attention, "forward"),
        (compat.torch_accelerator_noops, torch.accelerator, "empty_cache"),
        (compat.torch_accelerator_noops, torch.accelerator, "synchronize"),
        (compat.gptq_config_copied_shallow, gptq_utils, "deepcopy"),
    ]


@pytest.mark.parametrize("index", range(7))
def test_patch_is_undone_after_its_scope(index):
    """Each of compat's patches replaces vLLM's (or torch's) function inside its
    block only: the original is back after a normal exit and after a raise."""
    factory, owner, attr = _patch_sites()[index]
    original = getattr(owner, attr)
    with factory():
        assert getattr(owner, attr) is not original
    assert getattr(owner, attr) is original
    with contextlib.suppress(RuntimeError), factory():
        raise RuntimeError("inside the scope")
    assert getattr(owner, attr) is original


def test_captured_hash_factors_sees_vllms_factors():
    """The hash-factor capture records what vLLM's own hash_factors receives."""
    from vllm.config import utils as config_utils

    from wcache.vllm import compat

    with compat.captured_hash_factors() as captured:
        digest = config_utils.hash_factors({"a": 1})
    assert [{"a": 1}] == captured
    assert digest == config_utils.hash_factors({"a": 1})


def test_kernel_bindings_move_layer_state_onto_the_kernel():
    """sync_kernel_state_ moves a layer-local stage attr onto the kernel object its
    binding names, deletes it from the layer, and leaves it where no kernel is."""
    from wcache.vllm import compat

    class Kernel:
        logical_output_size = None

    layer = torch.nn.Module()
    layer.scheme = type("Scheme", (), {})()
    layer.scheme.fp8_linear = Kernel()
    layer.logical_output_size = 96
    compat.sync_kernel_state_(layer)
    assert 96 == layer.scheme.fp8_linear.logical_output_size
    assert "logical_output_size" not in vars(layer)
    bare = torch.nn.Module()
    bare.logical_output_size = 96
    compat.sync_kernel_state_(bare)
    assert 96 == bare.logical_output_size
    assert "scheme.fp8_linear.logical_output_size" == compat.bound_attr_path(
        layer, "logical_output_size"
    )
    assert "logical_output_size" == compat.bound_attr_path(bare, "logical_output_size")


def test_no_stage_declares_an_attr_through_another_object():
    """Every registered stage's attrs are layer-local names (no dotted path onto a
    kernel or scheme object): vLLM's objects are reached by compat's bindings."""
    import wcache.plans  # noqa: F401  (registers every stage)
    from wcache.core.registry import registered_stages

    stages = registered_stages()
    assert "onednn.prepack_scaled_weight" in stages
    assert {} == {
        name: [a for a in getattr(st, "attrs", ()) if "." in a]
        for name, st in stages.items()
        if any("." in a for a in getattr(st, "attrs", ()))
    }


def test_onednn_state_is_bound_onto_vllms_int8_kernel():
    """The oneDNN W8A8 stage's dnnl_handler and linear_method go onto scheme.kernel,
    linear_method as the kernel's own bound oneDNN apply (what vLLM's post-load sets)."""
    from wcache.stages.onednn import ONEDNN_LINEAR_METHOD
    from wcache.vllm import compat

    class Kernel:
        def _apply_weights_onednn(self, layer, x, bias=None):
            return "onednn"

    layer = torch.nn.Module()
    layer.scheme = type("Scheme", (), {})()
    layer.scheme.kernel = Kernel()
    handle = object()
    layer.dnnl_handler, layer.linear_method = handle, ONEDNN_LINEAR_METHOD
    assert "scheme.kernel.dnnl_handler" == compat.bound_attr_path(layer, "dnnl_handler")
    compat.sync_kernel_state_(layer)
    assert handle is layer.scheme.kernel.dnnl_handler
    assert layer.scheme.kernel._apply_weights_onednn == layer.scheme.kernel.linear_method
    assert "onednn" == layer.scheme.kernel.linear_method(layer, None)
    assert set() == {"dnnl_handler", "linear_method"} & set(vars(layer))
