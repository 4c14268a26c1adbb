"""vLLM-CPU's unquantized fused-MoE experts: pad the intermediate dim, prepack.

vLLM 0.32/0.33 CPU resolves every unquantized MoE layer to backend ``CPU`` and picks
the first experts class that supports the host (``oracle/unquantized.py``):
``X86CPUUnquantizedExperts`` (AMX, isa ``"amx"``), ``ArmCPUUnquantizedExperts``
(``"neon"``), ``PowerCPUUnquantizedExperts`` (``"vsx"``), ``CPUUnquantizedExperts``
(portable, ``"vec"``). Its ``process_weights_after_loading``:

1. zero-pads the intermediate dim to the class's alignment (:data:`pad_intermediate`,
   a TRANSFORM into new tensors);
2. prepacks both weights for the grouped GEMM (``cpu_prepack_moe_weight``,
   :data:`pack_weights`): a TRANSFORM that keeps the shape and dtype but permutes
   the bytes, and is **not idempotent** (packing packed bytes again gives other
   bytes). The daemon runs it once; a restore never does, and no shape check could
   notice a replay;
3. on Zen CPUs with zentorch's fused-MoE op it does neither (ZenDNN consumes the
   unpacked weights): no wcache plan; refused by name (``experts == "zentorch"``).

Then vLLM rebuilds its kernel objects from the final tensors (``moe.set_experts_kernel``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from wcache.core import LayerConfig, StageOut, Tag, Target, stage
from wcache.stages.common import require_op
from wcache.stages.moe import W13_W2, MoeLayoutError, moe_shape
from wcache.stages.packing import round_up

__all__ = [
    "CpuExperts",
    "CPU_EXPERTS",
    "ZENTORCH_EXPERTS",
    "cpu_experts",
    "padded_intermediate_size",
    "pad_intermediate_weights",
    "prepack_moe_weight",
    "pad_intermediate",
    "pack_weights",
]

_CPU_MOE = "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py"
#: Activation whose experts vLLM-CPU never pads (``_padded_intermediate_size``).
SWIGLUOAI = "swigluoai"
#: The marker :class:`~wcache.core.MoeShape.experts` carries for a layer vLLM hands
#: to zentorch's fused MoE (``is_zentorch_moe_supported``).
ZENTORCH_EXPERTS = "zentorch"


@attrs.frozen
class CpuExperts:
    """One of vLLM-CPU's unquantized experts classes.

    Attributes:
        isa: the layout ``cpu_prepack_moe_weight`` packs for (its ``isa`` argument).
        output_alignment, reduction_alignment: the class's alignments; the
            intermediate dim is padded to their lcm.
    """

    isa: str
    output_alignment: int
    reduction_alignment: int

    @property
    def intermediate_alignment(self) -> int:
        return math.lcm(self.output_alignment, self.reduction_alignment)


#: vLLM's experts class name -> its isa and alignments (class attributes in
#: ``experts/cpu_moe.py``, 0.32 and 0.33). Only classes whose layout a plan was
#: checked against are listed: the portable one on this project's hosts, AMX by
#: the same code path (an AMX host still needs its own run).
CPU_EXPERTS = {
    "CPUUnquantizedExperts": CpuExperts("vec", 32, 1),
    "X86CPUUnquantizedExperts": CpuExperts("amx", 32, 32),
}


def cpu_experts(config: LayerConfig) -> CpuExperts:
    """The experts class vLLM picked for this layer (``config.moe.experts``).

    Raises:
        MoeLayoutError: a class wcache has no layout for (named).
    """
    experts = moe_shape(config).experts
    if experts not in CPU_EXPERTS:
        raise MoeLayoutError(
            f"layer {config.name!r}: vLLM-CPU experts {experts!r} have no "
            f"wcache layout (known: {sorted(CPU_EXPERTS)})"
        )
    return CPU_EXPERTS[experts]


def padded_intermediate_size(intermediate_size: int, experts: CpuExperts, activation: str) -> int:
    """``round_up(I, lcm(output, reduction alignment))``; ``I`` for SwiGLU-OAI.

    Source: ``cpu_moe.CPUUnquantizedExperts._padded_intermediate_size``."""
    if activation == SWIGLUOAI:
        return intermediate_size
    return round_up(intermediate_size, experts.intermediate_alignment)


def pad_intermediate_weights(
    tensors: Mapping[str, torch.Tensor], intermediate_size: int, padded_size: int
) -> dict[str, torch.Tensor]:
    """Zero-pad the intermediate dim of gated experts (new tensors; ``{}`` when aligned).

    Args:
        tensors: ``w13_weight [E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``),
            ``w2_weight [E, H, I]``, optional ``w13_bias [E, 2I]``.
        intermediate_size: ``I``.
        padded_size: ``P >= I``.

    Returns:
        ``w13_weight [E, 2P, H]`` (gate in rows ``[0, I)``, up in ``[P, P + I)``),
        ``w2_weight [E, H, P]``, ``w13_bias [E, 2P]``; zeros elsewhere.

    Source: ``cpu_moe.CPUUnquantizedExperts._pad_moe_intermediate``.
    """
    if padded_size == intermediate_size:
        return {}
    w13, w2 = tensors["w13_weight"], tensors["w2_weight"]
    e, _, h = w13.shape
    i, p = intermediate_size, padded_size
    new_w13 = w13.new_zeros(e, 2 * p, h)
    new_w13[:, :i] = w13[:, :i]
    new_w13[:, p : p + i] = w13[:, i:]
    new_w2 = w2.new_zeros(e, h, p)
    new_w2[:, :, :i] = w2
    out = {"w13_weight": new_w13, "w2_weight": new_w2}
    if "w13_bias" in tensors:
        bias = tensors["w13_bias"]
        new_bias = bias.new_zeros(e, 2 * p)
        new_bias[:, :i] = bias[:, :i]
        new_bias[:, p : p + i] = bias[:, i:]
        out["w13_bias"] = new_bias
    return out


def prepack_moe_weight(weight: torch.Tensor, isa: str) -> torch.Tensor:
    """vLLM-CPU's grouped-GEMM prepack of stacked expert weights.

    Args:
        weight: ``[E, R, C]`` bf16 (``w13 [E, 2P, H]`` or ``w2 [E, H, P]``), contiguous.
        isa: ``"vec"`` or ``"amx"`` (:class:`CpuExperts`).

    Returns:
        A new ``[E, R, C]`` tensor of the same dtype and strides holding the same
        values per expert in the kernel's blocked order (a permutation; applying it
        twice differs from once). Meta in, meta out.

    Raises:
        OpUnavailable: vLLM's ``torch.ops._C.prepack_moe_weight`` is not loaded.

    Source: ``vllm._custom_ops.cpu_prepack_moe_weight``.
    """
    output = torch.empty_like(weight)
    if weight.device.type == "meta":
        return output
    require_op("_C", "prepack_moe_weight")(weight.contiguous(), output, isa)
    return output


@stage(
    "cpu_moe.pad_intermediate",
    Tag.TRANSFORM,
    reads=W13_W2,
    writes=("w13_weight", "w2_weight", "w13_bias"),
    optional=("w13_bias",),
    source=f"{_CPU_MOE}::CPUUnquantizedExperts._pad_moe_intermediate",
)
def pad_intermediate(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM: :func:`pad_intermediate_weights` to the experts class's alignment
    (``I = config.moe.intermediate_size_per_partition``); nothing when aligned.

    Source: cpu_moe.CPUUnquantizedExperts._pad_moe_intermediate
    """
    moe = moe_shape(config)
    size = moe.intermediate_size_per_partition
    padded = padded_intermediate_size(size, cpu_experts(config), moe.activation)
    return StageOut(tensors=pad_intermediate_weights(tensors, size, padded))


@stage(
    "cpu_moe.pack_weights",
    Tag.TRANSFORM,
    reads=W13_W2,
    writes=W13_W2,
    source=f"{_CPU_MOE}::CPUUnquantizedExperts.process_weights_after_loading "
    "(cpu_prepack_moe_weight)",
)
def pack_weights(
    tensors: Mapping[str, torch.Tensor],
    config: LayerConfig,
    target: Target,
    recorded: Mapping[str, Any],
) -> StageOut:
    """TRANSFORM ``w13_weight`` and ``w2_weight`` -> :func:`prepack_moe_weight` for the
    experts class's isa (same shapes, dtype and strides; other bytes). Not idempotent:
    never replayed on restore.

    Source: cpu_moe.CPUUnquantizedExperts.process_weights_after_loading
    """
    isa = cpu_experts(config).isa
    return StageOut(tensors={n: prepack_moe_weight(tensors[n], isa) for n in W13_W2})
