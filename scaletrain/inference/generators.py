"""Text generators behind one interface: `complete(prompts, params, seeds) -> completions`.

`LocalGenerator` runs scaletrain's own batched generation (left-padded batches through one KV
cache) over our checkpoints or local Hugging Face models; `HTTPGenerator` (http_client.py)
talks to any OpenAI-compatible server. Both count what they spend against a budget and raise
`BudgetExhausted` *before* starting work they could not pay for, so nothing half done is lost.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from scaletrain.models.transformer import Transformer

logger = logging.getLogger(__name__)


class BudgetExhausted(RuntimeError):
    """The token or request budget of a generator is spent."""


@dataclass
class SamplingParams:
    """Decoding controls shared by every generator (OpenAI names where they exist)."""

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float | None = 0.95
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature}); 0 is greedy")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (got {self.top_k}); leave it unset for none")


@dataclass
class Completion:
    text: str
    tokens: int  # generated tokens (as counted by the generator or reported by the server)
    finish_reason: str  # "stop" (eos or a stop string) or "length"


class Generator(Protocol):
    name: str

    def complete(self, prompts: list[str], params: SamplingParams,
                 seeds: list[int | None] | None = None) -> list[Completion]: ...


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop string (excluded); True when one was found."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class LocalGenerator:
    """In-process generation over a loaded model: prompts sorted by length and batched.

    `token_budget` (generated tokens, 0 = unlimited) is checked before each call: a call that
    starts may overshoot by at most one call's tokens.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, eos_id: int | None,
                 batch_size: int = 16, token_budget: int = 0, name: str = "local",
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 chat: bool = False, stop_ids: tuple[int, ...] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
        self.model, self.tokenizer, self.eos_id = model, tokenizer, eos_id
        self.stop_ids: tuple[int, ...] = tuple(stop_ids) if stop_ids else (
            () if eos_id is None else (eos_id,))
        """Every id decoding stops at (`eos_id` and a HF model's other eos ids)."""
        self.chat_template, self.special_tokens = chat_template, special_tokens
        self._formatter: Any = None
        self.chat = chat  # prompts are user messages, formatted as `chat_ids` does
        self.batch_size, self.token_budget, self.name = batch_size, token_budget, name
        self.tokens_generated = 0
        self.lock = threading.Lock()  # the model's KV cache is per model: one batch at a time

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, device: str = "cpu", dtype: Any = None,
                        **kwargs: Any) -> LocalGenerator:
        from scaletrain.inference.loader import load_model
        from scaletrain.models.transformer import Transformer

        loaded = load_model(path, device=device, dtype=dtype)
        if not isinstance(loaded.model, Transformer):
            raise ValueError(f"{path} is a classification fine-tune, not a language model")
        if loaded.tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json: text generation needs one (copy "
                             "the tokenizer file into the checkpoint directory)")
        return cls(loaded.model, loaded.tokenizer, loaded.eos_id, name=str(path),
                   chat_template=loaded.chat_template, special_tokens=loaded.special_tokens,
                   stop_ids=loaded.stop_ids, **kwargs)

    @property
    def pad_id(self) -> int:
        return self.eos_id if self.eos_id is not None else 0

    def chat_ids(self, messages: list[dict[str, str]],
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of a conversation, ready for the assistant's reply: the model's chat
        template (given `template_kwargs` as extra variables), else the documented default,
        exactly as fine-tuning formats it."""
        return self.formatter.conversation_prompt_ids(messages, template_kwargs)

    @property
    def formatter(self) -> Any:
        """The model's `ChatFormatter` (built on first use)."""
        from scaletrain.inference.chat import ChatFormatter

        if self._formatter is None:
            self._formatter = ChatFormatter(self.tokenizer, self.eos_id, self.chat_template,
                                            self.special_tokens)
        return self._formatter

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                  template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation as text, as `chat_ids` formats it (for clients that tokenize the
        prompt themselves, such as lm_eval's --apply_chat_template)."""
        return self.formatter.prompt_text(messages, add_generation_prompt, template_kwargs)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def complete_ids(self, prompts: list[list[int]], params: SamplingParams,
                     seeds: list[int | None] | None = None) -> list[list[int]]:
        """New token ids per prompt, batched `batch_size` at a time (longest first)."""
        from scaletrain.inference.generation import generate_batch

        params.validate()
        if self.token_budget and self.tokens_generated >= self.token_budget:
            raise BudgetExhausted(f"token budget of {self.token_budget} generated tokens spent")
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            with self.lock:
                res = generate_batch(
                    self.model, [prompts[i] for i in idx], params.max_new_tokens,
                    params.temperature, params.top_k, params.top_p, self.stop_ids,
                    [seeds[i] for i in idx])
            for i, r in zip(idx, res):
                out[i] = r
                self.tokens_generated += len(r)
        return out

    def stop_check(self, stop: list[str]) -> Any:
        """A row stop callback: True once the decoded new text holds a stop string."""
        if not stop:
            return None
        return lambda ids: cut_at_stop(self.decode(ids), stop)[1]

    def complete(self, prompts: list[str], params: SamplingParams,
                 seeds: list[int | None] | None = None) -> list[Completion]:
        """Text completions; a stop string ends decoding of its row (not just the text)."""
        from scaletrain.inference.batch_decode import Row, decode_rows

        params.validate()
        if self.token_budget and self.tokens_generated >= self.token_budget:
            raise BudgetExhausted(f"token budget of {self.token_budget} generated tokens spent")
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        stop = self.stop_check(params.stop)
        rows = [Row(self.chat_ids([{"role": "user", "content": p}]) if self.chat
                    else self.encode(p), params.max_new_tokens, s, stop=stop)
                for p, s in zip(prompts, seeds)]
        out: list[Completion | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].prompt))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            with self.lock:
                res = decode_rows(self.model, [rows[i] for i in idx], params.temperature,
                                  params.top_k, params.top_p, self.stop_ids, self.pad_id)
            for i, r in zip(idx, res):
                self.tokens_generated += len(r.ids)
                text = cut_at_stop(self.decode(r.ids), params.stop)[0]
                out[i] = Completion(text, len(r.ids), r.finish_reason)
        return out  # type: ignore[return-value]
