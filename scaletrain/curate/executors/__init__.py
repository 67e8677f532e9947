"""Executors: run a job's tasks locally (processes) or on Ray, with completion markers."""

from scaletrain.curate.executors.base import Executor
from scaletrain.curate.executors.local import LocalExecutor


def make_executor(
    kind: str = "local", workers: int | None = None, address: str | None = None
) -> Executor:
    """'local' (worker processes) or 'ray' (a cluster at `address`, else a local one)."""
    if kind == "local":
        return LocalExecutor(workers)
    if kind == "ray":
        from scaletrain.curate.executors.ray import RayExecutor

        return RayExecutor(address=address, num_cpus=workers)
    raise ValueError(f"executor '{kind}': use 'local' or 'ray'")


__all__ = ["Executor", "LocalExecutor", "make_executor"]
