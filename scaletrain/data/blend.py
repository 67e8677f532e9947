"""Several sample datasets mixed by weight with Megatron-LM's deterministic greedy rule.

Sample i (counting from 0) comes from the dataset whose `weight * max(i, 1) - drawn_so_far` is
largest, the lowest index on ties (weights normalized to sum to 1). The choice for sample i
depends only on the weights and on i, so a longer blend starts with the shorter one.

`by="samples"`: the weights are the shares of samples. `by="tokens"`: each weight multiplies
its dataset's token count (1.0 everywhere = the natural mixture, proportional to size; 2.0 =
that source seen twice as often per token). Every packed sample has `seq_len + 1` tokens, so
shares of samples are also shares of tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from scaletrain.data.gpt_dataset import GPTDataset

log = logging.getLogger(__name__)


def greedy_blend(weights: Sequence[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) for samples 0..n-1."""
    w = [float(x) for x in weights]
    if not w or any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum (got {w})")
    total = sum(w)
    w = [x / total for x in w]
    k = len(w)
    if k == 1:
        return np.zeros(n, dtype=np.int16), np.arange(n, dtype=np.int64)
    drawn = [0] * k
    which = np.empty(n, dtype=np.int16 if k < 2**15 else np.int32)
    within = np.empty(n, dtype=np.int64)
    for i in range(n):
        t = max(i, 1)
        best, best_err = 0, w[0] * t - drawn[0]
        for j in range(1, k):
            err = w[j] * t - drawn[j]
            if err > best_err:
                best, best_err = j, err
        which[i] = best
        within[i] = drawn[best]
        drawn[best] += 1
    return which, within


def _cached_blend(weights: list[float], n: int, cache_dir: str | Path | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    if cache_dir is None:
        return greedy_blend(weights, n)
    key = hashlib.sha256(json.dumps({"w": weights, "n": n}).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"blend-{key}.npz"
    try:
        with np.load(path) as z:
            return z["which"], z["within"]
    except (OSError, ValueError, KeyError):
        pass
    which, within = greedy_blend(weights, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{id(which)}.npz")
    np.savez(tmp, which=which, within=within)
    tmp.replace(path)
    return which, within


class BlendedDataset:
    """`num_samples` samples drawn from `datasets` by the greedy rule; `window(i)` as in
    GPTDataset. The member datasets are sized to exactly the samples drawn from each."""

    def __init__(
        self,
        datasets: list[GPTDataset],
        weights: Sequence[float],
        num_samples: int,
        by: Literal["samples", "tokens"] = "samples",
        cache_dir: str | Path | None = None,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if by not in ("samples", "tokens"):
            raise ValueError(f"blend by 'samples' or 'tokens' (got {by!r})")
        eff = [float(w) * (d.tokens_per_epoch if by == "tokens" else 1.0)
               for w, d in zip(weights, datasets)]
        self.weights = [x / sum(eff) for x in eff]
        self.by = by
        self.num_samples = num_samples
        self.which, self.within = _cached_blend(self.weights, num_samples, cache_dir)
        counts = np.bincount(self.which, minlength=len(datasets))
        self.datasets = [d if d.num_samples >= c else d.resized(int(c))
                         for d, c in zip(datasets, counts)]
        self.seq_len = datasets[0].seq_len

    def __len__(self) -> int:
        return self.num_samples

    def window(self, i: int) -> np.ndarray:
        return self.datasets[int(self.which[i])].window(int(self.within[i]))

    def positions(self, i: int) -> np.ndarray:
        return self.datasets[int(self.which[i])].positions(int(self.within[i]))

    def mixture(self) -> list[dict[str, Any]]:
        """The realized mixture: per dataset its target and realized share, samples, tokens
        and epochs (passes over its documents)."""
        counts = np.bincount(self.which, minlength=len(self.datasets))
        n = max(self.num_samples, 1)
        return [
            {"name": d.name, "target": round(w, 6), "realized": round(int(c) / n, 6),
             "samples": int(c), "tokens": int(c) * d.seq_len,
             "epochs": round(int(c) / d.samples_per_epoch, 4)}
            for d, w, c in zip(self.datasets, self.weights, counts)
        ]
