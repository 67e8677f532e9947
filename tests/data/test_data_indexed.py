"""Megatron .bin/.idx: our writer and reader against the layout written out in the test."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from tests.helpers import indexed_layout

CASES = [(np.uint16, 8, 65535), (np.int32, 4, 2**31 - 1)]


def _docs(rng: np.random.Generator, top: int, multi: bool) -> list[list[list[int]]]:
    docs = []
    for _ in range(30):
        n_seq = int(rng.integers(1, 4)) if multi else 1
        docs.append([rng.integers(0, top, int(rng.integers(0, 50))).tolist()
                     for _ in range(n_seq)])
    docs[3] = [[top - 1, 0, top - 1]]  # extreme ids survive
    return docs


@pytest.mark.parametrize("dtype,code,top", CASES)
def test_writer_output_matches_the_layout(tmp_path: Path, dtype, code, top) -> None:
    docs = _docs(np.random.default_rng(code), top, multi=True)
    with IndexedDatasetWriter(tmp_path / "ours", dtype) as w:
        for d in docs:
            for s in d:
                w.add_sequence(np.asarray(s, dtype=dtype))
            w.end_document()
    assert indexed_layout.read(tmp_path / "ours") == (code, docs)
    indexed_layout.write(tmp_path / "ref", docs, code)  # byte for byte the same files
    for ext in (".idx", ".bin"):
        ours, ref = Path(f"{tmp_path}/ours{ext}"), Path(f"{tmp_path}/ref{ext}")
        assert ours.read_bytes() == ref.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("dtype,code,top", CASES)
def test_reader_reads_files_written_from_the_layout(tmp_path: Path, dtype, code, top) -> None:
    docs = _docs(np.random.default_rng(code + 1), top, multi=True)
    indexed_layout.write(tmp_path / "ref", docs, code)
    ds = IndexedDataset(tmp_path / "ref.idx")  # either file name or the prefix
    seqs = [s for d in docs for s in d]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(seqs)
    assert ds.num_documents == len(docs) and ds.num_tokens == sum(map(len, seqs))
    assert isinstance(ds.tokens, np.memmap) and not ds.tokens.flags.writeable
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert ds.get(0, 1, 2).tolist() == seqs[0][1:3]
    back = pickle.loads(pickle.dumps(ds))  # workers reopen the maps from the prefix
    assert len(pickle.dumps(ds)) < 500 and back[5].tolist() == seqs[5]


def test_add_documents_and_merge_equal_one_writer(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, int(rng.integers(1, 40))).astype(np.uint16) for _ in range(20)]
    for name, parts in (("a", docs[:7]), ("b", docs[7:])):
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as w:
            w.add_documents(parts)
    with IndexedDatasetWriter(tmp_path / "merged", np.uint16) as w:
        w.append_dataset(tmp_path / "a")
        w.append_dataset(tmp_path / "b")
    with IndexedDatasetWriter(tmp_path / "one", np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for ext in (".idx", ".bin"):
        assert Path(f"{tmp_path}/merged{ext}").read_bytes() == \
            Path(f"{tmp_path}/one{ext}").read_bytes()


def test_failed_write_leaves_nothing_and_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        w.add_document(np.arange(5))
        raise RuntimeError("crash")
    assert not list(tmp_path.iterdir())
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(tmp_path / "x")
    indexed_layout.write(tmp_path / "ok", [[[1, 2, 3]], [[4]]], 8)
    (tmp_path / "bad.idx").write_bytes(b"NOTMAGIC" + (tmp_path / "ok.idx").read_bytes()[8:])
    (tmp_path / "bad.bin").write_bytes((tmp_path / "ok.bin").read_bytes())
    with pytest.raises(IndexedDatasetError, match="magic"):
        IndexedDataset(tmp_path / "bad")
    (tmp_path / "ok.bin").write_bytes(b"\x00\x00")  # truncated tokens
    with pytest.raises(IndexedDatasetError, match="do not match"):
        IndexedDataset(tmp_path / "ok")
