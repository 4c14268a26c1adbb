"""Wire protocol between a daemon and its clients over a Unix socket.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack
(a map). Nothing is ever unpickled: msgpack carries only maps, lists, strings,
bytes, numbers, booleans and nil. File descriptors (the arena memfd) travel as
SCM_RIGHTS ancillary data on the first bytes of a frame.

Commands (``{"op": ...}``), each answered by ``{"ok": true, ...}`` or
``{"ok": false, "code": <reason code>, "message": ...}``:

* ``hello {protocol, wcache}`` -> ``{protocol, wcache, pid, device, device_id, transport}``;
  must come first; another protocol version is refused.
* ``get {key, mode, transport}`` -> ``{manifest, handle}`` (+ memfd), or
  ``code="key-mismatch"`` with ``fields`` (sorted differing names).
* ``release {}`` -> the client dropped its mapping (copy mode or close).
* ``status {}`` -> memory held, clients, uptime, key, pid.
* ``shutdown {}`` -> the daemon stops after answering.
* ``artifacts {}`` -> ``{manifest}`` (+ a sealed memfd holding the start-up
  artifact bundle's tar, :mod:`wcache.store.artifacts`), or
  ``code="artifacts-missing"`` when the daemon holds none. The bytes never
  travel inside a frame.
* ``invalidate {key, code, message}`` -> a client's restore guard fired on this
  arena: the daemon answers, refuses every later ``get`` with
  ``code="arena-invalidated"``, shows the reason in ``status`` and exits
  (status 75, EX_TEMPFAIL) after :data:`~wcache.store.server.INVALIDATED_LINGER_S`.

Seeding over TCP (``wcache serve --seed-listen``, another host) uses the same
frames on a TCP connection that carries exactly one ``seed`` exchange, with a
shared-secret challenge-response instead of the Unix socket's uid check: the
daemon sends ``{"op": "challenge", "nonce", "protocol", "wcache"}``; the
client answers ``{"op": "seed", ..., "nonce": <its own>, "mac":
HMAC-SHA256(secret, "wcache-seed-request" || daemon nonce || SHA-256(request))}``;
the daemon's reply carries ``"mac": HMAC-SHA256(secret, "wcache-seed-reply" ||
client nonce || SHA-256(reply))``, so each side proves it knows the secret and
the secret never travels (:func:`seed_mac`).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import os
import socket
import struct
import sys
import time
from typing import Any

import msgpack

from wcache.errors import ConnectionClosed  # re-exported: its old home
from wcache.store.errors import KeyMismatch, ProtocolError, StoreError
from wcache.store.manifest import CacheKey, canonical_json

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_KEY_FIELDS",
    "HEADER",
    "OPS",
    "REQUEST_FIELDS",
    "REQUIRED_FIELDS",
    "check_request",
    "send_frame",
    "recv_frame",
    "error_frame",
    "raise_for_error",
    "ConnectionClosed",
    "seed_mac",
    "SEED_NONCE_BYTES",
    "SEED_REQUEST_LABEL",
    "SEED_REPLY_LABEL",
    "SEED_BACKENDS",
    "SEED_CHUNK_BYTES",
    "check_seed_request",
    "pin_map_keys",
]

PROTOCOL_VERSION = 1
# Largest frame either side accepts, checked before allocating: a manifest of
# ~100k tensors is ~10 MiB of msgpack, so 64 MiB leaves room without letting a
# bad length header make us allocate gigabytes.
MAX_FRAME_BYTES = 64 << 20
#: Largest request a daemon reads (a client's ``hello``/``get``/``seed``, bytes): a
#: request is a key of a few dozen fields (a few KiB, tens with hundreds of checkpoint
#: shards), so this bounds what a flood of half-sent frames can make a daemon hold,
#: before any authentication (TCP seeding), where replies keep :data:`MAX_FRAME_BYTES`.
MAX_REQUEST_BYTES = 4 << 20
#: Most top-level fields a client's key may have: a real key has a few dozen
#: (:func:`wcache.vllm.key.build_key`); more is not a key, and comparing it would
#: only cost the daemon time.
MAX_KEY_FIELDS = 1024
#: A large frame's buffer grows with the bytes that arrive, from this size, doubling:
#: a header claiming megabytes costs the reader only what the peer really sent.
_RECV_GROW_FROM = 1 << 20
HEADER = struct.Struct(">I")
# SCM_RIGHTS carries at most SCM_MAX_FD (253) descriptors per message; we send 1.
MAX_FDS_PER_FRAME = 1
_NONE = type(None)
#: Every command's fields besides ``op`` and the types each may have (a bool is
#: never an int here). :func:`check_request` refuses any other field or type.
REQUEST_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"protocol": (int,), "wcache": (str, _NONE)},
    "get": {"key": (dict,), "mode": (str, _NONE), "transport": (str, _NONE)},
    "release": {},
    "status": {},
    "shutdown": {},
    "invalidate": {"key": (dict,), "code": (str, _NONE), "message": (str, _NONE)},
    "seed": {"key": (dict,), "backend": (str, _NONE), "nonce": (str, _NONE), "mac": (str, _NONE)},
    "artifacts": {},
}
#: Fields a command cannot do without.
REQUIRED_FIELDS: dict[str, frozenset[str]] = {
    "hello": frozenset({"protocol"}),
    "get": frozenset({"key"}),
    "invalidate": frozenset({"key"}),
    "seed": frozenset({"key"}),
}
OPS = frozenset(REQUEST_FIELDS)
#: Random bytes per challenge nonce (256 bits: never repeats, cannot be guessed).
SEED_NONCE_BYTES = 32
#: Domain labels of the two MACs, so a request's MAC can never pass as a reply's.
SEED_REQUEST_LABEL = b"wcache-seed-request\0"
SEED_REPLY_LABEL = b"wcache-seed-reply\0"
#: torch.distributed backend a source seeds over, per device type (a CUDA source
#: also seeds over gloo when asked).
SEED_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
#: Bytes per broadcast: gloo's TCP transport handles messages below 2 GiB best,
#: and chunks let both sides report progress; 256 MiB costs one round trip per
#: chunk, negligible against the transfer.
SEED_CHUNK_BYTES = 256 << 20


#: Overrides the seeding timeout (seconds, > 0; :func:`wcache.store.seed.seed_timeout_s`):
#: ``wcache serve --seed-timeout`` sets it, so every rank process and seeding helper
#: reads the same value.
SEED_TIMEOUT_ENV = "WCACHE_SEED_TIMEOUT_S"


def parse_seconds(text: str, *, zero: bool = False) -> float:
    """``text`` as a positive, finite number of seconds (``--seed-timeout``,
    ``WCACHE_SEED_TIMEOUT_S``, ``wcache template start --timeout``); with ``zero``,
    0 too (``wcache status --wait-ready --timeout 0`` checks once). ``nan`` and
    ``inf`` are refused: a wait until either never ends (``nan`` compared the other
    way ends at once).

    Raises:
        ValueError: not a number, or below 0 (0 too without ``zero``), or not finite.
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 <= value if zero else 0 < value) or not value < float("inf"):
        kind = "finite number of seconds >= 0" if zero else "positive number of seconds"
        raise ValueError(f"{text!r} is not a {kind}")
    return value


def check_seed_request(req: dict[str, Any], server: Any) -> tuple[dict[str, Any] | None, str]:
    """A ``seed`` request checked against the source ``server`` (a
    :class:`wcache.store.server.DaemonServer`): ``(the key-mismatch reply, "")``
    when the receiver's key differs (the fields named, as ``get`` answers, led by
    both sides' versions when they run different releases), else
    ``(None, the backend to seed over)``. Torch-free: the full and the lean
    server's seeding both start here.

    Raises:
        ProtocolError: no key map, or a backend this device cannot seed over.
        StoreError: the arena was invalidated.
    """
    fields = req.get("key")
    if not isinstance(fields, dict):
        raise ProtocolError("seed needs a key map")
    theirs = CacheKey(fields)
    if theirs != server.key:
        diff = server.key.diff(theirs)
        return {
            "ok": False,
            "code": KeyMismatch.code,
            "fields": diff,
            "theirs": {k: server.key.fields.get(k) for k in diff},
            "message": f"{theirs.versions_note(server.key, 'receiver', 'source')}seeding "
            f"source's key differs in {', '.join(diff)}: "
            f"{theirs.describe_diff(server.key, 'receiver', 'source')}; start "
            f"the receiver with the source's engine arguments, or from the "
            f"checkpoint",
        }, ""
    device_type = server.device_type
    backend = req.get("backend") or SEED_BACKENDS[device_type]
    allowed = {SEED_BACKENDS[device_type]} | ({"gloo"} if device_type == "cuda" else set())
    if backend not in allowed:
        raise ProtocolError(
            f"receiver asks for backend {backend!r}; a {device_type} "
            f"daemon seeds over {' or '.join(sorted(allowed))}"
        )
    if server.invalidated:
        raise StoreError("this daemon's arena was invalidated; it seeds no one")
    return None, backend


def pin_map_keys(value: Any) -> frozenset[str]:
    """Every map key in the JSON-like ``value``, at every depth, interned
    (``sys.intern``); a server holds the result for as long as it serves.

    msgpack interns each map key it decodes (``PyUnicode_InternInPlace``). A key
    name nothing else holds (the cache key's field names: the server's copy came
    from ``json.loads``, which does not intern) is added to the interpreter's
    interned-string table by every request that carries it and removed when the
    request is freed. Each such add takes a fresh slot of the table, so the
    churn of a few hundred names per ``get`` soon makes the table resize, once
    into a table twice as large (+0.5 MiB in the lean serving process: the
    "RSS grows after warm-up, then levels off" of docs/benchmarks.md). With the
    names held, decoding finds them in the table and adds nothing.
    """
    out: set[str] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            out.update(sys.intern(k) for k in v if isinstance(k, str))
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return frozenset(out)


def send_frame(sock: socket.socket, obj: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """Send one msgpack frame, with ``fds`` attached to its first bytes.

    Raises:
        ProtocolError: the frame exceeds :data:`MAX_FRAME_BYTES` or holds a
            value msgpack cannot carry.
    """
    try:
        payload = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"frame cannot be encoded: {e}") from e
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    data = HEADER.pack(len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exact(
    sock: socket.socket,
    n: int,
    fds: list[int],
    want_fds: int,
    deadline: float | None = None,
) -> bytes | None:
    """Read exactly n bytes (None when the peer closed before the first byte), by
    ``deadline`` (``time.monotonic()``) when given, else under the socket's timeout
    per read. The buffer grows with what arrives (:data:`_RECV_GROW_FROM`, doubling).

    Raises:
        TimeoutError: the deadline passed (or the socket's timeout, per read).
        ProtocolError: the peer closed mid-read or sent more descriptors than asked.
    """
    buf = bytearray(min(n, _RECV_GROW_FROM))
    got = 0
    while got < n:
        if got == len(buf):  # full: grow by what has arrived, never ahead of it
            buf.extend(bytes(min(len(buf), n - len(buf))))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        view = memoryview(buf)[got:]
        try:
            if want_fds and not fds:
                anc_size = socket.CMSG_SPACE(want_fds * array.array("i").itemsize)
                nbytes, anc, flags, _ = sock.recvmsg_into([view], anc_size)
                for level, kind, cdata in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        arr = array.array("i")
                        arr.frombytes(cdata[: len(cdata) - len(cdata) % arr.itemsize])
                        fds.extend(arr)
                if flags & socket.MSG_CTRUNC:
                    raise ProtocolError("peer sent more descriptors than expected")
            else:
                nbytes = sock.recv_into(view)
        finally:
            view.release()
        if nbytes == 0:
            if got == 0:
                return None
            raise ProtocolError(f"connection closed mid-frame ({got} of {n} bytes)")
        got += nbytes
    return bytes(buf)


def recv_frame(
    sock: socket.socket,
    max_fds: int = 0,
    frame_timeout_s: float | None = None,
    max_bytes: int = MAX_FRAME_BYTES,
) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame and the descriptors attached to it.

    Waiting for a frame to start uses the socket's own timeout (the daemon
    waits forever: an attached client may stay idle); once its first byte has
    arrived, the whole rest must follow within ``frame_timeout_s`` (when given: a
    deadline, not a per-read timeout), so a stalled or trickled half frame cannot
    hold a handler thread forever. A length over ``max_bytes`` (a daemon reads
    requests with :data:`MAX_REQUEST_BYTES`) is refused before any payload is
    read, and the buffer grows only with the bytes that arrive.

    Descriptors received with a frame that turns out bad are closed.

    Raises:
        ConnectionClosed: the peer closed between frames.
        ProtocolError: truncated, stalled, oversized (checked before
            allocating), not msgpack, not a map, or more descriptors than ``max_fds``.
    """
    fds: list[int] = []
    old_timeout = sock.gettimeout()
    try:
        first = _recv_exact(sock, 1, fds, max_fds)
        if first is None:
            raise ConnectionClosed("peer closed the connection")
        deadline = None if frame_timeout_s is None else time.monotonic() + frame_timeout_s
        try:
            header = first + (_recv_exact(sock, HEADER.size - 1, fds, max_fds, deadline) or b"")
            if len(header) != HEADER.size:
                raise ProtocolError("connection closed inside a frame header")
            (length,) = HEADER.unpack(header)
            if length > max_bytes:
                raise ProtocolError(f"frame length {length} exceeds the {max_bytes}-byte limit")
            payload = _recv_exact(sock, length, fds, max_fds, deadline) if length else b""
            if payload is None:
                raise ProtocolError("connection closed after a frame header")
        except TimeoutError:
            raise ProtocolError(f"frame not completed within {frame_timeout_s} s") from None
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:  # noqa: BLE001 (msgpack raises several unrelated types on bad input)
            raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"frame is a {type(obj).__name__}, not a map")
        if len(fds) > max_fds:
            raise ProtocolError(f"frame carried {len(fds)} descriptors, at most {max_fds} expected")
        return obj, fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise
    finally:
        if frame_timeout_s is not None:
            sock.settimeout(old_timeout)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def seed_mac(secret: bytes, label: bytes, nonce_hex: str, frame: dict[str, Any]) -> str:
    """HMAC-SHA256 (hex) of ``label || nonce || SHA-256(canonical JSON of frame)``.

    ``frame`` is taken without its ``"mac"`` entry; canonical JSON (sorted keys,
    no spaces) makes both ends digest the same bytes whatever order msgpack
    delivered the map in.

    Raises:
        ProtocolError: ``nonce_hex`` is not hex, or ``frame`` holds a value JSON cannot carry.

    Source: RFC 2104 (HMAC) through Python's ``hmac``/``hashlib``; compare with
    ``hmac.compare_digest``.
    """
    try:
        nonce = bytes.fromhex(nonce_hex)
        body = canonical_json({k: v for k, v in frame.items() if k != "mac"}).encode()
    except (TypeError, ValueError, StoreError) as e:
        raise ProtocolError(f"seed frame cannot be authenticated: {e}") from None
    return hmac.new(
        secret, label + nonce + hashlib.sha256(body).digest(), hashlib.sha256
    ).hexdigest()


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("nil" if t is _NONE else t.__name__ for t in types)


def check_request(req: dict[str, Any]) -> str:
    """The command of a well-formed request frame.

    Well-formed: ``op`` is a string naming a command, every other field is one
    that command takes (:data:`REQUEST_FIELDS`) with one of its types (a bool is
    never taken for an int), the required fields (:data:`REQUIRED_FIELDS`) are
    there, and a ``key`` has at most :data:`MAX_KEY_FIELDS` fields (comparing a
    larger one would only cost the daemon time).

    Raises:
        ProtocolError: naming the first offending field, its type and what was expected.
    """
    op = req.get("op")
    if not isinstance(op, str):
        raise ProtocolError(
            f"'op' must be a string naming a command, not "
            f"{type(op).__name__}; commands: {sorted(OPS)}"
        )
    if op not in REQUEST_FIELDS:
        raise ProtocolError(f"unknown command {op[:40]!r}; expected one of {sorted(OPS)}")
    fields = REQUEST_FIELDS[op]
    for name, value in req.items():
        if name == "op":
            continue
        if name not in fields:
            raise ProtocolError(
                f"{op} takes no field {str(name)[:40]!r}; its fields: {sorted(fields) or 'none'}"
            )
        allowed = fields[name]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ProtocolError(
                f"{op}: field {name!r} must be {_type_names(allowed)}, not {type(value).__name__}"
            )
    missing = sorted(REQUIRED_FIELDS.get(op, frozenset()) - set(req))
    if missing:
        raise ProtocolError(f"{op} needs the field(s) {missing}")
    key = req.get("key")
    if key is not None and len(key) > MAX_KEY_FIELDS:  # a map: checked above
        raise ProtocolError(
            f"key has {len(key)} fields, at most {MAX_KEY_FIELDS}: not a wcache key"
        )
    return op


def error_frame(err: BaseException) -> dict[str, Any]:
    """The error answer for an exception (its reason code and message)."""
    code = getattr(err, "code", None) or "internal-error"
    frame = {"ok": False, "code": code, "message": f"{type(err).__name__}: {err}"}
    if hasattr(err, "fields"):
        frame["fields"] = list(err.fields)
    return frame


def raise_for_error(reply: dict[str, Any], errors: dict[str, type[StoreError]]) -> dict[str, Any]:
    """Return ``reply`` when ``ok``, else raise the error class of its code."""
    if reply.get("ok") is True:
        return reply
    if reply.get("ok") is not False:
        raise ProtocolError(f"reply has no ok flag: {sorted(reply)[:8]}")
    code = str(reply.get("code", "protocol-error"))
    message = str(reply.get("message", "daemon gave no message"))
    cls = errors.get(code, StoreError)
    err = cls(f"daemon: {message}")
    if cls is StoreError:
        err.code = code
    raise err
