"""Where the time of `data tokenize` over many tiny files goes: the CPU seconds of each step
for N one-line files against one file holding the same lines, in one process.

    python bench/tokenize_files_steps_cpu.py               # 100,000 files
    python bench/tokenize_files_steps_cpu.py --tiny 5000

Each step is measured alone (user + system CPU seconds, the least of `--repeat` runs: a
shared machine's load inflates wall time far more than CPU time). The syscall rows are the
floor that any reader of N files pays on this machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenize_files_cpu import FIXTURES, write_split  # noqa: E402

from scaletrain.curate.io.readers import ReadReport  # noqa: E402
from scaletrain.data.tokenize_inputs import group_texts, input_shards, read_documents  # noqa: E402
from scaletrain.data.tokenizer import TextTokenizer  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _least(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        c = _cpu()
        out = fn()
        best = min(best, _cpu() - c)
    return best, out


def _open_read_close(paths: list[str], fstat: bool) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        if fstat:
            os.fstat(fd)
        os.read(fd, 4096)
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", type=int, default=100_000, help="one-line files")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as each pool worker encodes
    n = args.tiny
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    tok = TextTokenizer.load(FIXTURES / "data" / "gpt-neox-tokenizer.json")
    lines = [f"tiny document {i}." for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="tokfiles-steps-") as tmp:
        write_split(Path(tmp) / "many", lines, n)
        write_split(Path(tmp) / "one", lines, 1)
        one = str(next((Path(tmp) / "one").rglob("*.jsonl")))
        rows: list[tuple[str, Callable[[], object]]] = []
        dt, paths = _least(lambda: input_shards(Path(tmp) / "many"), args.repeat)
        print(f"{f'list the folder ({n:,} files)':<58} {dt:7.3f} s")
        rows = [
            (f"stat each of {n:,} files (the driver did, before)",
             lambda: [os.stat(p) for p in paths]),
            (f"open+read+close {n:,} files (syscalls alone)",
             lambda: _open_read_close(paths, False)),
            (f"open+fstat+read+close {n:,} files (syscalls alone)",
             lambda: _open_read_close(paths, True)),
            (f"read {n:,} files: small-file fast path",
             lambda: list(group_texts(paths, "text", ReadReport()))),
            (f"read {n:,} files: general reader (before)",
             lambda: [t for p in paths for t in read_documents(p, "text", ReadReport())]),
            (f"read 1 file of {n:,} lines: general reader",
             lambda: list(read_documents(one, "text", ReadReport()))),
        ]
        for name, fn in rows:
            dt, _ = _least(fn, args.repeat)
            print(f"{name:<58} {dt:7.3f} s", flush=True)
        dt, _ = _least(lambda: tok.encode_documents(lines), args.repeat)
        print(f"{f'encode {n:,} texts, one thread':<58} {dt:7.3f} s")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
