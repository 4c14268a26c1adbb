"""Errors of the weight store, re-exported from :mod:`wcache.errors` (where every
wcache error lives). Each carries a stable reason code (``.code``) that the
engine-side fallback logs (docs/design.md section 5, "Fallback")."""

from __future__ import annotations

from wcache.errors import (  # re-exported: the store's errors' old home
    ArenaInvalidated,
    ArtifactsCorrupt,
    ArtifactsMissing,
    CheckpointChanged,
    DaemonBusy,
    DaemonMissing,
    IdleTimeout,
    KeyMismatch,
    PeerRefused,
    ProtocolError,
    Released,
    SeedUnavailable,
    ShmTooSmall,
    StoreError,
    TransportFailed,
    UnsafePath,
)

__all__ = [
    "StoreError",
    "DaemonMissing",
    "KeyMismatch",
    "TransportFailed",
    "ProtocolError",
    "DaemonBusy",
    "IdleTimeout",
    "ShmTooSmall",
    "Released",
    "UnsafePath",
    "PeerRefused",
    "CheckpointChanged",
    "ArenaInvalidated",
    "SeedUnavailable",
    "ArtifactsMissing",
    "ArtifactsCorrupt",
]
