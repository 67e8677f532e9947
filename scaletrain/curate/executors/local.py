"""Local executor: tasks on M worker processes (or in this process when M == 1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

from scaletrain.curate.executors.base import Executor, TaskFn, log_progress, run_and_mark
from scaletrain.curate.executors.lifeline import bind_to_parent
from scaletrain.curate.io.errors import InputError


class LocalExecutor(Executor):
    """Runs tasks on `workers` processes (default: the CPU count).

    A worker that dies (killed, out of memory) fails the run with `RuntimeError`; the tasks
    that completed keep their markers, so running the same job again only does the rest.
    Workers end with the driver (`bind_to_parent`): killing it leaves no orphan behind.
    """

    name = "local"

    def __init__(self, workers: int | None = None, start_method: str | None = None):
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.start_method = start_method

    def _run_pending(
        self, fn: TaskFn, pending: list[int], job_dir: str, desc: str
    ) -> list[tuple[int, dict]]:
        t0 = time.perf_counter()
        out: list[tuple[int, dict]] = []
        if self.workers == 1 or len(pending) == 1:
            for i in pending:
                out.append((i, run_and_mark(fn, i, job_dir)))
                log_progress(desc, len(out), len(pending), t0)
            return out
        method = self.start_method or ("fork" if "fork" in mp.get_all_start_methods() else None)
        ctx = mp.get_context(method)
        with ProcessPoolExecutor(
            max_workers=min(self.workers, len(pending)), mp_context=ctx,
            initializer=bind_to_parent,  # workers die with the driver
        ) as pool:
            futures: dict[Future, int] = {
                pool.submit(run_and_mark, fn, i, job_dir): i for i in pending
            }
            remaining = set(futures)
            while remaining:
                done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
                for fut in done:
                    try:
                        out.append((futures[fut], fut.result()))
                    except Exception as e:
                        for f in remaining:
                            f.cancel()
                        if isinstance(e, InputError):  # the input's fault (--strict): as is
                            raise
                        raise RuntimeError(
                            f"{desc}: task {futures[fut]} failed ({type(e).__name__}: {e}); "
                            f"completed tasks are kept in {job_dir}, run again to resume"
                        ) from e
                    log_progress(desc, len(out), len(pending), t0)
        return out
