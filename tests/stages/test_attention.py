"""wcache/stages/attention.py: the default-scale fill returns new 1.0 buffers (the
values vLLM's ``set_default_quant_scales`` leaves, without its in-place write), the host
floats come from the buffers or, on restore, from the record, the host copies are
private, and the ``kv_cache`` placeholder is empty on the CPU for a CPU or meta target."""

from __future__ import annotations

import types

import pytest
import torch

from wcache.core import LayerConfig, QuantSpec, Target
from wcache.stages import attention as A

CONFIG = LayerConfig(QuantSpec("attention", layer_kind="attention"), 0, 0)
CPU = Target("cpu")


def _buffers(values=(0.5, 0.25, 2.0, 4.0)) -> dict[str, torch.Tensor]:
    """The four 0-d float32 scale buffers, in SCALE_BUFFERS order."""
    return {n: torch.tensor(v, dtype=torch.float32) for n, v in zip(A.SCALE_BUFFERS, values)}


def test_default_scales_equal_vllms_fill_without_writing_the_inputs():
    """set_default_scales gives 0-d float32 1.0 buffers equal to vLLM's in-place fill of
    the same buffers, as new tensors (declared buffers); the inputs keep their values
    and version counters."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    tensors = _buffers()
    before = {n: (t.clone(), t._version) for n, t in tensors.items()}
    out = A.set_default_scales.fn(tensors, CONFIG, CPU, {})
    theirs = types.SimpleNamespace(**{n: t.clone() for n, t in tensors.items()})
    set_default_quant_scales(theirs, register_buffer=False)
    assert set(A.SCALE_BUFFERS) == set(out.tensors) == set(out.buffers)
    for name in A.SCALE_BUFFERS:
        ours = out.tensors[name]
        assert (torch.float32, ()) == (ours.dtype, tuple(ours.shape))
        assert torch.equal(getattr(theirs, name), ours)
        copy, version = before[name]
        assert torch.equal(copy, tensors[name]) and version == tensors[name]._version
        assert ours.data_ptr() != tensors[name].data_ptr()


def test_scale_floats_read_the_buffers_then_the_record():
    """Without a record the floats are the buffers' values (and are recorded); with one
    they are the recorded values, whatever the buffers hold (a restore reads no bytes)."""
    fresh = A.set_scale_floats.fn(_buffers(), CONFIG, CPU, {})
    expected = {"_q_scale_float": 2.0, "_k_scale_float": 0.5, "_v_scale_float": 0.25}
    assert {**expected, "_prob_scale_float": 4.0} == dict(fresh.attrs) == dict(fresh.record)
    recorded = {k: 1.0 for k in A.SCALE_FLOATS}
    replayed = A.set_scale_floats.fn(_buffers(), CONFIG, CPU, recorded)
    assert recorded == dict(replayed.attrs)


def test_scale_floats_of_meta_buffers_are_none():
    """Meta buffers (a plan checked without data) give None floats, not an error."""
    meta = {n: t.to("meta") for n, t in _buffers().items()}
    out = A.set_scale_floats.fn(meta, CONFIG, CPU, {})
    assert dict.fromkeys(A.SCALE_FLOATS) == dict(out.attrs)


def test_host_copies_are_private_cpu_tensors():
    """_k_scale_cpu / _v_scale_cpu equal the buffers but own their storage (a restore
    never aliases the mapped bytes)."""
    tensors = _buffers()
    out = A.copy_host_scales.fn(tensors, CONFIG, CPU, {})
    assert set(A.HOST_COPIES) == set(out.attrs)
    for name in ("_k_scale", "_v_scale"):
        copy = out.attrs[f"{name}_cpu"]
        assert "cpu" == copy.device.type and torch.equal(tensors[name], copy)
        assert copy.data_ptr() != tensors[name].data_ptr()


@pytest.mark.parametrize("target", [CPU, Target("meta")], ids=["cpu", "meta"])
def test_kv_cache_placeholder_is_an_empty_cpu_tensor(target):
    """On a CPU target, and on a meta one (a meta-device build), the placeholder is an
    empty tensor on the CPU, replacing the meta tensor the build leaves."""
    out = A.alloc_kv_cache_placeholder.fn({}, CONFIG, target, {})
    placeholder = out.attrs["kv_cache"]
    assert ("cpu", 0) == (placeholder.device.type, placeholder.numel())
