"""/dev/shm preflight: what wcache starts there is checked before any work, and a
small or missing /dev/shm is ``shm-too-small`` naming the sizes and the fix
(simulated with a patched ``os.statvfs``; CPU only)."""

import os
import socket
import threading
from types import SimpleNamespace

import pytest

from wcache import cli
from wcache.store import CacheKey, attach, paths
from wcache.store.errors import ShmTooSmall
from wcache.store.protocol import PROTOCOL_VERSION, recv_frame, send_frame
from wcache.testing.store import BASE_KEY

MIB = 1 << 20
#: Docker's default /dev/shm (64 MiB), nearly empty.
DOCKER_DEFAULT = SimpleNamespace(
    f_bavail=64 * MIB // 4096, f_frsize=4096, f_blocks=64 * MIB // 4096
)


@pytest.fixture
def small_shm(monkeypatch):
    """os.statvfs reports Docker's default 64 MiB /dev/shm; other paths are untouched."""
    real = os.statvfs

    def statvfs(path):
        return DOCKER_DEFAULT if os.fspath(path) == paths.DEV_SHM else real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_small_dev_shm_is_refused_with_sizes_and_fix(small_shm):
    """64 MiB free is refused for collectives, naming need, free space and --shm-size; enough passes."""
    with pytest.raises(ShmTooSmall) as info:
        paths.check_dev_shm(paths.DEV_SHM_COLLECTIVES_BYTES, "seeding over NCCL")
    msg = str(info.value)
    assert "shm-too-small" == info.value.code
    assert "seeding over NCCL needs 128 MiB free in /dev/shm, which has 64.0 MiB free" in msg
    assert "--shm-size" in msg
    assert 64 * MIB == paths.check_dev_shm(paths.DEV_SHM_REFCOUNT_BYTES, "cuda_ipc ref counters")


def test_missing_dev_shm_is_refused(tmp_path):
    """A /dev/shm that does not exist is shm-too-small, not an OSError traceback."""
    with pytest.raises(ShmTooSmall, match="cannot be used"):
        paths.check_dev_shm(1, "x", path=str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "device,world,seeding,expected",
    [
        ("cpu", 1, False, []),
        ("cpu", 1, True, []),  # gloo over TCP
        ("cpu", 2, False, [paths.DEV_SHM_COLLECTIVES_BYTES]),
        ("cuda", 1, False, [paths.DEV_SHM_REFCOUNT_BYTES]),
        ("cuda", 1, True, [paths.DEV_SHM_COLLECTIVES_BYTES, paths.DEV_SHM_REFCOUNT_BYTES]),
        ("cuda", 4, False, [paths.DEV_SHM_COLLECTIVES_BYTES, paths.DEV_SHM_REFCOUNT_BYTES]),
    ],
)
def test_serve_asks_for_dev_shm_where_its_backends_need_it(device, world, seeding, expected):
    """shm_needs: CPU TP/PP and NCCL (ranks, seeding) need the collectives' size; CUDA the ref counters'."""
    from wcache.daemon.serve import shm_needs

    assert expected == [need for need, _ in shm_needs(device, world, seeding)]


@pytest.mark.slow
def test_serve_with_two_cpu_ranks_refuses_a_small_dev_shm_before_any_work(
    small_shm, monkeypatch, capsys
):
    """`wcache serve -tp 2` on CPU with a 64 MiB /dev/shm: one [shm-too-small] line; no rank starts."""
    import wcache.daemon.serve as serve
    from wcache.testing.fixtures import build

    def never(*a, **k):
        pytest.fail("a rank started")

    monkeypatch.setattr(serve, "serve_rank", never)
    monkeypatch.setattr(serve, "_serve_ranks", never)
    assert 1 == cli.main(["serve", "--model", str(build("bf16")), "--tensor-parallel-size", "2"])
    err = capsys.readouterr().err
    assert err.startswith("wcache serve: error [shm-too-small]: wcache serve: 2 ranks (vLLM CPU ")
    assert 1 == len(err.splitlines())


def test_attach_over_cuda_ipc_checks_dev_shm_before_get(small_shm, monkeypatch, sock_dir):
    """A daemon announcing cuda_ipc with /dev/shm full: attach raises shm-too-small before asking get."""
    monkeypatch.setattr(
        os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096, f_blocks=16)
    )
    path = paths.socket_path(sock_dir, "gpu-test")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, paths.FILE_MODE)
    listener.listen(1)
    asked = []

    def serve():
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn)
            send_frame(
                conn,
                {
                    "ok": True,
                    "protocol": PROTOCOL_VERSION,
                    "wcache": "t",
                    "pid": os.getpid(),
                    "device": "cuda",
                    "device_id": "gpu-test",
                    "device_uuid": "GPU-x",
                    "transport": "cuda_ipc",
                },
            )
            conn.settimeout(2.0)
            try:
                asked.append(recv_frame(conn)[0].get("op"))
            except Exception:  # noqa: BLE001  (closed without another request: expected)
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with pytest.raises(ShmTooSmall, match="attaching over cuda_ipc"):
        attach(CacheKey(BASE_KEY), socket_dir=sock_dir, device="cuda:0", device_id="gpu-test")
    thread.join()
    listener.close()
    assert "get" not in asked
