"""A CPU daemon leaves none of vLLM's shared-memory collective segments in /dev/shm
(:func:`wcache.vllm.build.unlink_cpu_shm_names`; break pass 12 #4). The real TP=2
daemon's check is in tests/e2e/test_multirank_e2e.py."""

from __future__ import annotations

import os

from wcache.vllm.build import unlink_cpu_shm_names


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
