"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte for byte.

`.idx` layout (little-endian): 9-byte magic `MMIDIDX\\x00\\x00`, version u64 = 1, dtype code
u8, sequence count N u64, document count D+1 u64, int32 sequence lengths[N], int64 byte
pointers[N] (offset of each sequence in `.bin`), int64 document indices[D+1] (document d is
sequences [idx[d], idx[d+1]); idx[0] = 0). `.bin` holds the raw tokens, sequence after sequence.
Files from Megatron-LM, NeMo and datatrove use this layout; the reader maps both files with
numpy (no copy of the corpus in memory) and the writer streams to a temporary name that is
renamed into place when complete.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron-LM's DType codes.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")


class IndexedDatasetError(ValueError):
    """A missing or malformed indexed dataset; the message names the file."""


def strip_prefix(path: str | Path) -> Path:
    """`x.bin`, `x.idx` or `x` -> `x`."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def exists(prefix: str | Path) -> bool:
    p = strip_prefix(prefix)
    return Path(f"{p}.idx").is_file() and Path(f"{p}.bin").is_file()


class IndexedDatasetWriter:
    """Streams sequences into `PREFIX.bin.tmp`; `finalize()` writes the index and renames both.

    `add_document(tokens)` adds a one-sequence document (the usual case for GPT data);
    `add_sequence` + `end_document` build documents of several sequences.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type) -> None:
        self.prefix = strip_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise IndexedDatasetError(f"dtype {self.dtype} has no Megatron code")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed by finalize/abort
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[int] = [0]
        self._n_seq = 0

    def add_sequence(self, tokens: np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise IndexedDatasetError(f"a sequence must be 1-D (got shape {arr.shape})")
        arr.astype(self.dtype, copy=False).tofile(self._bin)
        self._lengths.append(np.array([len(arr)], dtype=np.int32))
        self._n_seq += 1

    def end_document(self) -> None:
        self._doc_ends.append(self._n_seq)

    def add_document(self, tokens: np.ndarray) -> None:
        self.add_sequence(tokens)
        self.end_document()

    def add_documents(self, docs: list[np.ndarray]) -> None:
        """Many one-sequence documents at once (one write)."""
        if not docs:
            return
        np.concatenate(docs).astype(self.dtype, copy=False).tofile(self._bin)
        self._lengths.append(np.fromiter((len(d) for d in docs), np.int32, len(docs)))
        self._doc_ends.extend(range(self._n_seq + 1, self._n_seq + len(docs) + 1))
        self._n_seq += len(docs)

    def append_dataset(self, other: str | Path) -> None:
        """Append all of another indexed dataset of the same dtype (shard merging)."""
        src = IndexedDataset(other)
        if src.dtype != self.dtype:
            raise IndexedDatasetError(f"{src.prefix}: dtype {src.dtype}, expected {self.dtype}")
        with open(f"{src.prefix}.bin", "rb") as f:
            while block := f.read(1 << 24):
                self._bin.write(block)
        self._lengths.append(np.asarray(src.sequence_lengths, dtype=np.int32))
        self._doc_ends.extend((np.asarray(src.document_indices[1:]) + self._n_seq).tolist())
        self._n_seq += len(src)

    def finalize(self) -> Path:
        """Write `PREFIX.idx`, move both files into place; returns the prefix."""
        self._bin.close()
        lengths = (np.concatenate(self._lengths) if self._lengths
                   else np.zeros(0, dtype=np.int32))
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        docs = np.asarray(self._doc_ends, dtype=np.int64)
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")
        return self.prefix

    def abort(self) -> None:
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _map(path: Path, dtype: Any, offset: int, n: int) -> np.ndarray:
    """A read-only memory map of n items at `offset` (numpy cannot map zero bytes)."""
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,))


class IndexedDataset:
    """Read-only view of `PREFIX.bin/.idx`: index arrays and tokens are numpy memory maps.

    Item i is sequence i (a 1-D array view of `.bin`). Pickles as its prefix, so DataLoader
    workers reopen the maps instead of copying them.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = strip_prefix(prefix)
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise IndexedDatasetError(
                    f"indexed dataset '{self.prefix}': {p} not found (an indexed dataset is a "
                    "PREFIX.bin + PREFIX.idx pair, e.g. from `scaletrain data tokenize`)"
                )
        size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not a Megatron indexed-dataset index "
                                      "(bad magic); was it written by another tool?")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION or code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path}: unsupported version {version} or dtype "
                                      f"code {code}")
        expect = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if size != expect:
            raise IndexedDatasetError(f"{idx_path}: {size} bytes, the header says {expect}; "
                                      "the file is truncated or damaged")
        self.dtype = DTYPE_CODES[code]
        off = _HEADER.size
        self.sequence_lengths = _map(idx_path, "<i4", off, n_seq)
        self.sequence_pointers = _map(idx_path, "<i8", off + 4 * n_seq, n_seq)
        self.document_indices = _map(idx_path, "<i8", off + 12 * n_seq, n_doc)
        bin_size = bin_path.stat().st_size
        if n_seq and int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) \
                * self.dtype.itemsize != bin_size:
            raise IndexedDatasetError(f"{bin_path}: {bin_size} bytes do not match its index; "
                                      "the pair is damaged or from different runs")
        self.tokens = _map(bin_path, self.dtype, 0, bin_size // self.dtype.itemsize)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (a view; no copy)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self.tokens[start : start + n]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = state["prefix"]
        self._open()
