"""`wcache serve --http`: /health and /metrics against one real `wcache serve` daemon on the
SmolLM2 bf16 fixture (CPU), shared by the module; no engine starts. The invalidation test
runs last: it ends the daemon."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from wcache.daemon import ready as ready_mod
from wcache.daemon.process import DaemonProcess, free_port
from wcache.store import CacheKey, KeyMismatch, attach, daemon_status, invalidate_daemon
from wcache.store.http import OpsServer, parse_http_address
from wcache.store.lean import LEAN_LINE
from wcache.store.paths import list_sockets
from wcache.store.server import INVALIDATED_EXIT

pytestmark = pytest.mark.slow

#: /health is polled this often while the daemon loads (seconds): far below a load of
#: tens of seconds, so the first answer comes while the rank still loads.
POLL_S = 0.1
#: One HTTP request to a local endpoint; the probe asks one socket, in milliseconds.
HTTP_TIMEOUT_S = 10.0
#: The lean hand-off after the ready line (an interpreter start and the store
#: imports: well under a second) is awaited this long (seconds).
LEAN_WAIT_S = 60.0
#: Issue 28's target: a ready CPU daemon's resident memory beyond its arena.
LEAN_TARGET_BYTES = 150 * 2**20
#: The invalidated daemon exits after INVALIDATED_LINGER_S; give it this long.
EXIT_WAIT_S = 30.0


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by (name, sorted labels), parsed by prometheus_client."""
    status, text = _get(f"{url}/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _k(
    name: str, tp_rank: int | None = 0, **labels: str
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A sample's key in :func:`_metrics`: rank 0's series unless ``tp_rank=None``."""
    if tp_rank is not None:
        labels = {**labels, "tp_rank": str(tp_rank), "pp_rank": "0"}
    return name, tuple(sorted(labels.items()))


class Served:
    def __init__(self, model: str, sock_dir: str, url: str):
        self.model, self.sock_dir, self.url = model, sock_dir, url
        self.first: tuple[int, str] | None = None
        self.daemon: DaemonProcess | None = None

    @property
    def sock(self) -> str:
        return list_sockets(self.sock_dir)[0]


@pytest.fixture(scope="module")
def served():
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    sock_dir = tempfile.mkdtemp(prefix="wch-")
    os.chmod(sock_dir, 0o700)
    port = free_port()
    s = Served(model, sock_dir, f"http://127.0.0.1:{port}")
    s.daemon = DaemonProcess(model, sock_dir, ["--http", f"127.0.0.1:{port}"])
    failure: list[BaseException] = []

    def start() -> None:
        try:
            s.daemon.start()
        except BaseException as e:  # noqa: BLE001  (re-raised below in the test thread)
            failure.append(e)

    starter = threading.Thread(target=start)
    starter.start()
    while starter.is_alive() and s.first is None:  # the first answer of /health
        try:
            s.first = _get(f"{s.url}/health")
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(POLL_S)
    starter.join()
    if failure:
        raise failure[0]
    try:
        yield s
    finally:
        s.daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_health_is_503_while_loading_then_200(served):
    """/health answers 503 daemon-missing while the rank loads and 200 once it serves."""
    assert served.first is not None
    status, body = served.first
    assert (status, json.loads(body)["code"]) == (503, "daemon-missing")
    status, body = _get(f"{served.url}/health")
    doc = json.loads(body)
    assert (status, doc["ready"], doc["code"]) == (200, True, None)
    assert doc["ranks"] == [{"tp_rank": 0, "pp_rank": 0, "serving": True}]


def test_ready_daemon_serves_lean_and_keeps_both_endpoints(served):
    """After ready the same pid serves without torch (no libtorch mapped, under issue 28's
    150 MiB beyond the arena) and still answers /health 200 and /metrics."""
    deadline = time.monotonic() + LEAN_WAIT_S
    while (st := daemon_status(served.sock))["serving"] != "lean" and time.monotonic() < deadline:
        time.sleep(POLL_S)
    pid = served.daemon.pid
    assert ("lean", False, pid) == (st["serving"], st["torch_loaded"], st["pid"])
    assert "" == st["job"]  # serve's --job (none here), kept across the lean hand-off

    def said_lean() -> bool:
        return any(ln.startswith(f"{LEAN_LINE} pid={pid} ") for ln in list(served.daemon.lines))

    # the daemon's stdout is read by a thread: on a busy host its lean line can reach
    # `lines` after the status already says lean
    while not said_lean() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert said_lean()
    with open(f"/proc/{pid}/maps") as f:
        assert "libtorch" not in f.read()
    with open(f"/proc/{pid}/status") as f:
        rss = dict(line.split(":", 1) for line in f)
    beyond = (int(rss["VmRSS"].split()[0]) - int(rss["RssShmem"].split()[0])) * 1024
    assert beyond < LEAN_TARGET_BYTES
    status, body = _get(f"{served.url}/health")
    assert (status, json.loads(body)["ready"]) == (200, True)
    metrics = _metrics(served.url)
    assert metrics[_k("wcache_bytes_held")] == float(st["bytes_held"])
    assert ["lean"] == [
        dict(labels)["serving"] for (name, labels) in metrics if name == "wcache_rank_info"
    ]


def test_health_matches_wait_ready(served):
    """/health's verdict is `wcache status --wait-ready`'s for the same engine arguments."""
    from wcache.daemon.process import ENGINE_ARGS

    spec = ready_mod.engine_ready_spec(served.model, list(ENGINE_ARGS))
    result = ready_mod.check_ready(served.sock_dir, spec)
    assert (result.ok, result.code) == (True, None)


def test_health_is_503_for_a_rank_not_ready(served):
    """With a second rank expected that no daemon serves, /health is 503 naming that rank."""
    from wcache.daemon.process import ENGINE_ARGS

    spec = ready_mod.engine_ready_spec(served.model, list(ENGINE_ARGS))
    two = ready_mod.ReadySpec(spec.digest, [(0, 0), (1, 0)], spec.fields)
    with OpsServer("127.0.0.1", 0, lambda: ready_mod.probe(served.sock_dir, two)) as ops:
        status, body = _get(f"http://127.0.0.1:{ops.address[1]}/health")
        metrics = _metrics(f"http://127.0.0.1:{ops.address[1]}")
    doc = json.loads(body)
    assert (status, doc["ready"], doc["code"]) == (503, False, "daemon-missing")
    assert "tp_rank=1 pp_rank=0" in doc["message"] and "1/2 ranks serve" in doc["message"]
    assert [r["serving"] for r in doc["ranks"]] == [True, False]
    assert metrics[_k("wcache_ready", None)] == 0.0
    assert metrics[_k("wcache_rank_serving")] == 1.0
    assert metrics[_k("wcache_rank_serving", 1)] == 0.0


def test_metrics_counters_move_after_attach_and_release(served):
    """An attach, a release and a key-mismatch refusal each move their /metrics series by one."""
    st = daemon_status(served.sock)
    key = CacheKey(st["key_fields"])
    before = _metrics(served.url)
    assert before[_k("wcache_bytes_held")] == float(st["bytes_held"]) > 0
    assert before[_k("wcache_ready", None)] == 1.0
    att = attach(key, socket_dir=served.sock_dir, device_id=st["device_id"])
    during = _metrics(served.url)
    att.close()
    wrong = CacheKey({**st["key_fields"], "dtype": "torch.float16"})
    with pytest.raises(KeyMismatch):
        attach(wrong, socket_dir=served.sock_dir, device_id=st["device_id"])
    after = _metrics(served.url)
    attaches, active = _k("wcache_attaches_total"), _k("wcache_attachments_active")
    released = _k("wcache_releases_total", how="release")
    mismatch = _k("wcache_refusals_total", code="key-mismatch")
    assert (during[attaches], during[active]) == (before[attaches] + 1, 1.0)
    assert (after[attaches], after[active]) == (before[attaches] + 1, 0.0)
    assert after[released] == before[released] + 1
    assert after[mismatch] == before.get(mismatch, 0.0) + 1
    assert after[_k("wcache_snapshot_state", state="none")] == 1.0
    assert after[_k("wcache_invalidations_total")] == 0.0


def test_unknown_path_is_404(served):
    """A path other than /health and /metrics is 404 naming both."""
    status, body = _get(f"{served.url}/ready")
    assert status == 404 and "/health" in body and "/metrics" in body


def test_invalidated_arena_is_503_with_its_reason(served):
    """After a client invalidates the arena, /health is 503 arena-invalidated with the reason
    and /metrics counts the invalidation; the daemon then exits with INVALIDATED_EXIT."""
    st = daemon_status(served.sock)
    assert invalidate_daemon(
        served.sock, CacheKey(st["key_fields"]), "guard-failed", "test: a shared tensor changed"
    )
    status, body = _get(f"{served.url}/health")
    metrics = _metrics(served.url)
    doc = json.loads(body)
    assert (status, doc["ready"], doc["code"]) == (503, False, "arena-invalidated")
    assert "[guard-failed]: test: a shared tensor changed" in doc["message"]
    assert metrics[_k("wcache_invalidations_total")] == 1.0
    assert metrics[_k("wcache_rank_serving")] == 0.0
    assert served.daemon.proc.wait(EXIT_WAIT_S) == INVALIDATED_EXIT


def test_http_address_parsing():
    """A bare port binds loopback; HOST:PORT and [IPv6]:PORT keep the host; junk is refused."""
    assert parse_http_address("9400") == ("127.0.0.1", 9400)
    assert parse_http_address(":9400") == ("127.0.0.1", 9400)
    assert parse_http_address("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_http_address("[::1]:9400") == ("::1", 9400)
    with pytest.raises(ValueError, match="is not \\[HOST:\\]PORT"):
        parse_http_address("host:http")


def test_engine_counters_line():
    """The engine's counters add restores and their time, and fallbacks by reason code."""
    from wcache.vllm.loader import EngineCounters

    c = (
        EngineCounters()
        .record("restore", 0.25)
        .record("fallback", 3.0, "key-mismatch")
        .record("restore", 0.5)
        .record("fallback", 2.0, "daemon-missing")
        .record("fallback", 1.0, "key-mismatch")
    )
    assert (c.restores, c.restore_s, c.fallbacks) == (
        2,
        0.75,
        (("daemon-missing", 1), ("key-mismatch", 2)),
    )
    assert c.line() == "restores=2 restore_s=0.750 fallbacks=3 (daemon-missing=1 key-mismatch=2)"
