"""Reviewer's tests of serve's start-up artifact paths (issue 24): the snapshot's
.startup read, and priming versus a stop request."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from wcache.daemon import prime, serve
from wcache.store import artifacts as art


def _stub_server():
    return types.SimpleNamespace(artifacts=None, artifacts_state=None, artifacts_error=None,
                                 socket_dir=None, _shutdown_requested=threading.Event())


def test_unreadable_snapshot_tar_does_not_fail_the_daemon_start(tmp_path):
    """BUG: _snapshot_artifacts catches StoreError only; read_bundle lets an OSError other
    than FileNotFoundError (startup.tar a directory, EACCES, EIO) escape, so a bad
    .startup file fails the daemon's start from a good snapshot."""
    d = tmp_path / "snap" / serve.SNAPSHOT_STARTUP_DIR / "tp0of1-pp0of1-dp0of1"
    d.mkdir(parents=True)
    (d / art.MANIFEST_FILE).write_text('{"format": 1}')
    (d / art.TAR_FILE).mkdir()  # not a file
    server = _stub_server()
    serve._snapshot_artifacts(server, str(tmp_path / "snap"), "tp0of1-pp0of1-dp0of1")
    assert server.artifacts is None and server.artifacts_error
