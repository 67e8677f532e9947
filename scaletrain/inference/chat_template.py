"""Chat templates rendered as transformers renders them (`apply_chat_template`).

The same Jinja environment as transformers: a sandbox with `trim_blocks`/`lstrip_blocks`,
the loop-controls extension (`{% break %}`, `{% continue %}`), the `{% generation %}` block
(assistant spans for training masks), the globals `raise_exception` and `strftime_now` (Llama
3.x templates print today's date with it), a `namespace` that refuses underscore names, and
`tojson` as `json.dumps` without HTML escaping (keyword arguments `indent`, `separators`,
`sort_keys`, `ensure_ascii`). The template sees `messages`, `tools=None`, `documents=None`,
`add_generation_prompt`, the tokenizer's special-token strings and any extra variables
(`chat_template_kwargs`, which win over the special tokens), as in transformers.

Our own small environment rather than transformers' private one: jinja2 comes with torch,
transformers is an optional extra (its import costs ~0.6 s). Tests render every family's
published template through both and compare.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use marks around {% generation %} output
_TRACKING: ContextVar[bool] = ContextVar("chat_template_tracking", default=False)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: while spans are tracked, the block's output
    is wrapped in marks that `render_with_spans` turns into character spans."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        return f"{_OPEN}{text}{_CLOSE}" if _TRACKING.get() else text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set the attribute {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template; raises `jinja2.TemplateError` when it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def has_generation_blocks(source: str) -> bool:
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


def render(template: jinja2.Template, messages: list[dict[str, Any]],
           add_generation_prompt: bool, special: dict[str, str] | None = None,
           extra: dict[str, Any] | None = None) -> str:
    """The conversation's text; raises `jinja2.TemplateError` (e.g. `raise_exception`)."""
    return template.render(messages=messages, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt,
                           **{**(special or {}), **(extra or {})})


def render_with_spans(template: jinja2.Template, messages: list[dict[str, Any]],
                      special: dict[str, str] | None = None,
                      extra: dict[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character spans of its `{% generation %}`
    blocks (what transformers' `return_assistant_tokens_mask` reads)."""
    token = _TRACKING.set(True)
    try:
        marked = render(template, messages, False, special, extra)
    finally:
        _TRACKING.reset(token)
    text, spans, start = [], [], None
    pos = 0
    for ch in marked:
        if ch == _OPEN:
            start = pos
        elif ch == _CLOSE and start is not None:
            spans.append((start, pos))
            start = None
        else:
            text.append(ch)
            pos += 1
    return "".join(text), spans


__all__ = ["compile_template", "render", "render_with_spans", "has_generation_blocks",
           "TemplateError"]
