"""Copy on write on an attached CPU arena (weight updates on a restored engine):
after ``allow_private_writes_`` a write lands in this process's own page, the
daemon's bytes and other attachments never see it."""

import pytest
import torch

from wcache.store import StoreError, attach
from wcache.testing.store import mapping_of, synthetic_export


def test_mapping_is_read_only_until_armed_then_private_writable(daemon, key, sock_dir):
    """The arena is mapped r--p; allow_private_writes_ makes it rw-p (never shared-writable)."""
    with attach(key, socket_dir=sock_dir) as att:
        lo, _ = att.arena_range
        assert ("r--p", False) == (mapping_of(lo)[0], att.copy_on_write)
        assert att.allow_private_writes_() is True
        assert ("rw-p", True) == (mapping_of(lo)[0], att.copy_on_write)


def test_private_write_is_seen_here_only(daemon, key, sock_dir):
    """A write after arming changes this attachment's tensor; a second attachment and the daemon keep the old bytes."""
    export = synthetic_export()
    with attach(key, socket_dir=sock_dir) as mine:
        mine.allow_private_writes_()
        mine.tensors["w0"].fill_(7)
        assert torch.equal(torch.full_like(export.tensors["w0"], 7), mine.tensors["w0"])
        assert torch.equal(mine.tensors["w0"], mine.tensors["lm_head.weight"])  # tied alias follows
        assert torch.equal(export.tensors["q"], mine.tensors["q"])  # untouched tensors unchanged
        with attach(key, socket_dir=sock_dir) as other:
            assert torch.equal(export.tensors["w0"], other.tensors["w0"])
    with attach(key, socket_dir=sock_dir) as later:
        assert torch.equal(export.tensors["w0"], later.tensors["w0"])


def test_release_ranges_after_arming_is_refused(daemon, key, sock_dir):
    """Dropping pages after arming would discard private writes: cow-armed, and the write survives."""
    with attach(key, socket_dir=sock_dir) as att:
        att.allow_private_writes_()
        att.tensors["q"].fill_(3)
        with pytest.raises(StoreError) as info:
            att.release_ranges_(["q"])
        assert "cow-armed" == info.value.code
        assert bool((att.tensors["q"] == 3).all())


def test_copy_mode_is_private_already(daemon, key, sock_dir):
    """A copy-mode attachment needs no arming: allow_private_writes_ is True and changes nothing."""
    with attach(key, socket_dir=sock_dir, mode="copy") as att:
        assert att.allow_private_writes_() is True and att.copy_on_write is False
