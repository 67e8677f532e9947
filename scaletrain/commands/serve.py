"""`scaletrain serve --checkpoint DIR --port P`: an OpenAI-compatible HTTP endpoint.

POST /v1/completions and /v1/chat/completions, GET /v1/models and /health, over scaletrain's
batched KV-cache generation. Requests that arrive together are decoded together: a worker
thread takes up to `--batch-size` waiting requests with the same sampling settings and runs
them as one left-padded batch. Binds to loopback unless `--host` says otherwise.
Streaming (`stream: true`) is not supported and answered with a clear 400.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scaletrain.commands._checkpoint_flags import add_trust_flags, trust_settings
from scaletrain.data.synth.generators import LocalGenerator, SamplingParams, cut_at_stop

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    pass


def chat_prompt(messages: Any) -> str:
    """Plain-text rendering of chat messages (our tokenizers carry no chat template)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content}")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise BadRequest(f"bad message {str(m)[:80]}: need {{'role': ..., 'content': str}}")
        lines.append(f"{m.get('role', 'user')}: {m['content']}")
    return "\n".join(lines) + "\nassistant:"


def _params(body: dict[str, Any]) -> tuple[SamplingParams, int, int | None]:
    try:
        stop = body.get("stop") or []
        params = SamplingParams(
            max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body["top_p"]) if body.get("top_p") is not None else None,
            top_k=int(body["top_k"]) if body.get("top_k") not in (None, -1, 0) else None,
            stop=[stop] if isinstance(stop, str) else list(stop))
        params.validate()
        n = int(body.get("n") or 1)
        seed = int(body["seed"]) if body.get("seed") is not None else None
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    if not 1 <= n <= 64:
        raise BadRequest(f"n must be in [1, 64] (got {n})")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by scaletrain serve; send stream=false")
    return params, n, seed


class BatchingEngine:
    """Queues (prompt ids, params, seed) and decodes compatible ones together."""

    def __init__(self, gen: LocalGenerator, batch_size: int = 8, wait_s: float = 0.005):
        self.gen, self.batch_size, self.wait_s = gen, batch_size, wait_s
        self.q: queue.Queue[tuple[list[int], SamplingParams, int | None, Future]] = queue.Queue()
        self.batches = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="serve-batcher")
        self.thread.start()

    def submit(self, ids: list[int], params: SamplingParams, seed: int | None) -> Future:
        fut: Future = Future()
        self.q.put((ids, params, seed, fut))
        return fut

    def close(self) -> None:
        self._stop = True

    def _loop(self) -> None:
        while not self._stop:
            try:
                first = self.q.get(timeout=0.1)
            except queue.Empty:
                continue
            items, rest = [first], []
            time.sleep(self.wait_s)  # let concurrent requests join the batch
            while len(items) < self.batch_size:
                try:
                    it = self.q.get_nowait()
                except queue.Empty:
                    break
                (items if it[1] == first[1] else rest).append(it)
            for it in rest:
                self.q.put(it)
            self.batches += 1
            try:
                out = self.gen.complete_ids([i[0] for i in items], first[1], [i[2] for i in items])
                for it, ids in zip(items, out):
                    it[3].set_result(ids)
            except Exception as e:  # hand the error to every waiting request
                for it in items:
                    it[3].set_exception(e)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default listen backlog (5) resets bursts of connections


def make_server(gen: LocalGenerator, host: str = "127.0.0.1", port: int = 8000,
                model_name: str = "scaletrain", batch_size: int = 8) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; `port=0` picks a free port (`server.server_address`)."""
    engine = BatchingEngine(gen, batch_size)

    def run(prompt: str, params: SamplingParams, n: int, seed: int | None) -> list[dict]:
        ids = gen.encode(prompt)
        futs = [engine.submit(ids, params, None if seed is None else seed + k) for k in range(n)]
        choices = []
        for fut in futs:
            new = fut.result()
            eos = bool(new) and new[-1] == gen.eos_id
            text, stopped = cut_at_stop(gen.decode(new), params.stop)
            choices.append({"text": text, "tokens": len(new), "prompt_tokens": len(ids),
                            "finish_reason": "stop" if eos or stopped else "length"})
        return choices

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, msg: str, kind: str = "invalid_request_error") -> None:
            self._send(status, {"error": {"message": msg, "type": kind}})

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [
                    {"id": model_name, "object": "model", "owned_by": "scaletrain"}]})
            elif self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok"})
            else:
                self._error(404, f"no route GET {self.path}; try /v1/models")

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.rstrip("/")
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("the request body must be a JSON object")
                if path in ("/v1/completions", "/completions"):
                    self._send(200, self._completions(body))
                elif path in ("/v1/chat/completions", "/chat/completions"):
                    self._send(200, self._chat(body))
                else:
                    self._error(404, f"no route POST {self.path}; use /v1/completions or "
                                     "/v1/chat/completions")
            except (BadRequest, json.JSONDecodeError) as e:
                self._error(400, str(e))
            except ValueError as e:  # prompt too long, ids outside the vocabulary, ...
                self._error(400, str(e))
            except Exception as e:  # keep serving; report the failure to the client
                logger.exception("request failed")
                self._error(500, f"{type(e).__name__}: {e}", "server_error")

        def _completions(self, body: dict[str, Any]) -> dict[str, Any]:
            params, n, seed = _params(body)
            prompts = body.get("prompt")
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, str) for p in prompts):
                raise BadRequest("'prompt' must be a string or a list of strings")
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
            for p in prompts:
                for c in run(p, params, n, seed):
                    choices.append({"index": len(choices), "text": c["text"], "logprobs": None,
                                    "finish_reason": c["finish_reason"]})
                    usage["prompt_tokens"] += c["prompt_tokens"]
                    usage["completion_tokens"] += c["tokens"]
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                    "created": int(time.time()), "model": model_name, "choices": choices,
                    "usage": usage}

        def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
            params, n, seed = _params(body)
            out = run(chat_prompt(body.get("messages")), params, n, seed)
            usage = {"prompt_tokens": out[0]["prompt_tokens"],
                     "completion_tokens": sum(c["tokens"] for c in out)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                    "created": int(time.time()), "model": model_name, "usage": usage,
                    "choices": [{"index": k, "finish_reason": c["finish_reason"],
                                 "message": {"role": "assistant", "content": c["text"]}}
                                for k, c in enumerate(out)]}

    server = _Server((host, port), Handler)
    server.engine = engine  # type: ignore[attr-defined]
    return server


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scaletrain serve", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (HF, native, or a run directory) with tokenizer.json")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--batch-size", type=int, default=8, help="most requests decoded together")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    p.add_argument("--model-name", default=None, help="the name /v1/models reports")
    add_trust_flags(p)
    args = p.parse_args(argv)
    try:
        with trust_settings(args):
            gen = LocalGenerator.from_checkpoint(args.checkpoint, device=args.device,
                                                 batch_size=args.batch_size)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"scaletrain serve: error: {e}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: reachable from other machines, with no authentication",
                       args.host)
    name = args.model_name or str(args.checkpoint).rstrip("/").split("/")[-1]
    server = make_server(gen, args.host, args.port, name, args.batch_size)
    host, port = server.server_address[:2]
    print(f"serving {name} on http://{host}:{port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
