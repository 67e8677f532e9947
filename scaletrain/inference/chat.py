"""The chat format: a conversation -> the token ids a model is trained on and prompted with.

One formatter for every verb: fine-tuning (`finetune/sft.py` scores the assistant turns it
marks), `predict`, `serve`'s chat endpoint and `data synth` (chat) prompt with the same tokens,
so a model is asked exactly as it was trained. With a chat template (the tokenizer config's
Jinja `chat_template`) each assistant turn's rendered text is the response and everything the
template puts around it (system prompt, user turns, role headers) is prompt. Without one the
documented default is `role: content` lines and `assistant: ` before the reply.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer


log = logging.getLogger(__name__)


class ChatFormatError(ValueError):
    """A record, a conversation or a chat template that cannot be formatted."""


class ChatFormatter:
    """Turns one JSON record into token ids and a loss mask.

    Records: {"prompt": ..., "response": ...} (also "completion") or
    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}.
    """

    def __init__(self, tokenizer: Tokenizer, eos_id: int | None, template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.special = dict(special_tokens or {})
        self._template = None
        self._source = template or ""
        self._prefill_said = False  # the PrefillDropped warning, once per formatter
        if template:
            from scaletrain.inference.chat_template import TemplateError, compile_template

            try:
                self._template = compile_template(template)
            except TemplateError as e:
                raise ChatFormatError(
                    f"the tokenizer's chat_template does not parse: {e}") from None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               **template_kwargs: Any) -> str:
        """The template's text, as transformers' `apply_chat_template` renders it; a
        conversation the template refuses (`raise_exception`, ...) is a ChatFormatError."""
        from scaletrain.inference.chat_template import TemplateError, render

        assert self._template is not None
        try:
            return render(self._template, messages, add_generation_prompt, self.special,
                          template_kwargs)
        except TemplateError as e:
            raise ChatFormatError(f"the chat template refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                RecursionError) as e:  # the template tripped over the messages or variables
            raise ChatFormatError(f"the chat template failed on the conversation: "
                                  f"{type(e).__name__}: {e}") from None

    # --- records -> (ids, mask) -----------------------------------------------------------
    def encode(self, record: dict[str, Any], where: str) -> tuple[list[int], list[bool]]:
        """Token ids of the whole example and, per token, whether it is scored."""
        if "messages" in record:
            messages = record["messages"]
            _check_messages(messages, where)
        elif "prompt" in record and ("response" in record or "completion" in record):
            response = record.get("response", record.get("completion"))
            if not isinstance(record["prompt"], str) or not isinstance(response, str):
                raise ChatFormatError(f"{where}: 'prompt' and 'response' must be strings")
            messages = [{"role": "user", "content": record["prompt"]},
                        {"role": "assistant", "content": response}]
        else:
            raise ChatFormatError(
                f"{where}: expected {{\"prompt\": ..., \"response\": ...}} or "
                f"{{\"messages\": [...]}} (got keys {sorted(record)})"
            )
        return self._templated(messages, where) if self.has_template else self._fallback(messages)

    def _fallback(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        """No template, the documented default format: one `role: content` line per message,
        an assistant turn being `assistant: ` + content + end-of-text + newline; assistant
        contents + end-of-text are scored."""
        ids: list[int] = []
        mask: list[bool] = []
        for m in messages:
            if m["role"] == "assistant":
                head = self._ids("assistant: ")
                body = self._ids(m["content"]) + ([self.eos_id] if self.eos_id is not None else [])
                tail = self._ids("\n")
                ids += head + body + tail
                mask += [False] * len(head) + [True] * len(body) + [False] * len(tail)
            else:
                piece = self._ids(f"{m['role']}: {m['content']}\n")
                ids += piece
                mask += [False] * len(piece)
        return ids, mask

    def _templated(self, messages: list[dict[str, str]],
                   where: str) -> tuple[list[int], list[bool]]:
        """The assistant's text of the rendered conversation is scored (`chat_spans`: the
        template's `{% generation %}` blocks, else render-and-diff per turn); each piece is
        encoded on its own, so the prompt tokens are those `conversation_prompt_ids` gives."""
        from scaletrain.inference.chat_spans import (
            PrefillDropped,
            SpanError,
            pieces_by_diff,
            pieces_by_marks,
            pieces_from_spans,
        )
        from scaletrain.inference.chat_template import (
            TemplateError,
            has_generation_blocks,
            render_with_spans,
        )

        try:
            if has_generation_blocks(self._source):
                assert self._template is not None
                try:
                    text, spans = render_with_spans(self._template, messages, self.special)
                except TemplateError as e:
                    raise ChatFormatError(f"the chat template refused the conversation: {e}"
                                          ) from None
                pieces = pieces_from_spans(text, spans)
            else:
                render = self.render
                try:
                    pieces = pieces_by_diff(render, messages, self._ids)
                except PrefillDropped as e:
                    if not self._prefill_said:
                        log.warning("%s; each assistant turn is trained as the whole "
                                    "conversation renders it, without that text (add {%% "
                                    "generation %%} blocks to the template to choose)", e)
                        self._prefill_said = True
                    pieces = pieces_by_marks(render, messages, self._ids)
        except (ChatFormatError, SpanError) as e:
            raise ChatFormatError(f"{where}: {e}") from None
        ids: list[int] = []
        mask: list[bool] = []
        for text, scored in pieces:
            piece = self._ids(text)
            ids += piece
            mask += [scored] * len(piece)
        return ids, mask

    def conversation_prompt_ids(self, messages: list[dict[str, str]],
                                template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Ids of a conversation followed by the assistant's turn opening (serve's chat), the
        same tokens fine-tuning puts before an assistant reply."""
        if self.has_template:
            return self._ids(self.render(messages, add_generation_prompt=True,
                                         **(template_kwargs or {})))
        return self._fallback(messages)[0] + self._ids("assistant: ")

    def prompt_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The text `conversation_prompt_ids` encodes (with the default format, its
        `role: content` lines; assistant turns end with the end-of-text token)."""
        if self.has_template:
            return self.render(messages, add_generation_prompt, **(template_kwargs or {}))
        eos = "" if self.eos_id is None else self.tokenizer.decode([self.eos_id],
                                                                    skip_special_tokens=False)
        text = "".join(f"assistant: {m['content']}{eos}\n" if m["role"] == "assistant"
                       else f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def prompt_ids(self, prompt: str) -> list[int]:
        """Ids of a new prompt as one user message, ready for the model to generate the
        response (predict), formatted exactly as a prompt/response record is in training."""
        return self.conversation_prompt_ids([{"role": "user", "content": prompt}])


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of OpenAI text parts
    ({"type": "text", "text": ...}) joined. Other part types raise ValueError."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: content part of type {kind!r} is not supported; "
                                 "only text parts are")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}: 'content' must be a string or a list of text parts")


def _check_messages(messages: Any, where: str) -> None:
    """Validate messages in place; list-of-parts content becomes its text."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: 'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatFormatError(f"{where}: each message needs a string 'role' and a 'content'")
        try:
            m["content"] = content_text(m.get("content"), where)
        except ValueError as e:
            raise ChatFormatError(str(e)) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError(f"{where}: no assistant message, so nothing would be trained on")


__all__ = ["ChatFormatter", "ChatFormatError", "content_text"]
