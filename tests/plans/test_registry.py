"""The stage registry is complete, derived from the registry itself (never a hand list).

* every stage registered with ``@stage`` (by a ``wcache.stages`` module) is used by a
  registered plan, and every stage a plan uses is registered there (conditional
  variants live in ``stages/``, not in plan modules);
* every registered stage appears in docs/plans.md;
* every stage has a hypothesis strategy that draws its inputs: each plan has one
  (:data:`PLAN_STRATEGIES`), whose draws resolve to that plan and run its full load
  fold on meta tensors (the stages accept meta tensors);
* every plan module under ``wcache/plans/`` is imported, and a missing one fails loudly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import (
    cpu_cases as cpu,  # skips this module without vLLM: its cases are vLLM layers
)
from tests.helpers import cuda_cases as cuda
from tests.helpers import moe_cases
from tests.helpers import vllm_layers as vl
from wcache.core import (
    LOAD_TAGS,
    STAGE_VERBS,
    LayerConfig,
    LayerState,
    QuantSpec,
    Target,
    registered_stages,
    stage_name_problem,
)
from wcache.core.registry import is_registered
from wcache.plans import PLAN_MODULES, _import_plan_modules, all_plans, plan_for
from wcache.shell import load_, prepare_, restore_, snapshot, state_from_module

ROOT = Path(__file__).resolve().parents[2]
H200, B200 = cuda.H200, cuda.B200
AMX = cpu.AMX


def _wcache_stages() -> dict[str, object]:
    """Registered stages defined by wcache's own stage modules (tests register toys)."""
    return {
        name: value
        for name, value in registered_stages().items()
        if value.fn.__module__.startswith("wcache.stages.")
    }


# --------------------------------------------------------------------------- strategies


def _vllm_case(case: vl.Case) -> tuple[LayerConfig, dict[str, torch.Tensor]]:
    """A vLLM layer built and filled by vLLM's create_weights/weight loader."""
    return case.config, dict(state_from_module(case.new_layer()).tensors)


def _from_vllm(family: str, target: Target) -> st.SearchStrategy:
    return cpu.FAMILIES[family].map(lambda case: (*_vllm_case(case), target))


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@st.composite
def _attention(draw) -> tuple:
    """An attention layer without a KV-cache method: the four 0-d scale buffers."""
    tensors = {
        n: _scalar(draw(st.floats(0.0625, 4.0, width=32)))
        for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    }
    return (
        LayerConfig(QuantSpec("attention", layer_kind="attention"), 0, 0, name="attn"),
        tensors,
        cpu.AVX512,
    )


@st.composite
def _mla_attention(draw) -> tuple:
    """An MLA layer (CPU_MLA / TRITON_MLA): the four scale buffers and its kv_b_proj
    child's bf16 weight ``[N*(P+V), L]`` (read as ``kv_b_proj.weight``)."""
    heads, nope, v, lora = (
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([32, 64])),
        draw(st.sampled_from([32, 64])),
        draw(st.sampled_from([128, 512])),
    )
    tensors = {n: _scalar(1.0) for n in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}
    tensors["kv_b_proj.weight"] = torch.zeros(heads * (nope + v), lora, dtype=torch.bfloat16)
    extra = {
        "kv_lora_rank": lora,
        "num_heads": heads,
        "qk_nope_head_dim": nope,
        "v_head_dim": v,
        "backend": draw(st.sampled_from(["CPU_MLA", "TRITON_MLA"])),
        "kv_b_proj_method": "UnquantizedLinearMethod",
        "kv_b_proj_dtype": "bfloat16",
    }
    config = LayerConfig(
        QuantSpec("mla_attention", layer_kind="attention"), 0, 0, name="mla_attn", extra=extra
    )
    return config, tensors, cpu.AVX512


@st.composite
def _ct_kv_cache(draw) -> tuple:
    """A compressed-tensors KV-cache layer: [heads] fp32 k/v/q scales (1 or per head),
    unused zero points and the three 0-d buffers."""
    heads = draw(st.sampled_from([1, 2, 4]))
    scale = st.lists(st.floats(0.0625, 4.0, width=32), min_size=heads, max_size=heads)
    tensors = {
        n: torch.tensor(draw(scale), dtype=torch.float32) for n in ("k_scale", "v_scale", "q_scale")
    }
    tensors.update(
        {
            n: torch.zeros(heads, dtype=torch.int8)
            for n in ("k_zero_point", "v_zero_point", "q_zero_point")
        }
    )
    tensors.update({n: _scalar(1.0) for n in ("_k_scale", "_v_scale", "_q_scale")})
    return (
        LayerConfig(
            QuantSpec("ct_kv_cache", layer_kind="attention"),
            0,
            0,
            name="attn",
            extra={"kv_cache_dtype": "fp8"},
        ),
        tensors,
        cpu.AVX512,
    )


def _cuda(strategy: st.SearchStrategy, target: Target) -> st.SearchStrategy:
    return strategy.map(lambda case: (case[0], case[1], target))


@st.composite
def _nvfp4_linear(draw) -> tuple:
    n, k = draw(st.sampled_from([32, 100, 128])), draw(st.sampled_from([64, 128]))
    bias = draw(st.booleans())
    cfg = cuda.cuda_config("modelopt_fp4", k, n, bits=4, g=16, kernel="cutlass", bias=bias)
    return cfg, cuda.nvfp4_linear_checkpoint(n, k, draw(st.integers(0, 2**16)), bias), B200


@st.composite
def _nvfp4_moe(draw) -> tuple:
    e, hidden, inter = (
        draw(st.sampled_from([1, 2, 3])),
        draw(st.sampled_from([64, 128])),
        draw(st.sampled_from([64, 128])),
    )
    cfg = cuda.cuda_config(
        "modelopt_fp4", hidden, inter, bits=4, g=16, kind="moe", kernel="cutlass_moe"
    )
    return cfg, cuda.nvfp4_moe_checkpoint(e, hidden, inter, draw(st.integers(0, 2**16))), B200


@st.composite
def _nvfp4_marlin_linear(draw) -> tuple:
    n, k = draw(st.sampled_from([32, 100, 128])), draw(st.sampled_from([64, 80, 128]))
    bias = draw(st.booleans())
    cfg = cuda.cuda_config("modelopt_fp4", k, n, bits=4, g=16, kernel="marlin", bias=bias)
    return cfg, cuda.nvfp4_linear_checkpoint(n, k, draw(st.integers(0, 2**16)), bias), H200


@st.composite
def _nvfp4_marlin_moe(draw) -> tuple:
    e, hidden, inter = (
        draw(st.sampled_from([1, 2, 3])),
        draw(st.sampled_from([64, 128, 192])),
        draw(st.sampled_from([32, 64, 96])),
    )
    cfg = cuda.nvfp4_marlin_moe_config(e, hidden, inter)
    return cfg, cuda.nvfp4_moe_checkpoint(e, hidden, inter, draw(st.integers(0, 2**16))), H200


#: plan id -> a strategy of ``(config, checkpoint tensors, target)`` drawing that plan's
#: inputs (filtered to the draws that resolve to it; the families mix kernels).
PLAN_STRATEGIES: dict[str, st.SearchStrategy] = {
    "unquantized/none@1": _from_vllm("unquantized_linear", Target("cuda", (9, 0))),
    "unquantized/onednn@1": _from_vllm("unquantized_linear", cpu.AVX512),
    "unquantized/torch_linear@1": _from_vllm("unquantized_linear", cpu.AVX2),
    "unquantized/sgl@1": _from_vllm("unquantized_linear", AMX),
    "awq/cpu_wna16@1": _from_vllm("awq", cpu.AVX512),
    "gptq/cpu_wna16@1": _from_vllm("gptq", cpu.AVX512),
    "ct_w4a16/cpu_wna16@1": _from_vllm("ct_w4a16", cpu.AVX512),
    "ct_w8a8_int8/onednn@1": _from_vllm("ct_w8a8_int8", cpu.AVX512),
    "ct_w8a8_int8/sgl@1": _from_vllm("ct_w8a8_int8", AMX),
    "awq/cpu_wna16_w4a8@1": _from_vllm("awq", AMX),
    "gptq/cpu_wna16_w4a8@1": _from_vllm("gptq", AMX),
    "ct_w4a16/cpu_wna16_w4a8@1": _from_vllm("ct_w4a16", AMX),
    "kv_cache/scales@1": _from_vllm("kv_cache", cpu.AVX512),
    "ct_kv_cache/scales@1": _ct_kv_cache(),
    "attention/default@1": _attention(),
    "mla_attention/absorb@1": _mla_attention(),
    **{
        plan_id: _cuda(cuda.marlin_int_cases(), H200)
        for plan_id in ("awq/marlin@1", "gptq/marlin@1", "ct_w4a16/marlin@1")
    },
    **{
        plan_id: _cuda(cuda.fp8_cases(), H200)
        for plan_id in (
            "fp8_per_tensor/cutlass@1",
            "fp8_per_channel/cutlass@1",
            "fp8_per_block/cutlass_block@1",
            "ct_w8a8_fp8/cutlass@1",
            "fp8/cutlass@1",
            "fp8/cutlass_block@1",
            "ct_w8a8_fp8/fp8_marlin@1",
            "ct_w8a8_fp8/cutlass@2",
            "ct_w8a8_fp8/fp8_marlin@2",
            "fp8/fp8_marlin@1",
            "mxfp8/marlin@1",
            "modelopt_mxfp8/marlin@1",
        )
    },
    **{
        plan_id: _cuda(cuda.machete_int_cases(), H200)
        for plan_id in ("awq/machete@1", "gptq/machete@1", "ct_w4a16/machete@1")
    },
    "ct_w8a8_int8/cutlass_int8@1": _cuda(cuda.cutlass_int8_cases(), H200),
    "modelopt_fp4/cutlass@1": _nvfp4_linear(),
    "modelopt_fp4/cutlass_moe@1": _nvfp4_moe(),
    "modelopt_fp4/marlin@1": _nvfp4_marlin_linear(),
    "modelopt_fp4/marlin_moe@1": _nvfp4_marlin_moe(),
    **moe_cases.PLAN_STRATEGIES,
}


def _resolves_to(plan_id: str):
    def check(case: tuple) -> bool:
        config, _, target = case
        try:
            return plan_for(config, target=target).id == plan_id
        except Exception:  # noqa: BLE001  (a draw of the family another plan takes)
            return False

    return check


# --------------------------------------------------------------------------- registry


def test_every_registered_stage_is_used_by_a_plan_and_back():
    """The registry and the plans agree: no registered stage is unused, and every
    stage a plan runs is the registered value of a wcache.stages module."""
    registered = _wcache_stages()
    used = [s for p in all_plans() for s in p.stages]
    assert [] == sorted(set(registered) - {s.name for s in used})
    for st_ in used:
        assert st_.name in registered, f"{st_.name} is not registered by a wcache.stages module"
        assert is_registered(st_), f"{st_.name}: the plan's stage is not the registered one"


def test_every_stage_has_a_strategy():
    """Every plan has a strategy, so every registered stage's inputs can be drawn."""
    assert set(PLAN_STRATEGIES) == {p.id for p in all_plans()}
    covered = {s.name for p in all_plans() if p.id in PLAN_STRATEGIES for s in p.stages}
    assert set(_wcache_stages()) <= covered


def test_every_stage_verb_is_used_and_every_name_has_one():
    """STAGE_VERBS is the verbs wcache's stages use, no more: every verb names at least
    one registered stage, and every registered name passes the name rule."""
    registered = _wcache_stages()
    assert [] == [n for n in registered if stage_name_problem(n)]
    used = {name.partition(".")[2].split("_", 1)[0] for name in registered}
    assert [] == sorted(set(STAGE_VERBS) - used)


def test_every_stage_is_in_plans_md():
    """docs/plans.md names every registered stage (regenerate it with `make docs`)."""
    text = (ROOT / "docs" / "plans.md").read_text()
    assert [] == sorted(n for n in _wcache_stages() if f"`{n}`" not in text)


@pytest.mark.parametrize("plan_id", sorted(PLAN_STRATEGIES))
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(data=st.data())
def test_strategy_draws_inputs_every_stage_runs_on_meta(plan_id, data):
    """A draw resolves to its plan, and the plan's whole load fold runs on meta copies
    of the drawn tensors (stages accept meta tensors), leaving the declared names."""
    config, tensors, target = data.draw(PLAN_STRATEGIES[plan_id].filter(_resolves_to(plan_id)))
    bound = plan_for(config, target=target)
    assert set(tensors) <= bound.checkpoint
    meta = LayerState(tensors={k: v.to("meta") for k, v in tensors.items()})
    state = bound.run(meta, LOAD_TAGS)
    declared = set(bound.checkpoint) | {w for s in bound.stages for w in s.writes}
    assert set(state.tensors) <= declared
    assert all(t.device.type == "meta" for t in state.tensors.values())


# --------------------------------------------------------------------------- plan modules


def test_every_plan_module_is_imported():
    """PLAN_MODULES names every module under wcache/plans/ that registers a plan."""
    registering = set()
    for path in (ROOT / "wcache" / "plans").glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(
            isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register"
            for n in ast.walk(tree)
        ):
            registering.add(path.stem)
    assert registering == set(PLAN_MODULES)


def test_a_missing_plan_module_fails_loudly():
    """Importing a plan module that does not exist raises instead of being skipped."""
    with pytest.raises(ModuleNotFoundError, match="wcache.plans.no_such_method"):
        _import_plan_modules(("no_such_method",))


# --------------------------------------------------------------------------- the card's API


def test_card_api_with_a_vllm_quant_method():
    """``wcache.vllm.plan_for(layer.quant_method, layer, target=t)`` resolves a vLLM
    method object to the plan its LayerConfig gets, and the bound plan's
    ``load(layer)`` / ``prepare(layer)`` / ``restore(layer, recorded)`` give a restored
    layer equal to the loaded one (tensors, bytes and attributes)."""
    import wcache.vllm

    case = vl.unquantized_linear(128, 64)
    layer = case.new_layer()
    bound = wcache.vllm.plan_for(layer.quant_method, layer, target=cpu.HOST, name="layer")
    assert plan_for(case.config, target=cpu.HOST).plan is bound.plan
    load_(layer, bound)
    daemon = case.new_layer()
    prepared = prepare_(daemon, bound)
    engine = case.new_layer("meta", seed=None)
    vl.install_exported_(engine, vl.export_clone(prepared), prepared.buffers)
    restore_(engine, bound, prepared.recorded, strict=True, drops=prepared.drops)
    assert {} == cpu.dict_diff(snapshot(layer, case.attr_paths), snapshot(engine, case.attr_paths))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "spec,size,target,message",
    [(QuantSpec("mystery_quant"), (256, 128), cpu.AVX512, "no plan for method 'mystery_quant'")],
)
def test_bad_inputs_raise_noplan(spec, size, target, message):
    """A method no plan module registers raises NoPlan naming the method."""
    from tests.helpers.cpu_plans import assert_refused

    assert_refused(spec, size, target, message)
