"""Which text of a rendered conversation is the assistant's (trained) and which is prompt.

With `{% generation %}` blocks in the template, the blocks are the assistant's text (as
transformers' `return_assistant_tokens_mask` and TRL read them). Without them, render and
diff per assistant turn, so that templates whose renders are not a growing prefix (Qwen3
drops the reasoning of earlier turns; Phi-3 appends the end-of-text token only at the end)
still train on every turn:
- turn k's text is what rendering messages[:k+1] adds to the generation prompt of
  messages[:k]: the turn as the model produces it when it is asked for it;
- the prompt text between turn j and turn k is what the template puts after message j in the
  generation prompt of messages[:k]; it is found as the common suffix of that prompt and the
  same prompt with message j's content swapped for a mark;
- turn j keeps of its closing text (after its content) what the template also writes after
  it mid-conversation (Phi-3's `<|end|>\n`, not the end-of-text token that only ends a
  conversation); the last turn keeps all of it.
For Qwen3 and Phi-3 this gives the text and mask TRL trains on with its training templates
(checked against TRL in the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Render = Callable[[list[dict[str, Any]], bool], str]
_MARK = "\ue002"


class SpanError(ValueError):
    """The template renders a conversation in a way assistant turns cannot be found in."""


class PrefillDropped(SpanError):
    """A rendered assistant turn does not continue the generation prompt it is asked with
    (the prompt prefills text, such as DeepSeek-R1's `<think>\\n`, that the rendered turn
    drops); `pieces_by_marks` still finds the turns."""

    def __init__(self, turn: int, prefill: str):
        super().__init__(f"the chat template renders assistant turn {turn} without the "
                         f"{prefill!r} its generation prompt ends with")
        self.prefill = prefill


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _with_mark(messages: list[dict[str, Any]], j: int) -> list[dict[str, Any]]:
    out = list(messages)
    out[j] = {**messages[j], "content": _MARK}
    return out


def _token_cut(text: str, k: int, encode: Callable[[str], list[int]] | None) -> int:
    """The largest cut <= k at which encoding text[:cut] and text[cut:] apart gives the
    tokens of the whole (a character-level common prefix can end inside a special token:
    `<|end|>\n<|` of `<|end|>\n<|endoftext|>` and `<|end|>\n<|user|>`)."""
    if encode is None:
        return k
    whole = encode(text)
    while k > 0 and encode(text[:k]) + encode(text[k:]) != whole:
        k -= 1
    return k


def pieces_by_diff(render: Render, messages: list[dict[str, Any]],
                   encode: Callable[[str], list[int]] | None = None) -> list[tuple[str, bool]]:
    """(text, is the assistant's) pieces whose concatenation is the training text; `encode`
    (the tokenizer) keeps the cut between a turn and the prompt after it on a token
    boundary."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    out: list[tuple[str, bool]] = []
    prev: tuple[int, str, int] | None = None  # (message index, its turn text, closer length)
    for i in turns:
        prompt = render(messages[:i], True)
        full = render(messages[: i + 1], False)
        if not full.startswith(prompt):
            raise PrefillDropped(i, prompt[_common_prefix(prompt, full):])
        turn = full[len(prompt):]
        marked = render(_with_mark(messages, i)[: i + 1], False)
        closer = _common_suffix(turn, marked)
        if prev is None:
            out.append((prompt, False))
        else:
            j, prev_turn, prev_closer = prev
            shared = _common_suffix(prompt, render(_with_mark(messages, j)[:i], True))
            after = prompt[len(prompt) - shared:]
            kept = _token_cut(after, _common_prefix(prev_turn[len(prev_turn) - prev_closer:],
                                                    after), encode)
            out[-1] = (prev_turn[: len(prev_turn) - prev_closer + kept], True)
            out.append((after[kept:], False))
        out.append((turn, True))
        prev = (i, turn, closer)
    if turns and turns[-1] < len(messages) - 1:  # messages after the last reply: prompt text
        whole = render(messages, False)
        last = turns[-1]
        shared = _common_suffix(whole, render(_with_mark(messages, last), False))
        j, prev_turn, prev_closer = prev  # type: ignore[misc]
        after = whole[len(whole) - shared:]
        kept = _token_cut(after, _common_prefix(prev_turn[len(prev_turn) - prev_closer:], after),
                          encode)
        out[-1] = (prev_turn[: len(prev_turn) - prev_closer + kept], True)
        out.append((after[kept:], False))
    return [(t, a) for t, a in out if t]


def pieces_by_marks(render: Render, messages: list[dict[str, Any]],
                    encode: Callable[[str], list[int]] | None = None
                    ) -> list[tuple[str, bool]]:
    """(text, is the assistant's) pieces of the whole conversation as the template renders
    it, for templates whose rendered turns do not continue their generation prompt: turn j
    is the text that changes when its content is swapped for a mark, plus the closing text
    the template writes after it (of which a turn followed by more messages keeps what the
    template also writes there, cut on a token boundary). The role header before a turn is
    prompt, as in `pieces_by_diff`."""
    whole = render(messages, False)
    spans: list[tuple[int, int]] = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        marked = render(_with_mark(messages, j), False)
        start = _common_prefix(whole, marked)
        end = max(start, len(whole) - _common_suffix(whole, marked))
        alone = render(messages[: j + 1], False)  # the turn closes the conversation here
        closer = alone[len(alone) - _common_suffix(alone, render(
            _with_mark(messages, j)[: j + 1], False)):]
        kept = _common_prefix(closer, whole[end:])
        if j < len(messages) - 1:
            kept = _token_cut(whole[end:], kept, encode)
        if spans and start < spans[-1][1]:
            raise SpanError(f"assistant turn {j} overlaps the turn before it in the render")
        spans.append((start, end + kept))
    return pieces_from_spans(whole, spans)


def pieces_from_spans(text: str, spans: list[tuple[int, int]]) -> list[tuple[str, bool]]:
    out, pos = [], 0
    for s, e in spans:
        if s > pos:
            out.append((text[pos:s], False))
        if e > s:
            out.append((text[s:e], True))
        pos = max(pos, e)
    if pos < len(text):
        out.append((text[pos:], False))
    return out


__all__ = ["PrefillDropped", "SpanError", "pieces_by_diff", "pieces_by_marks",
           "pieces_from_spans"]
