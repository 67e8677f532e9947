"""Fuzzy deduplication: MinHash + LSH banding, union-find components, optional verification.

Map (per shard, in parallel): shingles and MinHash signatures of every document. Reduce: for
each of `bands` bands, documents whose `rows` signature values are all equal share a bucket
and are linked to the bucket's first document; linked documents form components (union-find
with the smallest input position as root, so the earliest document survives,
deterministically). With `verify`, every member of a component is compared by true Jaccard
similarity of its shingle sets with the component's survivors in input order: it is dropped
only if it reaches `threshold` with one of them, otherwise it becomes a survivor itself, so
no removed document is below the threshold with the document it is a duplicate of.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from scaletrain.curate.dedup.common import DedupStep, equal_key_runs
from scaletrain.curate.dedup.shingles import (
    char_shingles,
    jaccard,
    minhash_batch,
    permutations,
    splitmix64,
    word_ngram_shingles,
)
from scaletrain.curate.io.readers import Shard, read_shard

PRESETS: dict[str, dict[str, Any]] = {
    # FineWeb: word 5-grams, 14 bands x 8 rows (S-curve midpoint ~0.72)
    "fineweb": {"shingle": "word", "ngram": 5, "bands": 14, "rows": 8, "threshold": 0.75},
    # NeMo Curator: 24-character shingles, 20 bands x 13 rows, Jaccard 0.8
    "nemo": {"shingle": "char", "ngram": 24, "bands": 20, "rows": 13, "threshold": 0.8},
}


class UnionFind:
    """Disjoint sets over 0..n-1; the root of a set is its smallest element."""

    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, x: int) -> int:
        p = self.parent
        while p[x] != x:
            p[x] = p[p[x]]
            x = int(p[x])
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class MinHashDedup(DedupStep):
    """MinHash near-duplicate removal. `preset` 'fineweb' or 'nemo' sets the defaults;
    any of shingle ('word'/'char'), ngram, bands, rows, threshold may be given."""

    name = "minhash_dedup"
    reason_name = "near_duplicate"

    def __init__(
        self,
        preset: str = "fineweb",
        shingle: str | None = None,
        ngram: int | None = None,
        bands: int | None = None,
        rows: int | None = None,
        threshold: float | None = None,
        verify: bool = False,
        seed: int = 1,
        batch_docs: int = 256,
    ):
        super().__init__()
        if preset not in PRESETS:
            raise ValueError(f"MinHash preset '{preset}': use one of {sorted(PRESETS)}")
        p = PRESETS[preset]
        self.shingle = shingle or p["shingle"]
        if self.shingle not in ("word", "char"):
            raise ValueError(f"shingle '{self.shingle}': use 'word' or 'char'")
        self.ngram = ngram or p["ngram"]
        self.bands, self.rows = bands or p["bands"], rows or p["rows"]
        self.threshold = p["threshold"] if threshold is None else threshold
        self.verify, self.seed, self.batch_docs = verify, seed, batch_docs

    def describe(self) -> str:
        return (
            f"{self.name}({self.shingle} {self.ngram}-grams, {self.bands}x{self.rows}, "
            f"threshold {self.threshold}, verify={self.verify})"
        )

    def shingles(self, text: str) -> np.ndarray:
        if self.shingle == "word":
            return word_ngram_shingles(text, self.ngram)
        return char_shingles(text, self.ngram)

    def signatures(self, texts: list[str]) -> np.ndarray:
        a, b = permutations(self.bands * self.rows, self.seed)
        return minhash_batch([self.shingles(t) for t in texts], a, b)

    def map_shard(self, shard: Shard, out_path: str) -> dict[str, Any]:
        ids: list[str] = []
        sigs: list[np.ndarray] = []
        batch: list[str] = []
        for doc in read_shard(shard):
            ids.append(doc.id)
            batch.append(doc.text)
            if len(batch) >= self.batch_docs:
                sigs.append(self.signatures(batch))
                batch = []
        if batch:
            sigs.append(self.signatures(batch))
        sig = np.concatenate(sigs) if sigs else np.zeros((0, self.bands * self.rows), np.uint32)
        np.savez(out_path, ids=np.array(ids, dtype=object), sig=sig)
        return {"docs": len(ids)}

    def candidate_edges(self, sig: np.ndarray) -> np.ndarray:
        """(E, 2) pairs (first document of a bucket, another member), unique, a < b."""
        edges = []
        for k in range(self.bands):
            band = sig[:, k * self.rows : (k + 1) * self.rows].astype(np.uint64)
            key = np.zeros(len(sig), np.uint64)
            for r in range(self.rows):
                key = splitmix64(key ^ band[:, r])
            order, start, head = equal_key_runs(key)
            member = ~start
            edges.append(np.stack([head[member], order[member]], axis=1))
        if not edges:
            return np.zeros((0, 2), np.int64)
        e = np.concatenate(edges)
        e = np.sort(e, axis=1)
        return np.unique(e, axis=0) if len(e) else e

    def reduce(self, shards: list[Shard], map_files: list[str]) -> dict[str, str]:
        ids: list[str] = []
        keys: list[str] = []
        sigs, shard_of, pos_of = [], [], []
        for si, f in enumerate(map_files):
            z = np.load(f, allow_pickle=True)
            n = len(z["ids"])
            ids += z["ids"].tolist()
            keys += self.position_keys(si, n)
            sigs.append(z["sig"])
            shard_of.append(np.full(n, si))
            pos_of.append(np.arange(n))
        sig = np.concatenate(sigs) if sigs else np.zeros((0, self.bands * self.rows), np.uint32)
        edges = self.candidate_edges(sig)
        uf = UnionFind(len(ids))
        for a, b in edges.tolist():
            uf.union(a, b)
        comps: dict[int, list[int]] = defaultdict(list)
        for i in np.unique(edges).tolist():
            comps[uf.find(i)].append(i)
        remove: dict[str, str] = {}
        if self.verify and comps:
            members = sorted(i for c in comps.values() for i in c)
            where = (np.concatenate(shard_of)[members], np.concatenate(pos_of)[members])
            sh = self._load_shingles(shards, members, where)
            below = 0
            for comp in comps.values():
                survivors: list[int] = []
                for i in sorted(comp):
                    best = next(
                        (s for s in survivors if jaccard(sh[i], sh[s]) >= self.threshold), None
                    )
                    if best is None:
                        survivors.append(i)
                        below += 1 if survivors[0] != i else 0
                    else:
                        remove[keys[i]] = ids[best]
            self.fit_stats["candidates_rejected_by_verification"] = below
        else:
            for root, comp in comps.items():
                for i in comp:
                    if i != root:
                        remove[keys[i]] = ids[root]
        self.fit_stats.update(
            {
                "documents": len(ids),
                "candidate_pairs": int(len(edges)),
                "components": len(comps),
                "removed": len(remove),
            }
        )
        return remove

    def _load_shingles(
        self, shards: list[Shard], members: list[int], where: tuple[np.ndarray, np.ndarray]
    ) -> dict[int, np.ndarray]:
        """Shingle sets of the given documents, re-read from their shards."""
        wanted: dict[int, dict[int, int]] = defaultdict(dict)
        for g, s, p in zip(members, where[0].tolist(), where[1].tolist()):
            wanted[s][p] = g
        out: dict[int, np.ndarray] = {}
        for s, positions in wanted.items():
            for p, doc in enumerate(read_shard(shards[s])):
                if p in positions:
                    out[positions[p]] = self.shingles(doc.text)
        return out
