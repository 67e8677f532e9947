"""What every deduplication step shares: per-shard tasks, a reduce, a saved removal map.

A dedup step is a `GlobalStep`: `fit` runs `map_shard` on every input shard with the
executor (results in `WORK/map/`, one file per shard, with completion markers), then
`reduce` in this process decides which ids go, and saves the decision to
`WORK/remove.json` (temporary name, then rename). A re-run finds the saved decision and
skips both phases. `process` then drops the chosen ids, noting which document they
duplicate in `metadata['duplicate_of']`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import numpy as np

from scaletrain.curate.documents import Document
from scaletrain.curate.executors import Executor
from scaletrain.curate.io.readers import Shard
from scaletrain.curate.runner import GlobalStep


def equal_key_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group equal keys, keeping input order within each group.

    Returns `(order, starts, first)`, all indexed by sorted position j: `order[j]` is the
    input index at j (a stable argsort), `starts[j]` is True where a run of equal keys
    begins, and `first[j]` is the input index of the first element of j's run.
    """
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.ones(len(sorted_keys), bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    first = order[np.maximum.accumulate(np.where(starts, np.arange(len(sorted_keys)), 0))]
    return order, starts, first


class DedupStep(GlobalStep):
    """Base of the dedup steps: subclasses implement `map_shard` and `reduce`."""

    reason_name = "duplicate"

    def __init__(self) -> None:
        super().__init__()
        # "shard:position" of a removed document -> id of the document it duplicates
        self.remove: dict[str, str] = {}
        self.fit_stats: dict[str, Any] = {}

    def map_shard(self, shard: Shard, out_path: str) -> dict[str, Any]:
        """Read one shard and write what the reduce needs to `out_path` (an .npz)."""
        raise NotImplementedError

    def reduce(self, shards: list[Shard], map_files: list[str]) -> dict[str, str]:
        """Decide the removals from all map outputs (shard order): {position key:
        duplicate_of id}, position keys as `position_keys` makes them."""
        raise NotImplementedError

    def extra_state(self) -> Any:
        """More of the reduce's decision to save with it (JSON-serializable)."""
        return None

    def load_extra(self, extra: Any) -> None:
        """Restore what `extra_state` saved."""

    def _map_task(self, i: int, shards: list[Shard], map_dir: str) -> dict[str, Any]:
        out = os.path.join(map_dir, f"{i:05d}.npz")
        tmp = out + ".tmp.npz"
        result = self.map_shard(shards[i], tmp)
        os.replace(tmp, out)
        return result

    def fit(self, shards: list[Shard], executor: Executor, work_dir: str) -> None:
        decision = os.path.join(work_dir, "remove.json")
        if os.path.exists(decision):
            with open(decision, encoding="utf-8") as f:
                saved = json.load(f)
            self.remove, self.fit_stats = saved["remove"], saved["stats"]
            self.load_extra(saved.get("extra"))
            return
        map_dir = os.path.join(work_dir, "map")
        os.makedirs(map_dir, exist_ok=True)
        fn = functools.partial(self._map_task, shards=shards, map_dir=map_dir)
        executor.run(fn, len(shards), os.path.join(work_dir, "job"), f"{self.name} (map)")
        files = [os.path.join(map_dir, f"{i:05d}.npz") for i in range(len(shards))]
        self.remove = self.reduce(shards, files)
        tmp = decision + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(
                {"remove": self.remove, "stats": self.fit_stats, "extra": self.extra_state()}, f
            )
        os.replace(tmp, decision)

    @staticmethod
    def position_keys(shard_index: int, n: int) -> list[str]:
        """The keys of a shard's documents, as the runner sets `Document.pos`."""
        return [f"{shard_index}:{p}" for p in range(n)]

    def process(self, doc: Document) -> Document | str:
        dup_of = self.remove.get(doc.pos if doc.pos is not None else doc.id)
        if dup_of is None:
            return doc
        doc.metadata["duplicate_of"] = dup_of
        return self.reason_name
