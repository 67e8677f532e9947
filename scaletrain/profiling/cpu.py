"""CPU-side analyses: time per step in each training phase, and the breakdown of CPU-only runs.

Phases are recognised by the names of record_function ranges: scaletrain's own
(`scaletrain/data`, `scaletrain/forward`, `scaletrain/backward`, `scaletrain/optimizer`,
`scaletrain/comm/...`) and the ones PyTorch and common trainers emit (`enumerate(DataLoader)...`,
`## forward ##`, `DistributedDataParallel.forward`, autograd's `evaluate_function`,
`Optimizer.step#...`, `nccl:all_reduce`, `gloo:all_reduce`, ...).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from scaletrain.profiling import intervals
from scaletrain.profiling.trace import Trace

PHASES: dict[str, re.Pattern[str]] = {
    "data": re.compile(r"^scaletrain/data|^enumerate\(DataLoader\)|DataLoaderIter.*__next__|"
                       r"^## data"),
    "forward": re.compile(r"^scaletrain/forward|^## forward ##|^DistributedDataParallel\.forward|"
                          r"^FullyShardedDataParallel\.forward|^forward$"),
    "backward": re.compile(r"^scaletrain/backward|^## backward ##|"
                           r"^autograd::engine::evaluate_function"),
    "optimizer": re.compile(r"^scaletrain/optimizer|^Optimizer\.step#|^Optimizer\.zero_grad#|"
                            r"^## optimizer ##"),
    "logging": re.compile(r"^scaletrain/log|^## log|[Ll]ogging|SummaryWriter|^wandb|"
                          r"^scaletrain/metrics"),
}
COMM_RE = re.compile(r"^(nccl|gloo|mpi|ucc|xccl):|^c10d::|^record_param_comms|^scaletrain/comm|"
                     r"^MPI_|^mpi_")
# Collectives that run on the host (the host is held until they finish): MPI, gloo.
HOST_COMM_RE = re.compile(r"^MPI_|^mpi_|^(mpi|gloo):")
_STEP_RE = re.compile(r"^(?:ProfilerStep|scaletrain/step)\s*#")

Ranges = tuple[np.ndarray, np.ndarray]


def window(trace: Trace) -> tuple[float, float, int]:
    """(start, end, number of steps) of the analysed steps; the whole CPU timeline if none."""
    if trace.steps:
        return trace.steps[0][1], trace.steps[-1][2], len(trace.steps)
    c = trace.cpu
    if not len(c):
        return 0.0, 0.0, 0
    return float(c.ts.min()), float(c.end.max()), 1


def ranges(trace: Trace, pattern: re.Pattern[str]) -> Ranges:
    """The CPU ranges whose name matches, clipped to the analysed window."""
    c = trace.cpu
    sel = c.matches(pattern)
    lo, hi, _ = window(trace)
    return intervals.clip(c.ts[sel], c.end[sel], lo, hi)


def phase_times(trace: Trace) -> dict[str, Any]:
    """Milliseconds per step in each phase and as a share of the step time."""
    lo, hi, n = window(trace)
    if n == 0 or hi <= lo:
        return {"steps": 0}
    step_us = (hi - lo) / n
    out: dict[str, Any] = {"steps": n, "step_time_ms": step_us / 1e3,
                           "step_numbers": [s[0] for s in trace.steps]}
    per_step = []
    for s in trace.steps:
        per_step.append((s[2] - s[1]) / 1e3)
    if per_step:
        out["step_times_ms"] = per_step
    phases: dict[str, Any] = {}
    for name, pat in {**PHASES, "communication": COMM_RE}.items():
        r = ranges(trace, pat)
        if len(r[0]):
            t = intervals.total(*r)
            phases[name] = {"ms_per_step": t / n / 1e3, "share": t / (hi - lo)}
    out["phases"] = phases
    out["outside_phases"] = outside_phases(trace, n)
    return out


def outside_phases(trace: Trace, n_steps: int, top: int = 5) -> list[dict[str, Any]]:
    """The biggest top-level CPU ranges of the step threads that fall outside every phase
    range (what the rest of the step time is spent on), in ms per step. Linear in the number
    of ranges: one pass per thread over its ranges sorted by start (longest first at ties)."""
    c = trace.cpu
    steps = c.matches(_STEP_RE)
    lo, hi, _ = window(trace)
    if not steps.any() or n_steps == 0:
        return []
    in_phase = phase_mask(trace)
    ph_s, ph_e = intervals.merge(c.ts[in_phase], c.end[in_phase])
    names, codes = c.name_codes()
    cand = np.flatnonzero(np.isin(c.tid, np.unique(c.tid[steps])) & ~steps & ~in_phase
                          & (c.ts >= lo) & (c.ts < hi))
    cand = cand[np.lexsort((-c.dur[cand], c.ts[cand], c.tid[cand]))]
    k = np.searchsorted(ph_s, c.ts[cand], side="right") - 1
    starts_in_phase = (k >= 0) & (ph_e[np.maximum(k, 0)] > c.ts[cand]) if len(ph_s) else \
        np.zeros(len(cand), dtype=bool)
    top_level = np.zeros(len(cand), dtype=bool)
    run_end, thread = -np.inf, None
    for j, (t, ts, end) in enumerate(zip(c.tid[cand].tolist(), c.ts[cand].tolist(),
                                         c.end[cand].tolist())):
        if t != thread:
            thread, run_end = t, -np.inf
        if ts >= run_end:  # not nested in the previous top-level range of its thread
            top_level[j], run_end = True, end
    keep = cand[top_level & ~starts_in_phase]
    totals = np.bincount(codes[keep], weights=c.dur[keep], minlength=len(names))
    seen = np.flatnonzero(np.bincount(codes[keep], minlength=len(names)))
    order = sorted(seen.tolist(), key=lambda i: -totals[i])[:top]
    return [{"name": names[i], "ms_per_step": float(totals[i]) / n_steps / 1e3} for i in order]


def phase_mask(trace: Trace) -> np.ndarray:
    """CPU ranges that are a training phase or a collective."""
    c = trace.cpu
    mask = c.matches(COMM_RE)
    for pat in PHASES.values():
        mask |= c.matches(pat)
    return mask


def cpu_only_breakdown(trace: Trace) -> dict[str, Any]:
    """For a trace without device activity the CPU is the compute device. The analysed window
    is split, whatever labels the loop used, into: communication (collective calls, MPI
    ranges), input (data-loading ranges, operators inside them included), compute (PyTorch
    operators outside those two) and overhead (the rest: Python and framework code between
    operators). A trace without operator events falls back on the forward/backward/optimizer
    phase ranges for compute."""
    lo, hi, n = window(trace)
    span = hi - lo
    if span <= 0:
        return {"span_us": 0.0, "breakdown": None}
    c = trace.cpu
    comm = ranges(trace, COMM_RE)
    data = ranges(trace, PHASES["data"])
    is_op = (c.stream == 1) & ~c.matches(_STEP_RE)
    if is_op.any():
        ops = intervals.clip(c.ts[is_op], c.end[is_op], lo, hi)
    else:
        parts = [ranges(trace, PHASES[p]) for p in ("forward", "backward", "optimizer")]
        ops = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    comm_t = intervals.total(*comm)
    data_t = intervals.total(*data) - intervals.intersect_length(data, comm)
    claimed = (np.concatenate([comm[0], data[0]]), np.concatenate([comm[1], data[1]]))
    compute = intervals.total(*ops) - intersect(ops, claimed)
    overhead = max(span - compute - comm_t - data_t, 0.0)
    idle = overhead + data_t
    return {
        "span_us": span,
        "breakdown": {"compute": compute / span, "communication": comm_t / span,
                      "memory": 0.0, "idle": idle / span},
        "idle_breakdown": {"input": data_t / idle if idle > 0 else 0.0,
                           "other": overhead / idle if idle > 0 else 0.0},
        "input_wait": data_t / span,
        "overhead": overhead / span,
        "operator_events": bool(is_op.any()),
    }


def intersect(a: Ranges, b: Ranges) -> float:
    return intervals.intersect_length(a, b) if len(a[0]) and len(b[0]) else 0.0


def input_wait_on_gpu(trace: Trace, gaps: Ranges, span: float) -> float:
    """Share of the GPU span that is idle while the CPU is loading data."""
    data = ranges(trace, PHASES["data"])
    if not len(data[0]) or span <= 0:
        return 0.0
    return intervals.intersect_length(gaps, data) / span


# The phases a device's idle time is put down to, innermost first (a logging range inside
# the optimizer's is logging).
IDLE_PHASES = ("logging", "optimizer", "data", "backward", "forward")


def idle_by_phase(trace: Trace, gaps: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """Per idle cause, the share of the span the host spent in each training phase while the
    device was idle for that cause (`gpu.classify_gaps`); the rest of a cause is `other`.
    Where the lost time falls picks the remedy: host launch inside the optimizer wants a
    fused optimizer, inside a logging range a longer log interval."""
    if gaps is None or not len(gaps["a"]) or gaps["span"] <= 0:
        return {}
    a, b, rest, cause = gaps["a"], gaps["b"], gaps["rest"], gaps["cause"]
    left = rest.copy()
    out: dict[str, dict[str, float]] = {}
    for name in IDLE_PHASES:
        if name == "data":
            continue  # the data part of a gap is the `input` cause already
        r = ranges(trace, PHASES[name])
        if not len(r[0]):
            continue
        part = np.minimum(intervals.covered(intervals.merge(*r), a, b), left)
        left -= part
        for c in np.unique(cause[part > 0]):
            out.setdefault(str(c), {})[name] = float(part[cause == c].sum()) / gaps["span"]
    for c in np.unique(cause[left > 0]):
        out.setdefault(str(c), {})["other"] = float(left[cause == c].sum()) / gaps["span"]
    return out



def launches_in(trace: Trace, phase: str) -> float | None:
    """Kernel/copy launch calls per step made while the host is in `phase` (a for-loop
    optimizer launches several per parameter tensor; a fused one a handful in all). On a
    CPU-only trace: the PyTorch operators started in it."""
    r = ranges(trace, PHASES[phase])
    lo, hi, n = window(trace)
    if not len(r[0]) or n == 0:
        return None
    if trace.platform == "cpu":
        c = trace.cpu
        t = c.ts[(c.stream == 1) & ~c.matches(PHASES[phase])]
    else:
        rt = trace.runtime
        t = rt.ts[rt.matches(_LAUNCH_CALL_RE, how="match")]
    s, e = intervals.merge(*r)
    k = np.searchsorted(s, t, side="right") - 1
    inside = (k >= 0) & (e[np.maximum(k, 0)] > t)
    return float(inside.sum()) / n


_LAUNCH_CALL_RE = re.compile(r"(cuda|hip|cu|mtia)(LaunchKernel|MemcpyAsync|MemsetAsync|"
                             r"ExtModuleLaunchKernel)|mtiaLaunch")
