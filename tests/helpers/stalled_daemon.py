"""A fake daemon that answers ``hello`` and then never answers again (shared by the
store and loader tests of bounded waits)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

from wcache.store import paths
from wcache.store.protocol import PROTOCOL_VERSION, recv_frame, send_frame

#: Pending connections the fake daemon's listener queues.
BACKLOG = 8
#: How often the accept loop looks at its stop flag (seconds).
ACCEPT_POLL_S = 0.1


@contextlib.contextmanager
def stalled_daemon(path: str) -> Iterator[str]:
    """Listen on ``path`` (mode 0600): reply to each connection's first frame with a
    CPU daemon's ``hello``, then hold it open without answering. Yields ``path``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, paths.FILE_MODE)
    listener.listen(BACKLOG)
    listener.settimeout(ACCEPT_POLL_S)
    stop, held = threading.Event(), []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            recv_frame(conn)
            send_frame(
                conn,
                {
                    "ok": True,
                    "protocol": PROTOCOL_VERSION,
                    "wcache": "stall",
                    "pid": os.getpid(),
                    "device": "cpu",
                    "device_id": "cpu",
                    "device_uuid": None,
                    "transport": "shm",
                },
            )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
