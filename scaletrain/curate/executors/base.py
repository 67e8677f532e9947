"""Executors run N independent tasks, each marked complete when done, so a re-run skips them.

A task is a picklable callable `fn(i) -> dict` (JSON-serializable result). The executor writes
`JOB_DIR/done/NNNNN.json` holding the result when task `i` finishes; tasks with a marker are
not run again, and their recorded results are returned with the new ones. A task must write
its outputs under temporary names and rename them before it returns, so a task killed half
way leaves nothing that looks complete and is simply run again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TaskFn = Callable[[int], dict[str, Any]]


def marker_path(job_dir: str, i: int) -> str:
    return os.path.join(job_dir, "done", f"{i:05d}.json")


def read_marker(job_dir: str, i: int) -> dict[str, Any] | None:
    try:
        with open(marker_path(job_dir, i), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def run_and_mark(fn: TaskFn, i: int, job_dir: str) -> dict[str, Any]:
    """Run task `i` and write its completion marker (temporary name, then rename)."""
    t0 = time.perf_counter()
    result = fn(i)
    result = {**result, "task": i, "task_seconds": round(time.perf_counter() - t0, 4)}
    path = marker_path(job_dir, i)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    return result


class Executor(ABC):
    """Runs the pending tasks of a job and returns every task's result in task order."""

    name = "executor"

    def run(self, fn: TaskFn, n_tasks: int, job_dir: str, desc: str = "tasks") -> list[dict]:
        os.makedirs(os.path.join(job_dir, "done"), exist_ok=True)
        results: dict[int, dict] = {}
        for i in range(n_tasks):
            r = read_marker(job_dir, i)
            if r is not None:
                results[i] = r
        pending = [i for i in range(n_tasks) if i not in results]
        if results:
            log.info("%s: %d/%d tasks already complete, skipping them", desc, len(results), n_tasks)
        if pending:
            for i, r in self._run_pending(fn, pending, job_dir, desc):
                results[i] = r
        return [results[i] for i in range(n_tasks)]

    @abstractmethod
    def _run_pending(
        self, fn: TaskFn, pending: list[int], job_dir: str, desc: str
    ) -> list[tuple[int, dict]]:
        """Run the pending tasks (each through `run_and_mark`)."""


def log_progress(desc: str, done: int, total: int, t0: float) -> None:
    elapsed = time.perf_counter() - t0
    eta = elapsed / done * (total - done) if done else 0.0
    log.info("%s: %d/%d tasks done (%.1fs elapsed, ~%.0fs left)", desc, done, total, elapsed, eta)
