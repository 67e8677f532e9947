"""Text helpers shared by the filters: words, lines, paragraphs, n-grams."""

from __future__ import annotations

import re
from collections import Counter

_PARA_SPLIT = re.compile(r"\n\s*\n")
_PUNCT_STRIP = re.compile(r"^[\W_]+|[\W_]+$")
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "\u201d", "\u2019", "\u3002", "\uff01", "\uff1f")
ELLIPSES = ("...", "\u2026")
BULLETS = ("\u2022", "\u25cf", "\u25cb", "\u25aa", "\u25e6", "\u2023", "\u2043", "-", "*", "\u2013")


def words(text: str) -> list[str]:
    """Whitespace-separated words (the unit used by the Gopher and FineWeb rules)."""
    return text.split()


def normalized_words(text: str) -> list[str]:
    """Lower-cased words with leading/trailing punctuation removed (empty ones dropped)."""
    out = []
    for w in text.lower().split():
        w = _PUNCT_STRIP.sub("", w)
        if w:
            out.append(w)
    return out


def lines(text: str) -> list[str]:
    """Non-empty lines, stripped."""
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in _PARA_SPLIT.split(text) if p.strip()]


def duplicate_stats(items: list[str]) -> tuple[int, int]:
    """(number of items that repeat an earlier one, characters in those repeats)."""
    seen: set[str] = set()
    n_dup = chars_dup = 0
    for it in items:
        if it in seen:
            n_dup += 1
            chars_dup += len(it)
        else:
            seen.add(it)
    return n_dup, chars_dup


def top_ngram_char_fraction(ws: list[str], n: int) -> float:
    """Characters covered by the most frequent word n-gram (counted once per occurrence)
    over all word characters."""
    if len(ws) < n:
        return 0.0
    grams = Counter(tuple(ws[i : i + n]) for i in range(len(ws) - n + 1))
    gram, count = grams.most_common(1)[0]
    if count <= 1:
        return 0.0
    total = sum(len(w) for w in ws)
    return sum(len(w) for w in gram) * count / max(total, 1)


def duplicate_ngram_char_fraction(ws: list[str], n: int) -> float:
    """Characters of words covered by a repeat of an earlier word n-gram (each word counted
    once, the first occurrence not counted) over all word characters.

    The Gopher reading as datatrove implements it: the repeated text is what is duplicated;
    the first occurrence is the page's own content."""
    if len(ws) < n:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    covered = bytearray(len(ws))
    for i in range(len(ws) - n + 1):
        g = tuple(ws[i : i + n])
        if g in seen:
            covered[i : i + n] = b"\x01" * n
        else:
            seen.add(g)
    total = sum(len(w) for w in ws)
    dup = sum(len(w) for w, c in zip(ws, covered) if c)
    return dup / max(total, 1)


class WordNgrams:
    """Vectorized n-gram statistics of one document's words (numpy, no per-n-gram loop).

    Words are hashed once (Python's `hash`, consistent within a process, which is all a
    per-document statistic needs); n-gram hashes are polynomial combinations of the word
    hashes computed with prefix sums. The results equal `top_ngram_char_fraction` and
    `duplicate_ngram_char_fraction` above (64-bit hash collisions aside).
    """

    def __init__(self, ws: list[str]):
        import numpy as np

        from scaletrain.curate.dedup.shingles import _PW, _window_hashes

        self._np, self._pw, self._window = np, _PW, _window_hashes
        self.n_words = len(ws)
        self.hashes = np.fromiter(map(hash, ws), np.int64, len(ws)).view(np.uint64)
        self.lengths = np.fromiter(map(len, ws), np.int64, len(ws))
        self.total = max(int(self.lengths.sum()), 1)

    def _grams(self, n: int):  # noqa: ANN202 - numpy array
        starts = self._np.arange(self.n_words - n + 1)
        return self._window(self.hashes, starts, starts + n, self._pw)

    def top_fraction(self, n: int) -> float:
        np = self._np
        if self.n_words < n:
            return 0.0
        uniq, first, counts = np.unique(self._grams(n), return_index=True, return_counts=True)
        c = counts.max()
        if c <= 1:
            return 0.0
        j = int(first[counts == c].min())  # ties: the earliest, as Counter.most_common does
        return float(self.lengths[j : j + n].sum()) * int(c) / self.total

    def duplicate_fraction(self, n: int) -> float:
        np = self._np
        if self.n_words < n:
            return 0.0
        _, first, inv = np.unique(self._grams(n), return_index=True, return_inverse=True)
        starts = np.flatnonzero(first[inv] != np.arange(len(inv)))  # repeats of earlier ones
        if len(starts) == 0:
            return 0.0
        diff = np.zeros(self.n_words + 1, np.int64)
        np.add.at(diff, starts, 1)
        np.add.at(diff, starts + n, -1)
        covered = np.cumsum(diff[:-1]) > 0
        return float(self.lengths[covered].sum()) / self.total
