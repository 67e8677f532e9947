"""Deduplication: exact (hash), fuzzy (MinHash + LSH) and semantic (embeddings + k-means)."""

from scaletrain.curate.dedup.exact import ExactDedup
from scaletrain.curate.dedup.minhash import PRESETS, MinHashDedup
from scaletrain.curate.dedup.semantic import SemanticDedup

__all__ = ["PRESETS", "ExactDedup", "MinHashDedup", "SemanticDedup"]
