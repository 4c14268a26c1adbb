"""Issue 13 on CPU: a view never outlives its mapping; the default restore guard
checks content where the mapping is writable (copy mode) and blames the layer
whose bytes changed; a client whose guard fires invalidates the daemon."""

import subprocess
import sys
import textwrap

import pytest
import torch

from wcache.core import (
    LayerConfig,
    Plan,
    QuantSpec,
    RestoreGuard,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
    stage,
)
from wcache.shell import restore_
from wcache.store import (
    ArenaInvalidated,
    CacheKey,
    attach,
    daemon_status,
    invalidate_daemon,
    socket_path,
)
from wcache.store.server import INVALIDATED_EXIT, INVALIDATED_LINGER_S
from wcache.testing.plans import UncheckedPlan, unregistered_stage
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon, synthetic_export

CPU = Target("cpu", None, frozenset())
# A daemon that was invalidated exits after INVALIDATED_LINGER_S; give a busy host this much more.
EXIT_MARGIN_S = 20.0


def _child(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=180
    )


def test_view_outlives_close_in_child(sock_dir):
    """att.close() with a view still held: the view stays readable (no SIGSEGV) and the
    mapping goes away only when the last view dies."""
    proc = start_daemon(sock_dir)
    try:
        child = _child(f"""
            import gc, sys
            from wcache.testing.store import BASE_KEY, count_arena_mappings, synthetic_export
            from wcache.store import CacheKey, attach
            att = attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r})
            t = att.tensors["layer0.weight"]
            att.close()
            want = synthetic_export().tensors["layer0.weight"]
            print("equal" if bool((t == want).all()) else "DIFFERENT", float(t.float().sum()) == float(want.float().sum()))
            print("mapped", count_arena_mappings())
            del t
            gc.collect()
            print("mapped", count_arena_mappings())
        """)
        assert 0 == child.returncode, child.stderr[-3000:]
        assert ["equal True", "mapped 1", "mapped 0"] == child.stdout.split("\n")[:3], child.stdout
    finally:
        stop_daemon(proc)


def test_copy_mode_is_writable_zero_copy_is_not(sock_dir):
    """The attachment says where a write would land: copy mode is writable, an shm zero-copy mapping is not."""
    proc = start_daemon(sock_dir)
    try:
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir) as zc:
            assert ("shm", False) == (zc.transport, zc.writable)
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir, mode="copy") as cp:
            assert ("shm", True) == (cp.transport, cp.writable)
    finally:
        stop_daemon(proc)


# --------------------------------------------------------------------------- content check

WRITE_FORMS = {
    "inplace": lambda t: t.add_(1),
    "data_add": lambda t: t.data.add_(1),
    "data_setitem": lambda t: t.data.__setitem__((0,), 7),
    "numpy_setitem": lambda t: t.numpy().__setitem__((0,), 7),
    "storage_view": lambda t: (
        torch.empty(0, dtype=torch.uint8)
        .set_(t.untyped_storage())[t.storage_offset() * t.element_size()]
        .fill_(0x55)
    ),
}


def _writer(form: str, victim: list):
    """A METADATA stage (mis-tagged: it writes) that writes ``victim[0]`` in one form
    (unregistered: tests/gpu/test_gpu_guard.py has its own under the same name)."""

    @unregistered_stage("toy.set_sneaky_write", Tag.METADATA, reads=("weight",))
    def sneaky(tensors, config, target, recorded):
        WRITE_FORMS[form](victim[0] if victim else tensors["weight"])
        return StageOut()

    return sneaky


def _bad_plan(form: str, victim: list) -> Plan:
    return UncheckedPlan("toy", "bad", (_writer(form, victim),), frozenset({"weight"}))


def _config(name: str) -> LayerConfig:
    return LayerConfig(QuantSpec("toy"), size_k=1, size_n=1, name=name)


def _module(weight: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight, requires_grad=False)
    return m


@pytest.mark.parametrize("form", sorted(WRITE_FORMS))
def test_default_guard_catches_every_write_form_in_copy_mode(sock_dir, form):
    """In copy mode (a writable mapping) the default guard (strict=False) catches each write form."""
    proc = start_daemon(sock_dir)
    try:
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir, mode="copy") as att:
            w = att.tensors["layer1.weight"]
            before = w.clone()
            plan = UncheckedPlan("toy", "bad", (_writer(form, []),), frozenset({"weight"}))
            with pytest.raises(RestoreWroteSharedTensor, match="layer 'l1'.*weight"):
                restore_(_module(w), plan.bind(_config("l1"), CPU), {})
            assert not torch.equal(
                before, w
            )  # the write landed (in the private copy) and was caught
    finally:
        stop_daemon(proc)


def test_untouched_restore_passes_default_guard():
    """A restore whose stages write nothing passes the default content check (no false alarm)."""

    @stage("toy.set_weight_width", Tag.METADATA, reads=("weight",), attrs=("width",))
    def width(tensors, config, target, recorded):
        return StageOut(attrs={"width": tensors["weight"].shape[1]})

    m = _module(torch.arange(12, dtype=torch.float16).reshape(3, 4))
    restore_(m, Plan("toy", "ok", (width,), frozenset({"weight"})).bind(_config("l"), CPU), {})
    assert 4 == m.width


def test_cross_layer_write_blames_the_written_layer():
    """Two layers in one arena (views of one storage, one version counter): a stage of layer A that
    writes layer B through .data is caught and layer B's tensor is named, not A's."""
    arena = torch.zeros(4096, dtype=torch.uint8)
    a = arena[:1024].view(torch.float16).reshape(16, 32)
    b = arena[2048:3072].view(torch.float16).reshape(16, 32)
    b_ = b  # reached by the bad stage through a global, as real bugs do
    guard = RestoreGuard({"A": {"weight": a}, "B": {"weight": b}})
    plan = UncheckedPlan("toy", "bad", (_writer("data_add", [b_]),), frozenset({"weight"}))
    with pytest.raises(RestoreWroteSharedTensor) as err:
        restore_(_module(a), plan.bind(_config("A"), CPU), {}, guard=guard)
        guard.check_all()
    assert "layer 'B' tensors ['weight']" in str(err.value)
    assert "layer 'A' tensors" not in str(err.value)


def test_deferred_guard_blames_own_layer_and_later_write():
    """Deferred mode (one device-to-host copy per restore): a layer that rewrote its own bytes is named
    as such; a write into an earlier layer is named as written after its restore."""
    arena = torch.zeros(8192, dtype=torch.uint8)
    a = arena[:1024].view(torch.float16)
    b = arena[2048:3072].view(torch.float16)
    guard = RestoreGuard({"A": {"weight": a}, "B": {"weight": b}}, defer=True)
    restore_(
        _module(a), _bad_plan("data_add", []).bind(_config("A"), CPU), {}, guard=guard
    )  # no raise yet
    with pytest.raises(
        RestoreWroteSharedTensor, match="while their own layer was restored: layer 'A'"
    ):
        guard.check_all()
    guard = RestoreGuard({"A": {"weight": a}, "B": {"weight": b}}, defer=True)
    guard.check_layer("A", ())
    restore_(_module(b), _bad_plan("data_add", [a]).bind(_config("B"), CPU), {}, guard=guard)
    with pytest.raises(RestoreWroteSharedTensor, match="during the restore: layer 'A'"):
        guard.check_all()


def test_inplace_cross_layer_write_names_stage_and_victim():
    """A tracked in-place write from A's stage into B: the stage that ran is blamed and B named as written."""
    arena = torch.zeros(4096, dtype=torch.uint8)
    a = arena[:1024].view(torch.float16)
    b = arena[2048:3072].view(torch.float16)
    guard = RestoreGuard({"A": {"weight": a}, "B": {"weight": b}})
    plan = UncheckedPlan("toy", "bad", (_writer("inplace", [b]),), frozenset({"weight"}))
    with pytest.raises(RestoreWroteSharedTensor) as err:
        restore_(_module(a), plan.bind(_config("A"), CPU), {}, guard=guard)
    msg = str(err.value)
    assert "stage 'toy.set_sneaky_write'" in msg and "layer 'B' tensors ['weight']" in msg, msg


def test_data_swap_is_caught_by_pointer():
    """A stage that swaps a shared tensor's .data (same shape and values) fails purity by data pointer."""

    @stage("toy.set_swapped_data", Tag.METADATA, reads=("weight",))
    def swap(tensors, config, target, recorded):
        tensors["weight"].data = tensors["weight"].data.clone()
        return StageOut()

    m = _module(torch.ones(4, 4))
    with pytest.raises(RestoreWroteSharedTensor, match="weight"):
        plan = UncheckedPlan("toy", "swap", (swap,), frozenset({"weight"}))
        restore_(m, plan.bind(_config("l"), CPU), {}, content=False)


# --------------------------------------------------------------------------- invalidate


def _wait_exit(proc, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_invalidate_refuses_attaches_shows_status_and_exits(sock_dir):
    """invalidate (a direct protocol call): later attaches are refused with arena-invalidated,
    status shows who and why, and the daemon exits with INVALIDATED_EXIT."""
    proc = start_daemon(sock_dir)
    sock = socket_path(sock_dir, "cpu")
    try:
        assert invalidate_daemon(sock, CacheKey(BASE_KEY), "guard-failed", "layer l1 rewritten")
        st = daemon_status(sock)
        assert ("guard-failed", "layer l1 rewritten") == (
            st["invalidated"]["code"],
            st["invalidated"]["message"],
        )
        with pytest.raises(ArenaInvalidated) as err:
            attach(CacheKey(BASE_KEY), socket_dir=sock_dir)
        assert "arena-invalidated" == err.value.code
        assert INVALIDATED_EXIT == _wait_exit(proc, INVALIDATED_LINGER_S + EXIT_MARGIN_S)
    finally:
        stop_daemon(proc)


def test_invalidate_of_another_key_is_refused(sock_dir):
    """A client cannot invalidate a daemon of another key: it keeps serving."""
    proc = start_daemon(sock_dir)
    sock = socket_path(sock_dir, "cpu")
    try:
        assert not invalidate_daemon(
            sock, CacheKey({**BASE_KEY, "dtype": "float16"}), "guard-failed", "x"
        )
        assert daemon_status(sock)["invalidated"] is None
        with attach(CacheKey(BASE_KEY), socket_dir=sock_dir) as att:
            assert torch.equal(synthetic_export().tensors["q"], att.tensors["q"])
    finally:
        stop_daemon(proc)


def test_guard_firing_in_copy_mode_invalidates_the_daemon(sock_dir):
    """The client flow: a mis-tagged stage writes in copy mode, the default guard fires, the client
    invalidates; the daemon refuses the next attach and exits for its supervisor."""
    proc = start_daemon(sock_dir)
    try:
        att = attach(CacheKey(BASE_KEY), socket_dir=sock_dir, mode="copy")
        plan = UncheckedPlan("toy", "bad", (_writer("numpy_setitem", []),), frozenset({"weight"}))
        try:
            restore_(_module(att.tensors["layer2.weight"]), plan.bind(_config("l2"), CPU), {})
        except RestoreWroteSharedTensor as e:
            assert att.invalidate(e.code, str(e))
        att.close()
        with pytest.raises(ArenaInvalidated):
            attach(CacheKey(BASE_KEY), socket_dir=sock_dir)
        assert INVALIDATED_EXIT == _wait_exit(proc, INVALIDATED_LINGER_S + EXIT_MARGIN_S)
    finally:
        stop_daemon(proc)
