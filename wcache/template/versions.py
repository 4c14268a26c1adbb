"""What a template is keyed on, read from the file system and the environment
(no import of torch or vLLM, so ``wcache run`` computes its side in milliseconds).

A template imported torch, vLLM and wcache once; a command it runs must see the
same code and the same import-time settings it would have seen in a fresh
interpreter. The template records, when it starts:

* ``python``: the interpreter (its bin directory, the binary it resolves to, that
  binary's size and mtime) and ``sys.version``;
* ``packages``: for wcache, vLLM and torch (the versions the cache key names,
  :func:`wcache.vllm.key.build_key`) the imported package's directory, its
  ``__version__``, and an install stamp: the digest of the ``*.dist-info/RECORD``
  that lists its ``__init__.py`` (pip rewrites it on every install), or, for a
  source tree without one (a checkout on ``PYTHONPATH``, the H200 bundle), the
  digest of every ``*.py`` file's (path, size, mtime);
* ``distributions``: every other installed distribution that owns a top-level
  module the template imported (transformers, tokenizers, numpy, ...), stamped by
  its ``RECORD`` file's (path, size, mtime): pip rewrites that file when it
  installs, upgrades or reinstalls the distribution and removes it on uninstall,
  so a child never runs a library older than what is on disk
  (:func:`imported_distributions`, :func:`changed_distributions`);
* ``env``: the environment variables that take effect at import or interpreter
  start (:func:`import_time_env`);
* ``env_imports``: every variable the template's own imports set or removed, with
  its value before and after them (:func:`imports_env`). A child gets the "after"
  value, as a fresh interpreter's imports would give it; but an import that only
  fills in a default (vLLM's ``os.environ.setdefault("TRITON_CACHE_AUTOTUNING",
  "1")``) keeps a value the command sets itself, so a command that sets such a
  variable to a third value must start directly (:func:`stale_fields`).

Each ``wcache run`` compares: its interpreter and import-time environment against
the recorded ones, its own wcache install stamp against the template's, and the
template re-stamps its packages on disk against what it imported. Any difference
is ``template-stale`` naming the fields, and the command runs directly.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import wcache

__all__ = [
    "IMPORT_TIME_ENV_PREFIXES",
    "IMPORT_TIME_ENV_NAMES",
    "KEYED_PACKAGES",
    "import_time_env",
    "imports_env",
    "interpreter_identity",
    "package_stamp",
    "same_install",
    "imported_distributions",
    "changed_distributions",
    "differences",
    "is_import_time_var",
    "stale_fields",
    "stale_reason",
]

#: Packages whose install a template is keyed on: the versions the weight cache key
#: names (wcache, vLLM, torch).
KEYED_PACKAGES = ("wcache", "vllm", "torch")

#: Prefixes of variables read at interpreter start or at import by what the template
#: imports, so a child would inherit the template's value, not its own:
#: ``PYTHON*`` (sys.path, hash seed, warnings, I/O encoding), the OpenMP / BLAS
#: runtimes (libgomp, MKL, OpenBLAS size their pools when torch and numpy load
#: them), torch (``TORCH_LOGS``, Inductor and PyTorch settings read into config
#: modules), Hugging Face (``huggingface_hub.constants`` and transformers read
#: offline flags and cache paths at import) and vLLM's logging (configured when
#: ``vllm.logger`` is imported; vLLM's other ``VLLM_*`` variables are read lazily).
IMPORT_TIME_ENV_PREFIXES = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "VLLM_LOGGING_",
    "LD_",
)
#: Single variables of the same kind: vLLM's logging switch, the locale (stdio and
#: file-system encodings are fixed at interpreter start), the cache roots
#: huggingface_hub derives its paths from at import, and the visible GPUs (vLLM
#: caches device counts per value of this variable; keying on it keeps a template
#: from answering for another device set).
IMPORT_TIME_ENV_NAMES = (
    "VLLM_CONFIGURE_LOGGING",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "HOME",
    "XDG_CACHE_HOME",
    "CUDA_VISIBLE_DEVICES",
)
#: ``PYTHONUNBUFFERED`` is replayed in the child (its stdio is rebuilt), so it is
#: not a reason to refuse a template.
REPLAYED_ENV = frozenset({"PYTHONUNBUFFERED"})
#: Names of the dist-info file that lists an install's files (PEP 376 / 627).
_RECORD = "RECORD"


def is_import_time_var(name: str) -> bool:
    """True when ``name`` is an import-time variable (:data:`IMPORT_TIME_ENV_PREFIXES`)."""
    if name in REPLAYED_ENV:
        return False
    return name in IMPORT_TIME_ENV_NAMES or name.startswith(IMPORT_TIME_ENV_PREFIXES)


def import_time_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The import-time variables of ``environ`` (:func:`is_import_time_var`), sorted."""
    return {k: environ[k] for k in sorted(environ) if is_import_time_var(k)}


def imports_env(
    before: Mapping[str, str], after: Mapping[str, str]
) -> dict[str, tuple[str | None, str | None]]:
    """The variables imports set or removed: name -> (value before, value after), None
    where unset, sorted by name."""
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }


def interpreter_identity(executable: str) -> dict[str, Any]:
    """Who an interpreter path is: its bin directory (a venv is its bin directory;
    ``python`` and ``python3`` there are the same interpreter), the binary it resolves
    to, and that binary's size and mtime (an upgrade in place changes them).

    Raises:
        FileNotFoundError: ``executable`` does not exist.
    """
    path = os.path.abspath(executable)
    binary = os.path.realpath(path)
    st = os.stat(binary)
    return {
        "bin_dir": os.path.dirname(path),
        "binary": binary,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _digest_record(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=16).hexdigest()


def _find_record(pkg_dir: str, name: str) -> str | None:
    """The ``RECORD`` of the dist-info beside ``pkg_dir`` that lists ``name/__init__.py``."""
    parent = os.path.dirname(pkg_dir)
    needle = f"{name}/__init__.py,".encode()
    for info in sorted(glob.glob(os.path.join(glob.escape(parent), "*.dist-info"))):
        record = os.path.join(info, _RECORD)
        try:
            with open(record, "rb") as f:
                if any(line.startswith(needle) for line in f):
                    return record
        except OSError:
            continue
    return None


def _tree_digest(pkg_dir: str) -> str:
    """Digest of every ``*.py`` file's (relative path, size, mtime) under ``pkg_dir``."""
    h = hashlib.blake2b(digest_size=16)
    for root, dirs, files in os.walk(pkg_dir):
        dirs.sort()
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            p = os.path.join(root, fn)
            try:
                st = os.stat(p)
            except OSError:
                continue
            h.update(f"{os.path.relpath(p, pkg_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def package_stamp(pkg_dir: str, name: str) -> dict[str, Any]:
    """The install stamp of the package ``name`` in ``pkg_dir`` (its directory, e.g.
    ``.../site-packages/vllm``): ``{"path", "record", "stamp"}`` where ``stamp`` is the
    digest of the dist-info ``RECORD`` listing it (``record`` its path), or, without
    one, of the source tree (:func:`_tree_digest`; ``record`` None). wcache is always
    stamped by its tree: a checkout is edited without reinstalling."""
    record = None if name == "wcache" else _find_record(pkg_dir, name)
    if record is not None:
        try:
            return {"path": pkg_dir, "record": record, "stamp": _digest_record(record)}
        except OSError:
            pass
    return {"path": pkg_dir, "record": None, "stamp": _tree_digest(pkg_dir)}


def own_wcache_stamp() -> dict[str, Any]:
    """The stamp of the wcache package this process runs."""
    return package_stamp(os.path.dirname(os.path.abspath(wcache.__file__)), "wcache")


def same_install(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two :func:`package_stamp` records name one install: the same
    directory and stamp (the ``record`` path follows from the directory)."""
    return (a.get("path"), a.get("stamp")) == (b.get("path"), b.get("stamp"))


def _record_stat(record: str) -> dict[str, Any] | None:
    try:
        st = os.stat(record)
    except OSError:
        return None
    return {"record": record, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def imported_distributions(
    modules: Iterable[str], exclude: Iterable[str] = KEYED_PACKAGES
) -> dict[str, dict[str, Any]]:
    """The installed distributions that own the top-level modules of ``modules``
    (names as in ``sys.modules``), but those owning ``exclude`` (stamped by
    :func:`package_stamp`): distribution name -> its ``RECORD``'s path, size and
    mtime (ns). A distribution without a readable ``RECORD`` on disk (an egg, an
    editable checkout's ``egg-link``) is left out.

    Source: ``importlib.metadata.packages_distributions`` (top-level module ->
    distribution names), ``Distribution.locate_file``.
    """
    owners = importlib.metadata.packages_distributions()
    tops = {m.partition(".")[0] for m in modules}
    skip = {d for name in exclude for d in owners.get(name, ())}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({d for top in tops for d in owners.get(top, ())} - skip):
        try:
            dist = importlib.metadata.distribution(name)
            record = next((f for f in dist.files or () if f.name == _RECORD), None)
        except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
            continue  # gone meanwhile, or a RECORD its own reader cannot parse: unstamped
        stat = _record_stat(str(dist.locate_file(record))) if record is not None else None
        if stat is not None:
            out[name] = stat
    return out


def changed_distributions(recorded: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The distributions of ``recorded`` (:func:`imported_distributions`) whose
    ``RECORD`` is gone or has another size or mtime now."""
    changed = []
    for name, rec in recorded.items():
        now = _record_stat(str(rec.get("record")))
        if now is None or (now["size"], now["mtime_ns"]) != (rec.get("size"), rec.get("mtime_ns")):
            changed.append(name)
    return changed


def differences(
    recorded: Mapping[str, Any], current: Mapping[str, Any], prefix: str = ""
) -> list[str]:
    """Dotted names of the fields that differ between two nested mappings, sorted."""
    out = []
    for k in sorted(set(recorded) | set(current)):
        a, b = recorded.get(k), current.get(k)
        name = f"{prefix}{k}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend(differences(a, b, name + "."))
        elif a != b:
            out.append(name)
    return out


def stale_fields(
    fingerprint: Mapping[str, Any],
    changed_packages: Iterable[str],
    interpreter: Mapping[str, Any],
    env: Mapping[str, str],
    client_wcache: Mapping[str, Any] | None,
) -> tuple[str, ...]:
    """Why a command of this client cannot run in the template: the sorted fields
    (``python.*``, ``env.*``, ``packages.*``, ``packages.wcache(client)``) in which
    the client differs from the template's ``fingerprint``; empty when none.

    Args:
        fingerprint: the template's, as recorded when it started.
        changed_packages: what the template re-stamped as changed on disk since.
        interpreter: the command's :func:`interpreter_identity`.
        env: the command's environment (its import-time variables are compared).
        client_wcache: the client's wcache install stamp (:func:`own_wcache_stamp`),
            or None when the client sent none.
    """
    mine = {k: v for k, v in fingerprint["python"].items() if k != "version"}
    fields = [f"python.{f}" for f in differences(mine, interpreter)]
    fields += [f"env.{f}" for f in differences(fingerprint["env"], import_time_env(env))]
    # a variable the template's imports set: the child gets their value, which a direct
    # start's imports may not impose (setdefault) on a command that sets another one
    fields += [
        f"env.{name}"
        for name, values in fingerprint.get("env_imports", {}).items()
        if env.get(name) not in values
    ]
    fields += [f"packages.{name}" for name in changed_packages]
    own = fingerprint["packages"].get("wcache", {})
    if client_wcache is not None and not same_install(client_wcache, own):
        fields.append("packages.wcache(client)")
    return tuple(sorted(set(fields)))


def stale_reason(fields: Iterable[str], subject: str = "this command's environment") -> str:
    """The ``template-stale`` message for :func:`stale_fields`' ``fields``: what
    differs and how to fix it (``wcache run``'s refusal, ``wcache template status``)."""
    return (
        f"{subject} differs from the template's in {', '.join(fields)}; restart the "
        f"template (`wcache template stop; wcache template start`) from this environment"
    )


def python_version() -> str:
    """``sys.version`` of this interpreter (recorded by the template, informative)."""
    return sys.version
