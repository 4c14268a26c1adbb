"""The daemon's model build with vLLM's own loader, and the vLLM state around it.

What ``wcache serve`` (:mod:`wcache.daemon.serve`) and ``wcache verify`` need from
vLLM: the engine config from vLLM's engine-argument parser, vLLM's distributed
initialization and platform set-up for one rank, the build itself (vLLM's load,
then every plan's ``prepare``, exported into one arena) and the key a daemon of
these arguments serves, computed as the engine computes it. The orchestration
around it (ranks, snapshots, seeding, the ready line) is in :mod:`wcache.daemon`,
which imports no vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from wcache.core import WcacheError
from wcache.errors import CheckpointCorrupt, ConfigInvalid, PrepareFailed, clip, name_some
from wcache.shell import PARAM_FLAGS_EXTRA, likeness, prepare_
from wcache.store import DaemonServer, Export
from wcache.store.fingerprint import (
    checkpoint_digest,
    checkpoint_stats,
    verify_checkpoint_unchanged,
)
from wcache.vllm import compat
from wcache.vllm.model import (
    initialize_on_meta,
    plan_ids,
    planned_layers,
)
from wcache.vllm.probe import host_target

logger = logging.getLogger("wcache.vllm")


#: The usage line vLLM's parser prints above an argument error (``%(prog)s`` is the
#: wcache command): the full one lists every engine argument, hiding the error.
ENGINE_ARGS_USAGE = "%(prog)s [wcache options] [vLLM engine arguments] (see `%(prog)s --help`)"


def _engine_args(prog: str, argv: list[str]) -> Any:
    """vLLM's ``EngineArgs`` from its own engine-argument parser (the same flags as
    ``vllm serve``); ``prog`` names the command in its usage messages."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    # a short usage: an unknown argument's error names it, not vLLM's ~200 options
    parser = FlexibleArgumentParser(prog=prog, usage=ENGINE_ARGS_USAGE)
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def engine_config(model: str, rest: list[str], *, prog: str = "wcache serve") -> Any:
    """A VllmConfig from vLLM's own engine-argument parser (the same flags as
    ``vllm serve``), with load_format forced to ``auto`` for the daemon's load;
    ``prog`` names the command in the parser's errors."""
    engine_args = _engine_args(prog, ["--model", model, *rest])
    return compat.disk_load_engine_args_(engine_args).create_engine_config()


def engine_load_options(model: str, rest: list[str], *, prog: str) -> tuple[str, Any]:
    """``(load_format, model_loader_extra_config)`` as the engine arguments give them
    (vLLM's parser), which :func:`engine_config` replaces by the daemon's own disk
    load: what the engine's restore runs with (``wcache verify``)."""
    engine_args = _engine_args(prog, ["--model", model, *rest])
    fmt = engine_args.load_format
    return str(getattr(fmt, "value", fmt)), engine_args.model_loader_extra_config


def engine_model_config(model: str, rest: list[str], *, prog: str) -> Any:
    """vLLM's ``ModelConfig`` for these engine arguments (the dtype and quantization
    vLLM decides), without the rest of the engine config: what ``wcache status
    --wait-ready`` needs to name the daemon's sockets."""
    return _engine_args(prog, ["--model", model, *rest]).create_model_config()


def checked_engine_config(model: str, rest: list[str], *, prog: str = "wcache serve") -> Any:
    """:func:`engine_config`, with what vLLM and transformers raise about the
    checkpoint's config (or the engine arguments) turned into one
    :class:`~wcache.errors.ConfigInvalid` naming the file; the traceback is logged
    at DEBUG (``wcache serve --verbose``).

    Raises:
        ConfigInvalid: vLLM or transformers refused the config or the arguments.
    """

    try:
        return engine_config(model, rest, prog=prog)
    except WcacheError:
        raise
    except Exception as exc:  # vLLM and transformers raise many kinds
        logger.debug("%s: vLLM refused the config", prog, exc_info=True)
        where = WHOLE_ERROR.get(prog, "--verbose logs the whole error")
        raise ConfigInvalid(
            f"{os.path.join(model, 'config.json')} (with the engine arguments "
            f"{' '.join(rest) or 'none'}): vLLM refused it: {type(exc).__name__}: "
            f"{clip(refusal_reason(exc), REASON_CHARS, where)}; fix the config or "
            f"the arguments"
        ) from exc


#: The most of vLLM's refusal :func:`checked_engine_config` quotes (characters): an
#: unknown architecture's names every supported one, a 12,000-character line (break14 #7).
REASON_CHARS = 600
#: Where the whole of a clipped refusal is, per command.
WHOLE_ERROR = {
    "wcache serve": "`wcache serve --verbose` logs the whole error",
    "wcache verify": "vLLM's own engine start with these arguments shows the whole error",
}


def refusal_reason(exc: BaseException) -> str:
    """What an exception vLLM raised about the config says, in one line: each error
    of a pydantic ``ValidationError`` (vLLM's config classes are pydantic dataclasses;
    the message's last line is only pydantic's "For further information visit URL"),
    else the message's last line (a traceback's innermost reason)."""
    errors = getattr(exc, "errors", None)  # pydantic's ValidationError, duck-typed
    if callable(errors):
        try:
            msgs = [str(e.get("msg", "")) for e in errors() if isinstance(e, dict)]
        except Exception:  # noqa: BLE001  (another class's errors(): use the message)
            msgs = []
        text = "; ".join(" ".join(m.split()) for m in msgs if m.strip())
        if text:
            return text
    return (str(exc).strip().splitlines() or [""])[-1].strip()


def loader_config(load_config: Any, progress: bool, **changes: Any) -> Any:
    """A copy of vLLM's ``LoadConfig`` for a loader of wcache's own (``changes``
    applied): without ``progress`` its "Loading safetensors checkpoint shards" bar is
    off too (``use_tqdm_on_load``, vllm/config/load.py). The engine's config, which
    the cache key reads, is left as it is."""
    return dataclasses.replace(
        load_config,
        use_tqdm_on_load=progress and load_config.use_tqdm_on_load,
        **changes,
    )


def build_export(vllm_config: Any, *, progress: bool = True):
    """Load the model with vLLM's loader, prepare every planned layer, and return
    ``(Export, CacheKey)``. Needs vLLM's distributed state initialized.

    Raises:
        NoPlan: a layer's method has no plan (before any weight is read).
        MetaBuildUnsupported: no engine could restore the model (:func:`meta_model`;
            before any weight is read).
        CheckpointChanged: a checkpoint file changed between the digest taken
            before the load and the end of prepare; nothing is served.
    """
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: PLC0415 (vLLM import ~6 s: only when called)
    from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    from wcache.vllm.key import build_key, parallel_layout  # noqa: PLC0415 (imported at call time: tests patch build_key)
    from wcache.vllm.model import daemon_param_flags, export_tensors, layer_entries  # noqa: PLC0415 (imported at call time: tests patch export_tensors)

    model_config = vllm_config.model_config
    device = torch.device(vllm_config.device_config.device)
    target = host_target(device)
    with meta_model(vllm_config):  # what every engine's restore builds first
        pass
    loader = DefaultModelLoader(loader_config(vllm_config.load_config, progress))
    t0 = time.perf_counter()
    with set_default_torch_dtype(model_config.dtype), device:
        model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
    # which parameters load and prepare keep (the engine then gives its restored
    # ones the build's class, attributes and requires_grad, as vLLM's load leaves them)
    built = {n: weakref.ref(p) for n, p in model.named_parameters(remove_duplicate=False)}
    built_grad = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    built_like = {n: likeness(p) for n, p in model.named_parameters(remove_duplicate=False)}
    planned = planned_layers(model, target)  # also refuses a model-level post-load hook
    layout = parallel_layout()
    logger.info(
        "wcache: loading weights of %s (rank tp%d/pp%d)",
        model_config.model,
        layout["tp_rank"],
        layout["pp_rank"],
    )
    # The key must describe the bytes loaded: digest and stat every file before the
    # load, and refuse after prepare if any file changed meanwhile (vLLM's loader
    # opens the files itself, so they cannot be hashed as it reads them).
    checkpoint_before = checkpoint_stats(model_config.model)
    checkpoint = checkpoint_digest(model_config.model)
    loaded = load_checkpoint_(loader, model, model_config)
    missing = unloaded_planned_weights(model, planned, loaded, model_config.quantization)
    if missing:
        raise CheckpointCorrupt(
            f"{model_config.model}: {len(missing)} weight(s) of the model its config.json "
            f"describes are not in the checkpoint: {name_some(missing, MAX_NAMED_TENSORS)}"
            f"; vLLM's loader leaves them uninitialized (torch.empty), so nothing "
            "is served. A shard missing or cut from a download, or a config.json of "
            "another model (e.g. MoE without its experts' tensors): download or copy "
            "the checkpoint again, or fix config.json"
        )
    _retie_word_embeddings_(model, model_config)
    t_load = time.perf_counter()
    prepared = prepare_layers_(planned, target, progress=progress)
    t_prep = time.perf_counter()
    tensors, kinds, aliases, nonpersistent = export_tensors(model)
    flags = daemon_param_flags(model, built, planned, built_grad, built_like)
    layers = layer_entries(planned, prepared)
    verify_checkpoint_unchanged(model_config.model, checkpoint_before)
    key = build_key(model_config, layout, plan_ids(planned), target, checkpoint=checkpoint)
    export = Export(
        tensors=tensors,
        kinds=kinds,
        aliases=aliases,
        layers=layers,
        nonpersistent=nonpersistent,
        extra={
            "model": str(model_config.model),
            "layout": layout,
            "load_s": t_load - t0,
            "prepare_s": t_prep - t_load,
            PARAM_FLAGS_EXTRA: flags,
        },
    )
    logger.info(
        "wcache: load %.2f s, prepare %.2f s (%d layers), %d tensors, %d aliases",
        t_load - t0,
        t_prep - t_load,
        len(planned),
        len(tensors),
        len(aliases),
    )
    return export, key


#: Tensors of a failing layer named in a PrepareFailed message (the rest counted).
MAX_NAMED_TENSORS = 8


def _layer_state(module: torch.nn.Module) -> str:
    """``name dtype [shape]`` of a layer's own tensors, as vLLM's loader left them."""
    items = [
        f"{n} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    ]
    return name_some(items, MAX_NAMED_TENSORS) or "no tensors"


def prepare_layers_(planned: list, target: Any, *, progress: bool = False) -> dict:
    """Run every planned layer's ``plan.prepare`` (the daemon's TRANSFORM stages).

    Returns:
        layer name -> the plan's prepared result.

    Raises:
        PrepareFailed: a plan failed on a layer; names the layer, the plan, the error
            and the layer's tensors as vLLM's loader left them (code ``prepare-failed``),
            before anything is exported or served.
    """

    prepared = {}
    iterator = planned
    if progress:
        iterator = tqdm(planned, desc="wcache prepare", unit="layer", file=sys.stderr)
    with torch.no_grad():
        for p in iterator:
            try:
                prepared[p.name] = prepare_(p.module, p.plan.bind(p.config, target))
            except Exception as exc:  # named and re-raised, never served
                raise PrepareFailed(
                    f"layer {p.name!r}, plan {p.plan.id}: {type(exc).__name__}: {exc} "
                    f"(vLLM's loader left: {_layer_state(p.module)}). Nothing was served; "
                    f"serve this model without wcache (load_format='auto') and report it.",
                    code="prepare-failed",
                ) from exc
    return prepared


def load_checkpoint_(loader: Any, model: torch.nn.Module, model_config: Any) -> set[str] | None:
    """Read the checkpoint into ``model`` with vLLM's loader, leaving every weight as
    the checkpoint has it for the plans' TRANSFORM stages.

    Returns:
        The names of the parameters the checkpoint filled, as the model's
        ``load_weights`` reports them (``None`` where it does not).

    vLLM quantizes online FP8/MXFP8 layers while it loads them; here that step is
    deferred (:func:`wcache.vllm.compat.online_quantization_deferred`), so what
    reaches ``plan.prepare`` is the checkpoint's bf16/fp16 weight for online methods
    too, as for every serialized method.

    Source: vllm/model_executor/model_loader/base_loader.py::load_model (load_weights,
    then finalize_layerwise_processing for online quantization).
    """
    with compat.online_quantization_deferred(), compat.loaded_weight_names(model) as calls:
        loader.load_weights(model, model_config)
        compat.finalize_online_loading_(model, model_config)
    if not calls or any(c is None for c in calls):
        return None
    return set().union(*(c for c in calls if c is not None))  # (narrows the type)


#: Layer kinds whose parameters all come from the checkpoint on an unquantized model
#: (an attention layer's are KV-cache scales, which a checkpoint may lack).
CHECKPOINT_LAYER_KINDS = ("linear", "embedding", "moe")


def unloaded_planned_weights(
    model: torch.nn.Module, planned: list, loaded: set[str] | None, quantization: str | None
) -> list[str]:
    """The parameters of planned linear, embedding and MoE layers that the checkpoint
    did not fill, by name, on an unquantized model.

    vLLM's loader checks an unquantized model's parameters against what
    ``load_weights`` reports, but exempts every module with post-load work, so a
    weight the checkpoint lacks (experts a MoE config.json names, a shard missing)
    keeps ``torch.empty``'s bytes, different in every build. A quantized model's
    parameters vLLM checks itself; ``loaded`` None (the model reports nothing)
    checks nothing. Parameters are matched by identity, so a tied ``lm_head`` counts
    as loaded with the embedding.

    Source: vllm/model_executor/model_loader/default_loader.py::track_weights_loading
    """
    if loaded is None or quantization is not None:
        return []
    loaded_ids = set()
    for name in loaded:
        try:
            loaded_ids.add(id(model.get_parameter(name)))
        except AttributeError:  # a name the model reports but does not hold as such
            continue
    missing = []
    for p in planned:
        if p.config.quant.layer_kind not in CHECKPOINT_LAYER_KINDS:
            continue
        for pname, param in p.module.named_parameters(recurse=False):
            if param.numel() and id(param) not in loaded_ids:
                missing.append(f"{p.name}.{pname}" if p.name else pname)
    return missing


def _retie_word_embeddings_(model: torch.nn.Module, model_config: Any) -> None:
    """Re-tie ``lm_head`` to the input embeddings as vLLM's disk load does
    (``process_weights_after_loading`` calls ``maybe_retie_word_embeddings``
    first): a checkpoint that stores a duplicate ``lm_head.weight`` with
    ``tie_word_embeddings=true`` gets one shared tensor, which the export then
    records as an alias.

    Source: vllm/model_executor/model_loader/weight_tying.py::maybe_retie_word_embeddings
    """
    try:
        from vllm.model_executor.model_loader.weight_tying import (  # noqa: PLC0415 (optional dependency, checked where it is used)
            maybe_retie_word_embeddings,
        )
    except ImportError:  # a vLLM without re-tying never unties either
        return
    maybe_retie_word_embeddings(model, model_config)


def init_distributed(vllm_config: Any, rank: int, world: int, init_method: str) -> None:
    """vLLM's distributed state for one rank of ``world`` (gloo on CPU, NCCL on
    CUDA), joined at ``init_method`` (``tcp://HOST:PORT`` or ``file://PATH``), and
    its TP/PP groups from ``vllm_config``."""
    from vllm.distributed import (  # noqa: PLC0415 (vLLM import ~6 s: only when called)
        init_distributed_environment,
        initialize_model_parallel,
    )

    pc = vllm_config.parallel_config
    backend = "nccl" if vllm_config.device_config.device_type == "cuda" else "gloo"
    if backend == "gloo":
        # vLLM's CPU communicator names its shared-memory segments after this (set by
        # CPUWorker.init_device the same way); unique per init method, so per job.
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init_method.removeprefix("file://"))
            if init_method.startswith("file://")
            else init_method.split(":")[-1]
        )
    init_distributed_environment(
        world_size=world,
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        distributed_init_method=init_method,
        backend=backend,
    )
    initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
    if backend == "gloo":
        unlink_cpu_shm_names(os.environ["VLLM_DIST_IDENT"])
    compat.unlink_broadcaster_shm()


def unlink_cpu_shm_names(ident: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the names of vLLM's CPU shared-memory collectives of the instance
    ``ident`` (``VLLM_DIST_IDENT``): ``{ident}-{group}-[{ranks}]-cpushm_{rank}``, 2 MiB
    per OpenMP thread each, once every rank has mapped them. Their memory stays
    mapped, and is freed when the last rank unmaps it (exits or ``execve``'s), so a
    daemon leaves nothing in ``/dev/shm``: vLLM unlinks them only in its C++
    destructors at a normal exit, which the lean hand-off's ``execve`` and a SIGKILL
    skip (break pass 12 #4: 16 MiB per TP=2 daemon start, until ``shm-too-small``).

    Safe right after ``initialize_model_parallel`` on any rank: each group's
    ``_init_cpu_shm`` creates and joins its segments before a barrier of the group,
    so a rank past it knows every member mapped them; vLLM's destructor ignores
    ``shm_unlink``'s ENOENT later.

    Returns:
        The names unlinked (another rank may have unlinked some first).

    Source: vllm/distributed/device_communicators/cpu_communicator.py::_CPUSHMDistributed
    (``make_group_name``, ``_init_cpu_shm``); csrc/cpu/shm.cpp::SHMManager::destroy_shm.
    """
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no /dev/shm: vLLM's SHM communicator could not have run either
        return []
    unlinked = []
    for name in names:
        stem, _, rank = name.rpartition("-cpushm_")
        if stem.startswith(f"{ident}-") and rank.isdigit():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                unlinked.append(name)
    return unlinked


@contextlib.contextmanager
def prepare_platform(vllm_config: Any) -> Iterator[None]:
    """The device set up for a build inside the block: on CPU vLLM's no-ops for
    ``torch.accelerator`` (:func:`wcache.vllm.compat.torch_accelerator_noops`,
    undone on exit), on CUDA this rank's device (``LOCAL_RANK``)."""
    if vllm_config.device_config.device_type == "cpu":
        # BaseModelLoader calls torch.accelerator.empty_cache(), which raises on a
        # CPU-only torch unless vLLM's CPU runner installed its no-ops.
        with compat.torch_accelerator_noops():
            yield
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        yield


def build_server(
    vllm_config: Any, *, socket_dir: str | None, device_id: str, progress: bool = True
) -> Any:
    """Build the export, copy it into the daemon's arena, and free everything else:
    the loaded model, vLLM's process-wide registrations of its layers (forward
    context, rotary cache), and on CUDA the caching allocator's unused blocks, so
    the daemon holds the arena and not a second copy of the weights. Needs vLLM's
    distributed state initialized and ``vllm_config`` current.

    Returns:
        A :class:`wcache.store.DaemonServer`, not yet started.

    Raises:
        as :func:`build_export`, and the server's own (a busy socket, an unsafe dir).
    """

    device_type = vllm_config.device_config.device_type
    before = compat.registrations(vllm_config)
    try:
        export, key = build_export(vllm_config, progress=progress)
        try:
            return DaemonServer(
                export, key, socket_dir=socket_dir, device=device_type, device_id=device_id
            )
        finally:
            del export  # the model's tensors: the arena holds its own copy now
    finally:
        compat.forget_registrations_(vllm_config, before)
        compat.free_device_memory(device_type)


#: The fix ``wcache serve``'s meta-build refusal names.
SERVE_META_BUILD_FIX = (
    "run vLLM on this model from disk (load_format='auto'): no engine can restore it from a daemon"
)


@contextlib.contextmanager
def meta_model(vllm_config: Any) -> Iterator[torch.nn.Module]:
    """The model built on the meta device as a restoring engine builds it
    (``WcacheModelLoader._load_model``: no weight allocated, none read), for the
    block; vLLM's process-global registrations of it are forgotten on the way out,
    so a later build in this process does not collide with them. Needs vLLM's
    distributed state initialized and ``vllm_config`` current.

    Raises:
        MetaBuildUnsupported: the model reads tensor values while it is built (BLOOM's
            ALiBi slopes), so no engine can restore it: ``wcache serve`` refuses it
            before it loads a weight, with this, instead of serving what every engine
            would refuse.
    """
    before = compat.registrations(vllm_config)
    model = None
    try:
        model = initialize_on_meta(vllm_config, vllm_config.model_config, SERVE_META_BUILD_FIX)
        yield model
    finally:
        del model
        compat.forget_registrations_(vllm_config, before)


def expected_key(vllm_config: Any) -> Any:
    """The key a daemon loading the checkpoint would serve, computed the way the
    engine computes it (``WcacheModelLoader.load_model``): the model built on the
    meta device (:func:`meta_model`), its plans, and the checkpoint's content
    digests (cached by stat), without reading a weight. Needs vLLM's distributed
    state initialized and ``vllm_config`` current.

    Raises:
        NoPlan: a layer's method has no plan.
        MetaBuildUnsupported: as :func:`meta_model`.
    """
    from wcache.vllm.key import build_key, parallel_layout  # noqa: PLC0415 (imported at call time: tests patch build_key)

    target = host_target(torch.device(vllm_config.device_config.device))
    with meta_model(vllm_config) as model:
        planned = planned_layers(model, target)
        return build_key(vllm_config.model_config, parallel_layout(), plan_ids(planned), target)


@contextlib.contextmanager
def current_config(vllm_config: Any) -> Iterator[None]:
    """``vllm_config`` as vLLM's current config inside the block (vLLM's layers read
    it while they are built)."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    with set_current_vllm_config(vllm_config):
        yield


def platform_device_type() -> str:
    """The device type of vLLM's platform on this host (``"cpu"``, ``"cuda"``)."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return current_platform.device_type
