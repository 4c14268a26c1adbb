"""What vLLM's torch.compile cache holds, and what an engine's log says it did with it.

vLLM's compile-cache directory is keyed by a hash of the engine's config in which
the load format does not appear (``LoadConfig.compute_hash`` has no factors), so an
engine with ``load_format="wcache"`` and one with ``"auto"`` read and write the same
``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/{hash}/`` entry. A hit
skips Dynamo: whatever Python-side state the traced graph baked in comes from the
engine that wrote the entry. Sharing is correct exactly when a wcache-restored
model traces to the graph vLLM's own load traces to; :func:`compiled_graphs`
reads that graph back from the saved artifact of each cache root, so two cold
roots (one written by each load format) can be compared text for text, and
:func:`compile_cache_events` reads whether an engine loaded, wrote or failed to
load an artifact.

Artifacts are pickles (torch's own ``AOTCompiledFunction`` format): read only
cache roots your own engines wrote.

Source: vllm/compilation/decorators.py (``torch_aot_compile/{hash}/rank_{r}_{dp}/model``,
``_try_load_aot_compiled_fn``, ``save_aot_compiled_function``),
torch/_dynamo/aot_compile.py (``AOTCompiledFunction.serialize``),
torch/_dynamo/aot_compile_types.py (``BundledAOTAutogradSerializableCallable``),
vllm/compilation/caching.py (``VllmSerializableFunction``), vllm/compilation/monitor.py.
"""

from __future__ import annotations

import difflib
import importlib
import io
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from wcache.errors import UnreadableArtifact
from wcache.testing.caches import CACHE_ENV_DIRS

__all__ = [
    "AOT_CACHE_DIR",
    "ARTIFACT_NAME",
    "CompileCacheEvents",
    "UnreadableArtifact",
    "VLLM_OP_MODULES",
    "aot_artifacts",
    "compile_cache_events",
    "compiled_graphs",
    "backend_cache_dirs",
    "graph_diff",
    "register_vllm_ops",
    "BACKEND_DIR_PLACEHOLDER",
]

#: Where vLLM keeps AOT-compiled functions under ``VLLM_CACHE_ROOT``.
AOT_CACHE_DIR = ("torch_compile_cache", "torch_aot_compile")
#: The artifact's file name inside ``{hash}/rank_{rank}_{dp_rank}/``.
ARTIFACT_NAME = "model"
#: The readable split graph vLLM's own backend writes (CUDA, with or without AOT
#: compile) at ``torch_compile_cache/{hash10}/rank_{r}_{dp}/{prefix}/``, once per
#: directory (the first engine to compile there wins).
COMPUTATION_GRAPH = "computation_graph.py"
#: Stands in for the ``{hash10}`` directory of a root's computation_graph.py entries
#: when the root has one such directory (:func:`backend_cache_dirs` says why a disk
#: and a wcache engine name it differently).
BACKEND_DIR_PLACEHOLDER = "<backend-cache-dir>"
#: Stands in for a cache root's path inside graph text (Inductor writes its own cache
#: paths into the output code), so texts from two roots compare.
ROOT_PLACEHOLDER = "<cache-root>"
#: The source-location comment Dynamo and Inductor put above each node ("# File:
#: .../parameter.py:124 in __torch_function__, code: ..."): which Python line produced
#: the op, not the op. A wcache-restored layer reaches the same ``F.linear`` through
#: other Python frames than vLLM's own load (a plain tensor instead of vLLM's
#: Parameter subclass, wcache's GEMM callable), so these lines differ by design.
_PROVENANCE_LINE = re.compile(r"^\s*# File: .*\n?", re.MULTILINE)
#: Where Inductor's output code turns from the compiled module to its stand-alone
#: benchmark harness (``get_args``: example inputs rebuilt from the inputs' storages,
#: one shared storage where wcache maps every weight from one arena, one each on
#: disk; then ``benchmark_compiled_module``). The compiled ``call`` never reads it.
_BENCHMARK_HARNESS = re.compile(r"\n(?:def get_args\(|def benchmark_compiled_module\()")
#: Dynamo names each compiled function ``__compiled_fn_<n>_<uuid>``: the uuid is per
#: process, not part of the graph.
_COMPILED_FN_NAME = re.compile(r"__compiled_fn_(\d+)_[0-9a-f_]{36}")
#: Modules whose import registers the torch ops a vLLM split graph names (its nodes'
#: targets are resolved by name while unpickling: ``torch.ops.vllm_ir.rms_norm``,
#: ``torch.ops.vllm.unified_attention_with_output``, ``torch.ops._C.*``). An engine
#: has imported them all before it loads an artifact; a reader must do the same.
#: Modules a release lacks are skipped (``vllm.ir`` is new in 0.33).
VLLM_OP_MODULES = (
    "vllm._custom_ops",  # torch.ops._C.* (CUDA kernels)
    "vllm.ir",  # torch.ops.vllm_ir.* (0.33)
    "vllm.kernels",  # the vllm_ir ops' implementations
    "vllm.model_executor.models.llama",  # linear, norm, rotary, attention ops
    "vllm.model_executor.layers.quantization.utils.marlin_utils",
    "vllm.model_executor.layers.quantization.utils.w8a8_utils",
)


@attrs.frozen
class CompileCacheEvents:
    """What one engine's log says about vLLM's compile cache.

    Attributes:
        loaded: artifact paths loaded from the cache ("Directly load AOT compilation
            from path ..."), a hit that skips Dynamo.
        saved: artifact paths this engine wrote ("saved AOT compiled function to ...").
        load_failures: ``(path, reason)`` for each artifact found but not loaded
            ("Compiling model again due to a load failure from ..."); the engine
            compiled again.
        graphs_loaded: lines of vLLM's piecewise backend loading compiled graphs
            ("Directly load the compiled graph(s) ...", non-AOT cache).
        compile_s: vLLM's "torch.compile took|takes X s in total" figures (seconds),
            only printed in vLLM's own compile mode (CUDA), not on CPU.
        graph_capture_s: "Graph capturing finished in X secs" (CUDA graphs; seconds).
    """

    loaded: tuple[str, ...] = ()
    saved: tuple[str, ...] = ()
    load_failures: tuple[tuple[str, str], ...] = ()
    graphs_loaded: tuple[str, ...] = ()
    compile_s: tuple[float, ...] = ()
    graph_capture_s: tuple[float, ...] = ()

    @property
    def hit(self) -> bool:
        """The engine took its compiled model from the cache and compiled nothing."""
        return bool(self.loaded or self.graphs_loaded) and not self.saved and not self.load_failures

    @property
    def compiled(self) -> bool:
        """The engine compiled (it wrote an artifact, or failed to load one)."""
        return bool(self.saved or self.load_failures)


_LOADED = re.compile(r"Directly load AOT compilation from path (\S+)")
_SAVED = re.compile(r"saved AOT compiled function to (\S+)")
_LOAD_FAILURE = re.compile(
    r"Compiling model again due to a load failure from (\S+), "
    r"reason: (.*)$"
)
_GRAPHS_LOADED = re.compile(r"Directly load the compiled graph\(s\) .*$")
_COMPILE_S = re.compile(r"torch\.compile (?:took|takes) ([\d.]+) s in total")
_CAPTURE_S = re.compile(r"Graph capturing finished in ([\d.]+) secs")


def compile_cache_events(log: str) -> CompileCacheEvents:
    """Parse an engine's log (vLLM's INFO lines, any process prefix) for what it did
    with the compile cache.

    Args:
        log: the engine's output; vLLM logs to stdout unless
            ``VLLM_LOGGING_STREAM=ext://sys.stderr`` (what :func:`run_engine`'s
            ``log`` holds).

    Returns:
        The events, in log order.

    Source: vllm/compilation/decorators.py, vllm/compilation/backends.py,
    vllm/compilation/monitor.py, vllm/v1/worker/gpu_model_runner.py (vLLM 0.32).
    """
    loaded, saved, failures, graphs, compile_s, capture_s = [], [], [], [], [], []
    for line in log.splitlines():
        if m := _LOADED.search(line):
            loaded.append(m.group(1))
        elif m := _SAVED.search(line):
            saved.append(m.group(1))
        elif m := _LOAD_FAILURE.search(line):
            failures.append((m.group(1), m.group(2).strip()))
        elif m := _GRAPHS_LOADED.search(line):
            graphs.append(m.group(0))
        if m := _COMPILE_S.search(line):
            compile_s.append(float(m.group(1)))
        if m := _CAPTURE_S.search(line):
            capture_s.append(float(m.group(1)))
    return CompileCacheEvents(
        tuple(loaded),
        tuple(saved),
        tuple(failures),
        tuple(graphs),
        tuple(compile_s),
        tuple(capture_s),
    )


def _vllm_cache_root(cache_root: str | Path) -> Path:
    """``cache_root`` as given to :func:`wcache.testing.caches.cache_env`, or a
    ``VLLM_CACHE_ROOT`` itself."""
    root = Path(cache_root)
    sub = root / CACHE_ENV_DIRS["VLLM_CACHE_ROOT"]
    return sub if (sub / AOT_CACHE_DIR[0]).is_dir() else root


def aot_artifacts(cache_root: str | Path) -> dict[str, Path]:
    """Every AOT artifact under a cache root.

    Returns:
        ``{"{hash}/rank_{rank}_{dp_rank}": path of its "model" file}``, sorted.
    """
    base = _vllm_cache_root(cache_root).joinpath(*AOT_CACHE_DIR)
    found = sorted(base.glob(f"*/rank_*/{ARTIFACT_NAME}")) if base.is_dir() else []
    return {f"{p.parent.parent.name}/{p.parent.name}": p for p in found}


class _Placeholder:
    """Stands in for an external (persistent-id) object of the artifact's pickle."""

    def __init__(self, key: Any):
        self.key = key


class _StateUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _Placeholder(pid)


def _graph_texts(compiled_fn_state: tuple[Any, bytes]) -> list[tuple[str, str]]:
    """``(title, text)`` of the graphs inside the artifact's compiled function."""
    deserializer, data = compiled_fn_state
    owner = getattr(deserializer, "__self__", None)
    kind = getattr(owner, "__name__", repr(deserializer))
    if kind == "BundledAOTAutogradSerializableCallable":
        # torch.compile's own Inductor backend (vLLM on CPU: DYNAMO_TRACE_ONCE)
        bundle = pickle.loads(data)  # noqa: S301  (an artifact our engine wrote)
        entry = bundle[0] if isinstance(bundle, tuple) else bundle
        out = []
        for part in ("compiled_fw", "compiled_bw"):
            compiled = getattr(entry, part, None)
            result = getattr(compiled, "result", None)
            if result is None:
                continue
            out.append((f"{part} post-grad graph", result.inductor_post_grad_graph_str or ""))
            out.append((f"{part} inductor output code", result.source_code or ""))
        return out
    if kind == "VllmSerializableFunction":
        # vLLM's own backend (VLLM_COMPILE, CUDA): the split graph module it compiled
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 (torch import ~2 s: only when called)
        from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415 (torch import ~2 s: only when called)

        register_vllm_ops()
        state = pickle.loads(data)  # noqa: S301  (an artifact our engine wrote)
        assert owner is not None  # kind is its __name__
        try:
            gm = owner.deserialize_graph_module(
                state["graph_module"], FakeTensorMode(shape_env=ShapeEnv())
            )
        except AttributeError as exc:
            if "_OpNamespace" not in str(exc):  # not an unregistered op: a real error
                raise
            raise UnreadableArtifact(
                f"the split graph names a torch op no imported module registers ({exc}): "
                "add the vLLM module that registers it to "
                "wcache.testing.compile_cache.VLLM_OP_MODULES"
            ) from exc
        return [("graph module", gm.print_readable(print_output=False))]
    raise UnreadableArtifact(
        f"AOT artifact with a compiled function of kind {kind!r}: "
        "compiled_graphs reads torch's bundled Inductor callable and "
        "vLLM's VllmSerializableFunction only"
    )


def register_vllm_ops() -> tuple[str, ...]:
    """Import :data:`VLLM_OP_MODULES`, so a vLLM split graph's op targets resolve.

    Returns:
        The modules that imported (a release lacks some; those are skipped).

    Raises:
        ModuleNotFoundError: a module of the list exists but one it imports is missing.
        ImportError: a module of the list fails to import.
    """

    done = []
    for name in VLLM_OP_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # the module exists but needs something missing: say so
            continue
        done.append(name)
    return tuple(done)


def _normalize(text: str, roots: tuple[str, ...], provenance: bool) -> str:
    for root in roots:
        text = text.replace(root, ROOT_PLACEHOLDER)
    if not provenance:
        text = _BENCHMARK_HARNESS.split(_PROVENANCE_LINE.sub("", text), maxsplit=1)[0]
    return _COMPILED_FN_NAME.sub(r"__compiled_fn_\1", text)


def compiled_graphs(cache_root: str | Path, *, provenance: bool = False) -> dict[str, str]:
    """The graph each AOT artifact under ``cache_root`` was compiled from, as text.

    For torch's Inductor backend (vLLM on CPU) the text is the post-grad FX graph
    (ops, dtypes, shapes and strides of every node) and Inductor's output code; for
    vLLM's backend (CUDA) the readable split graph module. vLLM's backend also
    writes ``computation_graph.py`` (its ``split_gm.print_readable()``); each such
    file is one more entry. Paths of the cache root and per-process names are
    normalized, so equal graphs give equal text. Unless ``provenance``, the
    source-location comments ("# File: ...") and Inductor's benchmark harness are
    dropped: they say which Python frames produced an op and how the example inputs'
    storages were laid out, which differ between a restored and a disk-loaded model
    whose graphs, kernels and compiled ``call`` are the same.

    Args:
        cache_root: a root given to :func:`wcache.testing.caches.cache_env` (or a
            ``VLLM_CACHE_ROOT``).
        provenance: keep the source-location comments and the benchmark harness.

    Returns:
        ``{"{hash}/rank_{rank}_{dp_rank}": text}`` for every AOT artifact and
        ``{"<backend-cache-dir>/rank_{rank}_{dp_rank}/{prefix}/computation_graph.py":
        text}`` for every graph vLLM's backend wrote (empty when none); the real
        ``{hash10}`` stays in the key when the root has more than one such directory.

    Raises:
        UnreadableArtifact: an artifact's compiled function is of an unknown kind.

    Source: torch/_dynamo/aot_compile.py::AOTCompiledFunction.serialize,
    vllm/compilation/caching.py::VllmSerializableFunction.serialize_compile_artifacts.
    """
    vllm_root = _vllm_cache_root(cache_root)
    roots = tuple(
        sorted(
            {str(Path(cache_root).resolve()), str(Path(cache_root)), str(vllm_root)},
            key=len,
            reverse=True,
        )
    )
    out = {}
    for key, path in aot_artifacts(cache_root).items():
        state = _StateUnpickler(io.BytesIO(path.read_bytes())).load()
        parts = _graph_texts(state["compiled_fn"])
        out[key] = "\n".join(
            f"# ---- {title}\n{_normalize(text, roots, provenance)}" for title, text in parts
        )
    base = vllm_root / AOT_CACHE_DIR[0]
    graphs = sorted(base.glob(f"*/rank_*/*/{COMPUTATION_GRAPH}")) if base.is_dir() else []
    one_dir = len({p.relative_to(base).parts[0] for p in graphs}) == 1
    for path in graphs:
        rel = path.relative_to(base)
        key = str(PurePosixPath(BACKEND_DIR_PLACEHOLDER, *rel.parts[1:])) if one_dir else str(rel)
        out[key] = _normalize(path.read_text(), roots, provenance)
    return dict(sorted(out.items()))


def backend_cache_dirs(cache_root: str | Path) -> list[str]:
    """The ``torch_compile_cache/{hash10}`` directories vLLM's backend made under
    ``cache_root`` (the AOT artifacts' ``torch_aot_compile`` left out), sorted.

    ``hash10`` is vLLM's key of the non-AOT compile cache: it covers the files
    Dynamo traced (their paths and text). On the H200 a disk-loaded and a restored
    model got different directories; the likely reason (read from the source, the
    traced files were not recorded) is that vLLM's parameter classes define
    ``__torch_function__`` and a restored model's plain tensors do not. The AOT key
    (``torch_aot_compile/{hash}``) leaves the traced files out and was the same. Source: vllm/compilation/backends.py ``VllmBackend.__call__``.
    """
    base = _vllm_cache_root(cache_root) / AOT_CACHE_DIR[0]
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and p.name != AOT_CACHE_DIR[1])


def graph_diff(
    a: dict[str, str],
    b: dict[str, str],
    names: tuple[str, str] = ("a", "b"),
    context: int = 3,
    max_lines: int = 200,
) -> str:
    """A unified diff of two :func:`compiled_graphs` results ("" when equal).

    Args:
        a, b: artifact key -> graph text.
        names: labels of the two sides in the diff.
        context: lines of context per hunk.
        max_lines: the diff is cut after this many lines.
    """

    if a == b:
        return ""
    lines = []
    if sorted(a) != sorted(b):
        lines.append(f"artifacts differ: {names[0]}={sorted(a)} {names[1]}={sorted(b)}")
    for key in sorted(set(a) & set(b)):
        lines += difflib.unified_diff(
            a[key].splitlines(),
            b[key].splitlines(),
            f"{names[0]}/{key}",
            f"{names[1]}/{key}",
            n=context,
            lineterm="",
        )
    return "\n".join(lines[:max_lines])
