"""Packed sequences and the resumable batch stream."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.config import DataConfig
from scaletrain.data.loader import (
    BatchStream,
    PackedSequences,
    build_train_val,
    iter_eval_batches,
)

SEQ = 7  # windows of 8 tokens


def _dataset(n_samples: int = 50) -> PackedSequences:
    return PackedSequences(np.arange(n_samples * (SEQ + 1) + 3, dtype=np.int32), SEQ)


def _take(stream: BatchStream, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(stream, k))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(s, t) for (x, s), (y, t) in zip(a, b)
    )


def test_packed_windows_do_not_overlap_and_targets_shift() -> None:
    ds = _dataset(50)
    assert len(ds) == 50  # the 3 leftover tokens are dropped
    x, y = ds[4]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ,)
    assert x.tolist() == list(range(32, 39)) and y.tolist() == list(range(33, 40))
    assert ds[5][0][0] == 40  # the next window starts right after this one
    assert torch.equal(ds[-1][0], ds[49][0])
    with pytest.raises(IndexError):
        ds[50]


def test_memmap_dataset_pickles_as_a_file_reference(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    ds = PackedSequences(np.memmap(path, dtype=np.uint16, mode="r"), SEQ)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # not the 8 KB of tokens
    back = pickle.loads(blob)
    assert len(back) == len(ds) and torch.equal(back[123][1], ds[123][1])


def test_stream_shapes_epochs_and_shuffle() -> None:
    ds = _dataset(50)
    stream = BatchStream(ds, batch_size=8, seed=1)
    assert stream.batches_per_epoch == 6  # 50 // 8, last partial batch dropped
    batches = _take(stream, 13)
    for x, y in batches:
        assert x.shape == y.shape == (8, SEQ) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    firsts = [x[:, 0].div(SEQ + 1).long() for x, _ in batches]  # sample indices
    epoch0 = torch.cat(firsts[:6])
    assert len(set(epoch0.tolist())) == 48  # no sample twice within an epoch
    assert epoch0.tolist() != sorted(epoch0.tolist())  # shuffled
    assert torch.cat(firsts[6:12]).tolist() != epoch0.tolist()  # a new order per epoch
    assert stream.state_dict()["epoch"] == 2 and stream.state_dict()["batch_in_epoch"] == 1


def test_order_depends_only_on_seed() -> None:
    ds = _dataset(50)
    a = _take(BatchStream(ds, 8, seed=3), 10)
    assert _same(a, _take(BatchStream(ds, 8, seed=3), 10))
    assert not _same(a, _take(BatchStream(ds, 8, seed=4), 10))
    with_workers = BatchStream(ds, 8, seed=3, num_workers=2, prefetch_factor=3)
    assert _same(a, _take(with_workers, 10))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", [3, 5, 6, 8])  # mid-epoch, last batch, epoch end, next epoch
def test_resume_from_state_dict_is_exact(num_workers: int, stop: int) -> None:
    ds = _dataset(50)
    kw = dict(batch_size=8, seed=7, num_workers=num_workers, persistent_workers=True)
    original = BatchStream(ds, **kw)
    _take(original, stop)
    sd = original.state_dict()
    assert sd["batch_in_epoch"] + 6 * sd["epoch"] == stop  # prefetched batches not counted
    expected = _take(original, 9)  # crosses the next epoch boundary

    restored = BatchStream(ds, **{**kw, "seed": 0})  # the seed comes from the state
    restored.load_state_dict(sd)
    assert _same(_take(restored, 9), expected)

    original.load_state_dict(sd)  # rewinding a live stream drops its prefetched batches
    assert _same(_take(original, 9), expected)


def test_resume_rejects_other_data() -> None:
    sd = BatchStream(_dataset(50), 8, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        BatchStream(_dataset(60), 8, seed=0).load_state_dict(sd)


def test_too_small_for_one_batch() -> None:
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchStream(_dataset(5), batch_size=8, seed=0)


def test_eval_batches_are_ordered_finite_and_repeatable() -> None:
    ds = _dataset(50)
    a = list(iter_eval_batches(ds, 8, max_batches=4))
    assert len(a) == 4 and _same(a, list(iter_eval_batches(ds, 8, max_batches=4)))
    assert a[0][0][:, 0].tolist() == [i * (SEQ + 1) for i in range(8)]
    assert len(list(iter_eval_batches(ds, 8))) == 6
    small = list(iter_eval_batches(_dataset(3), 8))
    assert len(small) == 1 and small[0][0].shape == (3, SEQ)


def test_build_train_val_on_a_small_corpus(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(f"file {i}\n" + "some words to tokenize here. " * 60)
    cfg = DataConfig(
        dataset="text_dir",
        path=str(text),
        file_glob="*.txt",
        seq_len=16,
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        val_fraction=0.25,
    )
    stream, val, corpus = build_train_val(cfg, batch_size=4, seed=0, pin_memory=False)
    x, y = next(stream)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(val) == len(corpus.val) // 17 > 0
    assert int(x.max()) < corpus.vocab_size
    with pytest.raises(ValueError, match="validation split"):
        build_train_val(DataConfig(**{**cfg.__dict__, "seq_len": 100_000}), 4, 0, False)


def test_data_parallel_ranks_split_each_global_batch() -> None:
    ds = _dataset(64)
    single = BatchStream(ds, batch_size=8, seed=3)
    ranks = [BatchStream(ds, batch_size=4, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(10):  # across an epoch boundary (64 // 8 = 8 batches per epoch)
        x, _ = next(single)
        parts = [next(s)[0] for s in ranks]
        assert torch.equal(torch.cat(parts), x)


def test_data_parallel_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="dp_rank"):
        BatchStream(_dataset(64), batch_size=4, seed=0, dp_rank=2, dp_size=2)
