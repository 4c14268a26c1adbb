"""``wcache serve --http HOST:PORT``: a health endpoint and Prometheus metrics.

Two read-only endpoints for orchestrators, served by a small threaded HTTP
server next to the daemon (off unless ``--http`` is given; loopback unless a
host is named):

* ``GET /health``: ``200`` with ``{"ready": true, ...}`` once every rank this
  node's ``wcache serve`` hosts answers on its socket and serves its arena;
  ``503`` with ``{"ready": false, "code": ..., "message": ...}`` otherwise
  (``daemon-missing`` while a rank loads or after it died, ``arena-invalidated``
  after a client's guard fired, ``key-mismatch`` when only another
  configuration answers). It is the same check as ``wcache status
  --wait-ready`` (:func:`wcache.daemon.ready.survey`).
* ``GET /metrics``: Prometheus text format (``prometheus_client``), gathered at
  scrape time from each rank's ``status`` reply, one label set per rank
  (``tp_rank``, ``pp_rank``): clients, attaches, releases (by how), bytes
  held, refusals by reason code, invalidations, snapshot state, seeding state.

The server holds no counters of its own: every figure is a daemon's, read over
its socket, so the ranks may be other processes (``--tensor-parallel-size``)
and a scrape never disagrees with ``wcache status``. This module knows the
``status`` reply (the store's protocol) but not how ranks are found: the
caller passes a ``probe`` returning a :class:`Probe`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from wcache.errors import HttpListenFailed  # re-exported: its old home

__all__ = [
    "HttpListenFailed",
    "Probe",
    "OpsServer",
    "DaemonCollector",
    "parse_http_address",
    "LOOPBACK",
    "SNAPSHOT_STATES",
    "HEALTH_PATH",
    "METRICS_PATH",
]

log = logging.getLogger("wcache.store")

#: ``--http PORT`` (no host) binds here: the endpoints say which arenas exist and
#: who attaches, which other hosts need not learn unless the operator says so.
LOOPBACK = "127.0.0.1"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
#: A snapshot's states as ``status`` reports them (``wcache.daemon.serve.serve_rank``),
#: plus ``none`` (no --snapshot): each is one 0/1 series so a dashboard sees changes.
SNAPSHOT_STATES = ("none", "read", "writing", "written", "failed")
#: How ended attachments are counted (:attr:`DaemonServer.releases`).
RELEASE_HOWS = ("release", "disconnect")
#: An HTTP request (headers included) must arrive within this (seconds): probes
#: and scrapes send theirs at once; a silent client must not hold a thread.
REQUEST_TIMEOUT_S = 10.0


@attrs.frozen
class Probe:
    """One look at this node's ranks.

    Attributes:
        ready: every rank serves (``/health`` 200).
        code: the reason code when not ready, else None.
        message: one line for operators.
        ranks: the (tp_rank, pp_rank) pairs that must serve, sorted.
        statuses: ``((tp_rank, pp_rank), status reply)`` of each rank that answered.
    """

    ready: bool
    code: str | None
    message: str
    ranks: tuple[tuple[int, int], ...]
    statuses: tuple[tuple[tuple[int, int], Mapping[str, Any]], ...] = ()


def parse_http_address(spec: str) -> tuple[str, int]:
    """``--http`` as ``(host, port)``: ``PORT``, ``:PORT`` (both on
    :data:`LOOPBACK`), ``HOST:PORT`` or ``[IPV6]:PORT``.

    Raises:
        ValueError: no port, or a port outside 0..65535.
    """
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "", spec
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"--http {spec!r} is not [HOST:]PORT (e.g. 9400 for loopback, "
            f"0.0.0.0:9400 for every interface)"
        )
    return host or LOOPBACK, int(port)


def _labels(rank: tuple[int, int]) -> list[str]:
    return [str(rank[0]), str(rank[1])]


class DaemonCollector:
    """A ``prometheus_client`` collector: at each scrape, the figures of every rank
    from ``probe()`` (one socket ``status`` per rank)."""

    RANK = ("tp_rank", "pp_rank")

    def __init__(self, probe: Callable[[], Probe]):
        self._probe = probe

    def collect(self) -> Iterator[Any]:
        """The metric families of one probe (see the module docstring)."""
        p = self._probe()
        statuses = dict(p.statuses)
        ready = GaugeMetricFamily(
            "wcache_ready", "1 when every rank of this node serves (GET /health answers 200)"
        )
        ready.add_metric([], 1.0 if p.ready else 0.0)
        yield ready
        serving = GaugeMetricFamily(
            "wcache_rank_serving",
            "1 when this rank answers and serves its arena (not loading, not invalidated)",
            labels=list(self.RANK),
        )
        for rank in p.ranks:
            st = statuses.get(rank)
            serving.add_metric(_labels(rank), 1.0 if st and not st.get("invalidated") else 0.0)
        yield serving
        yield from self._rank_families(statuses)

    def _rank_families(self, statuses: dict[tuple[int, int], Mapping[str, Any]]) -> Iterator[Any]:
        rank_l = list(self.RANK)
        gauges = {
            "clients_connected": (
                "wcache_clients_connected",
                "open client connections (the scrape's own status connection left out)",
            ),
            "attachments_active": ("wcache_attachments_active", "attachments held now"),
            "bytes_held": ("wcache_bytes_held", "bytes of the arena this rank serves"),
            "tensors": ("wcache_tensors", "tensors in the arena's manifest"),
            "uptime_s": ("wcache_uptime_seconds", "seconds since the rank started serving"),
        }
        for key, (name, doc) in gauges.items():
            fam = GaugeMetricFamily(name, doc, labels=rank_l)
            for rank, st in statuses.items():
                fam.add_metric(_labels(rank), float(st.get(key) or 0))
            yield fam
        attaches = CounterMetricFamily(
            "wcache_attaches", "attachments served (get answered with the arena)", labels=rank_l
        )
        releases = CounterMetricFamily(
            "wcache_releases",
            "attachments ended, by how: release (asked) or disconnect (the client closed or died)",
            labels=[*rank_l, "how"],
        )
        refusals = CounterMetricFamily(
            "wcache_refusals",
            "error replies by reason code "
            "(key-mismatch and arena-invalidated make engines fall "
            "back to disk)",
            labels=[*rank_l, "code"],
        )
        invalidations = CounterMetricFamily(
            "wcache_invalidations",
            "arena invalidations (a client's restore guard fired; the rank exits)",
            labels=rank_l,
        )
        seeds = CounterMetricFamily(
            "wcache_seeds_served", "peers seeded from this rank", labels=rank_l
        )
        snapshot = GaugeMetricFamily(
            "wcache_snapshot_state",
            "1 for the snapshot's current state (none: no --snapshot)",
            labels=[*rank_l, "state"],
        )
        seed_listening = GaugeMetricFamily(
            "wcache_seed_listening",
            "1 when the rank accepts seed requests over TCP (--seed-listen)",
            labels=rank_l,
        )
        info = InfoMetricFamily(
            "wcache_rank", "where the rank's arena came from and how it is served", labels=rank_l
        )
        for rank, st in statuses.items():
            labels = _labels(rank)
            attaches.add_metric(labels, float(st.get("attachments_total") or 0))
            done = st.get("releases") or {}
            for how in sorted({*RELEASE_HOWS, *done}):
                releases.add_metric([*labels, how], float(done.get(how, 0)))
            for code, n in sorted((st.get("refusals") or {}).items()):
                refusals.add_metric([*labels, str(code)], float(n))
            invalidations.add_metric(labels, 1.0 if st.get("invalidated") else 0.0)
            seeds.add_metric(labels, float(st.get("seeds_served") or 0))
            current = (st.get("snapshot") or {}).get("state") or "none"
            for state in sorted({*SNAPSHOT_STATES, current}):
                snapshot.add_metric([*labels, state], 1.0 if state == current else 0.0)
            seed_listening.add_metric(labels, 1.0 if st.get("seed_listen") else 0.0)
            info.add_metric(
                labels,
                {
                    "origin": str(st.get("origin") or "unknown"),
                    "transport": str(st.get("transport")),
                    "device_id": str(st.get("device_id")),
                    "key_digest": str(st.get("key_digest", ""))[:16],
                    "pid": str(st.get("pid")),
                    "serving": str(st.get("serving") or "full"),
                },
            )
        yield from (
            attaches,
            releases,
            refusals,
            invalidations,
            seeds,
            snapshot,
            seed_listening,
            info,
        )


class _ThreadingHTTPServer6(ThreadingHTTPServer):
    """:class:`ThreadingHTTPServer` on an IPv6 address."""

    address_family = socket.AF_INET6


class OpsServer:
    """``/health`` and ``/metrics`` on ``host:port`` in a background thread.

    Args:
        host, port: the address to bind (port 0: a free one; see :attr:`address`).
        probe: returns this node's :class:`Probe` (called once per request). A
            picklable one (a ``functools.partial`` of a module function) lets the
            lean hand-off (:mod:`wcache.store.lean`) carry the endpoints over.
        listen_fd: an already bound, listening socket to serve on instead of
            binding ``host:port`` (the lean hand-off passes it across ``execve``).

    Raises:
        HttpListenFailed: the address cannot be bound.
    """

    #: Started and not stopped, in this process (what the lean hand-off carries over).
    running: ClassVar[set[OpsServer]] = set()

    def __init__(
        self, host: str, port: int, probe: Callable[[], Probe], *, listen_fd: int | None = None
    ):
        self.probe = probe
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(probe))
        handler = _handler_class(self)
        server_cls = _ThreadingHTTPServer6 if ":" in host else ThreadingHTTPServer
        try:
            if listen_fd is None:
                self._httpd = server_cls((host, port), handler)
            else:
                self._httpd = server_cls((host, port), handler, bind_and_activate=False)
                self._httpd.socket.close()
                self._httpd.socket = socket.socket(fileno=listen_fd)
                self._httpd.server_address = self._httpd.socket.getsockname()[:2]
        except OSError as e:
            raise HttpListenFailed(
                f"cannot serve --http on {host}:{port}: {e}; pick another address or port"
            ) from e
        self._httpd.daemon_threads = True
        self.address: tuple[str, int] = (host, self._httpd.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> OpsServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="wcache-http", daemon=True
        )
        self._thread.start()
        OpsServer.running.add(self)
        log.info(
            "health and metrics on http://%s:%d%s and %s", *self.address, HEALTH_PATH, METRICS_PATH
        )
        return self

    def stop(self) -> None:
        """Stop answering and close the listener. Idempotent."""
        self.pause()
        self._httpd.server_close()

    def pause(self) -> None:
        """Stop answering; the listener stays bound (:meth:`start` answers again)."""
        OpsServer.running.discard(self)
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None

    def fileno(self) -> int:
        """The listening socket's fd."""
        return self._httpd.socket.fileno()

    def health(self) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON body)`` of ``GET /health``."""
        p = self.probe()
        body = {
            "ready": p.ready,
            "code": p.code,
            "message": p.message,
            "ranks": [
                {
                    "tp_rank": r[0],
                    "pp_rank": r[1],
                    "serving": r in dict(p.statuses) and not dict(p.statuses)[r].get("invalidated"),
                }
                for r in p.ranks
            ],
        }
        return (200 if p.ready else 503), body

    def __enter__(self) -> OpsServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _handler_class(ops: OpsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:  # http.server's name
            path = self.path.split("?", 1)[0]
            try:
                if path == HEALTH_PATH:
                    status, body = ops.health()
                    self._send(status, "application/json", json.dumps(body).encode())
                elif path == METRICS_PATH:
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(ops.registry))
                else:
                    self._send(
                        404,
                        "text/plain",
                        f"{path}: not found; try {HEALTH_PATH} or {METRICS_PATH}\n".encode(),
                    )
            except Exception as e:  # a probe's failure is an answer, not a dead endpoint
                log.exception("wcache --http: %s failed", path)
                self._send(
                    503 if path == HEALTH_PATH else 500,
                    "application/json",
                    json.dumps(
                        {
                            "ready": False,
                            "code": getattr(e, "code", "internal-error"),
                            "message": f"{type(e).__name__}: {e}",
                        }
                    ).encode(),
                )

        def _send(self, status: int, ctype: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:  # probes every few seconds: DEBUG
            log.debug("http %s " + fmt, self.address_string(), *args)

    return Handler
