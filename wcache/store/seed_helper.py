"""The sending side of a seeding from a lean daemon: ``python -m
wcache.store.seed_helper`` (started by :class:`wcache.store.lean.LeanSeedSource`).

The lean serving process imports no torch, and seeding needs torch.distributed;
so for each ``seed`` request the lean process starts this helper. It reads one
JSON line on stdin (``socket_dir``, ``device_id``, ``key``, ``backend``,
``host``, ``pid``), attaches to its daemon like any client (the attachment
shows in the daemon's counters and is released when the helper exits), opens
the seeding ``TCPStore`` on ``host``, prints ``{"port", "token"}`` as one JSON
line on stdout, then sends the arena (:func:`wcache.store.seed.send_arena`) and
exits 0 once the receiver has it (1 on any failure, which the receiver sees as
its own ``seed-failed``). The torch import and the transfer cost this helper's
memory and time, not the daemon's. It runs under the operator's
``MALLOC_ARENA_MAX`` (not the lean server's), and the lean daemon ends it
(SIGTERM, then SIGKILL) when it stops, so a receiver that never joins cannot
keep it past its daemon.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import sys

from wcache.store.manifest import CacheKey

__all__ = ["main"]

log = logging.getLogger("wcache.store")


def main() -> int:
    import torch  # noqa: PLC0415 (torch import ~2 s: only when called)

    from wcache.store.arena_digest import arena_digest  # noqa: PLC0415 (torch import ~2 s: only when called)
    from wcache.store.client import attach  # noqa: PLC0415 (imported at call time: tests patch attach)
    from wcache.store.seed import TOKEN_BYTES, _listening_store, seed_timeout_s, send_arena  # noqa: PLC0415 (torch import ~2 s: only when called)

    req = json.loads(sys.stdin.readline())
    logging.basicConfig(
        level=req.get("log_level", logging.INFO),
        format="%(asctime)s %(name)s seed-helper %(message)s",
    )
    with attach(
        CacheKey.from_json(req["key"]), socket_dir=req["socket_dir"], device_id=req["device_id"]
    ) as att:
        arena = att.arena
        store = _listening_store(req["host"], datetime.timedelta(seconds=seed_timeout_s()))
        token = secrets.token_hex(TOKEN_BYTES)
        print(json.dumps({"port": store.port, "token": token}), flush=True)
        send_arena(
            store,
            req["backend"],
            req["host"],
            token,
            arena,
            torch.device("cpu"),
            lambda: arena_digest(arena),
            req.get("pid"),
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # the lean daemon logs our stderr's last line and counts a failure
        log.exception("seeding from the lean daemon failed")
        sys.exit(1)
