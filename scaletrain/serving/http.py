"""The HTTP side of `scaletrain serve`: an asyncio server (no thread per connection), routes,
limits, API key, JSON errors and server-sent events.

Every answer that is not a success is OpenAI-shaped JSON ({"error": {...}}), whatever the
status or method; client mistakes are 4xx, only our own faults 5xx. A request's head and body
must arrive within fixed deadlines counted from its first byte (408), its body is bounded
(413), it waits at most `request_timeout_s` for its completions (504, and its rows are
cancelled). Slow connections (idle, or still sending) are bounded per client and in all
(`connections`): the oldest gives way, so trickling clients cannot lock others out. A client
that goes away (end of stream on its connection, or a failed write) cancels its rows: they
stop decoding at the next token. `GET /metrics` reports the engine's and the connections'
counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaletrain.serving import responses
from scaletrain.serving.connections import ConnectionTable, Tracked
from scaletrain.serving.engine import BatchingEngine
from scaletrain.serving.protocol import ApiError, Limits, client_error, parse, parse_json
from scaletrain.serving.wire import (
    CONTINUE,
    STREAM_HEAD,
    ClientGone,
    Evicted,
    HttpRequest,
    Incoming,
    WireLimits,
    body_length,
    json_response,
    read_body,
    read_request,
    sse,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from scaletrain.inference.generators import LocalGenerator

logger = logging.getLogger(__name__)

ROUTES = {"/v1/completions": False, "/completions": False,
          "/v1/chat/completions": True, "/chat/completions": True}
OPEN_PATHS = {"/health"}  # answered without the API key (liveness probes)
LINGER_S = 1.0  # longest wait for a closing client to stop sending


@dataclass
class ServerLimits(Limits, WireLimits):
    max_connections: int = 1024
    """Open connections in all; beyond, the oldest slow one gives way (503 if none is slow)."""
    max_slow_per_client: int = 64
    """Idle or still-sending connections of one client address; beyond, its oldest closes."""
    request_timeout_s: float = 600.0
    write_timeout_s: float = 30.0
    """Longest wait for a client to take a written chunk (a client that stops reading)."""


class _Gone(Exception):
    """The client went away while its completions were decoded."""


class Server:
    """`make_server`'s result, used as the standard library's servers are: `serve_forever()`
    (blocks; run it in a thread), `shutdown()` from another thread, `server_close()`,
    `server_address`, and `engine`."""

    def __init__(self, app: _App, host: str, port: int) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((host, port), family=family, backlog=1024)
        self.server_address = self._sock.getsockname()
        self.app, self.engine = app, app.engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._done = threading.Event()

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self._done.set()

    async def _main(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self.app.handle, sock=self._sock)
        await self._stop.wait()
        server.close()
        await self.app.close_all()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
            self._done.wait(30)

    def server_close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def make_server(gen: LocalGenerator, host: str = "127.0.0.1", port: int = 8000,
                model_name: str = "scaletrain", batch_size: int = 8,
                limits: ServerLimits | None = None, continuous: bool | None = None,
                api_key: str | None = None) -> Server:
    """A ready (not yet serving) server; `port=0` picks a free port (`server.server_address`).
    `continuous`: continuous batching (None: wherever the model allows it), else static.
    `api_key`: every route but /health then needs `Authorization: Bearer KEY` (401)."""
    lim = limits or ServerLimits()
    engine = BatchingEngine(gen, batch_size, continuous=continuous)
    return Server(_App(gen, engine, model_name, lim, api_key), host, port)


class _App:
    def __init__(self, gen: LocalGenerator, engine: BatchingEngine, model_name: str,
                 lim: ServerLimits, api_key: str | None) -> None:
        self.gen, self.engine, self.model_name, self.lim = gen, engine, model_name, lim
        self.api_key = api_key.encode() if api_key else None
        self.table = ConnectionTable(lim.max_connections, lim.max_slow_per_client)
        self.tasks: set[asyncio.Task] = set()
        self.timed_out = 0

    async def close_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # --- one connection ------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        peer = writer.get_extra_info("peername")
        conn = Incoming(reader)

        def evict() -> None:
            conn.evicted = True
            task.cancel()

        tracked = Tracked(str(peer[0]) if peer else "?", evict)
        try:
            if not self.table.admit(tracked):
                writer.write(json_response(503, ApiError(
                    503, f"the server has {self.lim.max_connections} connections busy; retry "
                         "later", code="server_busy").body(), close=True))
                return
            await self._serve_connection(conn, tracked, writer)
        except (asyncio.CancelledError, Evicted):
            if conn.evicted and (conn.started is not None or conn.buf):  # mid-request: say why
                writer.write(json_response(408, ApiError(
                    408, "the request was not sent in time and the connection gave way to "
                         "others", code="timeout").body(), close=True))
            # else: the server is shutting down; the connection just closes
        except (ConnectionError, OSError):
            pass
        finally:
            self.table.remove(tracked)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(_linger(writer, conn), LINGER_S)
            self.tasks.discard(task)
            writer.close()

    async def _serve_connection(self, conn: Incoming, tracked: Tracked,
                                writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                req = await read_request(conn, self.lim)
                if req is None:
                    return
                if conn.started is not None and not req.body and body_length(
                        req.headers, self.lim.max_body_bytes):  # Expect: 100-continue
                    writer.write(CONTINUE)
                    await read_body(conn, req, body_length(req.headers,
                                                           self.lim.max_body_bytes), self.lim)
            except ClientGone:
                return
            except ApiError as e:  # a malformed or late request: answer, then close
                self.timed_out += e.status == 408
                writer.write(json_response(e.status, e.body(), close=True))
                return
            self.table.set_busy(tracked, True)
            try:
                keep = await self._dispatch(req, conn, writer)
            finally:
                self.table.set_busy(tracked, False)
            if not keep or not req.keep_alive:
                return

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.lim.write_timeout_s)

    async def _dispatch(self, req: HttpRequest, conn: Incoming,
                        writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection may serve another."""
        close = not req.keep_alive
        try:
            if req.path not in OPEN_PATHS and self.api_key is not None:
                self._check_key(req)
            if req.method == "GET":
                status, obj = self._get(req)
                await self._send(writer, json_response(status, obj, close=close))
                return True
            if req.method != "POST":
                raise ApiError(405, f"method {req.method} is not allowed on {req.target}; use "
                                    "GET /v1/models or POST /v1/completions, "
                                    "/v1/chat/completions", code="method_not_allowed")
            if req.path not in ROUTES:
                raise ApiError(404, f"no route POST {req.target}; use /v1/completions or "
                                    "/v1/chat/completions", code="not_found")
            return await self._complete(req, conn, writer)
        except ApiError as e:
            keep = e.status < 500 and e.status not in (405,) and not close
            await self._send(writer, json_response(e.status, e.body(), close=not keep,
                                                   extra=_auth_header(e)))
            return keep
        except _Gone:
            return False

    def _check_key(self, req: HttpRequest) -> None:
        assert self.api_key is not None
        auth = req.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("utf-8", "replace"), self.api_key):
            raise ApiError(401, "Incorrect API key provided: send `Authorization: Bearer "
                                "<key>` with the key the server was started with",
                           code="invalid_api_key")

    def _get(self, req: HttpRequest) -> tuple[int, dict[str, Any]]:
        path, name = req.path, self.model_name
        if path in ("/v1/models", "/models"):
            return 200, {"object": "list", "data": [self._model()]}
        if path in (f"/v1/models/{name}", f"/models/{name}"):
            return 200, self._model()
        if path.startswith(("/v1/models/", "/models/")):
            raise ApiError(404, f"the model '{path.rsplit('/', 1)[-1]}' does not exist; this "
                                f"server serves '{name}'", code="model_not_found")
        if path == "/health":
            return 200, {"status": "ok"}
        if path == "/metrics":
            return 200, {**self.engine.metrics(),
                         "connections": {**self.table.metrics(), "timed_out": self.timed_out}}
        raise ApiError(404, f"no route GET {req.target}; try /v1/models", code="not_found")

    def _model(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "scaletrain",
                "max_model_len": self.gen.model.args.max_seq_len}

    # --- completions ---------------------------------------------------------------------
    async def _complete(self, req: HttpRequest, conn: Incoming,
                        writer: asyncio.StreamWriter) -> bool:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()

        def on_event(k: int, tok: int | None) -> None:  # the engine's thread
            with contextlib.suppress(RuntimeError):  # the loop has ended (shutdown)
                loop.call_soon_threadsafe(events.put_nowait, (k, tok))

        chat = ROUTES[req.path]
        job = await asyncio.to_thread(self._start, req.body, chat, on_event)
        watcher = asyncio.ensure_future(_watch_eof(conn))
        try:
            if job.request.stream:
                await self._stream(job, events, watcher, writer)
                return False
            await self._wait(job.futures, watcher)
            body = await asyncio.to_thread(responses.finish, job, self.gen, self.model_name,
                                           self.lim.request_timeout_s)
            await self._send(writer, json_response(200, body, close=not req.keep_alive))
            return True
        except BaseException:
            self.engine.cancel(job.futures)
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher

    def _start(self, raw: bytes, chat: bool, on_event: responses.Events) -> responses.Job:
        """Parse, validate, encode and queue (a worker thread: JSON, templates and tokenizing
        of a large body must not stall the other connections). Client mistakes -> ApiError."""
        try:
            request = parse(parse_json(raw), chat, self.gen.model.args.vocab_size,
                                 self.model_name, self.lim)
            return responses.start(request, self.gen, self.engine,
                                   on_event if request.stream else None)
        except ApiError:
            raise
        except Exception as e:
            err = client_error(e)
            if err is None:
                logger.exception("request failed")
                raise ApiError(500, f"{type(e).__name__}: {e}") from None
            raise err from None

    async def _wait(self, futures: list[Future], watcher: asyncio.Future) -> None:
        """Until every row is done; raises _Gone when the client goes away first and
        ApiError 504 at the request timeout."""
        waiting = _all_done(futures)
        done, _ = await asyncio.wait({waiting, watcher}, timeout=self.lim.request_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if waiting in done:
            return
        waiting.cancel()
        if watcher in done:
            raise _Gone
        raise ApiError(504, f"the completions took longer than {self.lim.request_timeout_s} s",
                       code="timeout")

    async def _stream(self, job: responses.Job, events: asyncio.Queue,
                      watcher: asyncio.Future, writer: asyncio.StreamWriter) -> None:
        streamer = responses.Streamer(job, self.gen, self.model_name)
        deadline = time.monotonic() + self.lim.request_timeout_s
        try:
            await self._send(writer, STREAM_HEAD)
            for ev in streamer.opening():
                await self._send(writer, sse(ev))
            while not streamer.done:
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, watcher},
                                             timeout=deadline - time.monotonic(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if watcher in done:
                        raise _Gone
                    raise ApiError(504, "the completions took longer than "
                                        f"{self.lim.request_timeout_s} s", code="timeout")
                for ev in streamer.on_event(*getter.result()):
                    await self._send(writer, sse(ev))
            for ev in streamer.closing():
                await self._send(writer, sse(ev))
        except (ConnectionError, OSError, asyncio.TimeoutError, _Gone):
            raise _Gone from None  # nobody reads on: the caller cancels the rows
        except Exception as e:  # after the headers, an error can only be an event
            if not isinstance(e, ApiError):
                logger.exception("stream failed")
            err = e if isinstance(e, ApiError) else ApiError(500, str(e))
            self.engine.cancel(job.futures)
            await self._send(writer, sse(err.body()))
        await self._send(writer, sse("[DONE]"))


async def _linger(writer: asyncio.StreamWriter, conn: Incoming) -> None:
    """Send what is written, close our side, and discard what the client still sends until
    it closes too: closing a socket with unread input resets the connection, and a reset can
    destroy the answer (a 408) before the client reads it. Bounded by LINGER_S."""
    await writer.drain()
    if conn.eof or writer.is_closing():
        return
    if writer.can_write_eof():
        writer.write_eof()
    while await conn.reader.read(65536):
        pass


def _all_done(futures: list[Future]) -> asyncio.Future:
    """An asyncio future that ends when every one of `futures` has ended. (Not
    `asyncio.wrap_future`: cancelling its wrapper would cancel the engine's futures from this
    thread, racing the engine that sets them.)"""
    loop = asyncio.get_running_loop()
    out: asyncio.Future = loop.create_future()
    left = [len(futures)]

    def one_done() -> None:
        left[0] -= 1
        if left[0] <= 0 and not out.done():
            out.set_result(None)

    def callback(_f: Future) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has ended (shutdown)
            loop.call_soon_threadsafe(one_done)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(callback)
    return out


async def _watch_eof(conn: Incoming) -> None:
    """Returns when the client closes its side (or the connection breaks); bytes it sends
    meanwhile (a pipelined request) are kept for the next read."""
    while True:
        try:
            chunk = await conn.reader.read(65536)
        except (ConnectionError, OSError):
            chunk = b""
        if not chunk:
            conn.eof = True
            return
        conn.buf += chunk
        if len(conn.buf) > 1 << 20:  # stop buffering a flood; the next request reads it
            await asyncio.Event().wait()


def _auth_header(err: ApiError) -> dict[str, str] | None:
    return {"WWW-Authenticate": "Bearer"} if err.status == 401 else None


__all__ = ["ServerLimits", "Server", "make_server", "ROUTES"]
