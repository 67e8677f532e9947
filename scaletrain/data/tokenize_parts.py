"""How `tokenize_to_indexed` splits its input into jobs, and the folder of their parts.

Files are packed, in order, into groups of about equal bytes: a group is one job, tokenized
by one worker into one partial dataset, so 100,000 small files cost a few jobs rather than
100,000 tokenizer loads and partial datasets. The parts live in `PREFIX.parts-tmp/` beside a
`plan.json` that records what they are a function of (the files with their sizes and
modification times, the tokenizer's content, the options, the grouping); each finished part
has a `part-NNNNN.json` marker with its counts. A run that is interrupted (Ctrl-C, a killed
worker or driver) leaves the folder; the next run with the same plan reuses the finished
parts and tokenizes the rest, and a run with another plan clears it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

GROUP_MIN_BYTES = 8 << 20  # a group below this is not worth a job of its own
GROUP_MAX_BYTES = 256 << 20
JOBS_PER_WORKER = 4  # enough jobs to balance workers when files differ in size
GROUP_MIN_FILES = 2000  # nor is a group of fewer (small) files


class FileStat(NamedTuple):
    path: str
    size: int
    mtime_ns: int


def file_stats(paths: list[str]) -> list[FileStat]:
    """Each file's size and modification time (one `stat` per file; -1 for one that is gone:
    its reader names it)."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append(FileStat(p, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(FileStat(p, -1, -1))
    return out


def group_files(files: list[FileStat], workers: int) -> list[list[FileStat]]:
    """Consecutive files in groups of about `total / (workers * JOBS_PER_WORKER)` bytes
    (between GROUP_MIN_BYTES and GROUP_MAX_BYTES; a larger file is a group of its own) and
    at most that share of the files (100,000 tiny files are read by every worker too)."""
    total = sum(max(f.size, 0) for f in files)
    jobs = max(1, workers * JOBS_PER_WORKER)
    target = min(GROUP_MAX_BYTES, max(GROUP_MIN_BYTES, total // jobs))
    max_files = max(GROUP_MIN_FILES, -(-len(files) // jobs))
    groups: list[list[FileStat]] = []
    acc = target
    for f in files:
        n = max(f.size, 0)
        if acc > 0 and (acc + n > target or len(groups[-1]) >= max_files):
            groups.append([])
            acc = 0
        groups[-1].append(f)
        acc += n
    return groups


def plan_fingerprint(groups: list[list[FileStat]], tokenizer: Path | None,
                     options: dict[str, Any]) -> str:
    """What the parts are a function of: files (path, size, mtime), tokenizer, options."""
    h = hashlib.sha256()
    h.update(json.dumps(options, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(hashlib.sha256(Path(tokenizer).read_bytes()).digest())
    for k, group in enumerate(groups):
        for f in group:
            h.update(f"{k}\0{f.path}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:20]


class PartsDir:
    """`PREFIX.parts-tmp/`: one partial dataset per job and a marker for each finished one."""

    def __init__(self, prefix: Path):
        self.path = Path(f"{prefix}.parts-tmp")

    def open(self, fingerprint: str) -> int:
        """Reuse the folder when its plan is `fingerprint`, else start it afresh; returns the
        number of finished parts found."""
        plan = self.path / "plan.json"
        try:
            same = json.loads(plan.read_text())["fingerprint"] == fingerprint
        except (OSError, ValueError, KeyError, TypeError):
            same = False
        if not same:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True)
            plan.write_text(json.dumps({"fingerprint": fingerprint}))
            return 0
        for tmp in self.path.glob("*.tmp"):  # a job killed half-way
            tmp.unlink()
        return sum(1 for _ in self.path.glob("part-*.json"))

    def part(self, i: int) -> str:
        return str(self.path / f"part-{i:05d}")

    def finished(self, i: int) -> dict[str, Any] | None:
        try:
            return json.loads(Path(f"{self.part(i)}.json").read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def mark_finished(part: str, stats: dict[str, Any]) -> None:
    """The marker of a finished part (written after its .bin/.idx are in place)."""
    with open(f"{part}.json.tmp", "w", encoding="utf-8") as f:
        json.dump(stats, f)
    os.replace(f"{part}.json.tmp", f"{part}.json")
