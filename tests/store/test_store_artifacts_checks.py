"""Start-up artifact bundles against hostile or damaged input (issue 24; the
review of the start-up artifact store): crafted tars (links, special and sparse
members, traversal, wrong sizes, listed entries without members), the install's
no-overwrite guarantee under a race, the manifest checks, ``status`` on any
bundle, unreadable snapshot files, and Inductor's entries merging file by file."""

from __future__ import annotations

import errno
import io
import os
import tarfile

import blake3
import pytest

from wcache.store import artifacts as art
from wcache.store import daemon_status
from wcache.store.errors import ArtifactsCorrupt, StoreError

FACTORS = {
    "vllm": "0.32.0",
    "torch": "2.13",
    "triton": None,
    "device": "cpu:x86_64",
    "capability": None,
    "env_hash": "e" * 64,
    "config_hash": "c" * 10,
}
AOT = "torch_compile_cache/torch_aot_compile/" + "a" * 64


def _tar(members):
    """The bytes of a tar of hand-made members [(TarInfo, bytes|None)]."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _manifest(raw, entries, files):
    return {
        "format": 1,
        "factors": FACTORS,
        "entries": entries,
        "files": files,
        "nbytes": sum(
            f.get("nbytes", 0)
            for f in files
            if isinstance(f, dict) and isinstance(f.get("nbytes"), int)
        ),
        "tar_nbytes": len(raw),
        "tar_blake3": blake3.blake3(raw).hexdigest(),
    }


def _crafted(members, entries, files=None):
    """A bundle from hand-made tar members [(TarInfo, bytes|None)] with a matching tar_blake3."""
    raw = _tar(members)
    if files is None:
        files = [
            {"path": i.name, "nbytes": len(d), "blake3": blake3.blake3(d).hexdigest()}
            for i, d in members
            if d is not None
        ]
    return art.bundle_from_bytes(raw, _manifest(raw, entries, files))


def _info(name, kind=tarfile.REGTYPE, linkname=""):
    i = tarfile.TarInfo(name)
    i.type, i.linkname, i.mode = kind, linkname, 0o644
    return i


def _file_bundle():
    """A bundle of one file entry, vllm/modelinfos/llama.json."""
    return _crafted(
        [(_info("vllm/modelinfos/llama.json"), b"bundle's")],
        [{"root": "vllm", "path": "modelinfos/llama.json"}],
    )


def _dir_bundle():
    """A bundle of one AOT hash-dir entry with one file."""
    return _crafted(
        [
            (_info("vllm/" + AOT, tarfile.DIRTYPE), None),
            (_info(f"vllm/{AOT}/rank_0_0/model"), b"fn"),
        ],
        [{"root": "vllm", "path": AOT}],
    )


def _race(monkeypatch, make):
    """Make ``make()`` run between an entry's extraction and its move into place
    (another engine installing the same entry meanwhile)."""
    real = art._extract_entry

    def extract_then_race(*a, **k):
        n = real(*a, **k)
        make()
        return n

    monkeypatch.setattr(art, "_extract_entry", extract_then_race)


# --- hostile members ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, linkname",
    [
        (tarfile.SYMTYPE, "/etc/passwd"),
        (tarfile.LNKTYPE, "vllm/x/a"),
        (tarfile.CHRTYPE, ""),
        (tarfile.FIFOTYPE, ""),
    ],
)
def test_links_and_special_members_are_refused_and_nothing_is_left(tmp_path, kind, linkname):
    """A symlink, hardlink, device or fifo member inside an entry is artifacts-corrupt; the entry is not installed."""
    b = _crafted(
        [
            (_info("vllm/x", tarfile.DIRTYPE), None),
            (_info("vllm/x/a"), b"ok"),
            (_info("vllm/x/evil", kind, linkname), None),
        ],
        [{"root": "vllm", "path": "x"}],
    )
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


def test_a_sparse_member_is_refused(tmp_path):
    """A GNU sparse member (what it writes is not its header's size) is artifacts-corrupt, nothing installed."""
    b = _crafted(
        [(_info("vllm/x", tarfile.GNUTYPE_SPARSE), b"ab")],
        [{"root": "vllm", "path": "x"}],
        files=[{"path": "vllm/x", "nbytes": 2, "blake3": blake3.blake3(b"ab").hexdigest()}],
    )
    try:
        with pytest.raises(ArtifactsCorrupt, match="'vllm/x' is a sparse file"):
            art.install_bundle(b, {"vllm": tmp_path / "v"})
        assert os.listdir(tmp_path / "v") == []
    finally:
        b.close()


def test_a_member_of_another_size_than_the_manifest_is_refused_before_writing(
    tmp_path, monkeypatch
):
    """A member whose tar size differs from the manifest's nbytes is artifacts-corrupt before a byte is written."""
    opened = []
    monkeypatch.setattr(
        art.tarfile.TarFile, "extractfile", lambda self, m: opened.append(m.name) or None
    )
    b = _crafted(
        [(_info("vllm/x"), b"12345")],
        [{"root": "vllm", "path": "x"}],
        files=[{"path": "vllm/x", "nbytes": 2, "blake3": blake3.blake3(b"12345").hexdigest()}],
    )
    try:
        with pytest.raises(
            ArtifactsCorrupt, match="'vllm/x' is 5 bytes, the bundle manifest says 2"
        ):
            art.install_bundle(b, {"vllm": tmp_path / "v"})
        assert (opened, os.listdir(tmp_path / "v")) == ([], [])
    finally:
        b.close()


# --- entries without members -------------------------------------------------------------


def test_a_listed_entry_without_members_is_skipped_with_its_reason_and_the_rest_installed(tmp_path):
    """An entry the tar carries nothing of (an older packer's symlinked entry) is skipped as not-in-tar; the next entry is installed."""
    b = _crafted(
        [(_info("vllm/b"), b"b")], [{"root": "vllm", "path": "a"}, {"root": "vllm", "path": "b"}]
    )
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert result == art.InstallResult(
        ("vllm/b",), ("vllm/a",), 1, (("vllm/a", art.SKIP_NOT_IN_TAR),)
    )
    assert sorted(os.listdir(tmp_path / "v")) == ["b"]


def test_pack_leaves_out_an_entry_that_carries_nothing(tmp_path):
    """pack_bundle does not list a symlinked entry (it carries no member), so every listed entry installs."""
    v = tmp_path / "v"
    v.mkdir()
    (v / "real.json").write_text("{}")
    (v / "link.json").symlink_to(v / "real.json")
    b = art.pack_bundle({"vllm": v}, [("vllm", "link.json"), ("vllm", "real.json")], FACTORS)
    try:
        assert b.manifest["entries"] == [{"root": "vllm", "path": "real.json"}]
        assert [f["path"] for f in b.manifest["files"]] == ["vllm/real.json"]
    finally:
        b.close()


def test_skips_name_their_reasons(tmp_path):
    """A present entry is skipped as present, an entry of a root without destination as no-root."""
    b = _crafted(
        [(_info("vllm/a"), b"a"), (_info("triton/k"), b"k")],
        [{"root": "vllm", "path": "a"}, {"root": "triton", "path": "k"}],
    )
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "a").write_bytes(b"mine")
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert result.reasons == (("vllm/a", art.SKIP_PRESENT), ("triton/k", art.SKIP_NO_ROOT))
    assert (result.installed, result.skipped) == ((), ("vllm/a", "triton/k"))
    assert (tmp_path / "v" / "a").read_bytes() == b"mine"


# --- the no-overwrite guarantee under a race ----------------------------------------------


def test_a_file_entry_that_appears_during_install_is_kept(tmp_path, monkeypatch):
    """A file another process writes between the existence check and the move is kept (RENAME_NOREPLACE) and the entry reported skipped."""
    dest = tmp_path / "v" / "modelinfos" / "llama.json"
    _race(monkeypatch, lambda: dest.write_bytes(b"theirs"))
    b = _file_bundle()
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert dest.read_bytes() == b"theirs"
    assert result == art.InstallResult(
        (), ("vllm/modelinfos/llama.json",), 0, (("vllm/modelinfos/llama.json", art.SKIP_PRESENT),)
    )
    assert os.listdir(dest.parent) == ["llama.json"]  # no temp dir left


def test_an_empty_dir_that_appears_during_install_is_kept(tmp_path, monkeypatch):
    """A hash dir another engine's vLLM just created (still empty) is kept, not replaced, and the entry skipped."""
    dest = tmp_path / "v" / AOT
    seen = {}

    def mkdir():
        dest.mkdir()
        seen["ino"] = dest.stat().st_ino

    _race(monkeypatch, mkdir)
    b = _dir_bundle()
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert (dest.stat().st_ino, os.listdir(dest)) == (seen["ino"], [])
    assert (result.installed, result.skipped) == ((), (f"vllm/{AOT}",))


def test_without_renameat2_a_file_is_linked_and_a_racing_file_kept(tmp_path, monkeypatch):
    """Where renameat2 is unsupported (ENOSYS), a file entry is hard-linked into place, and a file that appeared meanwhile is kept."""
    monkeypatch.setattr(art, "_renameat2", None)
    b = _file_bundle()
    try:
        first = art.install_bundle(b, {"vllm": tmp_path / "a"})
        dest = tmp_path / "b" / "modelinfos" / "llama.json"
        _race(monkeypatch, lambda: dest.write_bytes(b"theirs"))
        second = art.install_bundle(b, {"vllm": tmp_path / "b"})
    finally:
        b.close()
    installed = tmp_path / "a" / "modelinfos" / "llama.json"
    assert (installed.read_bytes(), installed.stat().st_nlink, first.installed) == (
        b"bundle's",
        1,
        ("vllm/modelinfos/llama.json",),
    )
    assert (dest.read_bytes(), second.installed, second.skipped) == (
        b"theirs",
        (),
        ("vllm/modelinfos/llama.json",),
    )
    assert sorted(os.listdir(tmp_path / "a" / "modelinfos")) == ["llama.json"]


def test_without_renameat2_a_dir_is_renamed_after_the_existence_check(tmp_path, monkeypatch):
    """Where renameat2 is unsupported (EINVAL from the file system), a dir entry is renamed into place when absent."""

    def refuse(src, dst):
        raise OSError(errno.EINVAL, "flag not supported", str(dst))

    monkeypatch.setattr(art, "_rename_noreplace", refuse)
    b = _dir_bundle()
    try:
        result = art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert result.installed == (f"vllm/{AOT}",)
    assert (tmp_path / "v" / AOT / "rank_0_0" / "model").read_bytes() == b"fn"


@pytest.mark.parametrize("err", [errno.EACCES, errno.EXDEV, errno.ENOSPC], ids=errno.errorcode.get)
def test_a_move_that_fails_otherwise_is_install_failed_not_skipped(tmp_path, monkeypatch, err):
    """A move failing with EACCES, EXDEV or ENOSPC raises StoreError artifacts-install-failed naming the errno, and leaves no temp dir."""

    def fail(src, dst):
        raise OSError(err, os.strerror(err), str(dst))

    monkeypatch.setattr(art, "_rename_noreplace", fail)
    b = _file_bundle()
    try:
        with pytest.raises(StoreError, match=rf"llama.json: \[{errno.errorcode[err]}\]") as info:
            art.install_bundle(b, {"vllm": tmp_path / "v"})
    finally:
        b.close()
    assert info.value.code == art.INSTALL_FAILED
    assert os.listdir(tmp_path / "v" / "modelinfos") == []


# --- manifest checks and status ------------------------------------------------------------

GOOD_FILE = {"path": "vllm/x", "nbytes": 1, "blake3": blake3.blake3(b"x").hexdigest()}


@pytest.mark.parametrize(
    "entries, files, match",
    [
        ([{"root": "vllm"}], [GOOD_FILE], "lacks a string root and path"),
        ([{"root": "vllm", "path": 7}], [GOOD_FILE], "lacks a string root and path"),
        ([{"path": "x"}], [GOOD_FILE], "lacks a string root and path"),
        ([{"root": "vllm", "path": "x/../y"}], [GOOD_FILE], "not a plain relative path"),
        (["x"], [GOOD_FILE], "bundle entry 'x' is not a map"),
        ([{"root": "vllm", "path": "x"}], ["junk"], "bundle files item 'junk' is not a map"),
        ([{"root": "vllm", "path": "x"}], [{"path": "vllm/x", "nbytes": 1}], "needs a string path"),
        ([{"root": "vllm", "path": "x"}], [dict(GOOD_FILE, path=None)], "needs a string path"),
        ([{"root": "vllm", "path": "x"}], [dict(GOOD_FILE, nbytes=-1)], "int nbytes >= 0"),
        ([{"root": "vllm", "path": "x"}], [dict(GOOD_FILE, nbytes="1")], "int nbytes >= 0"),
        ([{"root": "vllm", "path": "x"}], [dict(GOOD_FILE, nbytes=True)], "int nbytes >= 0"),
    ],
)
def test_malformed_manifest_entries_and_files_are_refused(entries, files, match):
    """Each malformed entry or files item is refused by bundle_from_bytes with artifacts-corrupt naming it."""
    raw = _tar([(_info("vllm/x"), b"x")])
    with pytest.raises(ArtifactsCorrupt, match=match):
        art.bundle_from_bytes(raw, _manifest(raw, entries, files))


def test_status_shows_a_bundle_whatever_its_manifest_holds(daemon, tmp_path):
    """bundle_summary reads the manifest with .get, so `status` answers even for an unchecked manifest with an entry without path."""
    raw = _tar([(_info("vllm/x"), b"x")])
    fd = os.memfd_create("t")
    os.write(fd, raw)
    b = art.Bundle(
        fd,
        {
            "format": 1,
            "factors": FACTORS,
            "entries": [{"root": "vllm"}, {"root": "vllm", "path": AOT}],
        },
    )
    daemon.artifacts, daemon.artifacts_state = b, "snapshot"
    try:
        st = daemon_status(daemon.socket_path)["artifacts"]
    finally:
        daemon.artifacts = None
        b.close()
    assert (st["present"], st["entries"], st["files"], st["compile_dirs"], st["bytes"]) == (
        True,
        2,
        0,
        ["a" * 64],
        None,
    )


# --- snapshot files ---------------------------------------------------------------------------


def test_an_unreadable_tar_is_artifacts_corrupt_naming_path_and_errno(tmp_path, monkeypatch):
    """read_bundle turns a startup.tar that is a directory (EISDIR), unreadable (EACCES) or failing (EIO) into artifacts-corrupt."""
    good = _file_bundle()
    try:
        art.write_bundle(tmp_path / "d", good)
    finally:
        good.close()
    tar = tmp_path / "d" / art.TAR_FILE
    tar.unlink()
    tar.mkdir()
    with pytest.raises(ArtifactsCorrupt, match=rf"{tar} is unreadable: \[EISDIR\]"):
        art.read_bundle(tmp_path / "d")
    tar.rmdir()
    tar.write_bytes(b"")

    def denied(path, *a, **k):  # the tests run as root, which chmod does not stop
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(art, "open", denied, raising=False)
    with pytest.raises(ArtifactsCorrupt, match=r"is unreadable: \[EACCES\]"):
        art.read_bundle(tmp_path / "d")


def test_a_read_error_of_the_tar_is_artifacts_corrupt():
    """An EIO while bundle_from_bytes reads the tar is artifacts-corrupt naming EIO, not a memfd StoreError."""

    class Failing(io.RawIOBase):
        def readable(self):
            return True

        def read(self, n=-1):
            raise OSError(errno.EIO, "Input/output error")

    raw = _tar([(_info("vllm/x"), b"x")])
    with pytest.raises(ArtifactsCorrupt, match=r"cannot read the bundle tar: \[EIO\]"):
        art.bundle_from_bytes(
            Failing(), _manifest(raw, [{"root": "vllm", "path": "x"}], [GOOD_FILE])
        )


# --- Inductor entries -------------------------------------------------------------------------


def test_inductor_files_merge_into_a_cache_that_has_other_compiles(tmp_path):
    """Inductor entries are leaf files, so an engine whose Inductor cache has other fxgraph entries gets the bundle's, and keeps its own."""
    from wcache.vllm import startup

    src = tmp_path / "src"
    (src / "inductor" / "fxgraph" / "ab" / "new-key").mkdir(parents=True)
    (src / "inductor" / "fxgraph" / "ab" / "new-key" / "g").write_bytes(b"graph")
    (src / "vllm" / AOT).mkdir(parents=True)
    (src / "vllm" / AOT / "model").write_bytes(b"fn")
    dirs = {"vllm": src / "vllm", "inductor": src / "inductor"}
    entries = startup.collect_entries(dirs)
    assert ("inductor", "fxgraph/ab/new-key/g") in entries
    b = art.pack_bundle(dirs, entries, FACTORS)
    dst = tmp_path / "dst"
    (dst / "inductor" / "fxgraph" / "zz" / "other-model").mkdir(parents=True)
    (dst / "inductor" / "fxgraph" / "zz" / "other-model" / "g").write_bytes(b"theirs")
    try:
        result = art.install_bundle(b, {"vllm": dst / "vllm", "inductor": dst / "inductor"})
    finally:
        b.close()
    assert (dst / "inductor" / "fxgraph" / "ab" / "new-key" / "g").read_bytes() == b"graph"
    assert (dst / "inductor" / "fxgraph" / "zz" / "other-model" / "g").read_bytes() == b"theirs"
    assert result.installed == (f"vllm/{AOT}", "inductor/fxgraph/ab/new-key/g")


def test_inductor_entries_are_regular_files_without_hidden_names_or_symlinks(tmp_path):
    """collect_entries lists each regular Inductor file by its relative path, sorted, leaving out dot-names and symlinks."""
    from wcache.vllm import startup

    ind = tmp_path / "inductor"
    (ind / "fxgraph" / "ab").mkdir(parents=True)
    (ind / "fxgraph" / "ab" / "k").write_bytes(b"k")
    (ind / "aotautograd").mkdir()
    (ind / "aotautograd" / "a").write_bytes(b"a")
    (ind / "fxgraph" / "ab" / ".lock").write_bytes(b"")
    (ind / ".tmp").mkdir()
    (ind / ".tmp" / "x").write_bytes(b"x")
    (ind / "fxgraph" / "link").symlink_to(ind / "aotautograd" / "a")
    (ind / "linkdir").symlink_to(ind / "fxgraph")
    assert startup.collect_entries({"inductor": ind}) == [
        ("inductor", "aotautograd/a"),
        ("inductor", "fxgraph/ab/k"),
    ]
