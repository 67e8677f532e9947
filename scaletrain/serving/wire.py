"""HTTP/1.1 on the wire for `scaletrain serve`: one request read from an asyncio stream under
deadlines, and responses written out.

A request's head must arrive within `header_timeout_s` and its head and body together within
`read_timeout_s`, both counted from the request's first byte: trickling bytes does not extend
them (a per-read idle timeout would). The wait for a request's first byte on an open
connection is bounded by `idle_timeout_s`. Anything malformed raises `ApiError` with the
status a client mistake gets (400, 408, 411, 413, 431), and the connection is closed
after the answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from scaletrain.serving.protocol import ApiError

MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 100
_TOKEN_CHARS = set(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                   b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")


class ClientGone(Exception):
    """The peer closed its side before a whole request arrived (nothing to answer)."""


class Evicted(Exception):
    """The connection was closed to make room for others while it was slow."""


@dataclass
class WireLimits:
    max_body_bytes: int = 4 << 20
    header_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0


@dataclass
class HttpRequest:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes = b""
    keep_alive: bool = True

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0].rstrip("/") or "/"


@dataclass
class Incoming:
    """A connection's read side: bytes received but not yet consumed, and whether a request
    has started arriving (its first byte is in) — what eviction and timeouts look at."""

    reader: asyncio.StreamReader
    buf: bytearray = field(default_factory=bytearray)
    started: float | None = None  # monotonic time of the current request's first byte
    eof: bool = False
    evicted: bool = False
    """Set when the connection must give way; checked after every read (a task cancellation
    alone can be lost when it races a read that completes, in Python < 3.12's wait_for)."""

    async def fill(self, deadline: float, what: str) -> None:
        """Read more bytes before `deadline`, else 408 (or ClientGone at end of stream)."""
        left = deadline - time.monotonic()
        if self.evicted:
            raise Evicted
        if left <= 0:
            raise ApiError(408, f"the request {what} did not arrive in time", code="timeout")
        try:
            chunk = await asyncio.wait_for(self.reader.read(65536), left)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request {what} did not arrive in time",
                           code="timeout") from None
        except (ConnectionError, OSError):
            chunk = b""
        self.buf += chunk
        if self.evicted:
            raise Evicted
        if not chunk:
            self.eof = True
            raise ClientGone


async def read_request(conn: Incoming, lim: WireLimits) -> HttpRequest | None:
    """The next request on the connection, or None when the client closed an idle connection
    (or kept it idle past `idle_timeout_s`)."""
    conn.started = None
    while conn.buf[:2] == b"\r\n":  # blank lines between requests are allowed
        del conn.buf[:2]
    if not conn.buf:
        try:
            await conn.fill(time.monotonic() + lim.idle_timeout_s, "")
        except (ClientGone, ApiError):
            return None  # idle: close quietly
    conn.started = time.monotonic()
    head_deadline = conn.started + min(lim.header_timeout_s, lim.read_timeout_s)
    while (end := conn.buf.find(b"\r\n\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD_BYTES:
            raise ApiError(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes",
                           code="headers_too_large")
        await conn.fill(head_deadline, "head")
    if end > MAX_HEAD_BYTES:
        raise ApiError(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes",
                       code="headers_too_large")
    head = bytes(conn.buf[:end])
    del conn.buf[: end + 4]
    req = parse_head(head)
    length = body_length(req.headers, lim.max_body_bytes)
    if length and req.headers.get("expect", "").lower() == "100-continue" \
            and len(conn.buf) < length:
        return req  # the caller sends "100 Continue", then `read_body`
    await read_body(conn, req, length, lim)
    return req


async def read_body(conn: Incoming, req: HttpRequest, length: int, lim: WireLimits) -> None:
    assert conn.started is not None
    deadline = conn.started + lim.read_timeout_s
    while len(conn.buf) < length:
        try:
            await conn.fill(deadline, "body")
        except ClientGone:
            raise ApiError(400, "the connection closed before the whole body arrived") from None
    req.body = bytes(conn.buf[:length])
    del conn.buf[:length]


def parse_head(head: bytes) -> HttpRequest:
    """Request line and headers (RFC 9112); header names lower-cased."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
        raise ApiError(400, "the request head is not text") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0].encode()) <= _TOKEN_CHARS \
            or not parts[1]:
        raise ApiError(400, f"bad request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ApiError(400, f"HTTP version {version[:20]!r} is not supported; use HTTP/1.1",
                       code="http_version_not_supported")
    if len(lines) - 1 > MAX_HEADERS:
        raise ApiError(431, f"more than {MAX_HEADERS} header lines", code="headers_too_large")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name.encode("latin-1")) <= _TOKEN_CHARS:
            raise ApiError(400, f"bad header line {line[:80]!r}")
        key, value = name.lower(), value.strip(" \t")
        if key == "content-length" and key in headers and headers[key] != value:
            raise ApiError(400, "conflicting Content-Length headers")
        if key in headers and key != "content-length":  # repeated: one comma-joined value
            value = f"{headers[key]}, {value}"
        headers[key] = value
    conn_opts = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in conn_opts if version == "HTTP/1.1" else "keep-alive" in conn_opts
    return HttpRequest(method, target, version, headers, keep_alive=keep)


def body_length(headers: dict[str, str], max_body: int) -> int:
    if "transfer-encoding" in headers:
        raise ApiError(411, "send the body with a Content-Length (chunked uploads are not "
                            "accepted)", code="length_required")
    raw = headers.get("content-length", "0")
    if not raw.isdigit() or len(raw) > 18:
        raise ApiError(400, "Content-Length is not a number")
    length = int(raw)
    if length > max_body:
        raise ApiError(413, f"the body has {length} bytes; at most {max_body} are accepted",
                       code="body_too_large")
    return length


def response_bytes(status: int, body: bytes, content_type: str = "application/json",
                   close: bool = False, extra: dict[str, str] | None = None) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:  # pragma: no cover
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(status: int, obj: dict[str, Any], close: bool = False,
                  extra: dict[str, str] | None = None) -> bytes:
    return response_bytes(status, json.dumps(obj).encode(), close=close, extra=extra)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache"
               b"\r\nConnection: close\r\n\r\n")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
