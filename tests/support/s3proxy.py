"""A fault-injecting HTTP/1.1 proxy on loopback, between an S3 client and the test server.

It forwards every request byte for byte (so SigV4 signatures still verify) and applies
run-time :class:`Rule` s matched on method, path, query keys and request headers:

* ``status``      answer with an S3 XML error (503 SlowDown, 500 InternalError, 409 ...)
                  without forwarding;
* ``delay``       sleep, then forward;
* ``reset_body``  read half of the request body, then reset the connection (RST) - a
                  connection lost mid-part;
* ``cut_response`` forward, then send the headers and half of the response body and close
                  (a response cut short);
* ``reset_response`` forward, send headers and half the body, then RST;
* ``drop_response`` forward (the server applies the request), then reset the connection
                  without sending a byte back - the ambiguous outcome;
* ``error_200``   answer 200 with an S3 ``<Error>`` body without forwarding (S3 does this on
                  CompleteMultipartUpload when it fails after sending the status);
* ``strip_header`` forward without the header named by ``header`` (a store that ignores a
                  precondition; the loopback server does not check signatures);
* ``short_200``   forward, then answer ``200 OK`` with half the body and an honest
                  ``Content-Length`` (no ``Content-Range``): a store that serves a ranged GET
                  with fewer bytes and says nothing wrong; ``short_206`` the same as a
                  ``206`` whose ``Content-Range`` names the shorter range it sends;
* ``hang``        read the request, then never answer (nor forward) until the proxy stops
                  or the rule is cleared (then the connection is dropped): a store that
                  accepts connections and never replies.

A rule with ``body_regex`` matches only requests whose body it is found in (while one
is armed, bodies are read before rules are matched). ``seen`` records every request, with
its query's values in ``params``.

With ``echo_auth`` a ``status`` answer quotes the request's Authorization header in its
message, as some S3 errors echo the access key id - for the credential-redaction tests.

It runs its own asyncio loop in a daemon thread so sync and async clients can use it; every
read has a timeout and the proxy stops itself after ``max_lifetime`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

_IO_TIMEOUT = 60.0


@dataclass
class Rule:
    """One fault: ``action`` for the next ``times`` requests that match every given filter."""

    action: str
    method: str | None = None
    path_contains: str | None = None
    path_regex: str | None = None  # re.search on the path, beside path_contains
    query_has: tuple[str, ...] = ()
    query_lacks: tuple[str, ...] = ()
    header: tuple[str, str] | None = None  # (lower-case name, value) that must be present
    body_regex: bytes | None = None  # re.search on the request body (bodies are read before matching)
    times: int = 1
    status: int = 503
    code: str = "SlowDown"
    delay: float = 0.0
    echo_auth: bool = False
    hits: int = 0

    def matches(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
                body: bytes | None = None) -> bool:
        if self.hits >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        if self.path_contains is not None and self.path_contains not in path:
            return False
        if self.path_regex is not None and re.search(self.path_regex, path) is None:
            return False
        if any(k not in query for k in self.query_has) or any(k in query for k in self.query_lacks):
            return False
        if self.body_regex is not None and (body is None or re.search(self.body_regex, body) is None):
            return False
        return not (self.header is not None and headers.get(self.header[0]) != self.header[1])


@dataclass
class Seen:
    """One request as the proxy saw it."""

    method: str
    path: str
    query: tuple[str, ...]
    action: str | None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)  # the query's values (the first of each)


class FaultProxy:
    """Loopback proxy to ``127.0.0.1:upstream_port``; ``add(Rule(...))`` arms a fault."""

    def __init__(self, upstream_port: int, max_lifetime: float = 900.0) -> None:
        self.upstream_port = upstream_port
        self.max_lifetime = max_lifetime
        self.port = 0
        self.rules: list[Rule] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.seen.clear()

    def count(self, method: str, *query_has: str) -> int:
        """How many requests with ``method`` and all ``query_has`` keys arrived so far."""
        with self._lock:
            return sum(1 for s in self.seen if s.method == method and all(k in s.query for k in query_has))

    def _pick(self, method: str, target: str, headers: dict[str, str], body: bytes | None = None) -> Rule | None:
        parts = urlsplit(target)
        query = parse_qs(parts.query, keep_blank_values=True)
        with self._lock:
            chosen = None
            for r in self.rules:
                if r.matches(method, parts.path, query, headers, body):
                    r.hits += 1
                    chosen = r
                    break
            self.seen.append(Seen(method, parts.path, tuple(sorted(query)), chosen.action if chosen else None, headers,
                                  {k: v[0] for k, v in query.items()}))
            return chosen

    def _wants_body(self) -> bool:
        with self._lock:
            return any(r.body_regex is not None and r.hits < r.times for r in self.rules)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> FaultProxy:
        self._thread = threading.Thread(target=self._main, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("fault proxy did not start")
        if self._error is not None:
            raise RuntimeError(f"fault proxy failed to start: {self._error!r}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start() / ignored at exit
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            tasks.add(task)
            try:
                await self._client(reader, writer)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                pass
            except asyncio.CancelledError:
                pass  # shutting down; asyncio's stream callback must not see a cancelled task
            finally:
                tasks.discard(task)
                _abort(writer)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0, limit=1 << 20)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.max_lifetime)
        server.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5.0)

    # -- one client connection ---------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r: asyncio.StreamReader | None = None
        up_w: asyncio.StreamWriter | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                request_line, headers, raw_head = head
                method, target, _ = request_line.split(" ", 2)
                length = int(headers.get("content-length", "0") or 0)
                early: bytes | None = None
                if self._wants_body():  # a rule matches on the body: read it first
                    early = await asyncio.wait_for(reader.readexactly(length), _IO_TIMEOUT) if length else b""
                rule = self._pick(method, target, headers, early)
                action = rule.action if rule else None
                if action == "reset_body" and early is None:
                    if length > 1:
                        await asyncio.wait_for(reader.readexactly(length // 2), _IO_TIMEOUT)
                    _reset(writer)
                    return
                if early is not None:
                    body = early
                else:
                    body = await asyncio.wait_for(reader.readexactly(length), _IO_TIMEOUT) if length else b""
                if action == "status":
                    assert rule is not None
                    echo = headers.get("authorization", "") if rule.echo_auth else ""
                    writer.write(_error_response(rule.status, rule.code, echo))
                    await writer.drain()
                    continue
                if action == "hang":
                    assert self._stop is not None and rule is not None
                    # polled: clear() runs on the test's thread, which has no event of this loop
                    while not self._stop.is_set() and rule in self.rules:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    return  # the connection is dropped: the client sees it fail
                if action == "error_200":
                    writer.write(_error_response(200, "InternalError"))
                    await writer.drain()
                    continue
                if action == "strip_header":
                    assert rule is not None and rule.header is not None
                    raw_head = _strip(raw_head, rule.header[0])
                if action == "delay":
                    assert rule is not None
                    await asyncio.sleep(rule.delay)
                if up_w is None:
                    up_r, up_w = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", self.upstream_port, limit=1 << 20), _IO_TIMEOUT
                    )
                assert up_r is not None
                up_w.write(raw_head + body)
                await up_w.drain()
                status_head, resp_headers, resp_body = await _read_response(up_r, method)
                if resp_headers.get("connection", "").lower() == "close":
                    _abort(up_w)
                    up_r = up_w = None
                if action == "drop_response":
                    _reset(writer)
                    return
                if action in ("cut_response", "reset_response"):
                    writer.write(status_head + resp_body[: len(resp_body) // 2])
                    await writer.drain()
                    if action == "reset_response":
                        _reset(writer)
                    else:
                        writer.close()
                    return
                if action in ("short_200", "short_206") and "content-range" in resp_headers:
                    writer.write(_shortened(status_head, resp_headers, resp_body, action == "short_206"))
                    await writer.drain()
                    continue
                writer.write(status_head + resp_body)
                await writer.drain()
        finally:
            if up_w is not None:
                _abort(up_w)


def _shortened(status_head: bytes, headers: dict[str, str], body: bytes, partial: bool) -> bytes:
    """A ranged GET's answer with the first half of ``body``: ``200 OK`` without a range, or
    (``partial``) a ``206`` whose ``Content-Range`` names the shorter range; either with an
    honest ``Content-Length``."""
    short = body[: len(body) // 2]
    kept = [ln for ln in status_head.split(b"\r\n")[1:]
            if ln and not ln.lower().startswith((b"content-length:", b"content-range:"))]  # fmt: skip
    if partial:
        first = int(headers["content-range"].split()[1].split("-")[0])
        total = headers["content-range"].rsplit("/", 1)[1].encode()
        last = first + len(short) - 1
        status = [b"HTTP/1.1 206 Partial Content", b"Content-Range: bytes %d-%d/%s" % (first, last, total)]
    else:
        status = [b"HTTP/1.1 200 OK"]
    return b"\r\n".join([*status, *kept, b"Content-Length: %d" % len(short)]) + b"\r\n\r\n" + short


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
    except asyncio.IncompleteReadError:
        return None
    lines = raw.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers, raw


async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[bytes, dict[str, str], bytes]:
    """One upstream response: its raw head, parsed headers and raw body (chunked kept as is)."""
    head = await _read_head(reader)
    if head is None:
        raise ConnectionResetError("upstream closed")
    status_line, headers, raw_head = head
    status = int(status_line.split(" ", 2)[1])
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return raw_head, headers, b""
    if "content-length" in headers:
        n = int(headers["content-length"])
        return raw_head, headers, await asyncio.wait_for(reader.readexactly(n), _IO_TIMEOUT)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), _IO_TIMEOUT)
            out += size_line
            n = int(size_line.split(b";")[0].strip(), 16)
            out += await asyncio.wait_for(reader.readexactly(n + 2), _IO_TIMEOUT)
            if n == 0:
                return raw_head, headers, bytes(out)
    headers["connection"] = "close"
    return raw_head, headers, await asyncio.wait_for(reader.read(), _IO_TIMEOUT)


_REASONS = {
    200: "OK", 409: "Conflict", 412: "Precondition Failed", 500: "Internal Server Error", 503: "Service Unavailable"
}


def _strip(raw_head: bytes, name: str) -> bytes:
    lines = raw_head.split(b"\r\n")
    keep = [ln for ln in lines if not ln.lower().startswith(name.encode() + b":")]
    return b"\r\n".join(keep)


def _error_response(status: int, code: str, echo: str = "") -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy {echo}</Message><RequestId>fault-{time.monotonic_ns()}</RequestId>"
        "</Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), the way a dropped connection looks to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.transport.abort()
