"""Out of memory as one message, for `train` and `finetune`: before set-up when the plan is far
above the memory there is, and when a step runs out anyway.

The message names the peak the planner estimates for this layout (`plan.from_config`, the
same estimate `--dry-run` prints), the memory the device has, and the cheapest change that fits
(`plan.search.advice`, e.g. a smaller micro-batch with more accumulation); the verb exits with
`EXIT_OUT_OF_MEMORY` (3, as `--dry-run` does for a layout that does not fit).

The check before set-up refuses only far beyond the device (`MARGIN`), so a run the estimate
puts near the limit still starts; `--training.skip_memory_check true` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from scaletrain.host import available_ram_bytes, host_ram_bytes

if TYPE_CHECKING:
    from scaletrain.plan.layout import Plan

log = logging.getLogger(__name__)

EXIT_OUT_OF_MEMORY = 3
MARGIN = {"cuda": 1.5, "cpu": 2.0}
"""Refuse before set-up only when the planned peak exceeds this multiple of the memory there
is: the estimate is not exact (allocator caching, fragmentation, the host's other users)."""
GIB = 2**30
# What the CPU allocator (c10 DefaultCPUAllocator) and CUDA say when an allocation fails.
_OOM_TEXT = re.compile(r"can't allocate memory|DefaultCPUAllocator|CUDA out of memory|"
                       r"out of memory", re.IGNORECASE)
_TRIED = re.compile(r"tried to allocate (\d+ bytes|[\d.]+ ?[KMGT]i?B)", re.IGNORECASE)

PlanFn = Callable[[], "Plan"]
_CUT = "lowers the planned peak by a quarter of what the layout decides"


class RunOutOfMemory(RuntimeError):
    """The run cannot fit, or ran out: one line with the plan, the memory and the fix."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's RuntimeError, or MemoryError."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and bool(_OOM_TEXT.search(str(error)))


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): the GPU's memory (this rank's GPU: `LOCAL_RANK` when the device
    names no index, as the trainer sets it), or the host RAM available now (MemAvailable)
    shared by the ranks on this host."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name} memory"
    available = available_ram_bytes()
    if available is not None:
        return available, "available host RAM"
    return host_ram_bytes(), "host RAM"


def _ranks_sharing(device: torch.device) -> int:
    """Ranks whose peaks add up in the same memory: all local ranks on a CPU host."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if device.type == "cpu" else 1


def size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def cheapest_fix(plan: Plan, budget: float, goal: str = "fits") -> str:
    """The planner's advice as one clause: the cheapest single change that fits `budget`, else
    changes that fit together, else what is left to do."""
    from scaletrain.plan.search.advice import advise, combine

    found = advise(plan, budget)
    if found and found[0].plan.peak_bytes <= budget:
        best = found[0]
        return (f"the cheapest change that {goal}: {best.change} (planned peak "
                f"{size(best.plan.peak_bytes)})")
    steps = combine(plan, budget)
    if steps:
        return ("no single change fits; these together do: "
                + ", then ".join(a.change for a in steps)
                + f" (planned peak {size(steps[-1].plan.peak_bytes)})")
    return ("no change the trainer offers fits on this many devices: add devices, shorten the "
            "sequence or use a smaller model")


def _layout(plan: Plan) -> str:
    lay = plan.layout
    return f"micro-batch {lay.mbs} x {lay.seq_len} tokens, accumulation {lay.grad_accum}"


def describe(plan: Plan, device: torch.device, ran_out: BaseException | None = None) -> str:
    """The one-line message (without the verb's prefix)."""
    avail, what = available_bytes(device)
    ranks = _ranks_sharing(device)
    budget = avail / ranks
    per = f" per rank ({ranks} ranks share it)" if ranks > 1 else ""
    peak = size(plan.peak_bytes)
    if ran_out is None:
        head = (f"this run needs an estimated {peak}{per} ({_layout(plan)}; the plan's "
                f"peak) but the {what} is {size(avail)}: it would run out of memory")
        tail = "; or pass --training.skip_memory_check true to start anyway"
    else:
        tried = _TRIED.search(str(ran_out))
        cause = f" (the allocator was asked for {tried.group(1)})" if tried else ""
        head = (f"out of memory{cause}: the plan estimates a peak of {peak}{per} for "
                f"this layout ({_layout(plan)}), the {what} is {size(avail)}")
        tail = ""
        if plan.peak_bytes <= budget:  # the plan says it fits: ask for a clear cut
            head += " (the estimate is below it: the run needs more than planned)"
            # A CPU process's own memory (`host_runtime`) is the same for every layout.
            fixed = plan.memory_bytes.get("host_runtime", 0)
            target = fixed + 0.75 * (plan.peak_bytes - fixed)
            return f"{head}; {cheapest_fix(plan, target, _CUT)}"
    return f"{head}; {cheapest_fix(plan, budget)}{tail}"


def check_before_setup(plan_fn: PlanFn, device: torch.device, skip: bool) -> None:
    """Raise RunOutOfMemory when the planned peak is far above the memory there is (`MARGIN`);
    a plan that cannot be made is left to the trainer, which says what is wrong."""
    if skip:
        return
    try:
        plan = plan_fn()
    except Exception as e:  # never stop a run because the estimate failed
        log.debug("memory check skipped: the plan failed (%s)", e)
        return
    avail, _ = available_bytes(device)
    need = plan.peak_bytes * _ranks_sharing(device)
    if need > MARGIN.get(device.type, 2.0) * avail:
        raise RunOutOfMemory(describe(plan, device))


@contextlib.contextmanager
def out_of_memory_as_message(plan_fn: PlanFn, device: torch.device) -> Iterator[None]:
    """Turn an out-of-memory error of the block into RunOutOfMemory (one line); other errors
    pass unchanged. The profiler's allocator snapshot has been written by then."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RunOutOfMemory) or not is_out_of_memory(e):
            raise
        try:
            plan = plan_fn()
        except Exception:  # the estimate must never hide the failure itself
            raise RunOutOfMemory(f"out of memory: {str(e).strip().splitlines()[-1]}; "
                                 "plan the run with --dry-run to see what fits") from None
        raise RunOutOfMemory(describe(plan, device, ran_out=e)) from None


def training_plan(cfg: Any) -> PlanFn:
    """The plan of a `scaletrain train` config, as `--dry-run` makes it."""
    def plan() -> Plan:
        from scaletrain.plan.from_config import plan_config
        from scaletrain.runtime import resolve_device

        return plan_config(cfg, resolve_device(cfg.training.device))[0]
    return plan


__all__ = ["EXIT_OUT_OF_MEMORY", "MARGIN", "RunOutOfMemory", "is_out_of_memory",
           "available_bytes", "size", "cheapest_fix", "describe", "check_before_setup",
           "out_of_memory_as_message", "training_plan"]
