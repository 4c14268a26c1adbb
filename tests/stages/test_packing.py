"""wcache.stages.packing: bit for bit against vLLM's pack/unpack and AWQ conversion,
round trips, meta shapes, bad inputs, and the check that nothing else in the package
writes its own int32 pack/unpack loop."""

from __future__ import annotations

import ast
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.stages import packing as P
from wcache.stages.common import StageInputError

qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
from vllm.model_executor.layers.quantization.auto_awq import _convert_awq_to_standard_format  # noqa: E402 (after pytest.importorskip)
from vllm.scalar_type import scalar_types  # noqa: E402 (after pytest.importorskip)

ROOT = Path(__file__).resolve().parents[2]
#: vLLM's scalar type per bit width (its pack/unpack take the width from it).
WTYPES = {4: scalar_types.uint4, 8: scalar_types.uint8}
#: Input dtypes a pack takes: int32 (unpacked values) and uint8 (bytes).
PACK_DTYPES = (torch.int32, torch.uint8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _words(seed: int, shape) -> torch.Tensor:
    """Arbitrary int32 words, every bit pattern drawable."""
    return torch.randint(-(2**31), 2**31 - 1, tuple(shape), dtype=torch.int32, generator=_gen(seed))


def _values(seed: int, shape, bits: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(0, 2**bits, tuple(shape), dtype=torch.int32, generator=_gen(seed)).to(
        dtype
    )


packs = st.tuples(
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from([4, 8]),
    st.sampled_from([0, 1]),
    st.sampled_from(PACK_DTYPES),
    st.integers(0, 2**16),
)


# --------------------------------------------------------------------------- pack / unpack


@given(packs)
def test_pack_int32_equals_vllm(case):
    """pack_int32 == vLLM's pack_quantized_values_into_int32 on the int32 values, for
    num_bits 4 and 8, packed dim 0 and 1, int32 and uint8 inputs."""
    rows, cols, bits, dim, dtype, seed = case
    shape = [rows, cols]
    shape[dim] *= 32 // bits
    values = _values(seed, shape, bits, dtype)
    expected = qu.pack_quantized_values_into_int32(values.to(torch.int32), WTYPES[bits], dim)
    actual = P.pack_int32(values, bits, dim)
    assert actual.dtype == torch.int32
    assert torch.equal(expected, actual)
    assert expected.stride() == actual.stride()


def test_pack_int32_casts_uint8_before_shifting():
    """A uint8 input keeps its high slots (vLLM's function, shifting in uint8, drops them)."""
    values = torch.full((1, 8), 15, dtype=torch.uint8)
    expected = torch.tensor([[-1]], dtype=torch.int32)  # 0xFFFFFFFF
    assert torch.equal(expected, P.pack_int32(values, 4, 1))
    assert not torch.equal(
        expected, qu.pack_quantized_values_into_int32(values, scalar_types.uint4, 1)
    )


@given(packs)
def test_unpack_int32_equals_vllm(case):
    """unpack_int32 == vLLM's unpack_quantized_values_into_int32 on arbitrary int32 words."""
    rows, cols, bits, dim, _, seed = case
    packed = _words(seed, (rows, cols))
    expected = qu.unpack_quantized_values_into_int32(packed, WTYPES[bits], dim)
    assert torch.equal(expected, P.unpack_int32(packed, bits, dim))


@given(packs)
def test_pack_unpack_round_trip(case):
    """unpack(pack(values)) == values and pack(unpack(words)) == words."""
    rows, cols, bits, dim, dtype, seed = case
    shape = [rows, cols]
    shape[dim] *= 32 // bits
    values = _values(seed, shape, bits, dtype)
    assert torch.equal(
        values.to(torch.int32), P.unpack_int32(P.pack_int32(values, bits, dim), bits, dim)
    )
    words = _words(seed, (rows, cols))
    assert torch.equal(words, P.pack_int32(P.unpack_int32(words, bits, dim), bits, dim))


@given(
    k=st.integers(1, 4).map(lambda i: 8 * i),
    n=st.integers(1, 4).map(lambda i: 8 * i),
    seed=st.integers(0, 2**16),
)
def test_pack_layouts_equal_vllm_numpy_references(k, n, seed):
    """Packed dim 0 == gptq_pack/pack_rows, dim 1 == pack_cols (unpack == unpack_cols),
    pack_awq == awq_pack and unpack_awq inverts it."""
    q = _values(seed, (k, n), 4, torch.int32)
    assert torch.equal(qu.pack_rows(q, 4, k, n), P.pack_int32(q, 4, 0))
    assert torch.equal(qu.gptq_pack(q, 4, k, n), P.pack_int32(q, 4, 0))
    assert torch.equal(qu.pack_cols(q, 4, k, n), P.pack_int32(q, 4, 1))
    packed = qu.pack_cols(q, 4, k, n)
    assert torch.equal(qu.unpack_cols(packed, 4, k, n), P.unpack_int32(packed, 4, 1))
    awq = P.pack_awq(q)
    assert torch.equal(qu.awq_pack(q, 4, k, n), awq)
    assert torch.equal(q, P.unpack_awq(awq))


# --------------------------------------------------------------------------- AWQ


def _vllm_awq(qweight: torch.Tensor, qzeros: torch.Tensor | None):
    """vLLM's _convert_awq_to_standard_format run on a layer holding the tensors."""
    import vllm.model_executor.parameter as vparam

    layer = torch.nn.Module()
    layer.qweight = torch.nn.Parameter(qweight.clone(), requires_grad=False)
    if qzeros is not None:
        layer.qzeros = torch.nn.Parameter(qzeros.clone(), requires_grad=False)
    with (
        mock.patch.object(vparam, "get_tensor_model_parallel_rank", lambda: 0),
        mock.patch.object(vparam, "get_tensor_model_parallel_world_size", lambda: 1),
    ):
        _convert_awq_to_standard_format(
            layer, "qweight", None if qzeros is None else "qzeros", P.AWQ_NUM_BITS
        )
    return layer.qweight.data, (None if qzeros is None else layer.qzeros.data)


@given(
    k=st.integers(1, 4).map(lambda i: 8 * i),
    n=st.integers(1, 4).map(lambda i: 8 * i),
    groups=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_awq_to_standard_equals_vllm(k, n, groups, seed):
    """awq_to_standard == vLLM's _convert_awq_to_standard_format on a layer (weight and
    zero points, and the weight alone; values and strides), arbitrary int32 words."""
    qweight, qzeros = _words(seed, (k, n // 8)), _words(seed + 1, (groups, n // 8))
    exp_w, exp_z = _vllm_awq(qweight, qzeros)
    w, z = P.awq_to_standard(qweight, qzeros)
    assert torch.equal(exp_w, w) and torch.equal(exp_z, z)
    # the strides too, a size-1 dim's included (one group: zero points [n // 8, 1])
    assert (exp_w.stride(), exp_z.stride()) == (w.stride(), z.stride())
    w_only, none = P.awq_to_standard(qweight, None)
    exp_w_only = _vllm_awq(qweight, None)[0]
    assert none is None and torch.equal(exp_w_only, w_only)
    assert exp_w_only.stride() == w_only.stride()


def test_awq_orders_invert_each_other():
    """AWQ_REVERSE_PACK_ORDER is the inverse permutation of AWQ_PACK_ORDER (vLLM's value)."""
    from vllm.model_executor.layers.quantization.auto_awq import _REVERSE_AWQ_PACK_ORDER

    assert list(P.AWQ_REVERSE_PACK_ORDER) == _REVERSE_AWQ_PACK_ORDER
    assert [P.AWQ_PACK_ORDER[r] for r in P.AWQ_REVERSE_PACK_ORDER] == list(range(8))


def test_awq_to_standard_other_width_uses_identity_order():
    """A pack factor other than 8 (8-bit) converts with the identity slot order, as the
    Marlin conversion it replaces did: the result is the plain re-pack along K."""
    values = _values(3, (8, 8), 8, torch.int32)
    w, z = P.awq_to_standard(P.pack_int32(values, 8, 1), P.pack_int32(values, 8, 1), 8)
    assert torch.equal(P.pack_int32(values, 8, 0).contiguous(), w)
    assert torch.equal(P.pack_int32(values.T, 8, 0).contiguous(), z)


def test_meta_shapes():
    """Pack, unpack and the AWQ conversion give the right shapes and dtype on meta."""
    meta = torch.empty(64, 16, dtype=torch.int32, device="meta")
    assert (8, 16) == tuple(P.pack_int32(meta, 4, 0).shape)
    assert (64, 128) == tuple(P.unpack_int32(meta, 4, 1).shape)
    w, z = P.awq_to_standard(meta, torch.empty(2, 16, dtype=torch.int32, device="meta"))
    assert ((8, 128), (16, 2)) == (tuple(w.shape), tuple(z.shape))
    assert w.device.type == "meta" and w.dtype == torch.int32


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: P.pack_factor(3), "does not divide"),
        (lambda: P.pack_int32(torch.zeros(7, 2, dtype=torch.int32), 4, 0), "multiple of 8"),
        (lambda: P.awq_to_standard(torch.zeros(8, 1, dtype=torch.int64), None), "2-D int32"),
        (
            lambda: P.awq_to_standard(
                torch.zeros(8, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            ),
            "qzeros must be 2-D",
        ),
        (
            lambda: P.awq_to_standard(torch.zeros(12, 1, dtype=torch.int32), None),
            r"qweight \(size_k\) of size 12 by 8",
        ),
        (lambda: P.pad_to(torch.ones(4), (2,)), "cannot pad"),
        (lambda: P.pad_to(torch.ones(2, 2), (2,)), "cannot pad"),
    ],
)
def test_bad_inputs_raise(call, match):
    """Each bad input raises StageInputError with its message."""
    with pytest.raises(StageInputError, match=match):
        call()


def test_pad_to_and_round_up():
    """pad_to fills the new elements with the value; round_up rounds to the multiple."""
    padded = P.pad_to(torch.ones(2, 3), (4, 5), value=7.0)
    expected = torch.full((4, 5), 7.0)
    expected[:2, :3] = 1.0
    assert torch.equal(expected, padded)
    assert (64, 64, 0, 32) == (
        P.round_up(33, 32),
        P.round_up(64, 32),
        P.round_up(0, 32),
        P.round_up(1, 32),
    )


# --------------------------------------------------------------------------- one packing module


#: Where a pack/unpack loop may live: the packing module itself.
PACKING_MODULE = ROOT / "wcache" / "stages" / "packing.py"


def _is_int_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def _variable_shifts(tree: ast.AST) -> list[int]:
    """Lines that shift by a computed amount a value that is not a literal: the heart of
    every int32 pack/unpack loop (``v << (num_bits * i)``, ``packed >> shifts``).
    ``1 << num_bits`` (a mask) and shifts by a literal (``x >> 4``, ``64 << 20``) pass."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.RShift)):
            left, right = node.left, node.right
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.LShift, ast.RShift)):
            left, right = node.target, node.value
        elif isinstance(node, ast.Call) and getattr(
            node.func, "attr", getattr(node.func, "id", None)
        ) in ("bitwise_left_shift", "bitwise_right_shift"):
            lines.append(node.lineno)
            continue
        else:
            continue
        if not _is_int_literal(left) and not _is_int_literal(right):
            lines.append(node.lineno)
    return sorted(lines)


def _shared_sources() -> list[Path]:
    """The package and the shared test helpers (tests/helpers, the conftests)."""
    return sorted(
        [
            *(ROOT / "wcache").rglob("*.py"),
            *(ROOT / "tests" / "helpers").glob("*.py"),
            *(ROOT / "tests").rglob("conftest.py"),
        ]
    )


def test_detector_finds_pack_loops():
    """The detector flags the shapes of a pack and an unpack loop and passes masks and
    literal shifts (so the check below can fail)."""
    flagged = (
        "res |= (v[..., i::pf] & mask) << (num_bits * i)\n"
        "vals = (packed.unsqueeze(-1) >> shifts) & mask\n"
        "w = torch.bitwise_left_shift(v, s)\n"
    )
    passed = "mask = (1 << num_bits) - 1\nhi = packed >> 4\nn = 64 << 20\n"
    assert [1, 2, 3] == _variable_shifts(ast.parse(flagged))
    assert [] == _variable_shifts(ast.parse(passed))


def test_no_pack_loop_outside_packing_module():
    """No module of the package or the shared test helpers, other than
    wcache/stages/packing.py, shifts values by a computed amount (its own pack loop)."""
    found = {
        str(p.relative_to(ROOT)): lines
        for p in _shared_sources()
        if p != PACKING_MODULE
        if (lines := _variable_shifts(ast.parse(p.read_text(), str(p))))
    }
    assert {} == found
    assert _variable_shifts(ast.parse(PACKING_MODULE.read_text()))  # the loops are here
