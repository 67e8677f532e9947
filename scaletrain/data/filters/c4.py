"""C4 rules (Raffel et al. 2020, T5 paper section 2.2): line-level boilerplate removal and
document rules, with the published settings as defaults."""

from __future__ import annotations

import re

from scaletrain.data.documents import Document
from scaletrain.data.filters.text import TERMINAL_PUNCT
from scaletrain.data.pipeline import Step

_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019]?(?:\s|$)")
POLICY_PHRASES = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)


class C4Filter(Step):
    """Removes lines (no terminal punctuation, fewer than 3 words, 'javascript', cookie and
    policy notices, a word over 1000 characters; citation marks are cut out), then drops the
    document if it has 'lorem ipsum' or a curly bracket, or fewer than 5 sentences left.

    Rewrites `text` with the kept lines; counts removed lines per reason."""

    name = "c4"

    def __init__(
        self,
        min_words_per_line: int = 3,
        max_word_length: int = 1000,
        min_sentences: int = 5,
        remove_citations: bool = True,
        drop_no_terminal_punct: bool = True,
        drop_javascript: bool = True,
        drop_policy: bool = True,
        filter_lorem_ipsum: bool = True,
        filter_curly_bracket: bool = True,
    ):
        super().__init__()
        self.min_words_per_line, self.max_word_length = min_words_per_line, max_word_length
        self.min_sentences, self.remove_citations = min_sentences, remove_citations
        self.drop_no_terminal_punct, self.drop_javascript = drop_no_terminal_punct, drop_javascript
        self.drop_policy, self.filter_lorem_ipsum = drop_policy, filter_lorem_ipsum
        self.filter_curly_bracket = filter_curly_bracket

    def _line_reason(self, line: str) -> str | None:
        low = line.lower()
        ws = line.split()
        if self.max_word_length and any(len(w) > self.max_word_length for w in ws):
            return "line_long_word"
        if self.drop_no_terminal_punct and not line.endswith(TERMINAL_PUNCT):
            return "line_no_terminal_punct"
        if len(ws) < self.min_words_per_line:
            return "line_too_few_words"
        if self.drop_javascript and "javascript" in low:
            return "line_javascript"
        if self.drop_policy and any(p in low for p in POLICY_PHRASES):
            return "line_policy"
        return None

    def process(self, doc: Document) -> Document | str:
        text = doc.text
        low = text.lower()
        if self.filter_lorem_ipsum and "lorem ipsum" in low:
            return "lorem_ipsum"
        if self.filter_curly_bracket and "{" in text:
            return "curly_bracket"
        kept = []
        for raw in text.split("\n"):
            line = raw.strip()
            if not line:
                continue
            if self.remove_citations:
                line = _CITATION.sub("", line).strip()
            why = self._line_reason(line)
            if why is None:
                kept.append(line)
            else:
                self.counters[why] += 1
        new_text = "\n".join(kept)
        if len(_SENTENCE_END.findall(new_text)) < self.min_sentences:
            return "too_few_sentences"
        doc.text = new_text
        return doc
