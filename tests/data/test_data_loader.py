"""The resumable, data-parallel batch stream over the global sample order."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.config import DataConfig
from scaletrain.data.gpt_dataset import GPTDataset
from scaletrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from scaletrain.data.loader import (
    BatchStream,
    DataExhausted,
    Windows,
    build_train_val,
    iter_eval_batches,
)

SEQ = 7


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> GPTDataset:
    """~200 samples per epoch over 3 epochs; token ids are unique (doc*1000 + offset)."""
    path = tmp_path_factory.mktemp("loader") / "d"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(path, np.int32) as w:
        for k in range(60):
            w.add_document(k * 1000 + np.arange(int(rng.integers(5, 45))))
    ds = IndexedDataset(path)
    spe = GPTDataset(ds, SEQ, seed=5).samples_per_epoch
    return GPTDataset(ds, SEQ, seed=5, num_samples=3 * spe)


def _take(stream: BatchStream, k: int) -> list[tuple[torch.Tensor, ...]]:
    return list(itertools.islice(stream, k))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b))


def test_batches_follow_the_global_sample_order(source: GPTDataset) -> None:
    stream = BatchStream(Windows(source), batch_size=8)
    batches = _take(stream, 30)  # crosses the first epoch boundary
    for b, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (8, SEQ) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        expect = np.stack([source.window(i) for i in range(8 * b, 8 * b + 8)])
        assert torch.equal(torch.cat([x, y[:, -1:]], 1), torch.from_numpy(expect).long())
    assert stream.state_dict()["consumed_samples"] == 240


def test_workers_give_the_same_batches(source: GPTDataset) -> None:
    a = _take(BatchStream(Windows(source), 8), 12)
    b = _take(BatchStream(Windows(source), 8, num_workers=2, prefetch_factor=3), 12)
    assert _same(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop", [3, 25])  # mid-epoch; past the first epoch
def test_resume_from_state_dict_is_exact(source: GPTDataset, num_workers: int,
                                         stop: int) -> None:
    kw = dict(batch_size=8, num_workers=num_workers, persistent_workers=True)
    original = BatchStream(Windows(source), **kw)
    _take(original, stop)
    sd = original.state_dict()
    assert sd["consumed_samples"] == 8 * stop  # prefetched batches not counted
    expected = _take(original, 9)
    restored = BatchStream(Windows(source), **{**kw, "num_workers": 2 - num_workers})
    restored.load_state_dict(sd)
    assert _same(_take(restored, 9), expected)
    original.load_state_dict(sd)  # rewinding a live stream drops its prefetched batches
    assert _same(_take(original, 9), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_stream_leaves_the_global_rng_alone(source: GPTDataset, num_workers: int) -> None:
    """Starting (or restarting, after a resume) the stream draws nothing from torch's RNG,
    which dropout shares: a resumed run must draw the masks the uninterrupted one draws."""
    stream = BatchStream(Windows(source), batch_size=8, num_workers=num_workers)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    _take(stream, 2)
    stream.load_state_dict(stream.state_dict())  # the next batch starts a new iterator
    _take(stream, 1)
    assert torch.equal(torch.rand(4), expected)


def test_data_parallel_ranks_split_each_global_batch(source: GPTDataset) -> None:
    single = BatchStream(Windows(source), batch_size=8)
    ranks = [BatchStream(Windows(source), batch_size=4, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(30):
        x, _ = next(single)
        assert torch.equal(torch.cat([next(s)[0] for s in ranks]), x)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_with_another_data_parallel_size(source: GPTDataset, workers: int) -> None:
    """DP 2 (global batch 8 = 2 x 4) saves; DP 1 (8 x 1) resumes: the same global batches."""
    reference = _take(BatchStream(Windows(source), batch_size=8), 15)
    ranks = [BatchStream(Windows(source), 4, num_workers=workers, dp_rank=r, dp_size=2)
             for r in range(2)]
    for b in range(5):
        parts = [next(s) for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), reference[b][0])
    sd = ranks[0].state_dict()
    assert sd == ranks[1].state_dict()  # every rank holds the same global position
    one = BatchStream(Windows(source), 8, num_workers=workers)
    one.load_state_dict(sd)
    assert _same(_take(one, 9), reference[5:14])
    back = [BatchStream(Windows(source), 4, dp_rank=r, dp_size=2) for r in range(2)]
    for s in back:  # and DP 1 -> DP 2
        s.load_state_dict(one.state_dict())
    parts = [next(s)[0] for s in back]
    assert torch.equal(torch.cat(parts), reference[14][0])


def test_positions_come_with_the_batch(source: GPTDataset) -> None:
    x, y, pos = next(BatchStream(Windows(source, with_positions=True), 4))
    assert pos.shape == x.shape and torch.equal(pos, x % 1000)


def test_resume_rejects_other_data_and_errors_are_clear(source: GPTDataset) -> None:
    sd = BatchStream(Windows(source), 8, fingerprint="aaa").state_dict()
    with pytest.raises(ValueError, match="other data"):
        BatchStream(Windows(source), 8, fingerprint="bbb").load_state_dict(sd)
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchStream(Windows(source), batch_size=len(source) + 1)
    with pytest.raises(ValueError, match="dp_rank"):
        BatchStream(Windows(source), batch_size=4, dp_rank=2, dp_size=2)
    s = BatchStream(Windows(source), batch_size=len(source) // 2 + 1)
    next(s)
    with pytest.raises(DataExhausted):
        next(s)


def test_eval_batches_are_ordered_finite_and_repeatable(source: GPTDataset) -> None:
    ds = Windows(source)
    a = list(iter_eval_batches(ds, 8, max_batches=4))
    assert len(a) == 4 and _same(a, list(iter_eval_batches(ds, 8, max_batches=4)))
    assert torch.equal(a[1][0][0], ds[8][0])


def _text_dir(root: Path, n: int, word: str) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"{i}.txt").write_text(f"file {i}\n" + f"some {word} to tokenize here. " * 60)
    return root


def test_build_train_val_on_a_small_corpus(tmp_path: Path) -> None:
    cfg = DataConfig(dataset="text_dir", path=str(_text_dir(tmp_path / "text", 8, "words")),
                     file_glob="*.txt", seq_len=16, cache_dir=str(tmp_path / "cache"),
                     vocab_size=300, val_fraction=0.25, curate=False)
    stream, val, info = build_train_val(cfg, batch_size=4, seed=0, pin_memory=False,
                                        num_samples=400)
    x, y = next(stream)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(stream.dataset) == 400 and len(val) == (len(info.val) - 1) // 16 > 0
    assert int(x.max()) < info.vocab_size
    again = build_train_val(cfg, batch_size=4, seed=0, pin_memory=False, num_samples=800)[0]
    assert torch.equal(next(again)[0], x)  # a longer run starts with the same samples
    with pytest.raises(ValueError, match="validation split"):
        build_train_val(DataConfig(**{**cfg.__dict__, "seq_len": 1500}), 4, 0, False)


def test_build_train_val_blends_data_paths(tmp_path: Path) -> None:
    from scaletrain.data.tokenize import tokenize_to_indexed
    from scaletrain.data.tokenizer import train_bpe

    docs = {}
    for name, word in (("a", "apples"), ("b", "bananas")):
        folder = tmp_path / name
        folder.mkdir()
        import json

        lines = [json.dumps({"text": f"doc {i}: " + f"{word} and more {word}. " * 30})
                 for i in range(40)]
        (folder / "x.jsonl").write_text("\n".join(lines))
        docs[name] = folder / "x.jsonl"
    tok = train_bpe([f"apples bananas doc and more {i}" for i in range(50)], 300)
    tok.save(str(tmp_path / "tok.json"))
    for name, path in docs.items():
        tokenize_to_indexed([path], tmp_path / name / "ds", tmp_path / "tok.json")
    cfg = DataConfig(paths=(str(tmp_path / "a/ds"), str(tmp_path / "b/ds")), weights=(0.2, 0.8),
                     seq_len=16, split="90,10,0", cache_dir=str(tmp_path / "cache"))
    stream, val, info = build_train_val(cfg, 10, 0, False, num_samples=1000)
    assert [round(m["realized"], 2) for m in info.mixture] == [0.2, 0.8]
    x, _ = next(stream)
    assert info.tokenizer_path == Path(f"{tmp_path}/a/ds.tokenizer.json")
    assert len(val) > 0 and int(x.max()) < info.vocab_size
