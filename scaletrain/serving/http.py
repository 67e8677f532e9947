"""The HTTP side of `scaletrain serve`: routes, limits, JSON errors and server-sent events.

Every answer that is not a success is OpenAI-shaped JSON ({"error": {...}}), whatever the
status or method. A request body is bounded (`max_body_bytes`, 413) and must arrive within
`read_timeout_s` (408); a request waits at most `request_timeout_s` for its completions
(504, and its rows are cancelled); at most `max_connections` connections are open at once
(503 beyond). A client that goes away (a stream's write fails, or a waiting connection is
closed) cancels its rows: they stop decoding at the next token. `GET /metrics` reports the
engine's counters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from concurrent.futures import wait
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from scaletrain.serving import responses
from scaletrain.serving.engine import BatchingEngine
from scaletrain.serving.protocol import ApiError, Limits, parse

if TYPE_CHECKING:
    from scaletrain.inference.generators import LocalGenerator

logger = logging.getLogger(__name__)

ROUTES = {"/v1/completions": False, "/completions": False,
          "/v1/chat/completions": True, "/chat/completions": True}


class _ClientGone(Exception):
    """The client closed its connection while its completions were decoded."""


@dataclass
class ServerLimits(Limits):
    max_body_bytes: int = 4 << 20
    max_connections: int = 64
    read_timeout_s: float = 30.0
    request_timeout_s: float = 600.0


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` at once: a connection beyond that
    is answered 503 at once and closed, so stalled clients cannot hold unbounded threads."""

    daemon_threads = True
    request_queue_size = 256  # the default listen backlog (5) resets bursts of connections

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            body = json.dumps(ApiError(503, f"the server has {self.max_connections} open "
                                            "connections; retry later",
                                       code="server_busy").body()).encode()
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(gen: LocalGenerator, host: str = "127.0.0.1", port: int = 8000,
                model_name: str = "scaletrain", batch_size: int = 8,
                limits: ServerLimits | None = None,
                continuous: bool | None = None) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; `port=0` picks a free port (`server.server_address`).
    `continuous`: continuous batching (None: wherever the model allows it), else static."""
    lim = limits or ServerLimits()
    engine = BatchingEngine(gen, batch_size, continuous=continuous)
    vocab = gen.model.args.vocab_size

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = lim.read_timeout_s  # socket timeout while a request is read

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: ApiError) -> None:
            self._send(err.status, err.body())

        def send_error(self, code: int, message: str | None = None,
                       explain: str | None = None) -> None:
            """The base class's own errors (bad request line, header too long) as JSON."""
            self.close_connection = True
            with contextlib.suppress(OSError):
                self._error(ApiError(code, message or explain or "bad request"))

        def _refuse_method(self) -> None:
            self.close_connection = True
            self._error(ApiError(405, f"method {self.command} is not allowed on {self.path}; "
                                      "use GET /v1/models or POST /v1/completions, "
                                      "/v1/chat/completions", code="method_not_allowed"))

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method  # noqa: N815

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [self._model()]})
            elif path in (f"/v1/models/{model_name}", f"/models/{model_name}"):
                self._send(200, self._model())
            elif path.startswith(("/v1/models/", "/models/")):
                self._error(ApiError(404, f"the model '{path.rsplit('/', 1)[-1]}' does not "
                                          f"exist; this server serves '{model_name}'",
                                     code="model_not_found"))
            elif path == "/health":
                self._send(200, {"status": "ok"})
            elif path == "/metrics":
                self._send(200, engine.metrics())
            else:
                self._error(ApiError(404, f"no route GET {self.path}; try /v1/models",
                                     code="not_found"))

        def _model(self) -> dict[str, Any]:
            return {"id": model_name, "object": "model", "created": 0, "owned_by": "scaletrain",
                    "max_model_len": gen.model.args.max_seq_len}

        def _body(self) -> Any:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                raise ApiError(411, "send the body with a Content-Length (chunked uploads are "
                                    "not accepted)")
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise ApiError(400, "Content-Length is not a number") from None
            if length > lim.max_body_bytes:
                raise ApiError(413, f"the body has {length} bytes; at most "
                                    f"{lim.max_body_bytes} are accepted", code="body_too_large")
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                raise ApiError(408, f"the body did not arrive within {lim.read_timeout_s} s",
                               code="timeout") from None
            if len(raw) < length:
                raise ApiError(400, "the connection closed before the whole body arrived")
            try:
                return json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the body is not valid JSON: {e}") from None

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].rstrip("/")
            try:
                if path not in ROUTES:
                    self.close_connection = True  # the body was not read
                    raise ApiError(404, f"no route POST {self.path}; use /v1/completions or "
                                        "/v1/chat/completions", code="not_found")
                try:
                    body = self._body()
                except ApiError:
                    self.close_connection = True
                    raise
                req = parse(body, ROUTES[path], vocab, model_name, lim)
                job = responses.start(req, gen, engine)
                if req.stream:
                    self._stream(job)
                else:
                    self._wait(job)
                    self._send(200, responses.finish(job, gen, model_name,
                                                     lim.request_timeout_s))
            except _ClientGone:
                self.close_connection = True
            except ApiError as e:
                self._error(e)
            except ValueError as e:  # a prompt that encodes to nothing, ...
                self._error(ApiError(400, str(e)))
            except TimeoutError:
                self._error(ApiError(504, f"the completions took longer than "
                                          f"{lim.request_timeout_s} s", code="timeout"))
            except Exception as e:  # keep serving; report the failure to the client
                logger.exception("request failed")
                self._error(ApiError(500, f"{type(e).__name__}: {e}"))

        def _wait(self, job: responses.Job) -> None:
            """Until every row of `job` is done; cancels them when the client goes away or the
            request times out."""
            deadline = time.monotonic() + lim.request_timeout_s
            pending = set(job.futures)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    engine.cancel(job.futures)
                    raise TimeoutError
                pending = wait(pending, timeout=min(0.2, left)).not_done
                if pending and self._client_gone():
                    engine.cancel(job.futures)
                    raise _ClientGone

        def _client_gone(self) -> bool:
            """Whether the peer closed the connection (readable with nothing to read)."""
            try:
                readable = select.select([self.connection], [], [], 0)[0]
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def _stream(self, job: responses.Job) -> None:
            self.close_connection = True  # the stream's end is the connection's end
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for event in responses.stream(job, gen, model_name, lim.request_timeout_s):
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                engine.cancel(job.futures)  # nobody reads on: stop decoding its rows
                return
            except Exception as e:  # after the headers, an error can only be an event
                engine.cancel(job.futures)
                logger.exception("stream failed")
                self.wfile.write(f"data: {json.dumps(ApiError(500, str(e)).body())}\n\n"
                                 .encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    server = _Server((host, port), Handler, lim.max_connections)
    server.engine = engine  # type: ignore[attr-defined]
    return server
