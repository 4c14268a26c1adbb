"""A CPU daemon leaves none of vLLM's shared-memory collective segments in /dev/shm
(:func:`wcache.vllm.build.unlink_cpu_shm_names`; break pass 12 #4), nor its group
message queues' ring buffers (:func:`wcache.vllm.compat.unlink_broadcaster_shm`; break
pass 13 #2). The real TP=2 daemon's checks are in tests/e2e/test_multirank_e2e.py."""

from __future__ import annotations

import gc
import os
import types

import pytest

from wcache.vllm.build import unlink_cpu_shm_names
from wcache.vllm.compat import unlink_broadcaster_shm


def test_only_this_instances_segments_are_unlinked(tmp_path):
    """The names vLLM's ``_CPUSHMDistributed`` gives the instance (every group, every
    rank) go; another instance's, a longer ident with the same start, and names that
    only look alike stay."""
    ours = ["34471-tp:0-[0-1]-cpushm_0", "34471-tp:0-[0-1]-cpushm_1", "34471-world-[0-1]-cpushm_1"]
    others = [
        "34472-tp:0-[0-1]-cpushm_0",  # another daemon's port
        "344711-tp:0-[0-1]-cpushm_0",  # an ident that only starts the same
        "34471-tp:0-[0-1]-cpushm_x",  # not a rank
        "34471-arena",  # not a collective
        "vllm_dist_4279cc3d-tp:0-[0-1]-cpushm_0",  # an engine's
    ]
    for name in ours + others:
        (tmp_path / name).write_bytes(b"\0")
    assert sorted(unlink_cpu_shm_names("34471", str(tmp_path))) == sorted(ours)
    assert sorted(os.listdir(tmp_path)) == sorted(others)
    assert unlink_cpu_shm_names("34471", str(tmp_path)) == []  # another rank was first


def test_no_shm_directory_unlinks_nothing(tmp_path):
    assert unlink_cpu_shm_names("34471", str(tmp_path / "absent")) == []


@pytest.fixture
def groups(monkeypatch):
    """vLLM's group registry (``parallel_state._groups``), emptied for the test: the
    groups a test registers hold real ``ShmRingBuffer`` objects."""
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state

    registry: dict = {}
    monkeypatch.setattr(parallel_state, "_groups", registry)
    return registry


def _ring(**kw):
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    return ShmRingBuffer(n_reader=1, max_chunk_bytes=4096, max_chunks=2, **kw)


def test_the_creators_ring_name_goes_and_its_memory_stays(groups):
    """The ring this rank created loses its /dev/shm name; its mapping still reads and
    writes; a reader's ring (a second rank's view) is left alone; the creator's
    ``__del__`` then unlinks nothing (no error at exit)."""
    created = _ring()
    reader = _ring(name=created.shared_memory.name)
    name = created.shared_memory.name
    keep = [
        types.SimpleNamespace(mq_broadcaster=types.SimpleNamespace(buffer=created)),
        types.SimpleNamespace(mq_broadcaster=types.SimpleNamespace(buffer=reader)),
        types.SimpleNamespace(mq_broadcaster=None),  # a group without a queue
        types.SimpleNamespace(mq_broadcaster=types.SimpleNamespace(buffer=None)),  # remote
    ]
    groups.update({f"g{i}": (lambda g=g: g) for i, g in enumerate(keep)})  # as weakrefs are
    groups["gone"] = lambda: None  # a group already collected
    assert os.path.exists(f"/dev/shm/{name}")
    assert unlink_broadcaster_shm() == [name]
    assert not os.path.exists(f"/dev/shm/{name}")
    created.shared_memory.buf[0] = 7
    assert reader.shared_memory.buf[0] == 7  # the same memory, still shared
    assert (created.is_creator, reader.is_creator) == (False, False)
    assert unlink_broadcaster_shm() == []  # nothing left to unlink
    del keep, created, reader
    gc.collect()  # __del__ closes; it raised FileNotFoundError had is_creator stayed True


def test_a_ring_another_rank_unlinked_is_skipped(groups):
    created = _ring()
    groups["tp"] = lambda: types.SimpleNamespace(
        mq_broadcaster=types.SimpleNamespace(buffer=created)
    )
    created.shared_memory.unlink()
    assert unlink_broadcaster_shm() == []
    assert created.is_creator is False
