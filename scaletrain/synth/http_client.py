"""A client for OpenAI-compatible servers (vLLM, SGLang, `scaletrain serve`, ...), stdlib only.

Requests run on a bounded thread pool (`concurrency`), each with a timeout; failures that can
pass (connection errors, timeouts, 408/409/429/5xx) are retried with exponential backoff and
jitter, honouring `Retry-After`; other HTTP errors fail at once with the server's message.
`max_requests` is a budget: a call that would exceed it raises `BudgetExhausted` before
sending anything.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scaletrain.inference.generators import BudgetExhausted, Completion, SamplingParams

logger = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class HTTPError(RuntimeError):
    """A request that failed for good (after retries, or with a non-retryable status)."""


class HTTPGenerator:
    """`complete()` over `/v1/completions`, or `/v1/chat/completions` with `chat=True` (each
    prompt becomes one user message). `base_url` ends with `/v1` (added when missing)."""

    def __init__(self, base_url: str, model: str = "default", chat: bool = False,
                 concurrency: int = 4, timeout_s: float = 60.0, max_retries: int = 4,
                 backoff_s: float = 0.5, max_requests: int = 0, api_key: str | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model, self.chat, self.concurrency = model, chat, concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.max_requests, self.api_key = max_requests, api_key
        self.name = f"{self.base_url} ({model})"
        self.requests_sent = 0  # attempts, retries included
        self.retries = 0
        self.tokens_generated = 0
        self._lock = threading.Lock()
        self._reserved = 0

    # --- one request ------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON with retries; the decoded JSON reply."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        for attempt in range(self.max_retries + 1):
            with self._lock:
                self.requests_sent += 1
            wait: float | None = None
            try:
                req = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code not in RETRY_STATUS or attempt == self.max_retries:
                    raise HTTPError(f"{url}: HTTP {e.code}: {detail}") from None
                retry_after = e.headers.get("Retry-After") if e.headers else None
                if retry_after and retry_after.replace(".", "", 1).isdigit():
                    wait = float(retry_after)
                err = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == self.max_retries:
                    raise HTTPError(f"{url}: {e} (after {attempt + 1} attempts; is the server "
                                    "up and the URL right?)") from None
                err = str(e)
            if wait is None:
                wait = self.backoff_s * 2**attempt * (0.5 + random.random())
            with self._lock:
                self.retries += 1
            logger.warning("%s: %s; retry %d/%d in %.2f s", url, err, attempt + 1,
                           self.max_retries, wait)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _one(self, prompt: str, params: SamplingParams, seed: int | None) -> Completion:
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature}
        if params.top_p is not None:
            body["top_p"] = params.top_p
        if params.top_k is not None:
            body["top_k"] = params.top_k  # vLLM/SGLang/scaletrain extension
        if params.stop:
            body["stop"] = params.stop
        if seed is not None:
            body["seed"] = seed
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            reply = self.post("/chat/completions", body)
        else:
            body["prompt"] = prompt
            reply = self.post("/completions", body)
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise HTTPError(f"{self.base_url}: reply is not an OpenAI completion: "
                            f"{str(reply)[:300]}") from None
        tokens = int((reply.get("usage") or {}).get("completion_tokens", 0))
        with self._lock:
            self.tokens_generated += tokens
        return Completion(text or "", tokens, choice.get("finish_reason") or "stop")

    # --- many -------------------------------------------------------------------------------
    def complete(self, prompts: list[str], params: SamplingParams,
                 seeds: list[int | None] | None = None) -> list[Completion]:
        params.validate()
        with self._lock:
            if self.max_requests and self._reserved + len(prompts) > self.max_requests:
                raise BudgetExhausted(
                    f"request budget of {self.max_requests} spent ({self._reserved} used, "
                    f"{len(prompts)} more needed)")
            self._reserved += len(prompts)
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        if len(prompts) == 1:
            return [self._one(prompts[0], params, seeds[0])]
        with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(lambda a: self._one(a[0], params, a[1]), zip(prompts, seeds)))
