"""Packed GPT samples, splits, shuffles, epochs, index cache, and greedy blending."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scaletrain.data import gpt_dataset as gd
from scaletrain.data.blend import BlendedDataset, greedy_blend
from scaletrain.data.gpt_dataset import GPTDataset, cu_seqlens, split_ranges
from scaletrain.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 16


def _indexed(tmp_path: Path, n_docs: int = 40, seed: int = 0, name: str = "d") -> IndexedDataset:
    """Documents of random lengths (some shorter than a sample, one empty) with unique ids:
    document k holds the ids k*1000 + 0, 1, 2, ... so every token names its place."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * SEQ, n_docs)
    lengths[5] = 0
    with IndexedDatasetWriter(tmp_path / name, np.int32) as w:
        for k, n in enumerate(lengths):
            w.add_document(k * 1000 + np.arange(n))
    return IndexedDataset(tmp_path / name)


def _stream(ds: IndexedDataset, order) -> np.ndarray:
    return np.concatenate([ds[int(i)] for i in order])


def test_packing_conserves_every_token_in_order(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    g = GPTDataset(ds, SEQ, seed=0, shuffle=False)
    stream = _stream(ds, range(len(ds)))
    assert g.samples_per_epoch == (len(stream) - 1) // SEQ
    windows = [g.window(i) for i in range(len(g))]
    assert all(len(w) == SEQ + 1 for w in windows)
    for a, b in zip(windows, windows[1:]):
        assert a[-1] == b[0]  # the last target of a sample is the next sample's first input
    joined = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])
    np.testing.assert_array_equal(joined, stream[: len(joined)])
    assert len(stream) - len(joined) < SEQ  # only the tail shorter than a sample is left


def test_positions_mark_document_boundaries(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    g = GPTDataset(ds, SEQ, seed=3)
    for i in range(len(g)):
        x, pos = g.window(i)[:-1], g.positions(i)
        np.testing.assert_array_equal(pos, x % 1000)  # ids encode the offset in the document
        cu = cu_seqlens(pos)
        assert cu[0] == 0 and cu[-1] == SEQ and np.all(np.diff(cu) > 0)
        for a, b in zip(cu[:-1], cu[1:]):  # one document per segment
            assert len(set((x[a:b] // 1000).tolist())) == 1


def test_shuffles_are_seeded_permutations(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    a = GPTDataset(ds, SEQ, seed=1)
    order = np.asarray(a._arrays["doc_order"][0])
    assert sorted(order.tolist()) == list(range(len(ds))) and order.tolist() != sorted(order)
    perm = np.asarray(a._arrays["shuffle"][0])
    assert sorted(perm.tolist()) == list(range(a.samples_per_epoch))
    # The samples are the unshuffled packing of the shuffled document order, permuted.
    stream = _stream(ds, order)
    for i in range(len(a)):
        k = int(perm[i])
        np.testing.assert_array_equal(a.window(i), stream[k * SEQ : k * SEQ + SEQ + 1])
    same = GPTDataset(ds, SEQ, seed=1)
    other = GPTDataset(ds, SEQ, seed=2)
    first = [a.window(i).tolist() for i in range(len(a))]
    assert first == [same.window(i).tolist() for i in range(len(a))]
    assert first != [other.window(i).tolist() for i in range(len(a))]


def test_epochs_extend_without_changing_the_first_samples(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    one = GPTDataset(ds, SEQ, seed=0)
    spe = one.samples_per_epoch
    three = GPTDataset(ds, SEQ, seed=0, num_samples=2 * spe + 5)
    assert three.num_epochs == 3 and len(three) == 2 * spe + 5
    for i in range(spe):
        np.testing.assert_array_equal(three.window(i), one.window(i))
    e0 = sorted(tuple(three.window(i)) for i in range(spe))
    e1 = [tuple(three.window(i)) for i in range(spe, 2 * spe)]
    assert e1 != [tuple(three.window(i)) for i in range(spe)]  # a new order each epoch
    assert len(e0) == spe
    with pytest.raises(IndexError):
        three.window(2 * spe + 5)


def test_split_ranges_are_contiguous_and_cover_all() -> None:
    assert split_ranges(100, (98, 2, 0)) == [(0, 98), (98, 100), (100, 100)]
    # Megatron's rule: cumulative rounded shares, the rounding excess taken off every boundary
    assert split_ranges(10, (1, 1, 1)) == [(0, 4), (4, 7), (7, 10)]
    assert split_ranges(7, (80, 20)) == [(0, 6), (6, 7)]
    with pytest.raises(ValueError):
        split_ranges(10, (0, 0))


def test_split_datasets_use_disjoint_documents(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    a, b = split_ranges(ds.num_documents, (75, 25))
    train = GPTDataset(ds, SEQ, 0, doc_range=a)
    val = GPTDataset(ds, SEQ, 0, doc_range=b, shuffle=False)
    docs = lambda g: {int(t) // 1000 for i in range(len(g)) for t in g.window(i)}  # noqa: E731
    assert docs(train) <= set(range(*a)) and docs(val) <= set(range(*b))


def test_index_is_cached_on_disk_under_its_config(tmp_path: Path, monkeypatch) -> None:
    ds = _indexed(tmp_path)
    cache = tmp_path / "cache"
    a = GPTDataset(ds, SEQ, seed=0, cache_dir=cache)
    entries = list(cache.iterdir())
    assert len(entries) == 1 and (entries[0] / "shuffle.npy").is_file()

    def no_build(self):
        raise AssertionError("index rebuilt on a cache hit")

    monkeypatch.setattr(gd.GPTDataset, "_build", no_build)
    b = GPTDataset(ds, SEQ, seed=0, cache_dir=cache)
    assert isinstance(b._arrays["shuffle"], np.memmap)
    np.testing.assert_array_equal(a.window(7), b.window(7))
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(ds, SEQ, seed=1, cache_dir=cache)  # another seed is another entry


def test_too_few_tokens_for_one_sample(tmp_path: Path) -> None:
    ds = _indexed(tmp_path)
    with pytest.raises(ValueError, match="less than one sample"):
        GPTDataset(ds, SEQ, 0, doc_range=(5, 6))  # the empty document


# --- blending -------------------------------------------------------------------------------
def test_greedy_blend_vectors() -> None:
    assert greedy_blend([0.5, 0.25, 0.25], 8)[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 0]
    assert greedy_blend([0.3, 0.7], 10)[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert greedy_blend([3, 7], 10)[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]  # normalized
    which, within = greedy_blend([0.2, 0.5, 0.3], 1000)
    for k in range(3):  # the k-th pick of a dataset is its sample k
        assert within[which == k].tolist() == list(range(int((which == k).sum())))
    np.testing.assert_array_equal(greedy_blend([0.2, 0.5, 0.3], 300)[0], which[:300])
    assert np.abs(np.bincount(which) / 1000 - [0.2, 0.5, 0.3]).max() < 0.002


def test_blended_dataset_draws_from_members_and_reports_the_mixture(tmp_path: Path) -> None:
    a = GPTDataset(_indexed(tmp_path, 30, 1, "a"), SEQ, seed=0)
    b = GPTDataset(_indexed(tmp_path, 10, 2, "b"), SEQ, seed=0)
    n = 3 * (a.samples_per_epoch + b.samples_per_epoch)  # more than one epoch of each
    blend = BlendedDataset([a, b], [0.25, 0.75], n, cache_dir=tmp_path / "cache")
    mix = {m["name"]: m for m in blend.mixture()}
    assert mix["a"]["samples"] + mix["b"]["samples"] == n
    assert abs(mix["b"]["realized"] - 0.75) < 0.01 and mix["b"]["epochs"] > 1
    src = blend.which
    for i in (0, 1, n // 2, n - 1):
        member = blend.datasets[int(src[i])]
        np.testing.assert_array_equal(blend.window(i), member.window(int(blend.within[i])))
    by_tokens = BlendedDataset([a, b], [1.0, 1.0], n, by="tokens")
    share = a.tokens_per_epoch / (a.tokens_per_epoch + b.tokens_per_epoch)
    assert abs(by_tokens.mixture()[0]["realized"] - share) < 0.01
