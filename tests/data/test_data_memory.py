"""The loader over a 1 GB indexed dataset holds constant memory (the corpus is never copied).

The dataset is a sparse file (no disk or time spent writing 1 GB); a subprocess reads batches
spread over the whole file through the real loader and reports its anonymous resident memory
(RssAnon: the process's own memory; file pages of the memory map are page cache, not copies).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.proc import scaled

GIB = 1 << 30
DOC = 4096  # tokens per document

CHILD = r"""
import json, sys
import numpy as np
from scaletrain.data.gpt_dataset import GPTDataset
from scaletrain.data.indexed import IndexedDataset
from scaletrain.data.loader import BatchStream, Windows

def rss_anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
ds = IndexedDataset(sys.argv[1])
src = GPTDataset(ds, 2048, seed=0)
stream = BatchStream(Windows(src), batch_size=16, num_workers=0)
marks, touched = [], set()
for step in range(400):
    x, y = next(stream)
    if step in (20, 399):
        marks.append(rss_anon_mb())
for i in range(400 * 16):
    touched.add(src._pieces(i)[0][0] * 16 // len(ds))
print(json.dumps({"marks": marks, "tokens": ds.num_tokens, "sixteenths": len(touched)}))
"""


def _sparse_dataset(prefix: Path) -> None:
    n_tok = GIB // 2  # uint16
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(GIB)
    n = n_tok // DOC
    lengths = np.full(n, DOC, dtype="<i4")
    pointers = np.arange(n, dtype="<i8") * DOC * 2
    docs = np.arange(n + 1, dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([8])
                + np.array([n, n + 1], "<u8").tobytes())
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())


def test_loader_memory_is_constant_on_a_1gb_dataset(tmp_path: Path) -> None:
    _sparse_dataset(tmp_path / "big")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "big")], check=True,
                         capture_output=True, text=True, timeout=scaled(300)).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["tokens"] == GIB // 2
    assert r["sixteenths"] == 16  # the batches came from all over the file
    early, late = r["marks"]
    # 380 more batches (~50 MB of int64 tensors made and freed): no growth beyond noise,
    # and far below the 1 GB a copy of the corpus would take.
    assert late - early < 32, r
    assert late < 512, r
