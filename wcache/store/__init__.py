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

from wcache.store.client import (
    Attachment, attach, cli_status, cli_stop, daemon_status, invalidate_daemon, shutdown_daemon,
)
from wcache.store.errors import (
    ArenaInvalidated, CheckpointChanged, DaemonBusy, DaemonMissing, KeyMismatch, PeerRefused, ProtocolError, Released, StoreError,
    TransportFailed, UnsafePath,
)
from wcache.store.fingerprint import (
    DigestCache, DigestingReader, checkpoint_digest, checkpoint_key_fields, checkpoint_stats,
    digest_file, read_file_digest, verify_checkpoint_unchanged,
)
from wcache.store.manifest import CacheKey, Export, Manifest
from wcache.store.paths import default_socket_dir, socket_path
from wcache.store.server import DaemonServer, serve

__all__ = [
    "Export", "CacheKey", "Manifest", "DaemonServer", "serve", "attach", "Attachment",
    "checkpoint_digest", "checkpoint_key_fields", "checkpoint_stats", "verify_checkpoint_unchanged",
    "digest_file", "read_file_digest", "DigestCache",
    "DigestingReader", "default_socket_dir", "socket_path", "daemon_status", "shutdown_daemon",
    "cli_status", "cli_stop", "invalidate_daemon", "ArenaInvalidated",
    "StoreError", "DaemonMissing", "KeyMismatch", "TransportFailed", "ProtocolError", "DaemonBusy",
    "Released", "UnsafePath", "PeerRefused", "CheckpointChanged",
]
