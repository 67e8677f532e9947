"""Filters for generated candidates: incremental MinHash dedup and n-gram decontamination.

`MinHashIndex` is an in-memory LSH index that grows as candidates are kept, so a candidate is
compared with the existing corpus and with everything kept before it in the run (within-batch
and across batches). It reuses the curation MinHash (shingles, permutations) so thresholds mean
the same thing in `data dedup` and `data synth`; a candidate is a duplicate when it shares an
LSH bucket with an indexed document whose estimated Jaccard (signature agreement) reaches
`threshold`.

`Decontaminator` drops a candidate that shares any word n-gram (default 13, the GPT-3 /
Llama practice) with an evaluation set; evaluation texts shorter than n words are matched as
whole normalized word sequences.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import numpy as np

from scaletrain.curate.dedup.minhash import MinHashDedup
from scaletrain.curate.dedup.shingles import splitmix64

logger = logging.getLogger(__name__)


class MinHashIndex:
    def __init__(self, threshold: float = 0.7, preset: str = "fineweb", shingle: str | None = None,
                 ngram: int | None = None, bands: int | None = None, rows: int | None = None,
                 seed: int = 1):
        self.mh = MinHashDedup(preset, shingle=shingle, ngram=ngram, bands=bands, rows=rows,
                               threshold=threshold, seed=seed)
        self.threshold = threshold
        self.buckets: list[dict[int, list[int]]] = [{} for _ in range(self.mh.bands)]
        self.sigs: list[np.ndarray] = []
        self.keys: list[str] = []

    def __len__(self) -> int:
        return len(self.keys)

    def _band_keys(self, sig: np.ndarray) -> list[int]:
        r = self.mh.rows
        out = []
        for k in range(self.mh.bands):
            key = np.zeros(1, np.uint64)
            for v in sig[k * r : (k + 1) * r].astype(np.uint64):
                key = splitmix64(key ^ v)
            out.append(int(key[0]))
        return out

    def signatures(self, texts: list[str]) -> np.ndarray:
        return self.mh.signatures(texts)

    def query(self, sig: np.ndarray) -> tuple[str, float] | None:
        """(key, estimated Jaccard) of the most similar indexed document over the threshold."""
        best: tuple[str, float] | None = None
        seen: set[int] = set()
        for band, key in zip(self.buckets, self._band_keys(sig)):
            for j in band.get(key, ()):
                if j in seen:
                    continue
                seen.add(j)
                sim = float(np.mean(self.sigs[j] == sig))
                if sim >= self.threshold and (best is None or sim > best[1]):
                    best = (self.keys[j], sim)
        return best

    def add(self, key: str, sig: np.ndarray) -> None:
        j = len(self.keys)
        self.keys.append(key)
        self.sigs.append(sig)
        for band, bkey in zip(self.buckets, self._band_keys(sig)):
            band.setdefault(bkey, []).append(j)

    def add_texts(self, items: Iterable[tuple[str, str]], batch: int = 256) -> int:
        """Index (key, text) pairs; returns how many were added."""
        n, chunk = 0, []
        for item in items:
            chunk.append(item)
            if len(chunk) >= batch:
                n += self._add_chunk(chunk)
                chunk = []
        return n + (self._add_chunk(chunk) if chunk else 0)

    def _add_chunk(self, chunk: list[tuple[str, str]]) -> int:
        for (key, _), sig in zip(chunk, self.signatures([t for _, t in chunk])):
            self.add(key, sig)
        return len(chunk)


_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Decontaminator:
    def __init__(self, texts: Iterable[str], n: int = 13):
        if n < 1:
            raise ValueError(f"decontamination n-gram size must be >= 1 (got {n})")
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.short: set[tuple[str, ...]] = set()
        self.sources = 0
        for t in texts:
            w = words(t)
            self.sources += 1
            if len(w) < n:
                if w:
                    self.short.add(tuple(w))
            else:
                self.grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
        logger.info("decontamination: %d evaluation texts, %d %d-grams", self.sources,
                    len(self.grams), n)

    def match(self, text: str) -> str | None:
        """The first evaluation n-gram found in `text` (joined by spaces), or None."""
        w = words(text)
        for i in range(len(w) - self.n + 1):
            g = tuple(w[i : i + self.n])
            if g in self.grams:
                return " ".join(g)
        if self.short:
            for g in self.short:
                k = len(g)
                if any(tuple(w[i : i + k]) == g for i in range(len(w) - k + 1)):
                    return " ".join(g)
        return None
