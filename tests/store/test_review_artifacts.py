"""Reviewer's tests of start-up artifact bundles (issue 24): hostile tars, the
install's no-overwrite claim under a race, manifests the checks let through."""

from __future__ import annotations

import io
import json
import os
import tarfile

import blake3
import pytest

from wcache.store import artifacts as art
from wcache.store import daemon_status
from wcache.store.errors import ArtifactsCorrupt

FACTORS = {"vllm": "0.32.0", "torch": "2.13", "triton": None, "device": "cpu:x86_64",
           "capability": None, "env_hash": "e" * 64, "config_hash": "c" * 10}
AOT = "torch_compile_cache/torch_aot_compile/" + "a" * 64


def _crafted(members, entries, files=None):
    """A bundle from hand-made tar members [(TarInfo, bytes|None)] with a matching tar_blake3."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    raw = buf.getvalue()
    if files is None:
        files = [{"path": i.name, "nbytes": len(d), "blake3": blake3.blake3(d).hexdigest()}
                 for i, d in members if d is not None]
    manifest = {"format": 1, "factors": FACTORS, "entries": entries, "files": files,
                "nbytes": sum(f.get("nbytes", 0) for f in files if isinstance(f, dict)),
                "tar_nbytes": len(raw), "tar_blake3": blake3.blake3(raw).hexdigest()}
    return art.bundle_from_bytes(raw, manifest)


def _info(name, kind=tarfile.REGTYPE, linkname=""):
    i = tarfile.TarInfo(name)
    i.type, i.linkname, i.mode = kind, linkname, 0o644
    return i


@pytest.mark.parametrize("kind, linkname, data", [
    (tarfile.SYMTYPE, "/etc/passwd", None),
    (tarfile.LNKTYPE, "vllm/x/a", None),
    (tarfile.CHRTYPE, "", None),
    (tarfile.FIFOTYPE, "", None),
])
def test_links_and_special_members_are_refused_and_nothing_is_left(tmp_path, kind, linkname, data):
    """A symlink, hardlink, device or fifo member inside an entry is artifacts-corrupt; the entry is not installed."""
    b = _crafted([(_info("vllm/x", tarfile.DIRTYPE), None), (_info("vllm/x/a"), b"ok"),
                  (_info("vllm/x/evil", kind, linkname), data)],
                 [{"root": "vllm", "path": "x"}])
    try:
        with pytest.raises(ArtifactsCorrupt, match="not a plain file or directory"):
            art.install_bundle(b, {"vllm": tmp_path / "v"})
        assert sorted(os.listdir(tmp_path / "v")) == []
    finally:
        b.close()


def test_traversal_member_is_refused(tmp_path):
    """A member named entry/../../outside is refused and writes nothing outside the temp dir."""
    b = _crafted([(_info("vllm/x/../../../pwned"), b"x")], [{"root": "vllm", "path": "x"}])
    try:
        with pytest.raises(ArtifactsCorrupt, match="escapes"):
            art.install_bundle(b, {"vllm": tmp_path / "v"})
        assert not (tmp_path / "pwned").exists() and os.listdir(tmp_path / "v") == []
    finally:
        b.close()


def test_a_file_entry_that_appears_during_install_is_overwritten(tmp_path, monkeypatch):
    """BUG: install_bundle's docstring says an existing destination is never touched, but
    os.rename replaces a FILE that another process wrote between the lexists check and
    the rename (file entries: modelinfos/*.json, top-level Triton/Inductor files)."""
    b = _crafted([(_info("vllm/modelinfos/llama.json"), b"bundle's")],
                 [{"root": "vllm", "path": "modelinfos/llama.json"}])
    dest = tmp_path / "v" / "modelinfos" / "llama.json"
    real = art._extract_entry

    def extract_then_race(*a, **k):  # another engine/vLLM writes the file meanwhile
        n = real(*a, **k)
        dest.write_bytes(b"theirs")
        return n

    monkeypatch.setattr(art, "_extract_entry", extract_then_race)
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    # what the contract says should hold:
    assert dest.read_bytes() == b"theirs", f"overwritten; install reported {result}"


def test_an_empty_dir_that_appears_during_install_is_replaced(tmp_path, monkeypatch):
    """BUG: rename(2) onto an EMPTY directory succeeds, so a hash dir another engine's
    vLLM just created (mkdir before writing into it) is replaced, not kept."""
    b = _crafted([(_info("vllm/" + AOT, tarfile.DIRTYPE), None),
                  (_info(f"vllm/{AOT}/rank_0_0/model"), b"fn")], [{"root": "vllm", "path": AOT}])
    dest = tmp_path / "v" / AOT
    real = art._extract_entry
    seen = {}

    def extract_then_race(*a, **k):
        n = real(*a, **k)
        dest.mkdir()
        seen["ino"] = dest.stat().st_ino
        return n

    monkeypatch.setattr(art, "_extract_entry", extract_then_race)
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert dest.stat().st_ino == seen["ino"], f"their dir was replaced; install reported {result}"


def test_manifest_entry_without_a_path_passes_the_checks(tmp_path):
    """BUG: _check_manifest checks str(entry.get('path')), so an entry with no path ('None')
    or a non-string path is accepted by bundle_from_bytes/read_bundle/open_bundle_fd."""
    with pytest.raises(ArtifactsCorrupt):
        b = _crafted([(_info("vllm/None"), b"x")], [{"root": "vllm"}])
        b.close()


def test_a_bundle_with_an_entry_without_path_breaks_status(daemon, tmp_path):
    """BUG: such a bundle (e.g. read from a snapshot's startup.json) makes `status` fail:
    bundle_summary indexes e['path'] -> KeyError -> every status call is an error."""
    b = _crafted([(_info("vllm/None"), b"x")], [{"root": "vllm"}])
    daemon.artifacts, daemon.artifacts_state = b, "snapshot"
    try:
        st = daemon_status(daemon.socket_path)
        assert st["artifacts"]["present"] is True
    finally:
        daemon.artifacts = None
        b.close()


def test_files_list_items_are_not_checked(tmp_path):
    """BUG (minor): manifest['files'] items are not checked; a non-map item passes the
    manifest check and fails the install with a TypeError instead of artifacts-corrupt."""
    b = _crafted([(_info("vllm/x"), b"x")], [{"root": "vllm", "path": "x"}], files=["junk"])
    try:
        with pytest.raises(ArtifactsCorrupt):
            art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()


def test_inductor_entries_are_top_level_dirs_so_any_prior_compile_blocks_them(tmp_path):
    """BUG (effectiveness): collect_entries makes each TOP-LEVEL Inductor cache dir one
    entry (fxgraph, aotautograd, triton); an engine whose Inductor cache has any
    fxgraph/ (another model compiled once) gets none of the bundle's kernels."""
    from wcache.vllm import startup

    src = tmp_path / "src"
    (src / "inductor" / "fxgraph" / "ab" / "new-key").mkdir(parents=True)
    (src / "inductor" / "fxgraph" / "ab" / "new-key" / "g").write_bytes(b"graph")
    (src / "vllm" / AOT).mkdir(parents=True)
    (src / "vllm" / AOT / "model").write_bytes(b"fn")
    dirs = {"vllm": src / "vllm", "inductor": src / "inductor"}
    b = art.pack_bundle(dirs, startup.collect_entries(dirs), FACTORS)
    dst = tmp_path / "dst"
    (dst / "inductor" / "fxgraph" / "zz" / "other-model").mkdir(parents=True)
    try:
        art.install_bundle(b, {"vllm": dst / "vllm", "inductor": dst / "inductor"})
    finally:
        b.close()
    assert (dst / "inductor" / "fxgraph" / "ab" / "new-key" / "g").exists()
