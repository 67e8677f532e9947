"""Deduplication: exact (hash), fuzzy (MinHash + LSH) and semantic (embeddings + k-means)."""

from scaletrain.data.dedup.exact import ExactDedup
from scaletrain.data.dedup.minhash import PRESETS, MinHashDedup
from scaletrain.data.dedup.semantic import SemanticDedup

__all__ = ["PRESETS", "ExactDedup", "MinHashDedup", "SemanticDedup"]
