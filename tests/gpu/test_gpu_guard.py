"""Issue 13 on the H200: cuda_vmm maps read-only (a write faults), cuda_ipc and copy
mode are guarded by the default content check (every write form caught, the daemon
invalidated), engines keep their weights when the daemon is SIGKILLed, and a view
outlives ``Attachment.close()``. Run: ``python -m pytest tests/gpu/test_gpu_guard.py -q``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

#: The repository root: the children import wcache (and its testing helpers) from it.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wcache.core import (
    LayerConfig,
    Plan,
    QuantSpec,
    RestoreWroteSharedTensor,
    StageOut,
    Tag,
    Target,
)
from wcache.shell import restore_
from wcache.store import ArenaInvalidated, CacheKey, attach, daemon_status, socket_path
from wcache.store.server import INVALIDATED_EXIT, INVALIDATED_LINGER_S
from wcache.testing.plans import UncheckedPlan, unregistered_stage
from wcache.testing.store import BASE_KEY, start_daemon, stop_daemon, synthetic_export

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = Target("cuda", (9, 0), frozenset())
# Seconds a child process may take (imports torch, initialises CUDA).
CHILD_TIMEOUT_S = 180
# A daemon exits INVALIDATED_LINGER_S after invalidate; this much more on a busy host.
EXIT_MARGIN_S = 30.0
TRANSPORTS = ("cuda_vmm", "cuda_ipc")
#: Every write form of issue 13 that works on a CUDA tensor (``.numpy()`` needs a host tensor).
WRITE_FORMS = {
    "inplace": lambda t: t.add_(1),
    "data_add": lambda t: t.data.add_(1),
    "data_setitem": lambda t: t.data.__setitem__((0,), 7),
    "storage_view": lambda t: (
        torch.empty(0, dtype=torch.uint8, device=t.device)
        .set_(t.untyped_storage())[t.storage_offset() * t.element_size()]
        .fill_(0x55)
    ),
}


@pytest.fixture
def sock_dir(tmp_path_factory, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    d = tempfile.mkdtemp(prefix="wcg-")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _device_id() -> str:
    from wcache.store.paths import cuda_device_uuid

    return cuda_device_uuid(0)


def _daemon(sock_dir: str, transport: str):
    return start_daemon(
        sock_dir, _device_id(), extra_args=("--device", "cuda:0", "--transport", transport)
    )


def _attach(sock_dir: str, mode: str = "zero_copy"):
    return attach(
        CacheKey(BASE_KEY), socket_dir=sock_dir, device="cuda:0", device_id=_device_id(), mode=mode
    )


def _child(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]),
        },
    )


def _config(name: str) -> LayerConfig:
    return LayerConfig(QuantSpec("toy"), size_k=1, size_n=1, name=name)


def _module(w: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(w, requires_grad=False)
    return m


def _writer(form: str) -> Plan:
    @unregistered_stage("toy.set_sneaky_write", Tag.METADATA, reads=("weight",))
    def sneaky(tensors, config, target, recorded):
        WRITE_FORMS[form](tensors["weight"])
        return StageOut()

    return UncheckedPlan("toy", "bad", (sneaky,), frozenset({"weight"}))


def _equal_export(att) -> list[str]:
    return [
        n for n, t in synthetic_export().tensors.items() if not torch.equal(t, att.tensors[n].cpu())
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transport_serves_bit_exact_zero_copy(sock_dir, transport):
    """Each CUDA transport serves every tensor bit-exact as views of one mapping, and says which served."""
    proc = _daemon(sock_dir, transport)
    try:
        assert transport == daemon_status(socket_path(sock_dir, _device_id()))["transport"]
        assert f"transport={transport}" in proc.ready_line
        with _attach(sock_dir) as att:
            assert (transport, transport == "cuda_ipc") == (att.transport, att.writable)
            assert [] == _equal_export(att)
            lo, hi = att.arena_range
            assert all(lo <= v.data_ptr() < hi for v in att.tensors.values() if v.numel())
    finally:
        stop_daemon(proc)


def test_vmm_write_faults_and_leaves_daemon_bytes(sock_dir):
    """A kernel writing a cuda_vmm (PROT_READ) mapping fails in that engine; the daemon's bytes stay intact."""
    proc = _daemon(sock_dir, "cuda_vmm")
    try:
        child = _child(f"""
            import torch
            from wcache.testing.store import BASE_KEY
            from wcache.store import CacheKey, attach
            from wcache.store.paths import cuda_device_uuid
            att = attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r}, device="cuda:0",
                         device_id=cuda_device_uuid(0))
            print("attached", att.transport, flush=True)
            att.tensors["layer0.weight"].add_(1)
            torch.cuda.synchronize()
            print("WROTE", flush=True)
        """)
        assert "attached cuda_vmm" in child.stdout, child.stderr[-3000:]
        assert "WROTE" not in child.stdout and 0 != child.returncode, (
            child.stdout + child.stderr[-3000:]
        )
        with _attach(sock_dir) as att:
            assert [] == _equal_export(att)
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("form", sorted(WRITE_FORMS))
def test_ipc_default_guard_catches_each_write_form_and_invalidates(sock_dir, form):
    """cuda_ipc zero-copy (writable): the default guard catches the write; invalidate refuses the next
    attach and the daemon exits for its supervisor."""
    proc = _daemon(sock_dir, "cuda_ipc")
    try:
        att = _attach(sock_dir)
        with pytest.raises(RestoreWroteSharedTensor, match="layer 'l0'") as err:
            restore_(
                _module(att.tensors["layer0.weight"]), _writer(form).bind(_config("l0"), CUDA), {}
            )
        assert att.invalidate(err.value.code, str(err.value))
        att.close()
        with pytest.raises(ArenaInvalidated):
            _attach(sock_dir)
        assert INVALIDATED_EXIT == proc.wait(INVALIDATED_LINGER_S + EXIT_MARGIN_S)
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("form", sorted(WRITE_FORMS))
def test_copy_mode_default_guard_catches_each_write_form(sock_dir, form):
    """Copy mode on CUDA (a private writable copy): the default guard catches each write form."""
    proc = _daemon(sock_dir, "cuda_vmm")
    try:
        with _attach(sock_dir, mode="copy") as att:
            assert att.writable
            with pytest.raises(RestoreWroteSharedTensor, match="layer 'l1'"):
                restore_(
                    _module(att.tensors["layer1.weight"]),
                    _writer(form).bind(_config("l1"), CUDA),
                    {},
                )
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkilled_daemon_leaves_engine_weights_and_restarts_cleanly(sock_dir, transport):
    """SIGKILL the daemon: the attached engine's weights stay readable and unchanged; a new daemon then
    starts on the same socket dir and serves."""
    proc = _daemon(sock_dir, transport)
    try:
        att = _attach(sock_dir)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        torch.cuda.synchronize()
        assert [] == _equal_export(att)
        assert [] == _equal_export(att)  # a second read after the daemon's context is gone
        att.close()
    finally:
        stop_daemon(proc)
    fresh = _daemon(sock_dir, transport)
    try:
        with _attach(sock_dir) as att:
            assert [] == _equal_export(att)
    finally:
        stop_daemon(fresh)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_view_outlives_close_on_cuda(sock_dir, transport):
    """att.close() with a view still held: the view stays readable and equal (the storage holds the mapping)."""
    proc = _daemon(sock_dir, transport)
    try:
        child = _child(f"""
            import gc, torch
            from wcache.testing.store import BASE_KEY, synthetic_export
            from wcache.store import CacheKey, attach
            from wcache.store.paths import cuda_device_uuid
            att = attach(CacheKey(BASE_KEY), socket_dir={sock_dir!r}, device="cuda:0",
                         device_id=cuda_device_uuid(0))
            t = att.tensors["layer0.weight"]
            att.close(); del att; gc.collect()
            print("equal" if torch.equal(t.cpu(), synthetic_export().tensors["layer0.weight"]) else "DIFFERENT")
        """)
        assert "equal" == child.stdout.strip(), child.stderr[-3000:]
    finally:
        stop_daemon(proc)
