"""Exact deduplication: a 64-bit xxhash of normalized text per document, or per line or
paragraph (the first occurrence in input order survives)."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np
import xxhash

from scaletrain.curate.dedup.common import DedupStep, equal_key_runs
from scaletrain.curate.documents import Document
from scaletrain.curate.io.readers import Shard, read_shard

_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """NFKC, lower case, runs of whitespace collapsed to one space, stripped."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def _units(text: str, level: str) -> list[str]:
    if level == "line":
        return text.split("\n")
    return re.split(r"\n\s*\n", text)


class ExactDedup(DedupStep):
    """`level='document'` drops whole documents whose normalized text was seen before;
    `'line'` / `'paragraph'` remove lines or paragraphs (of at least `min_unit_chars`
    normalized characters) already seen earlier in the corpus or the same document."""

    name = "exact_dedup"
    reason_name = "exact_duplicate"

    def __init__(self, level: str = "document", min_unit_chars: int = 20):
        super().__init__()
        if level not in ("document", "line", "paragraph"):
            raise ValueError(f"exact dedup level '{level}': use document, line or paragraph")
        self.level, self.min_unit_chars = level, min_unit_chars
        self.unit_owner: dict[int, str] = {}  # unit hash -> id of the doc where it first occurs

    def describe(self) -> str:
        return f"{self.name}(level={self.level})"

    def _hash(self, s: str) -> int:
        return xxhash.xxh3_64_intdigest(s.encode("utf-8"))

    def map_shard(self, shard: Shard, out_path: str) -> dict[str, Any]:
        ids: list[str] = []
        hashes: list[int] = []
        doc_of: list[int] = []
        for k, doc in enumerate(read_shard(shard)):
            ids.append(doc.id)
            if self.level == "document":
                hashes.append(self._hash(normalize(doc.text)))
                doc_of.append(k)
            else:
                for u in _units(doc.text, self.level):
                    n = normalize(u)
                    if len(n) >= self.min_unit_chars:
                        hashes.append(self._hash(n))
                        doc_of.append(k)
        np.savez(
            out_path,
            ids=np.array(ids, dtype=object),
            hashes=np.array(hashes, dtype=np.uint64),
            doc=np.array(doc_of, dtype=np.int64),
        )
        return {"docs": len(ids)}

    def reduce(self, shards: list[Shard], map_files: list[str]) -> dict[str, str]:
        ids: list[str] = []
        keys: list[str] = []
        hashes, docs = [], []
        for si, f in enumerate(map_files):
            z = np.load(f, allow_pickle=True)
            docs.append(z["doc"] + len(ids))
            ids += z["ids"].tolist()
            keys += self.position_keys(si, len(z["ids"]))
            hashes.append(z["hashes"])
        h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        d = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        # first occurrence of each hash, in input order (stable sort keeps order among equals)
        order, first, first_pos = equal_key_runs(h)
        hs = h[order]
        dup_mask = ~first
        self.fit_stats = {"units": int(len(h)), "duplicate_units": int(dup_mask.sum())}
        if self.level == "document":
            return {keys[d[order[i]]]: ids[d[first_pos[i]]] for i in np.flatnonzero(dup_mask)}
        # unit level: remember the owner of every repeated unit; process() cuts the repeats
        self.unit_owner = {int(hs[i]): keys[d[first_pos[i]]] for i in np.flatnonzero(dup_mask)}
        return {}

    def extra_state(self) -> Any:
        return {str(k): v for k, v in self.unit_owner.items()}

    def load_extra(self, extra: Any) -> None:
        self.unit_owner = {int(k): v for k, v in (extra or {}).items()}

    def process(self, doc: Document) -> Document | str:
        if self.level == "document":
            return super().process(doc)
        kept, seen_here = [], set()
        sep = "\n" if self.level == "line" else "\n\n"
        for u in _units(doc.text, self.level):
            n = normalize(u)
            if len(n) >= self.min_unit_chars:
                h = self._hash(n)
                owner = self.unit_owner.get(h)
                me = doc.pos if doc.pos is not None else doc.id
                if (owner is not None and owner != me) or h in seen_here:
                    self.counters[f"removed_{self.level}s"] += 1
                    continue
                seen_here.add(h)
            kept.append(u)
        if not any(k.strip() for k in kept):
            return f"all_{self.level}s_duplicate"
        doc.text = sep.join(kept)
        return doc
