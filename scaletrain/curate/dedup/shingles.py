"""Vectorized shingle hashing and MinHash signatures (numpy; no per-token Python loops).

Word shingles: the text is lower-cased and encoded to UTF-8; words are runs of ASCII letters
and digits or non-ASCII bytes. Every word gets a polynomial hash from a prefix sum over the
bytes (mod 2^64, uint64 wraparound: h(s) = sum b_j P^j, shifted to the word start by the
inverse power), every n-gram of words the same construction over the word hashes, and a
splitmix64 finalizer spreads the bits. Character shingles (NeMo's 24-char) are windows of
the UTF-8 bytes hashed the same way. MinHash uses multiply-shift permutations
h_i(x) = (a_i x + b_i) >> 32 with odd 64-bit a_i from a fixed seed.
"""

from __future__ import annotations

import numpy as np

_P = 0x100000001B3  # odd multipliers: invertible mod 2^64
_Q = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789":
    _WORD_BYTE[_c] = True
_WORD_BYTE[128:] = True


class _Powers:
    """base^i and base^-i mod 2^64 for i < n, grown on demand."""

    def __init__(self, base: int):
        self.base, self.inv = base, pow(base, -1, 1 << 64)
        self.pow = np.ones(1, np.uint64)
        self.ipow = np.ones(1, np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.pow) < n:
            m = max(n, 2 * len(self.pow))
            one = np.ones(1, np.uint64)
            with np.errstate(over="ignore"):
                self.pow = np.concatenate((one, np.cumprod(np.full(m - 1, self.base, np.uint64))))
                self.ipow = np.concatenate((one, np.cumprod(np.full(m - 1, self.inv, np.uint64))))
        return self.pow[:n], self.ipow[:n]


_PB, _PW = _Powers(_P), _Powers(_Q)


def splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _window_hashes(
    values: np.ndarray, starts: np.ndarray, ends: np.ndarray, powers: _Powers
) -> np.ndarray:
    """Polynomial hash of values[s:e] for every (s, e), position-independent."""
    pw, ipw = powers.get(len(values) + 1)
    with np.errstate(over="ignore"):
        terms = values.astype(np.uint64) * pw[: len(values)]
        prefix = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
        return (prefix[ends] - prefix[starts]) * ipw[starts]


def word_hashes(text: str) -> np.ndarray:
    """One uint64 per word of the lower-cased text."""
    b = np.frombuffer(text.lower().encode("utf-8"), np.uint8)
    if len(b) == 0:
        return np.zeros(0, np.uint64)
    edge = np.diff(np.concatenate(([0], _WORD_BYTE[b].view(np.int8), [0])))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    return splitmix64(_window_hashes(b, starts, ends, _PB))


def word_ngram_shingles(text: str, n: int = 5) -> np.ndarray:
    """Unique hashes of the word n-grams (a text shorter than n words: one shingle)."""
    w = word_hashes(text)
    if len(w) == 0:
        return np.zeros(1, np.uint64)  # every empty text is the same single shingle
    k = min(n, len(w))
    starts = np.arange(len(w) - k + 1)
    return np.unique(splitmix64(_window_hashes(w, starts, starts + k, _PW)))


def char_shingles(text: str, n: int = 24) -> np.ndarray:
    """Unique hashes of the n-byte windows of the UTF-8 text."""
    b = np.frombuffer(text.encode("utf-8"), np.uint8)
    if len(b) == 0:
        return np.zeros(1, np.uint64)
    k = min(n, len(b))
    starts = np.arange(len(b) - k + 1)
    return np.unique(splitmix64(_window_hashes(b, starts, starts + k, _PB)))


def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64)
    return a, b


def minhash_batch(
    shingle_sets: list[np.ndarray], a: np.ndarray, b: np.ndarray, chunk_rows: int = 1 << 15
) -> np.ndarray:
    """MinHash signatures (len(sets), num_perm) uint32 of several shingle sets at once."""
    sizes = np.array([len(s) for s in shingle_sets], np.int64)
    flat = np.concatenate(shingle_sets) if shingle_sets else np.zeros(0, np.uint64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    out = np.empty((len(shingle_sets), len(a)), np.uint32)
    # process whole documents per chunk so reduceat stays inside one chunk
    d0 = 0
    while d0 < len(shingle_sets):
        d1 = int(np.searchsorted(offsets, offsets[d0] + chunk_rows, side="right")) - 1
        d1 = max(d1, d0 + 1)
        lo, hi = offsets[d0], offsets[d1]
        with np.errstate(over="ignore"):
            vals = ((flat[lo:hi, None] * a[None, :] + b[None, :]) >> np.uint64(32)).astype(
                np.uint32
            )
        out[d0:d1] = np.minimum.reduceat(vals, offsets[d0:d1] - lo, axis=0)
        d0 = d1
    return out


def jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """True Jaccard similarity of two sorted unique hash arrays."""
    inter = len(np.intersect1d(x, y, assume_unique=True))
    union = len(x) + len(y) - inter
    return inter / union if union else 1.0
