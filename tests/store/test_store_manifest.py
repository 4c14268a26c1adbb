"""Export, CacheKey, Manifest and arena layout: values, validation, views."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wcache.core import WcacheError
from wcache.store import CacheKey, Export, KeyMismatch, ProtocolError, StoreError
from wcache.store.arena import CPU_ALIGNMENT, make_manifest, plan_layout, tensor_views
from wcache.store.manifest import MANIFEST_FORMAT_VERSION, Manifest, canonical_json
from wcache.testing.store import synthetic_export, synthetic_tensors


def _arena_from(export, key):
    """Lay out and fill a private (non-shm) arena the way the builders do."""
    from wcache.store.arena import _fill

    blocks, placed, nbytes = plan_layout(export.tensors, CPU_ALIGNMENT)
    manifest = make_manifest(export, key, "cpu", CPU_ALIGNMENT, placed, nbytes)
    base = torch.zeros(nbytes, dtype=torch.uint8)
    _fill(base, export, blocks)
    return base, manifest


def test_cache_key_is_order_independent_and_digest_stable():
    """Two keys with the same fields in another order are equal, hash equal and share a digest."""
    a = CacheKey({"b": 1, "a": [1, 2], "c": {"y": 1, "x": 2}})
    b = CacheKey({"c": {"x": 2, "y": 1}, "a": (1, 2), "b": 1})
    assert a == b and hash(a) == hash(b)
    assert a.digest == b.digest and len(a.digest) == 64
    assert CacheKey.from_json(a.to_json()) == a


def test_cache_key_diff_names_changed_added_and_removed_fields():
    """diff lists, sorted, every field that differs or exists on one side only."""
    a = CacheKey({"checkpoint": "x", "dtype": "bf16", "tp": 1, "only_a": 0})
    b = CacheKey({"checkpoint": "y", "dtype": "bf16", "tp": 2, "only_b": 0})
    assert ["checkpoint", "only_a", "only_b", "tp"] == a.diff(b)
    assert [] == a.diff(CacheKey(a.fields))


def test_describe_diff_caps_the_checkpoint_config_and_names_an_echoed_field_once():
    """Two models' keys differ in dozens of hf_config entries, twice (hf_text_config
    repeats a text model's hf_config): the message names three of the config's leaves,
    counts the rest, and names the repeating field once (it was one line of ~4 KB);
    every other field's leaves are all named."""
    cfg_a = {f"k{i:02d}": i for i in range(40)}
    cfg_b = {f"k{i:02d}": -i for i in range(40)}
    a = CacheKey(
        {
            "model_config.hf_config": cfg_a,
            "model_config.hf_text_config": cfg_a,
            "dtype": "bfloat16",
        }
    )
    b = CacheKey(
        {
            "model_config.hf_config": cfg_b,
            "model_config.hf_text_config": cfg_b,
            "dtype": "float16",
        }
    )
    assert a.describe_diff(b) == (
        'dtype: engine="bfloat16" daemon="float16"; '
        "model_config.hf_config.k01: engine=1 daemon=-1; "
        "model_config.hf_config.k02: engine=2 daemon=-2; "
        "model_config.hf_config.k03: engine=3 daemon=-3; "
        "model_config.hf_config: 36 more differ; "
        "model_config.hf_text_config: as model_config.hf_config"
    )
    # any other field names every leaf: a kernel decision is never counted away
    kernels_a = {f"op{i:02d}": "onednn" for i in range(12)}
    kernels_b = {f"op{i:02d}": "torch_linear" for i in range(12)}
    t = CacheKey({"target": {"kernels": kernels_a}}).describe_diff(
        CacheKey({"target": {"kernels": kernels_b}})
    )
    assert 'target.kernels.op11: engine="onednn" daemon="torch_linear"' in t
    assert "more differ" not in t
    # a repeating field that differs otherwise is named in full
    c = CacheKey({**b.fields, "model_config.hf_text_config": {**cfg_b, "k01": 7}})
    assert "model_config.hf_text_config.k01: engine=1 daemon=7" in a.describe_diff(c)
    assert "as model_config.hf_config" not in a.describe_diff(c)


@pytest.mark.parametrize(
    "fields", [{"x": float("nan")}, {"x": object()}, {1: "a"}, ["not", "a", "map"]]
)
def test_cache_key_rejects_non_json(fields):
    """Non-JSON values, NaN and non-str keys are refused with a StoreError."""
    with pytest.raises(StoreError):
        CacheKey(fields)


def test_cache_key_fields_copy_does_not_change_key():
    """Mutating the returned fields leaves the key unchanged (the key is frozen)."""
    k = CacheKey({"a": [1]})
    f = k.fields
    f["a"].append(2)
    assert {"a": [1]} == k.fields


def test_store_errors_have_reason_codes_and_roots():
    """Every store error subclasses WcacheError and carries its documented reason code."""
    from wcache.store import errors as e

    expected = {
        e.DaemonMissing: "daemon-missing",
        e.KeyMismatch: "key-mismatch",
        e.TransportFailed: "transport-failed",
        e.ProtocolError: "protocol-error",
        e.DaemonBusy: "daemon-busy",
        e.Released: "released",
    }
    for cls, code in expected.items():
        assert issubclass(cls, WcacheError) and issubclass(cls, RuntimeError)
        assert code == cls("x").code
    assert issubclass(KeyMismatch, ValueError) and issubclass(ProtocolError, ValueError)
    assert ["a", "b"] == KeyMismatch("x", fields=["b", "a"]).fields


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tensors={"a": torch.zeros(2)}, kinds={"a": "weight"}), "kind"),
        (
            dict(tensors={"a": torch.zeros(2)}, kinds={"a": "param"}, aliases={"b": "missing"}),
            "target",
        ),
        (
            dict(tensors={"a": torch.zeros(2)}, kinds={"a": "param"}, aliases={"a": "a"}),
            "also a canonical",
        ),
        (dict(tensors={"a": torch.zeros(2, device="meta")}, kinds={"a": "param"}), "meta"),
        (
            dict(tensors={"a": torch.zeros(2)}, kinds={"a": "param"}, nonpersistent={"a"}),
            "non-persistent",
        ),
        (
            dict(
                tensors={"a": torch.zeros(2)}, kinds={"a": "param"}, layers={"l": {"x": object()}}
            ),
            "layers",
        ),
    ],
)
def test_export_rejects_bad_inputs(kw, needle):
    """Each bad export raises a StoreError naming the problem."""
    with pytest.raises(StoreError, match=needle):
        Export(**kw)


def test_layout_is_page_aligned_and_shares_storage_once():
    """Blocks start on page boundaries; tensors viewing one storage are stored once."""
    tensors = synthetic_tensors()
    blocks, placed, nbytes = plan_layout(tensors, CPU_ALIGNMENT)
    assert all(b.offset % CPU_ALIGNMENT == 0 for b in blocks)
    assert 0 == nbytes % CPU_ALIGNMENT
    # "base" and "w0_t" share one storage: same offset, one block for both.
    assert placed["base"][0] == placed["w0_t"][0]
    assert len(blocks) == len(tensors) - 2  # minus the shared view and the empty tensor
    assert (0, 0) == placed["empty"]


def test_views_rebuild_every_tensor_bit_exact_with_strides():
    """tensor_views gives back each tensor bit for bit, with its shape, stride and dtype; aliases are the same object."""
    export = synthetic_export()
    base, manifest = _arena_from(export, CacheKey({"k": 1}))
    views = tensor_views(base, manifest)
    for name, t in export.tensors.items():
        v = views[name]
        assert (t.shape, t.stride(), t.dtype) == (v.shape, v.stride(), v.dtype), name
        assert torch.equal(t, v), name
        assert v.untyped_storage().data_ptr() == base.data_ptr(), name
    assert views["lm_head.weight"] is views["w0"]


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    perm_seed=st.integers(0, 100),
    step=st.integers(1, 3),
    dtype=st.sampled_from(
        [
            torch.float32,
            torch.bfloat16,
            torch.int8,
            torch.int64,
            torch.float8_e4m3fn,
            torch.bool,
            torch.uint8,
        ]
    ),
)
def test_views_roundtrip_any_strided_tensor(shape, perm_seed, step, dtype):
    """Any permuted, sliced view of any dtype survives layout + fill + views bit-exactly with its strides."""
    full = torch.randint(0, 255, [s * step for s in shape] or [], dtype=torch.uint8)
    t = full.view(dtype) if dtype.itemsize == 1 else full.to(torch.float32).to(dtype)
    if shape:
        t = t[tuple(slice(None, None, step) for _ in shape)]
        perm = torch.randperm(
            len(shape), generator=torch.Generator().manual_seed(perm_seed)
        ).tolist()
        t = t.permute(perm)
    export = Export({"t": t, "pad": torch.ones(3)}, {"t": "param", "pad": "buffer"})
    base, manifest = _arena_from(export, CacheKey({"k": 1}))
    v = tensor_views(base, manifest)["t"]
    assert (t.shape, t.stride(), t.dtype) == (v.shape, v.stride(), v.dtype)
    assert torch.equal(
        t.view(torch.uint8) if dtype.itemsize == 1 else t,
        v.view(torch.uint8) if dtype.itemsize == 1 else v,
    )


def test_manifest_json_roundtrip_and_version_check():
    """A manifest survives JSON; another format version is refused with a ProtocolError."""
    _, m = _arena_from(synthetic_export(), CacheKey({"k": 1}))
    assert m == Manifest.from_json(m.to_json())
    d = json.loads(m.to_json())
    d["format_version"] = MANIFEST_FORMAT_VERSION + 1
    with pytest.raises(ProtocolError, match="format"):
        Manifest.from_dict(d)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["tensors"][0].__setitem__(1, d["arena_nbytes"]), "outside the arena"),
        (lambda d: d["tensors"][0].__setitem__(3, "float99"), "unknown dtype"),
        (lambda d: d["tensors"][0].__setitem__(2, 1), "span"),
        (lambda d: d["aliases"][0].__setitem__(1, "nope"), "unknown target"),
        (lambda d: d.pop("tensors"), "malformed"),
        (lambda d: d["tensors"][0].__setitem__(4, "notalist"), "do not fit"),
        (lambda d: d["tensors"][0].__setitem__(4, 7), "malformed"),
    ],
)
def test_manifest_rejects_inconsistent_entries(mutate, needle):
    """A manifest whose entries leave the arena, use unknown dtypes or targets, or miss fields is refused."""
    _, m = _arena_from(synthetic_export(), CacheKey({"k": 1}))
    d = json.loads(m.to_json())
    mutate(d)
    with pytest.raises(ProtocolError, match=needle):
        Manifest.from_dict(d)


def test_canonical_json_sorted_and_compact():
    """canonical_json sorts keys and drops spaces (so digests do not depend on order)."""
    assert '{"a":[1,2],"b":{"c":null}}' == canonical_json({"b": {"c": None}, "a": (1, 2)})


@pytest.mark.parametrize("index, value", [(0, 5), (1, "0"), (2, 1.5), (6, ["param"]), (7, "yes")])
def test_manifest_rejects_wrong_field_types(index, value):
    """Entries with fields of the wrong JSON type (a number for a name, a string offset, ...) are refused."""
    _, m = _arena_from(synthetic_export(), CacheKey({"k": 1}))
    d = json.loads(m.to_json())
    d["tensors"][0][index] = value
    with pytest.raises(ProtocolError):
        Manifest.from_dict(d)
