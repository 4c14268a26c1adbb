"""Serialized FP8 MoE checkpoints, produced offline by wcache's own code (no
llm-compressor) from the tiny MoE models of :mod:`wcache.testing.tiny_models`.

Formats (:data:`MOE_FORMATS`), every decoder linear and every expert quantized, the
routers (``mlp.gate``, ``mlp.shared_expert_gate``), the embedding, the norms and the
LM head left in bf16:

* ``fp8``: vLLM's serialized FP8 (``quant_method: fp8``), per-tensor weight scales
  (``weight_scale`` fp32 0-d per linear and per expert), dynamic activations.
* ``fp8_static``: the same with static activations: ``input_scale`` fp32 0-d per
  linear and per expert, from a calibration forward (:func:`calibrate_moe_input_amax`).
* ``fp8_block``: ``weight_block_size`` [128, 128]: ``weight_scale_inv`` fp32
  ``[ceil(N / 128), ceil(K / 128)]``, dynamic activations. Its base must have every
  quantized dimension a multiple of 128 (``qwen3_moe_128``).
* ``ct_w8a8_fp8``: compressed-tensors ``float-quantized``, channel weight scales
  ``[N, 1]``, dynamic per-token activations (llm-compressor's FP8_DYNAMIC).
* ``ct_w8a8_fp8_static``: tensor weight scales ``[1]`` and static tensor
  ``input_scale`` ``[1]`` (llm-compressor's FP8).

Checkpoint names are transformers' per-expert layout
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``), which vLLM's
``FusedMoE.make_expert_params_mapping`` maps onto ``experts.w13_*`` / ``experts.w2_*``:
``weight_scale`` -> ``w13_weight_scale [E, 2]`` (tensor) or ``[E, 2N, 1]`` (channel),
``weight_scale_inv`` -> ``w13_weight_scale_inv [E, 2N/128, K/128]``, ``input_scale`` ->
``w13_input_scale [E]``.

    python -m wcache.testing.moe_fixtures [--bases qwen3_moe,...] [--formats fp8,...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from wcache.errors import FixtureError
from wcache.testing import fixtures as fx
from wcache.testing import tiny_models as tm

__all__ = ["MOE_FORMATS", "MOE_BASES", "FP8_BLOCK", "fp8_block_quantize", "is_moe_quantized",
           "ignored_modules", "convert_moe_state_dict", "moe_quantization_config",
           "calibrate_moe_input_amax", "build_moe"]

MOE_FORMATS = ("fp8", "fp8_static", "fp8_block", "ct_w8a8_fp8", "ct_w8a8_fp8_static")
#: vLLM's FP8 block shape ([block_n, block_k]).
FP8_BLOCK = tm.FP8_BLOCK
#: Base architecture -> the formats built from it. ``qwen3_moe_128`` is the one base
#: whose dims are multiples of the block; the others exercise padding (96-wide
#: experts, 6 and 12 experts, a shared expert) in the per-tensor and channel formats.
MOE_BASES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("fp8", "fp8_static", "ct_w8a8_fp8", "ct_w8a8_fp8_static"),
    "qwen3_moe_128": MOE_FORMATS,
    "qwen2_moe": ("fp8", "ct_w8a8_fp8"),
    "mixtral": ("fp8",),
}
#: Formats with static activation scales (a calibration forward sets them).
STATIC_FORMATS = ("fp8_static", "ct_w8a8_fp8_static")
#: A decoder linear or an expert projection (transformers' names); routers (``gate``,
#: ``shared_expert_gate``) do not match: vLLM builds them unquantized or ignores them.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*\.(\w+_proj|w1|w2|w3)\.weight$")
#: The routers of each layer that the quantization config must name as ignored.
_ROUTER = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:gate|router))\.weight$")
#: compressed-tensors ignore patterns for the routers (llm-compressor's MoE recipes).
CT_IGNORE = ("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
             "re:.*block_sparse_moe.gate$")


def is_moe_quantized(name: str, tensor: torch.Tensor) -> bool:
    """True for a 2-D decoder linear or expert weight that the formats quantize."""
    return tensor.ndim == 2 and bool(_QUANTIZED.match(name))


def ignored_modules(names: Mapping[str, Any] | list[str]) -> list[str]:
    """The router modules (``model.layers.L.mlp.gate``) of a state dict, sorted: what
    vLLM's FP8 config must skip (``ignored_layers``)."""
    return sorted({m.group(1) for n in names if (m := _ROUTER.match(n))})


def fp8_block_quantize(weight: torch.Tensor, block: int = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """vLLM's block FP8 tensors for one linear: one scale per ``block x block`` tile.

    Math (float32): ``scale[i, j] = max|w[tile i, j]| / 448`` (the float32 tiny for
    an all-zero tile); ``q = clamp(w / scale, -448, 448)`` in float8_e4m3fn.

    Args:
        weight: ``[size_n, size_k]`` float; both multiples of ``block``.
        block: tile edge (vLLM's ``weight_block_size`` [block, block]).

    Returns:
        ``weight`` float8_e4m3fn ``[size_n, size_k]``; ``weight_scale_inv`` fp32
        ``[size_n // block, size_k // block]`` (vLLM's name: the dequantization
        multiplier, despite "inv").

    Raises:
        FixtureError: not 2-D float, or a dimension not a multiple of ``block``.

    Source: vLLM ``Fp8LinearMethod.create_weights`` (block) and
    ``per_block_cast_to_fp8`` (tests/kernels/quant_utils.py); DeepSeek-V3's FP8 layout.
    """
    if weight.ndim != 2 or not weight.is_floating_point() or weight.shape[0] % block \
            or weight.shape[1] % block:
        raise FixtureError(f"block FP8 needs a 2-D float weight with both dims multiples of "
                           f"{block}, got {tuple(weight.shape)} {weight.dtype}; build the "
                           "block fixture from a base whose dims are (qwen3_moe_128)")
    n, k = weight.shape
    tiles = weight.to(torch.float32).reshape(n // block, block, k // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / fx.FP8_E4M3_MAX).clamp(
        min=torch.finfo(torch.float32).tiny)
    q = (tiles / scale[:, None, :, None]).clamp(-fx.FP8_E4M3_MAX, fx.FP8_E4M3_MAX)
    return {"weight": q.reshape(n, k).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def _quantize(weight: torch.Tensor, fmt: str, amax: float | None) -> dict[str, torch.Tensor]:
    if fmt in ("fp8", "fp8_static"):
        out = fx.fp8_quantize(weight)
        if fmt == "fp8_static":
            out["input_scale"] = torch.tensor(
                float(amax) * fx.CALIBRATION_HEADROOM / fx.FP8_E4M3_MAX, dtype=torch.float32)
        return out
    if fmt == "fp8_block":
        return fp8_block_quantize(weight)
    return fx.ct_compress(weight, fmt, amax)


def convert_moe_state_dict(state_dict: Mapping[str, torch.Tensor], fmt: str,
                           input_amax: Mapping[str, float] | None = None
                           ) -> dict[str, torch.Tensor]:
    """A bf16 MoE state dict in ``fmt``; pure (the input is not changed).

    Args:
        state_dict: name -> tensor of a tiny MoE checkpoint (transformers' per-expert
            layout).
        fmt: one of :data:`MOE_FORMATS`.
        input_amax: module prefix (``model.layers.0.mlp.experts.3.down_proj``) ->
            calibrated ``max|x|`` of its input; required for :data:`STATIC_FORMATS`.

    Returns:
        name -> tensor, sorted: each quantized ``<prefix>.weight`` replaced by the
        format's tensors under ``<prefix>.``; other tensors unchanged (bf16).

    Raises:
        FixtureError: unknown format, a static format without ``input_amax`` (or
            without an entry for a quantized linear), or block dims not multiples of 128.
    """
    if fmt not in MOE_FORMATS:
        raise FixtureError(f"unknown MoE fixture format {fmt!r}; use one of {MOE_FORMATS}")
    if fmt in STATIC_FORMATS and input_amax is None:
        raise FixtureError(f"{fmt} has static activation scales: pass input_amax "
                           "(calibrate_moe_input_amax)")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not is_moe_quantized(name, tensor):
            out[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        amax = None
        if fmt in STATIC_FORMATS:
            if prefix not in input_amax:
                raise FixtureError(f"no calibrated input amax for {prefix}; calibrate on "
                                   "the same bf16 checkpoint")
            amax = input_amax[prefix]
        out.update({f"{prefix}.{k}": v for k, v in _quantize(tensor, fmt, amax).items()})
    return dict(sorted(out.items()))


def moe_quantization_config(fmt: str, ignored: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of ``fmt``; ``ignored`` are the router modules.

    Source: vLLM ``Fp8Config.from_config`` (``activation_scheme``, ``ignored_layers``,
    ``weight_block_size``) and ``CompressedTensorsConfig.from_config``; Qwen's
    Qwen3-30B-A3B-FP8 config (block FP8, routers not converted).
    """
    if fmt in ("fp8", "fp8_static", "fp8_block"):
        config = {"quant_method": "fp8", "ignored_layers": list(ignored),
                  "activation_scheme": "static" if fmt == "fp8_static" else "dynamic"}
        if fmt == "fp8_block":
            config["weight_block_size"] = [FP8_BLOCK, FP8_BLOCK]
        return config
    if fmt in ("ct_w8a8_fp8", "ct_w8a8_fp8_static"):
        return {**fx.quantization_config(fmt), "ignore": list(CT_IGNORE)}
    raise FixtureError(f"unknown MoE fixture format {fmt!r}; use one of {MOE_FORMATS}")


def _act(name: str):
    return {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[name]


def calibrate_moe_input_amax(bf16_dir: Path, state_dict: Mapping[str, torch.Tensor]
                             ) -> dict[str, float]:
    """``max|x|`` of each quantized linear's input over the calibration prompts, from a
    transformers forward of the bf16 checkpoint on the CPU.

    Attention and shared-expert linears: hooks on their ``nn.Linear``. Experts (fused
    inside transformers' experts module): the experts module's input ``x`` (every
    token, routed or not: an upper bound of what each expert sees) is the input of
    ``gate_proj``/``up_proj``; ``act(x @ gate.T) * (x @ up.T)`` over the same tokens,
    per expert, is the input of ``down_proj``.

    Returns:
        module prefix -> amax (float).

    Source: llm-compressor's static activation calibration (min-max observer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(bf16_dir)
    act = _act(getattr(model.config, "hidden_act", "silu"))
    amax: dict[str, float] = {}

    def bump(key: str, value: float) -> None:
        amax[key] = max(amax.get(key, 0.0), value)

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda mod, inp, out, _n=name: bump(_n, float(inp[0].abs().max()))))
        elif name.endswith(".experts") and not isinstance(module, torch.nn.ModuleList):
            def record(mod, inp, out, _n=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).to(torch.float32)
                for e in range(1_000_000):
                    gate = state_dict.get(f"{_n}.{e}.gate_proj.weight")
                    if gate is None:
                        break
                    up = state_dict[f"{_n}.{e}.up_proj.weight"].to(torch.float32)
                    bump(f"{_n}.{e}.gate_proj", float(x.abs().max()))
                    bump(f"{_n}.{e}.up_proj", float(x.abs().max()))
                    h = act(x @ gate.to(torch.float32).t()) * (x @ up.t())
                    bump(f"{_n}.{e}.down_proj", float(h.abs().max()))
            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        for prompt in fx.CALIBRATION_PROMPTS:
            model(**tokenizer(prompt, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    return amax


def build_moe(base: str, fmt: str, out: str | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) ``base`` (a tiny MoE architecture) in ``fmt``.

    Returns:
        The checkpoint folder (``tiny-<base>-<fmt>``).

    Raises:
        FixtureError: ``fmt`` is not built from ``base`` (:data:`MOE_BASES`).
    """
    if fmt not in MOE_BASES.get(base, ()):
        raise FixtureError(f"{base} in {fmt} is not a MoE fixture; built are "
                           f"{ {b: list(f) for b, f in MOE_BASES.items()} }")
    a = tm.arch(base)
    final = tm.arch_path(base, out, fmt)
    if tm.is_built(final, a, fmt) and not force:
        return final
    bf16_dir = tm.build_arch(base, out)
    state = fx.load_state_dict(bf16_dir)
    amax = calibrate_moe_input_amax(bf16_dir, state) if fmt in STATIC_FORMATS else None
    converted = convert_moe_state_dict(state, fmt, amax)
    with fx.atomic_folder(final) as tmp:
        tm.copy_tokenizer(bf16_dir, tmp)
        for extra in ("generation_config.json",):
            if (bf16_dir / extra).is_file():
                (tmp / extra).write_bytes((bf16_dir / extra).read_bytes())
        fx._save_state_dict(converted, tmp)
        config = json.loads((bf16_dir / fx.CONFIG_FILE).read_text())
        config["quantization_config"] = moe_quantization_config(fmt, ignored_modules(state))
        (tmp / fx.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / tm.STAMP_FILE).write_text(json.dumps(tm._stamp(a, fmt), sort_keys=True) + "\n")
    return final


def main(argv: list[str] | None = None) -> int:
    """Command line: build the MoE fixtures and print their folders."""
    ap = argparse.ArgumentParser(prog="python -m wcache.testing.moe_fixtures",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--bases", default=",".join(MOE_BASES))
    ap.add_argument("--formats", default=",".join(MOE_FORMATS))
    ap.add_argument("--out")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    for base in filter(None, args.bases.split(",")):
        for fmt in filter(None, args.formats.split(",")):
            if fmt in MOE_BASES.get(base, ()):
                print(f"{base:14s} {fmt:20s} {build_moe(base, fmt, args.out, force=args.force)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
