"""GPT-style samples: documents packed into windows of `seq_len + 1` tokens.

One epoch of a split is its documents (the indexed dataset's sequences) in a seeded random
order, read as one token stream; sample k of the epoch is stream[k*seq_len : k*seq_len+seq_len+1]
(consecutive samples share one token: the last target of one is the first input of the next,
so every token after the first is a target exactly once). The epoch's samples are then shuffled
(seeded). Epochs follow each other when more samples are asked for than one epoch holds; each
epoch is a function of (seed, epoch) only, so asking for more samples never changes the first
ones. The index arrays (document order, sample start positions, sample shuffle) are cached on
disk under a hash of everything that determines them and memory-mapped when read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.data.indexed import IndexedDataset

log = logging.getLogger(__name__)

INDEX_VERSION = 1
_ARRAYS = ("doc_order", "sample_doc", "sample_off", "shuffle")


def split_ranges(n_docs: int, split: tuple[float, ...]) -> list[tuple[int, int]]:
    """Contiguous document ranges for ratios like (98, 2, 0) (Megatron's `--split` rule:
    boundaries at round(cumulative share * n_docs))."""
    if not split or any(s < 0 for s in split) or sum(split) <= 0:
        raise ValueError(f"split ratios must be non-negative with a positive sum (got {split})")
    total = float(sum(split))
    bounds = [0]
    for s in split:
        bounds.append(bounds[-1] + int(round(s / total * n_docs)))
    diff = bounds[-1] - n_docs
    bounds = [b - diff if i else b for i, b in enumerate(bounds)]  # fix rounding at the end
    bounds = [min(max(b, 0), n_docs) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(len(split))]


@dataclass(frozen=True)
class _Epoch:
    doc_order: np.ndarray  # sequence ids of the epoch, in stream order
    sample_doc: np.ndarray  # [spe + 1] index into doc_order where each sample starts
    sample_off: np.ndarray  # [spe + 1] token offset in that sequence
    shuffle: np.ndarray  # [spe] the epoch's sample order


class GPTDataset:
    """Packed samples over documents [doc_start, doc_end) of an indexed dataset.

    `window(i)` gives sample i's `seq_len + 1` tokens; `positions(i)` the position of each of
    its first `seq_len` tokens inside its own document (0 where a document starts), from which
    the document boundaries / cumulative sequence lengths follow (`cu_seqlens`).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        seed: int,
        num_samples: int | None = None,
        doc_range: tuple[int, int] | None = None,
        shuffle: bool = True,
        cache_dir: str | Path | None = None,
        name: str | None = None,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive (got {seq_len})")
        self.indexed, self.seq_len, self.seed, self.shuffle = indexed, seq_len, seed, shuffle
        self.name = name or indexed.prefix.name
        d0, d1 = doc_range if doc_range is not None else (0, indexed.num_documents)
        if not 0 <= d0 <= d1 <= indexed.num_documents:
            raise ValueError(f"{self.name}: document range ({d0}, {d1}) outside "
                             f"[0, {indexed.num_documents}]")
        self.doc_range = (d0, d1)
        docs = indexed.document_indices
        self.seq_range = (int(docs[d0]), int(docs[d1]))
        s0, s1 = self.seq_range
        lengths = np.asarray(indexed.sequence_lengths[s0:s1], dtype=np.int64)
        self.tokens_per_epoch = int(lengths.sum())
        self.samples_per_epoch = max((self.tokens_per_epoch - 1) // seq_len, 0)
        if self.samples_per_epoch == 0:
            raise ValueError(
                f"{self.name}: documents {d0}..{d1} hold {self.tokens_per_epoch} tokens, less "
                f"than one sample of {seq_len + 1}; use more data or a smaller seq_len"
            )
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)
        self.num_epochs = max(-(-self.num_samples // self.samples_per_epoch), 1)
        self._cache_dir = cache_dir
        self._arrays = self._load_or_build(cache_dir)

    def resized(self, num_samples: int) -> GPTDataset:
        """The same dataset with `num_samples` samples (its first samples are unchanged)."""
        return GPTDataset(self.indexed, self.seq_len, self.seed, num_samples, self.doc_range,
                          self.shuffle, self._cache_dir, self.name)

    # --- index arrays -----------------------------------------------------------------------
    def _key(self) -> str:
        idx = Path(f"{self.indexed.prefix}.idx")
        st = idx.stat()
        spec = {"v": INDEX_VERSION, "idx": str(idx.resolve()), "size": st.st_size,
                "mtime": st.st_mtime_ns, "seq_range": self.seq_range, "seq_len": self.seq_len,
                "seed": self.seed, "shuffle": self.shuffle, "epochs": self.num_epochs}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]

    def _build_epoch(self, epoch: int) -> _Epoch:
        s0, s1 = self.seq_range
        order = np.arange(s0, s1, dtype=np.int64)
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, 0]).shuffle(order)
        lengths = np.asarray(self.indexed.sequence_lengths, dtype=np.int64)[order]
        cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cum[1:])
        starts = np.arange(self.samples_per_epoch + 1, dtype=np.int64) * self.seq_len
        doc = np.searchsorted(cum, starts, side="right") - 1
        off = starts - cum[doc]
        perm = np.arange(self.samples_per_epoch, dtype=np.int64)
        if self.shuffle:
            np.random.default_rng([self.seed, epoch, 1]).shuffle(perm)
        return _Epoch(order, doc, off, perm)

    def _build(self) -> dict[str, np.ndarray]:
        epochs = [self._build_epoch(e) for e in range(self.num_epochs)]
        small = np.int32 if max(self.seq_range[1], self.samples_per_epoch + 1) < 2**31 \
            else np.int64
        out = {}
        for name in _ARRAYS:
            dtype = np.int32 if name == "sample_off" else small
            out[name] = np.stack([getattr(e, name) for e in epochs]).astype(dtype)
        return out

    def _load_or_build(self, cache_dir: str | Path | None) -> dict[str, np.ndarray]:
        if cache_dir is None:
            return self._build()
        entry = Path(cache_dir) / f"gpt-{self._key()}"
        try:
            return {n: np.load(entry / f"{n}.npy", mmap_mode="r") for n in _ARRAYS}
        except (OSError, ValueError):
            pass
        arrays = self._build()
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        try:
            for n, a in arrays.items():
                np.save(tmp / f"{n}.npy", a)
            (tmp / "config.json").write_text(json.dumps(self.describe(), indent=1))
            with contextlib.suppress(OSError):  # another process finished it first
                os.rename(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("cached sample index %s (%d epochs of %d samples)", entry, self.num_epochs,
                 self.samples_per_epoch)
        return {n: np.load(entry / f"{n}.npy", mmap_mode="r") for n in _ARRAYS}

    # --- samples ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_samples

    def _pieces(self, i: int) -> list[tuple[int, int, int]]:
        """(sequence id, offset, length) pieces making up sample i."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sample {i} out of range for {self.num_samples}")
        e, j = divmod(i, self.samples_per_epoch)
        a = self._arrays
        k = int(a["shuffle"][e, j])
        d0, o0 = int(a["sample_doc"][e, k]), int(a["sample_off"][e, k])
        d1, o1 = int(a["sample_doc"][e, k + 1]), int(a["sample_off"][e, k + 1])
        order = a["doc_order"][e]
        lengths = self.indexed.sequence_lengths
        if d0 == d1:
            return [(int(order[d0]), o0, o1 - o0 + 1)]
        seq = int(order[d0])
        pieces = [(seq, o0, int(lengths[seq]) - o0)]
        for d in range(d0 + 1, d1):
            seq = int(order[d])
            pieces.append((seq, 0, int(lengths[seq])))
        if d1 < len(order):
            pieces.append((int(order[d1]), 0, o1 + 1))
        return pieces

    def window(self, i: int) -> np.ndarray:
        """Sample i's `seq_len + 1` tokens (inputs are [:-1], targets [1:])."""
        parts = [self.indexed.get(s, o, n) for s, o, n in self._pieces(i)]
        out = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
        assert len(out) == self.seq_len + 1, (i, len(out))
        return out

    def positions(self, i: int) -> np.ndarray:
        """Position of each input token inside its document (0 at each document start)."""
        pos = [np.arange(o, o + n, dtype=np.int64) for _, o, n in self._pieces(i)]
        return np.concatenate(pos)[: self.seq_len]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "prefix": str(self.indexed.prefix),
                "doc_range": list(self.doc_range), "seq_len": self.seq_len, "seed": self.seed,
                "shuffle": self.shuffle, "tokens_per_epoch": self.tokens_per_epoch,
                "samples_per_epoch": self.samples_per_epoch, "num_samples": self.num_samples,
                "epochs": self.num_epochs}


def cu_seqlens(positions: np.ndarray) -> np.ndarray:
    """Cumulative document lengths of one sample from its `positions` (starts + the end)."""
    starts = np.flatnonzero(positions == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.concatenate([starts, [len(positions)]]).astype(np.int32)
