"""Errors of the weight store. Each carries a stable reason code (``.code``)
that the engine-side fallback logs (docs/design.md section 5, "Fallback")."""

from __future__ import annotations

from collections.abc import Iterable

from wcache.core import WcacheError

__all__ = [
    "StoreError", "DaemonMissing", "KeyMismatch", "TransportFailed", "ProtocolError",
    "DaemonBusy", "IdleTimeout", "ShmTooSmall", "Released", "UnsafePath", "PeerRefused", "CheckpointChanged", "ArenaInvalidated",
]


class StoreError(WcacheError, RuntimeError):
    """Root of the store's errors (arena, transports, protocol, daemon, client)."""

    code = "store-error"


class DaemonMissing(StoreError):
    """No daemon answers on the socket: none was started, it died, or it is not
    answering within the timeout. Start one with ``wcache serve``."""

    code = "daemon-missing"


class KeyMismatch(StoreError, ValueError):
    """The daemon holds weights for a different cache key; ``.fields`` names the
    differing key fields (sorted), ``.theirs`` the daemon's values of them."""

    code = "key-mismatch"

    def __init__(self, message: str, *, fields: Iterable[str] = (), theirs: dict | None = None):
        super().__init__(message)
        self.fields = sorted(fields)
        self.theirs = dict(theirs or {})


class TransportFailed(StoreError):
    """A handle could not be passed or mapped (memfd not sealed, size differs
    from the manifest, CUDA IPC open failed, wrong device)."""

    code = "transport-failed"


class ProtocolError(StoreError, ValueError):
    """A frame is malformed, truncated, oversized, of an unknown command, or the
    peer speaks another protocol version."""

    code = "protocol-error"


class IdleTimeout(ProtocolError):
    """The daemon closed a connection that said nothing for too long (no ``hello``
    after connecting, or no request while holding no attachment). Connect again
    when there is something to ask."""

    code = "idle-timeout"


class ShmTooSmall(StoreError, OSError):
    """``/dev/shm`` is missing or has less free space than what wcache is about to
    start needs there (NCCL, vLLM's CPU shared-memory all-reduce, torch's CUDA IPC
    ref counters); refused before any work instead of SIGBUS or NCCL's "No space
    left on device" mid-way. The message names the size, the need and the fix."""

    code = "shm-too-small"


class DaemonBusy(StoreError):
    """Another live daemon already serves this device (its lock or its socket is
    held). Stop it first (``wcache stop``) or pick another socket dir."""

    code = "daemon-busy"


class Released(StoreError):
    """The attachment was closed; its tensors are no longer served through it."""

    code = "released"


class UnsafePath(StoreError, PermissionError):
    """A socket dir, socket or lock file is a symlink, is owned by another user,
    or is group/world accessible."""

    code = "unsafe-path"


class PeerRefused(StoreError, PermissionError):
    """The peer on the socket runs as another user (SO_PEERCRED check)."""

    code = "peer-refused"


class CheckpointChanged(StoreError):
    """A checkpoint file changed, shrank, vanished or could not be read while it
    was hashed or loaded, so no key can describe the bytes that were read. Wait
    until the checkpoint is fully written, then start again."""

    code = "checkpoint-changed"


class ArenaInvalidated(StoreError):
    """A client's restore guard fired on this daemon's arena, so its bytes may have
    been rewritten: the daemon serves it to no one and exits (a supervisor starts
    a fresh one, which rebuilds the arena from the checkpoint). Engines fall back
    to disk meanwhile."""

    code = "arena-invalidated"
