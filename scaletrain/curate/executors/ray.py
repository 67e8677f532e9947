"""Ray executor: the same tasks on a Ray cluster (`address=None` starts a local one)."""

from __future__ import annotations

import logging
import time
from typing import Any

from scaletrain.curate.executors.base import Executor, TaskFn, log_progress, run_and_mark
from scaletrain.curate.io.errors import InputError
from scaletrain.optional import require

log = logging.getLogger(__name__)


def _ray() -> Any:
    return require("ray", "the Ray executor needs ray: pip install 'scaletrain[curate]'")


class RayExecutor(Executor):
    """Runs each task as a Ray task with `cpus_per_task` CPUs.

    Connects to `address` (e.g. 'auto' or 'ray://head:10001'); with no address and no Ray
    session running, starts a local one with `num_cpus`. The job directory (markers) must be
    on storage every node sees (a shared filesystem) for resume to work across nodes.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        cpus_per_task: float = 1.0,
        max_in_flight: int | None = None,
    ):
        self.address, self.num_cpus = address, num_cpus
        self.cpus_per_task, self.max_in_flight = cpus_per_task, max_in_flight

    def _ensure_init(self) -> Any:
        ray = _ray()
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False}
            if self.address:
                kwargs["address"] = self.address
            elif self.num_cpus:
                kwargs["num_cpus"] = self.num_cpus
            ray.init(**kwargs)
        return ray

    def _run_pending(
        self, fn: TaskFn, pending: list[int], job_dir: str, desc: str
    ) -> list[tuple[int, dict]]:
        ray = self._ensure_init()
        remote = ray.remote(num_cpus=self.cpus_per_task, max_retries=0)(run_and_mark)
        fn_ref = ray.put(fn)
        limit = self.max_in_flight or max(1, int(ray.cluster_resources().get("CPU", 1) * 2))
        t0 = time.perf_counter()
        todo = list(pending)
        in_flight: dict[Any, int] = {}
        out: list[tuple[int, dict]] = []
        while todo or in_flight:
            while todo and len(in_flight) < limit:
                i = todo.pop(0)
                in_flight[remote.remote(fn_ref, i, job_dir)] = i
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in ready:
                i = in_flight.pop(ref)
                try:
                    out.append((i, ray.get(ref)))
                except Exception as e:
                    cause = getattr(e, "cause", e)
                    if isinstance(cause, InputError):  # the input's fault (--strict): said as is
                        raise InputError(str(cause)) from None
                    raise RuntimeError(
                        f"{desc}: task {i} failed on Ray ({e}); completed tasks are kept in "
                        f"{job_dir}, run again to resume"
                    ) from e
                log_progress(desc, len(out), len(pending), t0)
        return out
