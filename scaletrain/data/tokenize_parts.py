"""How `tokenize_to_indexed` splits its input into jobs, and the folder of their parts.

Files are packed, in order, into groups: a group is one job, tokenized by one worker into
partial datasets (parts) of at most about GROUP_MAX_BYTES of input each, cut between files
as the worker reads them, so 100,000 small files cost a few jobs rather than 100,000
tokenizer loads and partial datasets. Up to STAT_FILES_MAX files, the groups follow bytes
(`stream_groups`: one `stat` per file, each group handed to a worker as soon as it is full);
above it, a `stat` per file would cost the driver as much as its workers spend reading, so
the groups follow the count of files (`count_groups`) and each file's size and time come
with the open file.

The parts live in `PREFIX.parts-tmp/` beside a `plan.json` that records what every part is
a function of (the tokenizer's content, the options); each finished part has a
`part-GGGGG-PPPP.json` marker with its counts, the range of its group's files it holds and
their digest (paths, sizes, modification times). A run that is interrupted (Ctrl-C, a killed
worker or driver) leaves the folder; the next run with the same plan reuses each finished
part whose files are unchanged and tokenizes the rest (a changed, added or removed file
redoes the parts from it on in its group), and a run with another plan clears the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

GROUP_MIN_BYTES = 8 << 20  # a group below this is not worth a job of its own
GROUP_MAX_BYTES = 256 << 20
JOBS_PER_WORKER = 4  # enough jobs to balance workers when files differ in size
GROUP_MIN_FILES = 2000  # nor is a group of fewer (small) files
PARTS_FORMAT = 3  # 3: a group's parts are cut by bytes as it is read; markers hold digests
STAT_FILES_MAX = 10_000  # at most this many input files are stat'ed up front (~30 ms)


class FileStat(NamedTuple):
    path: str
    size: int
    mtime_ns: int


def stat_files(paths: Iterable[str]) -> Iterator[FileStat]:
    """Each file's size and modification time, one `stat` per file as it is asked for (-1
    for one that is gone: its reader names it)."""
    stat = os.stat
    for p in paths:
        try:
            st = stat(p)
            yield FileStat(p, st.st_size, st.st_mtime_ns)
        except OSError:
            yield FileStat(p, -1, -1)


def file_stats(paths: list[str]) -> list[FileStat]:
    return list(stat_files(paths))


def stream_groups(files: Iterable[FileStat], n_files: int, workers: int
                  ) -> Iterator[list[FileStat]]:
    """Consecutive files in groups, each given as soon as it is full, so the first jobs run
    while later files are still being looked at (the total size is never needed).

    A round is `workers * JOBS_PER_WORKER` groups: the first round's groups hold about
    GROUP_MIN_BYTES of input each, each later round's twice the round before, up to
    GROUP_MAX_BYTES (a larger file is a group of its own); so a small input is still spread
    over every worker, a large one makes parts of a bounded size, and the last groups are
    small enough to balance. A group holds at most max(GROUP_MIN_FILES, n_files / round)
    files (100,000 tiny files are read by every worker too)."""
    per_round = max(1, workers * JOBS_PER_WORKER)
    max_files = max(GROUP_MIN_FILES, -(-n_files // per_round))
    group: list[FileStat] = []
    acc = made = 0
    target = GROUP_MIN_BYTES
    for f in files:
        n = max(f.size, 0)
        if group and (acc + n > target or len(group) >= max_files):
            yield group
            made += 1
            target = min(GROUP_MAX_BYTES, GROUP_MIN_BYTES << (made // per_round))
            group, acc = [], 0
        group.append(f)
        acc += n
    if group:
        yield group


def group_files(files: list[FileStat], workers: int) -> list[list[FileStat]]:
    """`stream_groups` of a list, as a list."""
    return list(stream_groups(files, len(files), workers))


def count_groups(paths: list[str], workers: int) -> Iterator[list[FileStat]]:
    """Consecutive files in `workers * JOBS_PER_WORKER` groups of equal count, sizes not
    known (-1): for an input of many files, where a `stat` of each costs the driver as much
    time as its workers take to read them. Each worker cuts its group into parts of at most
    about GROUP_MAX_BYTES as it reads (the size comes with the open file), so parts stay
    bounded, and the many groups balance the workers as files of mixed sizes average out."""
    per = max(1, -(-len(paths) // max(1, workers * JOBS_PER_WORKER)))
    for start in range(0, len(paths), per):
        yield [FileStat(p, -1, -1) for p in paths[start:start + per]]


def plan_groups(paths: list[str], workers: int) -> Iterator[list[FileStat]]:
    """The groups of an input: by bytes (`stream_groups`, each file stat'ed) for up to
    STAT_FILES_MAX files, else by count (`count_groups`)."""
    if len(paths) <= STAT_FILES_MAX:
        return stream_groups(stat_files(paths), len(paths), workers)
    return count_groups(paths, workers)


def group_digest(group: Iterable[FileStat]) -> str:
    """What one part is a function of, besides the run's plan: its files, in order, with
    their sizes and modification times. A part is reused only for the same digest."""
    h = hashlib.sha256()
    h.update("\n".join(f"{f.path}\0{f.size}\0{f.mtime_ns}" for f in group).encode(
        "utf-8", "surrogateescape"))
    return h.hexdigest()[:20]


def run_fingerprint(tokenizer: Path | None, options: dict[str, Any]) -> str:
    """What every part is a function of: the tokenizer's content and the options."""
    h = hashlib.sha256()
    h.update(json.dumps({**options, "format": PARTS_FORMAT}, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(hashlib.sha256(Path(tokenizer).read_bytes()).digest())
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

    def group(self, i: int) -> str:
        """The name of group `i`'s parts: GROUP-0000, GROUP-0001, ..."""
        return str(self.path / f"part-{i:05d}")

    def any_finished(self) -> bool:
        return any(self.path.glob("part-*.json"))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def part_name(group: str, j: int) -> str:
    return f"{group}-{j:04d}"


def mark_finished(part: str, start: int, files: list[FileStat], stats: dict[str, Any]
                  ) -> None:
    """The marker of a finished part (written after its .bin/.idx are in place): it holds
    its group's files [start, start + len(files)) and their digest."""
    marker = {"start": start, "end": start + len(files), "group": group_digest(files),
              "stats": stats}
    with open(f"{part}.json.tmp", "w", encoding="utf-8") as f:
        json.dump(marker, f)
    os.replace(f"{part}.json.tmp", f"{part}.json")


def finished_parts(group: str, paths: list[str]) -> list[tuple[str, int, dict[str, Any]]]:
    """(part, end, stats) of the parts of `group` (whose files are `paths`) that an earlier
    run finished and that still hold what those files hold now (sizes and modification times
    the same), in order; the markers of any later part of the group are removed (it is done
    again)."""
    found: list[tuple[str, int, dict[str, Any]]] = []
    pos, j = 0, 0
    while True:
        part = part_name(group, j)
        try:
            marker = json.loads(Path(f"{part}.json").read_text())
            end = int(marker["end"])
            if (marker["start"] != pos or not pos < end <= len(paths)
                    or group_digest(stat_files(paths[pos:end])) != marker["group"]):
                break
            found.append((part, end, dict(marker["stats"])))
        except (OSError, ValueError, KeyError, TypeError):
            break
        pos, j = end, j + 1
    for stale in Path(group).parent.glob(f"{Path(group).name}-*.json"):
        try:
            if int(stale.name[len(Path(group).name) + 1:-len(".json")]) >= j:
                stale.unlink()
        except ValueError:
            continue
    return found
