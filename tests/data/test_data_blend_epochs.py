"""Blending checked from the tokens themselves: every token names its dataset and place, so
the source, epoch coverage and order of each drawn sample are read off the sample (an
independent reference for the greedy mixture, oversampling and per-epoch permutations)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scaletrain.data.blend import BlendedDataset
from scaletrain.data.gpt_dataset import GPTDataset
from scaletrain.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 16
BASE = {"a": 1_000_000, "b": 2_000_000}


def _dataset(tmp_path: Path, name: str, n_docs: int, seed: int) -> IndexedDataset:
    """Document k of `name` holds BASE[name] + k*1000 + 0, 1, 2, ... (every id unique)."""
    lengths = np.random.default_rng(seed).integers(1, 3 * SEQ, n_docs)
    with IndexedDatasetWriter(tmp_path / name, np.int32) as w:
        for k, n in enumerate(lengths):
            w.add_document(BASE[name] + k * 1000 + np.arange(n))
    return IndexedDataset(tmp_path / name)


def _draw(tmp_path: Path, weights: list[float], n: int, seed: int) -> list[np.ndarray]:
    a = GPTDataset(_dataset(tmp_path, "a", 30, 1), SEQ, seed)
    b = GPTDataset(_dataset(tmp_path, "b", 12, 2), SEQ, seed)
    blend = BlendedDataset([a, b], weights, n)
    return [blend.window(i) for i in range(n)]


def test_blend_shares_oversampling_and_epochs_from_the_tokens(tmp_path: Path) -> None:
    ds = {k: _dataset(tmp_path, k, n, s) for k, n, s in (("a", 30, 1), ("b", 12, 2))}
    spe = {k: (d.num_tokens - 1) // SEQ for k, d in ds.items()}  # samples per epoch
    weights = [0.3, 0.7]
    n = 4 * spe["b"]  # b (70 %) goes round about 2.8 epochs, a (30 %) less than one
    windows = _draw(tmp_path, weights, n, seed=5)
    src = np.array([int(w[0] >= BASE["b"]) for w in windows])
    for w, s in zip(windows, src):  # a sample never mixes datasets
        assert ((w >= BASE["b"]) == bool(s)).all()
    for m in range(1, n + 1):  # shares follow the weights at every prefix (greedy: within 1)
        counts = np.bincount(src[:m], minlength=2)
        assert np.abs(counts - np.asarray(weights) * m).max() <= 1.0 + 1e-9
    for k, key in enumerate(("a", "b")):
        mine = [w for w, s in zip(windows, src) if s == k]
        tokens = np.asarray(ds[key].tokens)
        for e in range(0, len(mine), spe[key]):  # each epoch, in the order it was drawn
            epoch = mine[e:e + spe[key]]
            targets = np.concatenate([w[1:] for w in epoch])
            assert len(np.unique(targets)) == len(targets)  # no token is a target twice
            if len(epoch) == spe[key]:  # a whole epoch: all but the first and a short tail
                missing = np.setdiff1d(tokens, targets)
                assert 1 <= len(missing) <= SEQ
                assert np.isin(targets, tokens).all()
        if len(mine) > spe[key]:  # the second epoch is another order of the same samples
            assert not all(np.array_equal(x, y) for x, y in
                           zip(mine[:spe[key]], mine[spe[key]:2 * spe[key]]))
    assert (src == 1).sum() > 2 * spe["b"]  # b was oversampled into a third epoch

    again = _draw(tmp_path / "again", weights, n, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(windows, again))  # deterministic
    other = _draw(tmp_path / "other", weights, n, seed=6)
    assert not all(np.array_equal(x, y) for x, y in zip(windows, other))
    longer = _draw(tmp_path / "longer", weights, n + 50, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(windows, longer))  # a longer run extends
