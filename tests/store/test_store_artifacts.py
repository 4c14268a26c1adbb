"""Start-up artifact bundles (wcache.store.artifacts, issue 24 item 3): packing,
the ``artifacts`` command (fd passing, missing bundle, bad frames), atomic
installs that never overwrite, snapshot files, and the lean server serving them."""

from __future__ import annotations

import fcntl
import os
import socket
import time

import pytest

from wcache.store import artifacts as art
from wcache.store import daemon_status, paths
from wcache.store.client import Connection, fetch_artifacts
from wcache.store.errors import ArtifactsCorrupt, ArtifactsMissing, ProtocolError
from wcache.store.protocol import recv_frame, send_frame
from wcache.testing.store import start_daemon, stop_daemon

FACTORS = {
    "vllm": "0.32.0",
    "torch": "2.13",
    "triton": None,
    "device": "cpu:x86_64",
    "capability": None,
    "env_hash": "e" * 64,
    "config_hash": "c" * 10,
    "aot_hash": "a" * 64,
}
AOT = "torch_compile_cache/torch_aot_compile/" + "a" * 64


def _cache_tree(root):
    """A priming run's private caches: one AOT hash dir, one model-info file, one Triton entry."""
    hash_dir = root / "vllm" / AOT
    (hash_dir / "rank_0_0").mkdir(parents=True)
    (hash_dir / "rank_0_0" / "model").write_bytes(b"compiled-fn" * 100)
    (hash_dir / "inductor_cache" / "fx").mkdir(parents=True)
    (hash_dir / "inductor_cache" / "fx" / "k.py").write_text("kernel = 1\n")
    (root / "vllm" / "modelinfos").mkdir(parents=True)
    (root / "vllm" / "modelinfos" / "llama.json").write_text("{}")
    (root / "triton" / "abc").mkdir(parents=True)
    (root / "triton" / "abc" / "k.so").write_bytes(b"\x7fELF" + bytes(60))
    return {"vllm": root / "vllm", "triton": root / "triton"}


@pytest.fixture
def bundle(tmp_path):
    dirs = _cache_tree(tmp_path / "src")
    b = art.pack_bundle(
        dirs, [("vllm", AOT), ("vllm", "modelinfos/llama.json"), ("triton", "abc")], FACTORS
    )
    yield b
    b.close()


def _tree(root):
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_pack_records_every_file_with_its_digest_and_seals_the_memfd(bundle):
    """The manifest lists each file with bytes and blake3; the memfd is sealed against writes and holds the tar."""
    files = {f["path"]: f["nbytes"] for f in bundle.manifest["files"]}
    assert files == {
        f"vllm/{AOT}/rank_0_0/model": 1100,
        f"vllm/{AOT}/inductor_cache/fx/k.py": 11,
        "vllm/modelinfos/llama.json": 2,
        "triton/abc/k.so": 64,
    }
    assert bundle.nbytes == 1177
    assert fcntl.fcntl(bundle.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
    assert os.fstat(bundle.fd).st_size == bundle.tar_nbytes
    assert dict(bundle.manifest["factors"]) == FACTORS


def test_install_into_empty_caches_reproduces_the_tree(bundle, tmp_path):
    """Into empty caches every entry is installed, byte for byte, and no temp dir is left."""
    src = _tree(tmp_path / "src")
    dests = {"vllm": tmp_path / "dst" / "vllm", "triton": tmp_path / "dst" / "triton"}
    result = art.install_bundle(bundle, dests)
    assert result.installed == (f"vllm/{AOT}", "vllm/modelinfos/llama.json", "triton/abc")
    assert result.skipped == () and result.nbytes == 1177
    assert _tree(tmp_path / "dst") == src
    assert not [p for p in (tmp_path / "dst").rglob(".wcache-startup-*")]


def test_install_never_overwrites_an_existing_entry(bundle, tmp_path):
    """An entry the engine's cache already has is skipped and left exactly as it was; the others are installed."""
    dests = {"vllm": tmp_path / "dst" / "vllm", "triton": tmp_path / "dst" / "triton"}
    mine = dests["vllm"] / AOT / "rank_0_0" / "model"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"the engine's own")
    result = art.install_bundle(bundle, dests)
    assert result.skipped == (f"vllm/{AOT}",)
    assert result.installed == ("vllm/modelinfos/llama.json", "triton/abc")
    assert mine.read_bytes() == b"the engine's own"
    assert sorted(p.name for p in (dests["vllm"] / AOT).iterdir()) == ["rank_0_0"]


def test_install_refuses_a_member_whose_digest_differs(bundle, tmp_path):
    """A file whose bytes differ from the manifest's blake3 fails with artifacts-corrupt and leaves nothing of that entry."""
    manifest = dict(bundle.manifest)
    manifest["files"] = [
        dict(f, blake3="0" * 64) if f["path"].endswith("k.so") else f for f in manifest["files"]
    ]
    bad = art.Bundle(os.dup(bundle.fd), manifest)
    dests = {"triton": tmp_path / "dst" / "triton"}
    with pytest.raises(ArtifactsCorrupt, match="k.so: blake3"):
        art.install_bundle(bad, dests)
    assert list(dests["triton"].iterdir()) == []
    bad.close()


@pytest.mark.parametrize(
    "root, rel, match",
    [
        ("vllm", "../etc", "not a plain relative path"),
        ("vllm", "/abs", "not a plain relative path"),
        ("home", "x", "unknown cache root"),
    ],
)
def test_pack_refuses_entries_outside_their_root(tmp_path, root, rel, match):
    """Entry paths that escape their root, or an unknown root, are refused with artifacts-corrupt."""
    with pytest.raises(ArtifactsCorrupt, match=match):
        art.pack_bundle({"vllm": tmp_path, "home": tmp_path}, [(root, rel)], FACTORS)


def test_snapshot_files_round_trip_and_a_changed_tar_is_refused(bundle, tmp_path):
    """write_bundle/read_bundle keep manifest and bytes; an absent bundle is None; a changed tar is artifacts-corrupt."""
    d = tmp_path / "snap" / ".startup" / "tp0of1-pp0of1-dp0of1"
    assert art.read_bundle(d) is None
    art.write_bundle(d, bundle)
    back = art.read_bundle(d)
    assert back.manifest == dict(bundle.manifest)
    assert os.pread(back.fd, back.tar_nbytes, 0) == os.pread(bundle.fd, bundle.tar_nbytes, 0)
    back.close()
    with open(d / art.TAR_FILE, "r+b") as f:
        f.seek(600)
        f.write(b"X")
    with pytest.raises(ArtifactsCorrupt, match="blake3"):
        art.read_bundle(d)
    # the manifest gone, the tar left (an unfinished write): said, not a silent "absent"
    os.unlink(d / art.MANIFEST_FILE)
    with pytest.raises(ArtifactsCorrupt, match="has no .* beside it"):
        art.read_bundle(d)


def test_a_bundle_written_under_umask_002_is_private(bundle, tmp_path):
    """write_bundle's folder and files are 0700/0600 whatever the umask: a snapshot's
    folder that group or others can write is refused (unsafe-path) when read, so a
    bundle written under umask 002 (0775) made the next start fail."""
    d = tmp_path / "snap" / ".startup" / "tp0of1-pp0of1-dp0of1"
    d.parent.mkdir(parents=True, mode=0o700)
    old = os.umask(0o002)
    try:
        art.write_bundle(d, bundle)
    finally:
        os.umask(old)
    assert 0o700 == d.stat().st_mode & 0o777
    assert {0o600} == {(d / f).stat().st_mode & 0o777 for f in os.listdir(d)}


def test_artifacts_command_passes_a_sealed_memfd(daemon, bundle, tmp_path):
    """`artifacts` answers the manifest with the bundle as one sealed memfd, never in the frame; status shows it."""
    daemon.artifacts, daemon.artifacts_state = bundle, "primed"
    got = fetch_artifacts(daemon.socket_path)
    try:
        assert got.manifest == dict(bundle.manifest)
        assert got.fd != bundle.fd
        assert os.pread(got.fd, got.tar_nbytes, 0) == os.pread(bundle.fd, bundle.tar_nbytes, 0)
        result = art.install_bundle(got, {"vllm": tmp_path / "e" / "vllm"})
        assert result.installed == (f"vllm/{AOT}", "vllm/modelinfos/llama.json")
    finally:
        got.close()
    st = daemon_status(daemon.socket_path)["artifacts"]
    assert (st["present"], st["bytes"], st["files"], st["compile_dirs"], st["state"]) == (
        True,
        1177,
        4,
        [AOT.rsplit("/", 1)[-1]],
        "primed",
    )
    daemon.artifacts = None  # the fixture's bundle closes its own fd


def test_artifacts_command_without_a_bundle_is_artifacts_missing(daemon):
    """A daemon holding no bundle answers artifacts-missing naming its state; status says absent."""
    daemon.artifacts_state, daemon.artifacts_error = "failed", "[priming-failed] boom"
    with pytest.raises(ArtifactsMissing, match=r"state failed: \[priming-failed\] boom"):
        fetch_artifacts(daemon.socket_path)
    assert daemon_status(daemon.socket_path)["artifacts"] == {
        "present": False,
        "state": "failed",
        "error": "[priming-failed] boom",
    }
    assert daemon.refusals["artifacts-missing"] == 1


@pytest.mark.parametrize(
    "frame, match",
    [
        ({"op": "artifacts", "key": {}}, "artifacts takes no field 'key'"),
        ({"op": "artifacts", "fd": 3}, "artifacts takes no field 'fd'"),
    ],
)
def test_artifacts_command_refuses_bad_frames(daemon, frame, match):
    """An artifacts frame with fields it does not take is a protocol-error naming the field."""
    conn = Connection(daemon.socket_path)
    try:
        with pytest.raises(ProtocolError, match=match):
            conn.request(frame, max_fds=1)
    finally:
        conn.close()


def test_artifacts_before_hello_is_refused(daemon):
    """`artifacts` before hello is refused (protocol-error) and carries no descriptor."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket_path)
    try:
        send_frame(s, {"op": "artifacts"})
        reply, fds = recv_frame(s, max_fds=1)
        assert (reply["ok"], reply["code"], fds) == (False, "protocol-error", [])
        assert "before hello" in reply["message"]
    finally:
        s.close()


def test_open_bundle_fd_refuses_an_unsealed_memfd(bundle):
    """A client refuses a bundle memfd that is not sealed against writes (artifacts-corrupt) and closes it."""
    fd = os.memfd_create("x", os.MFD_CLOEXEC)
    os.write(fd, os.pread(bundle.fd, bundle.tar_nbytes, 0))
    with pytest.raises(ArtifactsCorrupt, match="not sealed"):
        art.open_bundle_fd(dict(bundle.manifest), [fd])
    with pytest.raises(OSError):
        os.fstat(fd)


def test_lean_daemon_keeps_serving_the_bundle(sock_dir, bundle, tmp_path):
    """After the hand-off to the torch-free server, `artifacts` still answers the same bytes and status shows them."""
    d = tmp_path / "b"
    art.write_bundle(d, bundle)
    proc = start_daemon(sock_dir, extra_args=("--lean", "--artifacts", str(d)))
    try:
        sock = paths.socket_path(sock_dir, "cpu")
        deadline = time.monotonic() + 30
        while daemon_status(sock).get("serving") != "lean":
            assert time.monotonic() < deadline, "no lean hand-off"
            time.sleep(0.1)
        st = daemon_status(sock)
        assert (st["torch_loaded"], st["artifacts"]["present"], st["artifacts"]["bytes"]) == (
            False,
            True,
            1177,
        )
        got = fetch_artifacts(sock)
        assert os.pread(got.fd, got.tar_nbytes, 0) == os.pread(bundle.fd, bundle.tar_nbytes, 0)
        got.close()
    finally:
        stop_daemon(proc)
