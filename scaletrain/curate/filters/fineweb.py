"""FineWeb quality rules (Penedo et al. 2024, "The FineWeb Datasets"): punctuation at line
ends, short lines, characters in duplicated lines, and newlines per word."""

from __future__ import annotations

from scaletrain.curate.documents import Document
from scaletrain.curate.filters.text import TERMINAL_PUNCT, duplicate_stats, lines, words
from scaletrain.curate.pipeline import Filter


class FineWebQualityFilter(Filter):
    """Drops a document when: lines ending in terminal punctuation <= 12%; lines of at most
    30 characters >= 67%; characters in duplicated lines >= 10% of all; or more than 0.3
    newlines per word (a list of single words). None disables a rule."""

    name = "fineweb_quality"

    def __init__(
        self,
        min_line_punct_ratio: float | None = 0.12,
        max_short_line_ratio: float | None = 0.67,
        short_line_length: int = 30,
        max_dup_line_char_ratio: float | None = 0.1,
        max_newline_word_ratio: float | None = 0.3,
    ):
        super().__init__()
        self.min_line_punct_ratio = min_line_punct_ratio
        self.max_short_line_ratio, self.short_line_length = max_short_line_ratio, short_line_length
        self.max_dup_line_char_ratio = max_dup_line_char_ratio
        self.max_newline_word_ratio = max_newline_word_ratio

    def reason(self, doc: Document) -> str | None:
        ls = lines(doc.text)
        if not ls:
            return "empty"
        n = len(ls)
        punct = sum(ln.endswith(TERMINAL_PUNCT) for ln in ls) / n
        if self.min_line_punct_ratio is not None and punct <= self.min_line_punct_ratio:
            return "line_punct_ratio"
        if self.max_short_line_ratio is not None:
            short = sum(len(ln) <= self.short_line_length for ln in ls)
            if short / n >= self.max_short_line_ratio:
                return "short_line_ratio"
        if self.max_dup_line_char_ratio is not None:
            _, dup_chars = duplicate_stats(ls)
            if dup_chars / max(sum(len(ln) for ln in ls), 1) >= self.max_dup_line_char_ratio:
                return "dup_line_char_ratio"
        if self.max_newline_word_ratio is not None:
            n_words = max(len(words(doc.text)), 1)
            if doc.text.count("\n") / n_words > self.max_newline_word_ratio:
                return "newline_word_ratio"
        return None
