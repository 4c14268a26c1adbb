"""wcache's weight store: arena + manifest, content fingerprint, the ``shm``
and ``cuda_ipc`` transports, the socket protocol, the daemon and the client
(docs/design.md section 5).

Daemon side::

    server = DaemonServer(Export(tensors, kinds, aliases, layers, extra), key,
                          device="cpu", device_id="cpu-rank0-<job>")
    server.serve_forever()          # or serve(export, key, ...) in the foreground

Engine side::

    with attach(key, device="cpu", device_id="cpu-rank0-<job>") as att:
        att.tensors["model.embed_tokens.weight"]   # a read-only zero-copy view
"""

import importlib

# Imported on first use (PEP 562), so that ``import wcache.store.<module>`` loads only
# that module's imports: the lean serving process (wcache.store.lean) must not import
# torch, which the client and the arena builders need.
_EXPORTS = {
    "wcache.store.client": (
        "Attachment",
        "attach",
        "cli_status",
        "cli_stop",
        "daemon_status",
        "invalidate_daemon",
        "shutdown_daemon",
    ),
    "wcache.store.errors": (
        "ArenaInvalidated",
        "CheckpointChanged",
        "DaemonBusy",
        "DaemonMissing",
        "KeyMismatch",
        "PeerRefused",
        "ProtocolError",
        "Released",
        "StoreError",
        "TransportFailed",
        "UnsafePath",
    ),
    "wcache.store.fingerprint": (
        "DigestCache",
        "DigestingReader",
        "checkpoint_digest",
        "checkpoint_key_fields",
        "checkpoint_stats",
        "digest_file",
        "read_file_digest",
        "verify_checkpoint_unchanged",
    ),
    "wcache.store.manifest": ("CacheKey", "Export", "Manifest"),
    "wcache.store.paths": ("default_socket_dir", "socket_path"),
    "wcache.store.server": ("DaemonServer", "serve"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'wcache.store' has no attribute {name!r}")

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Export",
    "CacheKey",
    "Manifest",
    "DaemonServer",
    "serve",
    "attach",
    "Attachment",
    "checkpoint_digest",
    "checkpoint_key_fields",
    "checkpoint_stats",
    "verify_checkpoint_unchanged",
    "digest_file",
    "read_file_digest",
    "DigestCache",
    "DigestingReader",
    "default_socket_dir",
    "socket_path",
    "daemon_status",
    "shutdown_daemon",
    "cli_status",
    "cli_stop",
    "invalidate_daemon",
    "ArenaInvalidated",
    "StoreError",
    "DaemonMissing",
    "KeyMismatch",
    "TransportFailed",
    "ProtocolError",
    "DaemonBusy",
    "Released",
    "UnsafePath",
    "PeerRefused",
    "CheckpointChanged",
]
