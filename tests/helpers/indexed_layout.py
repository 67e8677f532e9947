"""Megatron's .bin/.idx layout written out independently of scaletrain.data.indexed.

Used by the tests to check our writer and reader against the format itself: 9-byte magic
`MMIDIDX\\x00\\x00`, version u64 = 1, dtype code u8 (8 = uint16, 4 = int32), N u64, D+1 u64,
int32 lengths[N], int64 byte pointers[N], int64 document indices[D+1]; .bin = raw tokens.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CODES = {8: np.uint16, 4: np.int32}


def write(prefix: Path, docs: list[list[list[int]]], code: int) -> None:
    """docs: documents, each a list of sequences of token ids."""
    dtype = np.dtype(CODES[code])
    seqs = [s for d in docs for s in d]
    lengths = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * dtype.itemsize
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())


def read(prefix: Path) -> tuple[int, list[list[list[int]]]]:
    """(dtype code, documents as lists of sequences) parsed with struct only."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", raw, 17)
    n, d1 = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n}i", raw, off)
    pointers = struct.unpack_from(f"<{n}q", raw, off + 4 * n)
    doc_idx = struct.unpack_from(f"<{d1}q", raw, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * d1 and doc_idx[0] == 0
    dtype = np.dtype(CODES[code])
    data = Path(f"{prefix}.bin").read_bytes()
    seqs = [np.frombuffer(data, dtype, lengths[i], pointers[i]).tolist() for i in range(n)]
    return code, [seqs[doc_idx[k]:doc_idx[k + 1]] for k in range(d1 - 1)]
