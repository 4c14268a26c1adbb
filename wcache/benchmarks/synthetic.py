"""Synthetic Llama-shaped layer stacks for the restore benchmarks.

Only the linear layers of the decoder are built (per layer ``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``): they hold nearly all the bytes and
every tensor a quantization plan touches. Values are random but in the real
formats, so every plan stage runs its real arithmetic:

* ``bf16``: ``weight`` ``[N, K]`` bfloat16, N(0, 0.02).
* ``awq``: AutoAWQ GEMM layout, group 128: ``qweight`` ``[K, N // 8]`` int32 and
  ``qzeros`` ``[K // 128, N // 8]`` int32 (random nibbles, packed along N),
  ``scales`` ``[K // 128, N]`` float16 (positive).
* ``fp8``: online FP8, i.e. the bf16 checkpoint with the ``fp8_per_tensor`` plan.

A checkpoint is one safetensors file per (shape, layers, checkpoint kind),
written once under the cache dir (``$WCACHE_BENCH_DIR`` or
``/tmp/wcache-bench``) and reused; ``fp8`` reads the ``bf16`` file.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.errors import DiskFull  # re-exported: its old home

__all__ = [
    "ModelShape",
    "LinearSpec",
    "SHAPES",
    "FORMATS",
    "CHECKPOINT_KIND",
    "AWQ_GROUP_SIZE",
    "linears",
    "layer_config",
    "quant_spec",
    "bench_dir",
    "checkpoint_path",
    "make_linear_tensors",
    "write_checkpoint",
    "ensure_checkpoint",
    "checkpoint_nbytes",
    "DiskFull",
]

#: AutoAWQ's default group size (the 8B AWQ checkpoints on the Hub use it).
AWQ_GROUP_SIZE = 128
#: int4 values per int32 word.
INT4_PER_WORD = 8
#: Standard deviation of synthetic bf16 weights (typical of trained Llama linears).
WEIGHT_STD = 0.02
#: AWQ scales are drawn uniformly from [SCALE_MIN, SCALE_MIN + SCALE_SPAN) (fp16).
SCALE_MIN, SCALE_SPAN = 1e-3, 4e-3
#: Bumped whenever the bytes written for a (shape, layers, kind) change.
WRITER_VERSION = 1
BENCH_DIR_ENV = "WCACHE_BENCH_DIR"
DEFAULT_BENCH_DIR = "/tmp/wcache-bench"
STAMP_SUFFIX = ".json"
#: Free space required before writing a checkpoint, as a multiple of its size
#: (the temporary file plus room for the rest of the machine).
DISK_HEADROOM = 1.1


@frozen
class ModelShape:
    """A Llama-style decoder's linear shapes.

    Attributes:
        name: ``"tiny"``, ``"1b"``, ``"8b"``, ``"30b"``.
        num_layers: decoder layers.
        hidden: hidden size (K of qkv/gate_up, N of o/down).
        intermediate: MLP intermediate size.
        num_heads: attention heads.
        num_kv_heads: key/value heads (GQA).
        head_dim: per-head dimension.
    """

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def with_layers(self, num_layers: int | None) -> ModelShape:
        if num_layers is None:
            return self
        return ModelShape(
            self.name,
            num_layers,
            self.hidden,
            self.intermediate,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def params(self) -> int:
        """Parameters in the linear layers."""
        return sum(s.size_n * s.size_k for s in linears(self))


#: Llama-3.2-1B, Llama-3.1-8B and a LLaMA-30B-like stack with GQA (8 KV heads);
#: ``tiny`` is for smoke tests on CPU (every dim a multiple of 128 so AWQ
#: group 128 and the Marlin tiles apply).
SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", 2, 256, 512, 4, 2, 64),
    "1b": ModelShape("1b", 16, 2048, 8192, 32, 8, 64),
    "8b": ModelShape("8b", 32, 4096, 14336, 32, 8, 128),
    "30b": ModelShape("30b", 60, 6656, 17920, 52, 8, 128),
}

#: Benchmark format -> checkpoint kind on disk.
CHECKPOINT_KIND = {"bf16": "bf16", "awq": "awq", "fp8": "bf16"}
FORMATS = tuple(CHECKPOINT_KIND)


@frozen
class LinearSpec:
    """One linear layer: its qualified name, ``size_n`` x ``size_k`` and the fused
    shard widths along N (``logical_widths``)."""

    name: str
    size_n: int
    size_k: int
    logical_widths: tuple[int, ...]


def linears(shape: ModelShape) -> tuple[LinearSpec, ...]:
    """Every linear of the stack, in order (per layer: qkv, o, gate_up, down)."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    out = []
    for n in range(shape.num_layers):
        p = f"model.layers.{n}"
        out += [
            LinearSpec(f"{p}.self_attn.qkv_proj", q + 2 * kv, h, (q, kv, kv)),
            LinearSpec(f"{p}.self_attn.o_proj", h, q, (h,)),
            LinearSpec(f"{p}.mlp.gate_up_proj", 2 * i, h, (i, i)),
            LinearSpec(f"{p}.mlp.down_proj", h, i, (h,)),
        ]
    return tuple(out)


def quant_spec(fmt: str, target: Target) -> QuantSpec:
    """The method of a benchmark format; the kernel is the one vLLM picks on the
    target (``none``/``marlin``/``cutlass`` on CUDA, the registry's default on CPU).

    Raises:
        ValueError: an unknown format.
    """
    cuda = target.device_type == "cuda"
    if fmt == "bf16":
        return QuantSpec("unquantized", kernel="none" if cuda else None)
    if fmt == "awq":
        return QuantSpec(
            "awq",
            num_bits=4,
            group_size=AWQ_GROUP_SIZE,
            zero_point=True,
            kernel="marlin" if cuda else None,
        )
    if fmt == "fp8":
        return QuantSpec(
            "fp8_per_tensor",
            num_bits=8,
            act_bits=8,
            strategy="tensor",
            kernel="cutlass" if cuda else None,
        )
    raise ValueError(f"unknown benchmark format {fmt!r}; known: {FORMATS}")


def params_dtype(fmt: str) -> str:
    """Activation dtype: AutoAWQ checkpoints are float16, the others bfloat16."""
    return "float16" if fmt == "awq" else "bfloat16"


def layer_config(spec: LinearSpec, fmt: str, target: Target) -> LayerConfig:
    """The frozen config of one linear for a format."""
    return LayerConfig(
        quant=quant_spec(fmt, target),
        size_k=spec.size_k,
        size_n=spec.size_n,
        params_dtype=params_dtype(fmt),
        name=spec.name,
        extra=(("logical_widths", spec.logical_widths),),
    )


def make_linear_tensors(
    spec: LinearSpec, kind: str, generator: torch.Generator, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors of one linear (local names).

    Args:
        spec: the linear.
        kind: ``"bf16"`` (``weight [N, K]`` bf16) or ``"awq"`` (``qweight [K, N // 8]``
            int32, ``qzeros [K // 128, N // 8]`` int32, ``scales [K // 128, N]`` fp16).
        generator: a generator on ``device`` (deterministic values).

    Raises:
        ValueError: an unknown kind, or N/K that AWQ cannot pack.
    """
    n, k = spec.size_n, spec.size_k
    if kind == "bf16":
        w = torch.randn((n, k), generator=generator, device=device, dtype=torch.bfloat16)
        return {"weight": w.mul_(WEIGHT_STD)}
    if kind == "awq":
        if n % INT4_PER_WORD or k % AWQ_GROUP_SIZE:
            raise ValueError(
                f"{spec.name}: AWQ needs N % 8 == 0 and K % 128 == 0, got N={n}, K={k}"
            )
        g = k // AWQ_GROUP_SIZE
        bits: dict[str, Any] = dict(dtype=torch.int32, generator=generator, device=device)
        return {
            "qweight": torch.randint(-(2**31), 2**31 - 1, (k, n // INT4_PER_WORD), **bits),
            "qzeros": torch.randint(-(2**31), 2**31 - 1, (g, n // INT4_PER_WORD), **bits),
            "scales": (
                torch.rand((g, n), generator=generator, device=device, dtype=torch.float32)
                * SCALE_SPAN
                + SCALE_MIN
            ).half(),
        }
    raise ValueError(f"unknown checkpoint kind {kind!r}; known: bf16, awq")


def bench_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache dir for checkpoints: ``path``, ``$WCACHE_BENCH_DIR`` or
    ``/tmp/wcache-bench``."""
    return Path(path or os.environ.get(BENCH_DIR_ENV) or DEFAULT_BENCH_DIR)


def checkpoint_path(root: Path, shape: ModelShape, kind: str) -> Path:
    return root / f"{shape.name}-L{shape.num_layers}-{kind}.safetensors"


def _stamp(shape: ModelShape, kind: str, seed: int) -> dict:
    return {
        "writer_version": WRITER_VERSION,
        "shape": shape.name,
        "layers": shape.num_layers,
        "hidden": shape.hidden,
        "intermediate": shape.intermediate,
        "kind": kind,
        "seed": seed,
    }


def iter_layers(
    shape: ModelShape, kind: str, seed: int, device: torch.device | str
) -> Iterator[tuple[LinearSpec, dict[str, torch.Tensor]]]:
    """(spec, local tensors) for every linear, deterministic in ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for spec in linears(shape):
        yield spec, make_linear_tensors(spec, kind, gen, device)


def write_checkpoint(
    path: Path, shape: ModelShape, kind: str, seed: int = 0, gen_device: torch.device | str = "cpu"
) -> Path:
    """Write one safetensors file with every linear of ``shape`` (full names,
    ``<linear>.<tensor>``), then a stamp next to it. Values are generated on
    ``gen_device`` (a GPU generates 8B of bf16 in well under a second) and
    written from host memory; the file lands in the page cache.
    """
    from safetensors.torch import save_file  # noqa: PLC0415 (imported at call time: tests patch save_file)

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for spec, local in iter_layers(shape, kind, seed, gen_device):
        for name, t in local.items():
            tensors[f"{spec.name}.{name}"] = t.cpu()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"wcache_bench": json.dumps(_stamp(shape, kind, seed))})
    os.replace(tmp, path)
    path.with_suffix(STAMP_SUFFIX).write_text(json.dumps(_stamp(shape, kind, seed)))
    return path


def ensure_checkpoint(
    root: Path, shape: ModelShape, kind: str, seed: int = 0, gen_device: torch.device | str = "cpu"
) -> tuple[Path, bool]:
    """The checkpoint file for (shape, kind), written unless an identical one
    exists. Returns (path, written)."""
    path = checkpoint_path(root, shape, kind)
    stamp = path.with_suffix(STAMP_SUFFIX)
    if path.exists() and stamp.exists():
        try:
            if json.loads(stamp.read_text()) == _stamp(shape, kind, seed):
                return path, False
        except ValueError:
            pass
    root.mkdir(parents=True, exist_ok=True)
    need = int(checkpoint_nbytes(shape, kind) * DISK_HEADROOM)
    free = shutil.disk_usage(root).free
    if free < need:
        raise DiskFull(
            f"writing the {shape.name} {kind} checkpoint needs {need / 2**30:.1f} GiB in "
            f"{root}, only {free / 2**30:.1f} GiB are free; free space, point "
            f"--bench-dir/${BENCH_DIR_ENV} elsewhere, or measure this size with "
            f"--no-disk {shape.name}"
        )
    return write_checkpoint(path, shape, kind, seed, gen_device), True


def checkpoint_nbytes(shape: ModelShape, kind: str) -> int:
    """Bytes of tensor data a checkpoint of ``kind`` holds (before writing it)."""
    total = 0
    for s in linears(shape):
        if kind == "bf16":
            total += s.size_n * s.size_k * 2
        else:
            g = s.size_k // AWQ_GROUP_SIZE
            total += s.size_k * s.size_n // 2 + g * s.size_n // 2 + g * s.size_n * 2
    return total
