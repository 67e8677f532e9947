"""OpenAI request bodies -> validated requests; every refusal is an `ApiError` with the HTTP
status and OpenAI's error shape. A field we do not implement is refused with a 400 that names
it, never silently ignored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from scaletrain.inference.chat import content_text

# Accepted and without effect on the result: identifiers and transport options.
_INERT = {"model", "user", "stream_options", "metadata", "store"}
_COMMON = {"max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias"}
COMPLETION_FIELDS = _INERT | _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _INERT | _COMMON | {"messages", "max_completion_tokens", "logprobs",
                                  "top_logprobs", "response_format", "chat_template_kwargs"}
_RESERVED_TEMPLATE_NAMES = {"messages", "add_generation_prompt", "tools", "documents"}
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class Limits:
    """What one request may ask for."""

    max_n: int = 16
    max_rows: int = 256
    """prompts x n."""
    max_stop: int = 4
    default_max_tokens: int = 16


@dataclass
class Request:
    """A validated completion or chat request; prompts are token ids or text to encode."""

    chat: bool
    prompts: list[list[int] | str]
    max_tokens: int | None  # None: as many as fit (chat's default)
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    echo: bool = False
    logprobs: int | None = None
    include_usage: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """`chat_template_kwargs`: extra variables for the chat template (enable_thinking, ...)."""

    @property
    def sampling_key(self) -> tuple[float, int | None, float | None]:
        """Settings shared by all rows of one decoding batch."""
        return (self.temperature, self.top_k, self.top_p)


def _number(body: dict[str, Any], name: str, default: float | None, lo: float,
            hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number (got {value!r})", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be in [{lo}, {hi}] (got {value})", name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int,
         hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer (got {value!r})", name)
    if value < lo or (hi is not None and value > hi):
        raise bad(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}] (got "
                  f"{value})", name)
    return value


def _prompts(value: Any, vocab: int) -> list[list[int] | str]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    def ids_ok(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        out: list[list[int] | str] = [value]
    elif ids_ok(value):
        out = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or ids_ok(p)
                                                    for p in value):
        out = list(value)
    else:
        raise bad("'prompt' must be a string, a list of strings, a non-empty list of token ids "
                  "or a list of such lists", "prompt")
    for p in out:
        if isinstance(p, list):
            wrong = [t for t in p if not 0 <= t < vocab]
            if wrong:
                raise bad(f"prompt token ids {wrong[:5]} are outside the vocabulary [0, {vocab})",
                          "prompt")
    return out


def messages_of(value: Any) -> list[dict[str, str]]:
    """Chat messages with plain-text content."""
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{k}] needs a string 'role'", "messages")
        try:
            text = content_text(m.get("content"), f"messages[{k}]")
        except ValueError as e:
            raise bad(str(e), "messages") from None
        out.append({"role": m["role"], "content": text})
    return out


def parse_json(raw: bytes) -> Any:
    """A request body as JSON; every way it can fail is a 400."""
    try:
        return json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad("the body is nested too deeply") from None


def client_error(e: Exception) -> ApiError | None:
    """The 4xx a client's mistake found past validation gets (a conversation the chat
    template refuses, a prompt that encodes to nothing, input nested too deeply for the
    template); None for anything else (our fault: 500)."""
    from scaletrain.inference.chat import ChatFormatError

    if isinstance(e, ChatFormatError):
        return bad(str(e), "messages")
    if isinstance(e, RecursionError):
        return bad("the request is nested too deeply")
    if isinstance(e, ValueError):
        return bad(str(e))
    return None


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("'chat_template_kwargs' must be an object of template variables",
                  "chat_template_kwargs")
    reserved = sorted(set(value) & _RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise bad(f"'chat_template_kwargs' cannot set {reserved}", "chat_template_kwargs")
    return dict(value)


def parse(body: Any, chat: bool, vocab: int, model_name: str, limits: Limits) -> Request:
    """Validate a request body; raises `ApiError`."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported field(s) {unknown}: scaletrain serve implements "
                  f"{sorted(allowed)}", unknown[0])
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{model_name}' (see /v1/models)", "model", "model_not_found")
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n", 1):
        raise bad("'best_of' other than n is not supported", "best_of")
    if body.get("suffix"):
        raise bad("'suffix' (insertion) is not supported", "suffix")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("only response_format {\"type\": \"text\"} is supported", "response_format")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > limits.max_stop:
        raise bad(f"'stop' must be a non-empty string or a list of at most {limits.max_stop}",
                  "stop")
    bias_in = body.get("logit_bias") or {}
    if not isinstance(bias_in, dict):
        raise bad("'logit_bias' must map token ids to numbers in [-100, 100]", "logit_bias")
    bias = {}
    for tok, b in bias_in.items():
        try:
            t = int(tok)
        except (TypeError, ValueError):
            raise bad(f"logit_bias key {tok!r} is not a token id", "logit_bias") from None
        if not 0 <= t < vocab:
            raise bad(f"logit_bias token id {t} is outside the vocabulary [0, {vocab})",
                      "logit_bias")
        bias[t] = _number({"logit_bias": b}, "logit_bias", 0.0, -100, 100)
    if chat:
        logprobs = body.get("logprobs")
        if logprobs not in (None, True, False):
            raise bad("'logprobs' must be true or false", "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        lp = top if logprobs else None
        if body.get("top_logprobs") is not None and not logprobs:
            raise bad("'top_logprobs' needs logprobs: true", "top_logprobs")
        messages = messages_of(body.get("messages"))
        max_tokens = _int(body, "max_completion_tokens", None, 0)
        max_tokens = _int(body, "max_tokens", max_tokens, 0)
        prompts: list[list[int] | str] = []
    else:
        lp = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
        messages = []
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt")
        prompts = _prompts(body["prompt"], vocab)
        max_tokens = _int(body, "max_tokens", limits.default_max_tokens, 0)
    echo = body.get("echo", False)
    stream = body.get("stream", False)
    for name, value in (("echo", echo), ("stream", stream)):
        if not isinstance(value, bool):
            raise bad(f"'{name}' must be true or false", name)
    if stream and echo:
        raise bad("'echo' cannot be combined with 'stream'", "echo")
    n = _int(body, "n", 1, 1, limits.max_n)
    rows = max(len(prompts), 1) * n
    if rows > limits.max_rows:
        raise bad(f"{rows} completions asked (prompts x n); at most {limits.max_rows} per "
                  "request", "n")
    top_k = body.get("top_k")
    opts = body.get("stream_options") or {}
    return Request(
        chat=chat, prompts=prompts, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", None, 1e-9, 1.0),
        top_k=None if top_k in (None, 0, -1) else _int(body, "top_k", None, 1),
        n=n, stream=stream, stop=stop, seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=bias, echo=echo, logprobs=lp,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        messages=messages,
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")) if chat else {})

