"""Gopher quality and repetition filters (Rae et al. 2021, "Scaling Language Models:
Methods, Analysis & Insights from Training Gopher", appendix A1), with its published
thresholds as defaults."""

from __future__ import annotations

from collections.abc import Sequence

from scaletrain.curate.documents import Document
from scaletrain.curate.filters.text import (
    BULLETS,
    ELLIPSES,
    WordNgrams,
    duplicate_stats,
    lines,
    paragraphs,
    words,
)
from scaletrain.curate.pipeline import Filter

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")


class GopherQualityFilter(Filter):
    """Word count and length, symbol ratio, bullet/ellipsis lines, alphabetic words,
    stop words. A threshold set to None disables its rule."""

    name = "gopher_quality"

    def __init__(
        self,
        min_words: int | None = 50,
        max_words: int | None = 100_000,
        min_avg_word_length: float | None = 3,
        max_avg_word_length: float | None = 10,
        max_symbol_word_ratio: float | None = 0.1,
        max_bullet_lines_ratio: float | None = 0.9,
        max_ellipsis_lines_ratio: float | None = 0.3,
        min_alpha_words_ratio: float | None = 0.8,
        min_stop_words: int | None = 2,
        stop_words: Sequence[str] = STOP_WORDS,
    ):
        super().__init__()
        self.min_words, self.max_words = min_words, max_words
        self.min_avg_word_length, self.max_avg_word_length = (
            min_avg_word_length,
            max_avg_word_length,
        )
        self.max_symbol_word_ratio = max_symbol_word_ratio
        self.max_bullet_lines_ratio = max_bullet_lines_ratio
        self.max_ellipsis_lines_ratio = max_ellipsis_lines_ratio
        self.min_alpha_words_ratio = min_alpha_words_ratio
        self.min_stop_words, self.stop_words = min_stop_words, frozenset(stop_words)

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        ws = words(text)
        n = len(ws)
        if self.min_words is not None and n < self.min_words:
            return "too_few_words"
        if self.max_words is not None and n > self.max_words:
            return "too_many_words"
        if n == 0:
            return "too_few_words"
        avg = sum(len(w) for w in ws) / n
        if self.min_avg_word_length is not None and avg < self.min_avg_word_length:
            return "avg_word_too_short"
        if self.max_avg_word_length is not None and avg > self.max_avg_word_length:
            return "avg_word_too_long"
        if self.max_symbol_word_ratio is not None:  # "for either the hash or the ellipsis"
            hashes, ellipses = text.count("#"), text.count("...") + text.count("\u2026")
            if max(hashes, ellipses) / n > self.max_symbol_word_ratio:
                return "symbol_word_ratio"
        ls = lines(text)
        n_lines = max(len(ls), 1)
        bullets = sum(ln.startswith(BULLETS) for ln in ls) / n_lines
        if self.max_bullet_lines_ratio is not None and bullets > self.max_bullet_lines_ratio:
            return "bullet_lines"
        ellipses = sum(ln.endswith(ELLIPSES) for ln in ls) / n_lines
        if self.max_ellipsis_lines_ratio is not None and ellipses > self.max_ellipsis_lines_ratio:
            return "ellipsis_lines"
        if self.min_alpha_words_ratio is not None:
            alpha = sum(any(c.isalpha() for c in w) for w in ws)
            if alpha / n < self.min_alpha_words_ratio:
                return "non_alpha_words"
        if self.min_stop_words is not None:
            found = sum(1 for w in ws if w.lower() in self.stop_words)
            if found < self.min_stop_words:
                return "too_few_stop_words"
        return None

    def describe(self) -> str:
        return (
            f"{self.name}(words {self.min_words}-{self.max_words}, avg word "
            f"{self.min_avg_word_length}-{self.max_avg_word_length}, stop words >= "
            f"{self.min_stop_words})"
        )


class GopherRepetitionFilter(Filter):
    """Duplicate lines/paragraphs (count and character fractions), the most frequent 2-4
    grams and duplicated 5-10 grams as fractions of the characters."""

    name = "gopher_repetition"

    def __init__(
        self,
        max_dup_line_frac: float | None = 0.30,
        max_dup_para_frac: float | None = 0.30,
        max_dup_line_char_frac: float | None = 0.20,
        max_dup_para_char_frac: float | None = 0.20,
        top_ngrams: Sequence[tuple[int, float]] = ((2, 0.20), (3, 0.18), (4, 0.16)),
        dup_ngrams: Sequence[tuple[int, float]] = (
            (5, 0.15),
            (6, 0.14),
            (7, 0.13),
            (8, 0.12),
            (9, 0.11),
            (10, 0.10),
        ),
    ):
        super().__init__()
        self.max_dup_line_frac, self.max_dup_para_frac = max_dup_line_frac, max_dup_para_frac
        self.max_dup_line_char_frac = max_dup_line_char_frac
        self.max_dup_para_char_frac = max_dup_para_char_frac
        self.top_ngrams = [tuple(x) for x in top_ngrams]
        self.dup_ngrams = [tuple(x) for x in dup_ngrams]

    def reason(self, doc: Document) -> str | None:
        text = doc.text
        total_chars = max(len(text), 1)
        for kind, items, frac, char_frac in (
            ("para", paragraphs(text), self.max_dup_para_frac, self.max_dup_para_char_frac),
            ("line", lines(text), self.max_dup_line_frac, self.max_dup_line_char_frac),
        ):
            if not items:
                continue
            n_dup, chars_dup = duplicate_stats(items)
            if frac is not None and n_dup / len(items) > frac:
                return f"dup_{kind}_frac"
            if char_frac is not None and chars_dup / total_chars > char_frac:
                return f"dup_{kind}_char_frac"
        grams = WordNgrams(words(text))
        for n, thr in self.top_ngrams:
            if grams.top_fraction(int(n)) > thr:
                return f"top_{int(n)}gram"
        for n, thr in self.dup_ngrams:
            if grams.duplicate_fraction(int(n)) > thr:
                return f"dup_{int(n)}gram"
        return None
