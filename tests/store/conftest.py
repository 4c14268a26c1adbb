"""Fixtures for the store tests: a key and an in-process daemon (the private socket
dir, ``sock_dir``, comes from tests/conftest.py)."""

import pytest

from wcache.store import CacheKey, DaemonServer
from wcache.testing.store import BASE_KEY, synthetic_export


@pytest.fixture
def key():
    return CacheKey(BASE_KEY)


@pytest.fixture
def daemon(sock_dir, key):
    """An in-process daemon (background threads) serving the synthetic export."""
    server = DaemonServer(synthetic_export(), key, socket_dir=sock_dir).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def private_registry(tmp_path_factory, monkeypatch):
    """Daemons started by a test record themselves in a private registry dir, so
    other daemons on this machine (other tests', other sessions') never show up."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
