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
    """Characters in words covered by any n-gram that occurs more than once (each word
    counted once) over all word characters."""
    if len(ws) < n:
        return 0.0
    first: dict[tuple[str, ...], int] = {}
    covered = bytearray(len(ws))
    for i in range(len(ws) - n + 1):
        g = tuple(ws[i : i + n])
        j = first.setdefault(g, i)
        if j != i:
            covered[i : i + n] = b"\x01" * n
            covered[j : j + n] = b"\x01" * n
    total = sum(len(w) for w in ws)
    dup = sum(len(w) for w, c in zip(ws, covered) if c)
    return dup / max(total, 1)
