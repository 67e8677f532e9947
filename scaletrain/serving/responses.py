"""Requests -> decoding rows, and decoded rows -> OpenAI response objects (whole or streamed)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaletrain.inference.batch_decode import Decoded, Row
from scaletrain.inference.generators import cut_at_stop
from scaletrain.serving.protocol import ApiError, Request

if TYPE_CHECKING:
    from concurrent.futures import Future

    from scaletrain.inference.generators import LocalGenerator
    from scaletrain.serving.engine import BatchingEngine


@dataclass
class Job:
    """The rows of one request: choice k is prompt k // n, sample k % n."""

    request: Request
    prompt_ids: list[list[int]]
    futures: list[Future]


Events = Callable[[int, "int | None"], None]
"""Streaming: called (choice, token id) per decoded token and (choice, None) when the choice
ends, from the engine's thread."""


def start(req: Request, gen: LocalGenerator, engine: BatchingEngine,
          events: Events | None = None) -> Job:
    """Encode the prompts and queue one row per choice."""
    ctx = gen.model.args.max_seq_len
    if req.chat:
        ids_list = [gen.chat_ids(req.messages, req.template_kwargs)]
    else:
        ids_list = [p if isinstance(p, list) else gen.encode(p) for p in req.prompts]
    for ids in ids_list:
        if len(ids) > ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the model's "
                                f"context of {ctx}", "prompt", "context_length_exceeded")
    stop = gen.stop_check(req.stop)
    rows = []
    for p, ids in enumerate(ids_list):
        room = ctx - len(ids)
        budget = room if req.max_tokens is None else min(req.max_tokens, room)
        for s in range(req.n):
            k = p * req.n + s
            rows.append(Row(
                ids, budget, None if req.seed is None else req.seed + k, stop=stop,
                logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, logprobs=req.logprobs,
                echo_logprobs=req.echo and req.logprobs is not None,
                on_token=None if events is None else (lambda t, k=k: events(k, t))))
    futures = engine.submit(rows, req.sampling_key)
    if events is not None:
        for k, f in enumerate(futures):
            f.add_done_callback(lambda _f, k=k: events(k, None))
    return Job(req, ids_list, futures)


def _token_str(gen: LocalGenerator, tok: int) -> str:
    return gen.tokenizer.decode([tok], skip_special_tokens=False)


def _completion_logprobs(gen: LocalGenerator, ids: list[int], d: Decoded, echo: bool,
                         offset0: int) -> dict[str, Any]:
    toks = (list(ids) if echo else []) + d.ids
    lps: list[float | None] = (list(d.prompt_logprobs) if echo else []) + d.logprobs
    tops: list[Any] = ([None] + d.prompt_top[1:] if echo else []) + d.top
    strs = [_token_str(gen, t) for t in toks]
    offsets, pos = [], offset0
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [None if t is None else {_token_str(gen, i): v for i, v in t.items()}
                             for t in tops]}


def _chat_logprobs(gen: LocalGenerator, d: Decoded) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        s = _token_str(gen, tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top.items()]}
                        for t, lp, top in zip(d.ids, d.logprobs, d.top)]}


def _usage(job: Job, results: list[Decoded]) -> dict[str, int]:
    prompt = sum(len(p) for p in job.prompt_ids)
    done = sum(len(d.ids) for d in results)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _text(gen: LocalGenerator, ids: list[int], stop: list[str]) -> str:
    return cut_at_stop(gen.decode(ids), stop)[0]


def finish(job: Job, gen: LocalGenerator, model_name: str, timeout_s: float) -> dict[str, Any]:
    """The whole response of a non-streaming request."""
    req = job.request
    results: list[Decoded] = [f.result(timeout=timeout_s) for f in job.futures]
    choices = []
    for k, d in enumerate(results):
        ids = job.prompt_ids[k // req.n]
        text = _text(gen, d.ids, req.stop)
        if req.chat:
            c: dict[str, Any] = {"index": k, "message": {"role": "assistant", "content": text},
                                 "logprobs": None if req.logprobs is None
                                 else _chat_logprobs(gen, d), "finish_reason": d.finish_reason}
        else:
            head = gen.decode(ids) if req.echo else ""
            c = {"index": k, "text": head + text, "finish_reason": d.finish_reason,
                 "logprobs": None if req.logprobs is None
                 else _completion_logprobs(gen, ids, d, req.echo, 0)}
        choices.append(c)
    kind = "chat.completion" if req.chat else "text_completion"
    return {"id": _id(req), "object": kind, "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": _usage(job, results)}


def _id(req: Request) -> str:
    return f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


class Streamer:
    """Server-sent event payloads of a streaming request: text as it is decoded (held back
    where it could still turn out to be the start of a stop string), then each choice's
    finish reason. Fed the (choice, token | None) events `start` reports, in order."""

    def __init__(self, job: Job, gen: LocalGenerator, model_name: str) -> None:
        self.job, self.gen, self.model_name = job, gen, model_name
        req = job.request
        self.rid, self.created = _id(req), int(time.time())
        self.kind = "chat.completion.chunk" if req.chat else "text_completion"
        self.hold = max((len(s) for s in req.stop), default=1) - 1
        self.ids: dict[int, list[int]] = {k: [] for k in range(len(job.futures))}
        self.sent: dict[int, int] = dict.fromkeys(self.ids, 0)
        self.open = set(self.ids)

    @property
    def done(self) -> bool:
        return not self.open

    def _chunk(self, k: int, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.job.request.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            c: dict[str, Any] = {"index": k, "delta": delta, "finish_reason": finish}
        else:
            c = {"index": k, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {"id": self.rid, "object": self.kind, "created": self.created,
                "model": self.model_name, "choices": [c]}

    def opening(self) -> list[dict[str, Any]]:
        if not self.job.request.chat:
            return []
        return [{"id": self.rid, "object": self.kind, "created": self.created,
                 "model": self.model_name,
                 "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}]} for k in self.ids]

    def on_event(self, k: int, tok: int | None) -> list[dict[str, Any]]:
        req, gen = self.job.request, self.gen
        if k not in self.open:
            return []
        if tok is not None:
            self.ids[k].append(tok)
            text, stopped = cut_at_stop(gen.decode(self.ids[k]), req.stop)
            safe = len(text) if stopped else max(len(text) - self.hold, self.sent[k])
            while safe > self.sent[k] and text[safe - 1] == "\ufffd":  # an incomplete char
                safe -= 1
            if safe > self.sent[k]:
                out = [self._chunk(k, text[self.sent[k]:safe], None)]
                self.sent[k] = safe
                return out
            return []
        d = self.job.futures[k].result()  # raises the decoding error, if any
        text = _text(gen, d.ids, req.stop)
        out = []
        if len(text) > self.sent[k]:
            out.append(self._chunk(k, text[self.sent[k]:], None))
            self.sent[k] = len(text)
        out.append(self._chunk(k, None, d.finish_reason))
        self.open.discard(k)
        return out

    def closing(self) -> list[dict[str, Any]]:
        if not self.job.request.include_usage:
            return []
        results = [f.result() for f in self.job.futures]
        return [{"id": self.rid, "object": self.kind, "created": self.created,
                 "model": self.model_name, "choices": [], "usage": _usage(self.job, results)}]
