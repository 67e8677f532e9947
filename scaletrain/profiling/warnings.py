"""What could make a diagnosis misleading, said next to it: the analysed window is not steady
state, the device time is missing, or traces of different jobs are mixed."""

from __future__ import annotations

from typing import Any

import numpy as np

from scaletrain.profiling.trace import Trace

WARMUP_FACTOR = 1.5  # a first step this much slower than the median of the others


def of_trace(trace: Trace, r: dict[str, Any]) -> list[str]:
    """Warnings about one rank's trace."""
    out: list[str] = []
    if trace.all_steps == 0:
        out.append("no ProfilerStep markers: the whole trace (start-up, warm-up, autotuning "
                   "included) is analysed as if it were steady-state training; profile with a "
                   "schedule and call prof.step() once per step")
    times = [(n, hi - lo) for n, lo, hi in trace.steps]
    if len(times) >= 3:
        rest = float(np.median([d for _, d in times[1:]]))
        n0, d0 = times[0]
        if rest > 0 and d0 > WARMUP_FACTOR * rest:
            out.append(f"step {n0} takes {d0 / 1e3:.1f} ms against {rest / 1e3:.1f} ms for the "
                       "median other step: warm-up (compilation, autotuning, allocator growth) "
                       "is inside the analysed window; raise the profiler's warmup")
    if trace.is_device_job and len(trace.gpu) and not trace.kernel_timing:
        out.append(f"{len(trace.gpu)} device activities all of zero length: the device timeline "
                   "is empty, so no device figure is reported")
    what = {"gpu": "device activities (kernels, copies)", "rt": "runtime calls",
            "cpu": "CPU operators/ranges", "sync": "synchronization events"}
    for key, n in sorted(trace.untimed.items()):
        out.append(f"{n} {what.get(key, key)} without a valid start or duration (missing or "
                   "NaN) were left out, not counted as zero-length; the figures cover the "
                   "timed ones only")
    if len(trace.syncs):
        out.append(f"{len(trace.syncs)} cuda_sync events (stream/event/device waits): idle time "
                   "they cover with work queued is counted as synchronization")
    return out


def across(ranks: list[dict[str, Any]]) -> list[str]:
    """Warnings about a set of traces read as one job."""
    out: list[str] = []
    for key, what in (("platform", "device types"), ("world_size", "world sizes"),
                      ("job", "jobs (backend, world size)"),
                      ("device", "devices")):
        seen = {str(r.get(key)) for r in ranks if r.get(key) is not None}
        if len(seen) > 1:
            out.append(f"the traces come from different {what}: {', '.join(sorted(seen))}; "
                       "they are averaged as one job, which may mean nothing")
    steps = [set((r.get("cpu") or {}).get("step_numbers") or []) for r in ranks]
    steps = [s for s in steps if s]
    if len(steps) > 1 and not set.intersection(*steps):
        out.append("the traces share no step number: they are not the same steps of one run")
    return out
