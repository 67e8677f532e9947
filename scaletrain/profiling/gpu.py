"""GPU-side analyses of one trace: time breakdown, idle causes, top kernels, overlap, launches.

Definitions (all times in microseconds, over the analysed steps):
- span: first GPU activity start to last GPU activity end, all streams (HTA's "kernel time").
- breakdown: each instant of the span is counted once, in the first of compute >
  communication > memory that is running then, or as idle when nothing runs. `compute` is
  HTA's compute share and `idle` its idle share; communication + memory is its non-compute.
- kernel_time_by_kind: busy time split by the exact set of kinds running at once (HTA's
  kernel-type breakdown: "computation", "communication", "computation+communication", ...).
- idle_breakdown: every gap in the span is put down to the activity that ends it: host wait
  when its launch call started after the gap began (the GPU waited for the CPU), kernel wait
  when the gap is shorter than 30 us (back-to-back launch latency), else other.
- idle_by_stream: HTA's per-stream version of the same (gaps between consecutive kernels on a
  stream).
- overlap: share of communication time during which a compute kernel also runs (HTA).
- queue length: outstanding launches per stream, +1 at the runtime call, -1 when the GPU
  starts the work (HTA); mean over its change points and the maximum.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import numpy as np

from scaletrain.profiling import intervals
from scaletrain.profiling.trace import COMM, COMPUTE, MEMORY, OTHER, Trace

KERNEL_WAIT_US = 30.0
SHORT_KERNEL_US = 10.0
# nvjet_*: cuBLAS's own GEMM kernels on Hopper and later (no "gemm" in their names).
_GEMM_RE = re.compile(r"gemm|matmul|cutlass|xmma|cublaslt|wgmma|nvjet", re.I)
_TENSOR_CORE_RE = re.compile(
    r"tensorop|h884|h1688|s1688|h16816|s16816|i8816|hmma|wgmma|bf16|f16|fp16|half|tf32|xmma|"
    r"sm80_|sm90_|sm100_|_e4m3|_e5m2|mfma", re.I)
_LOW_PRECISION_RE = re.compile(r"bf16|f16|half|h884|h1688|h16816|hmma|_e4m3|_e5m2|fp8", re.I)
_FULL_PRECISION_RE = re.compile(r"sgemm|tf32|s1688|s884|fp32|f32f32_f32|_float", re.I)
_KIND_BITS = {COMPUTE: 1, COMM: 2, MEMORY: 4, OTHER: 8}


def sweep(trace: Trace) -> dict[int, float]:
    """Time (us) per set of running kinds (bit 1 compute, 2 communication, 4 memory, 8 other)
    over the span; key 0 is idle."""
    g = trace.gpu
    bits = np.array([_KIND_BITS.get(int(k), 1) for k in trace.gpu_kind], dtype=np.int64)
    times = np.concatenate([g.ts, g.end])
    # Per-kind counters change by +1/-1 at starts/ends; ends sort before starts at ties.
    order = np.lexsort((np.concatenate([np.ones(len(g)), np.zeros(len(g))]), times))
    times = times[order]
    delta = np.concatenate([np.ones(len(g)), -np.ones(len(g))])[order]
    kind_bits = np.concatenate([bits, bits])[order]
    mask = np.zeros(len(times), dtype=np.int64)
    for b in (1, 2, 4, 8):
        running = np.cumsum(np.where(kind_bits == b, delta, 0)) > 0
        mask |= np.where(running, b, 0)
    widths = np.diff(times)
    out: dict[int, float] = defaultdict(float)
    for m in np.unique(mask[:-1]):
        out[int(m)] = float(widths[mask[:-1] == m].sum())
    return dict(out)


def breakdown(trace: Trace) -> dict[str, Any]:
    by_set = sweep(trace)
    span = float(trace.gpu.end.max() - trace.gpu.ts.min())
    # Unclassified kernels (HTA's "other") count as compute in the four-way breakdown; their
    # own share is reported as `other_kernels` (HTA's compute = compute - other_kernels).
    compute = sum(v for m, v in by_set.items() if m & 9)
    other = sum(v for m, v in by_set.items() if m & 8 and not m & 1)
    comm = sum(v for m, v in by_set.items() if m & 2 and not m & 9)
    memory = sum(v for m, v in by_set.items() if m & 4 and not m & 11)
    idle = by_set.get(0, 0.0)
    busy = span - idle
    names = {1: "computation", 2: "communication", 4: "memory", 8: "other"}
    by_kind = {
        "+".join(names[b] for b in (1, 2, 4, 8) if m & b): v / busy
        for m, v in sorted(by_set.items()) if m and busy > 0
    }
    comm_total = sum(v for m, v in by_set.items() if m & 2)
    overlapped = sum(v for m, v in by_set.items() if m & 2 and m & 1)
    return {
        "span_us": span,
        "breakdown": {"compute": compute / span, "communication": comm / span,
                      "memory": memory / span, "idle": idle / span} if span > 0 else None,
        "kernel_time_by_kind": by_kind,
        "other_kernels": other / span if span > 0 else 0.0,
        "overlap": overlapped / comm_total if comm_total > 0 else None,
        "communication_us": comm_total,
    }


def idle_breakdown(trace: Trace) -> dict[str, float]:
    """Share of GPU-wide idle time by cause (host_wait, kernel_wait, other)."""
    g = trace.gpu
    order = np.argsort(g.ts, kind="stable")
    ts, end, launch = g.ts[order], g.end[order], trace.launch_ts[order]
    run_end = np.maximum.accumulate(end)
    gap = ts[1:] - run_end[:-1]
    is_gap = gap > 0
    gap, nxt_launch, prev_end = gap[is_gap], launch[1:][is_gap], run_end[:-1][is_gap]
    host = nxt_launch > prev_end  # NaN compares False
    kernel = ~host & (gap < KERNEL_WAIT_US)
    total = float(gap.sum())
    if total <= 0:
        return {"host_wait": 0.0, "kernel_wait": 0.0, "other": 0.0}
    return {"host_wait": float(gap[host].sum()) / total,
            "kernel_wait": float(gap[kernel].sum()) / total,
            "other": float(gap[~host & ~kernel].sum()) / total}


def idle_by_stream(trace: Trace) -> list[dict[str, Any]]:
    """HTA's idle-time breakdown per stream, busiest stream first."""
    g = trace.gpu
    out = []
    for stream, sel in _by_stream(g.stream, np.ones(len(g), dtype=bool)):
        sel = sel[np.argsort(g.ts[sel], kind="stable")]
        ts, end, launch = g.ts[sel], g.end[sel], trace.launch_ts[sel]
        gap = ts[1:] - end[:-1]
        host = launch[1:] > end[:-1]
        kernel = ~host & (gap < KERNEL_WAIT_US)
        total = float(gap.sum())
        parts = {"host_wait": float(gap[host].sum()), "kernel_wait": float(gap[kernel].sum()),
                 "other": float(gap[~host & ~kernel].sum())}
        out.append({"stream": int(stream), "busy_us": float(g.dur[sel].sum()), "idle_us": total,
                    **{k: (v / total if total > 0 else 0.0) for k, v in parts.items()}})
    return sorted(out, key=lambda r: -r["busy_us"])


def top_kernels(trace: Trace, n: int = 15) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Kernels by total time; `share` is of all kernel time (nsys cuda_gpu_kern_sum's Time %),
    `share_of_gpu_time` of kernels + memory copies/sets."""
    g, kinds = trace.gpu, trace.gpu_kind
    is_kernel = kinds != MEMORY
    gpu_time = float(g.dur.sum())
    kernel_time = float(g.dur[is_kernel].sum())
    totals: dict[str, list[float]] = defaultdict(list)
    for name, d, k in zip(g.name, g.dur.tolist(), is_kernel.tolist()):
        if k:
            totals[name].append(d)
    rows = sorted(((name, float(np.sum(d)), len(d)) for name, d in totals.items()),
                  key=lambda r: -r[1])
    names, codes = g.name_codes()
    kind_of = dict(zip(names, kinds[np.unique(codes, return_index=True)[1]].tolist())) \
        if len(g) else {}
    top = [{
        "name": name, "total_us": t, "count": c, "mean_us": t / c,
        "share": t / kernel_time if kernel_time else 0.0,
        "share_of_gpu_time": t / gpu_time if gpu_time else 0.0,
        "kind": "communication" if kind_of[name] == COMM else "compute",
        "tensor_core_gemm": is_tensor_core_gemm(name),
    } for name, t, c in rows[:n]]
    gemm = sum(t for name, t, _ in rows if _GEMM_RE.search(name))
    tc = sum(t for name, t, _ in rows if is_tensor_core_gemm(name))
    low = sum(t for name, t, _ in rows if _GEMM_RE.search(name) and _LOW_PRECISION_RE.search(name))
    full = sum(t for name, t, _ in rows if _GEMM_RE.search(name) and _FULL_PRECISION_RE.search(name)
               and not _LOW_PRECISION_RE.search(name))
    mem_time = float(g.dur[~is_kernel].sum())
    summary = {
        "kernel_time_us": kernel_time, "gpu_time_us": gpu_time, "kernels": int(is_kernel.sum()),
        "distinct_kernels": len(rows),
        "gemm_share": gemm / kernel_time if kernel_time else 0.0,
        "tensor_core_gemm_share": tc / kernel_time if kernel_time else 0.0,
        # GEMMs in bf16/fp16/fp8: the run already computes in reduced precision
        "low_precision_gemm_share": low / gemm if gemm else 0.0,
        # GEMMs whose names say fp32/tf32 (sgemm, s1688, tf32): reduced precision would help
        "full_precision_gemm_share": full / gemm if gemm else 0.0,
        "memory_ops_share_of_gpu_time": mem_time / gpu_time if gpu_time else 0.0,
    }
    return top, summary


def is_tensor_core_gemm(name: str) -> bool:
    """A GEMM kernel whose name says it runs on tensor cores (fp16/bf16/tf32/fp8 MMA)."""
    return bool(_GEMM_RE.search(name)) and bool(_TENSOR_CORE_RE.search(name)) and \
        "sgemm" not in name.lower()


def launches(trace: Trace) -> dict[str, Any]:
    """Launch delay, short kernels and CUDA queue length."""
    g = trace.gpu
    known = ~np.isnan(trace.launch_ts)
    delay = (g.ts - trace.launch_ts)[known]
    kernel = trace.gpu_kind != MEMORY
    short = kernel & (g.dur < SHORT_KERNEL_US)
    queue = queue_length(trace)
    return {
        "launch_delay_us": _stats(delay),
        "short_kernels": {"threshold_us": SHORT_KERNEL_US,
                          "share_of_kernels": float(short.sum() / max(kernel.sum(), 1)),
                          "share_of_kernel_time": float(g.dur[short].sum()
                                                        / max(g.dur[kernel].sum(), 1e-9))},
        "queue_length": queue,
    }


def queue_length(trace: Trace) -> dict[str, Any]:
    """Per stream: mean and max outstanding launches (HTA's event-based definition: kernel,
    memcpy and memset launch calls; work from CUDA-graph launches is not counted)."""
    g = trace.gpu
    known = ~np.isnan(trace.launch_ts) & trace.direct_launch
    out: dict[str, Any] = {}
    for stream, sel in _by_stream(g.stream, known):
        times = np.concatenate([trace.launch_ts[sel], g.ts[sel]])
        delta = np.concatenate([np.ones(len(sel)), -np.ones(len(sel))])
        order = np.argsort(times, kind="stable")
        q = np.cumsum(delta[order])
        out[str(int(stream))] = {"mean": float(q.mean()), "max": int(q.max()),
                                 "launches": int(len(sel))}
    return out


def _by_stream(stream: np.ndarray, mask: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(stream, indices of its entries in `mask`, in trace order) for every stream: one sort,
    not one pass over the trace per stream."""
    idx = np.flatnonzero(mask)
    idx = idx[np.argsort(stream[idx], kind="stable")]
    keys, first = np.unique(stream[idx], return_index=True)
    return list(zip(keys.tolist(), np.split(idx, first[1:])))


def _stats(x: np.ndarray) -> dict[str, float] | None:
    if len(x) == 0:
        return None
    return {"mean": float(x.mean()), "p50": float(np.median(x)),
            "p95": float(np.percentile(x, 95)), "max": float(x.max())}


def idle_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The GPU-wide idle gaps inside the span."""
    return intervals.gaps(trace.gpu.ts, trace.gpu.end)


# Runtime calls that make a stream or the host wait (device-side waits show up as cuda_sync).
_SYNC_CALL_RE = re.compile(r"Synchronize|StreamWaitEvent")
_COPY_CALL_RE = re.compile(r"^(cuda|hip)Memcpy")
IDLE_CAUSES = ("input", "host_launch", "blocked_collective", "blocked_copy", "blocked_sync",
               "blocked_other")


def idle_causes(trace: Trace, data: tuple[np.ndarray, np.ndarray],
                host_comm: tuple[np.ndarray, np.ndarray] | None = None,
                gaps: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the device waited on in each GPU-wide gap, as shares of the span.

    - input: the part of a gap during which the CPU was in a data-loading range;
    - host_launch: the rest of a gap whose next activity was launched after the gap began (the
      device waited for the host), or any gap shorter than 30 us (launch latency);
    - blocked_*: the next activity was already queued when the gap began, so something else
      held it: `sync` when a stream/event wait overlaps the gap, else `collective` when that
      activity is a communication kernel, `copy` when it is a memory copy/set, else `other`.
    A gap the host spent mostly inside a host-side collective (`host_comm`: MPI_*, gloo
    ranges) is `blocked_collective` whatever launched next: the host was held by the collective.
    Gaps whose next activity has no known launch call are `blocked_other`. `gaps`: what
    `classify_gaps` gave for the same arguments, if at hand."""
    g = gaps if gaps is not None else classify_gaps(trace, data, host_comm)
    out: dict[str, Any] = dict.fromkeys(IDLE_CAUSES, 0.0)
    if g is None:
        return out
    out["input"] = float(g["data_part"].sum())
    for cause in IDLE_CAUSES[1:]:
        out[cause] = float(g["rest"][g["cause"] == cause].sum())
    span = g["span"]
    return {k: v / span if span > 0 else 0.0 for k, v in out.items()}


def classify_gaps(trace: Trace, data: tuple[np.ndarray, np.ndarray],
                  host_comm: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> dict[str, Any] | None:
    """The GPU-wide gaps [a, b], the part of each spent in data loading (`data_part`), the
    rest and the cause of the rest (`cause`: one of IDLE_CAUSES[1:] per gap); see
    `idle_causes`."""
    g = trace.gpu
    if len(g) < 2:
        return None
    order = np.argsort(g.ts, kind="stable")
    ts, end = g.ts[order], g.end[order]
    launch, kind = trace.launch_ts[order], trace.gpu_kind[order]
    span = float(end.max() - ts.min())
    run_end = np.maximum.accumulate(end)
    gap = ts[1:] - run_end[:-1]
    sel = np.flatnonzero(gap > 0)
    a, b = run_end[:-1][sel], ts[1:][sel]
    nxt = sel + 1
    data_part = intervals.covered(intervals.merge(*data), a, b)
    rest = (b - a) - data_part
    sync_s, sync_e = _call_ranges(trace, _SYNC_CALL_RE, with_sync_events=True)
    sync_part = intervals.covered(intervals.merge(sync_s, sync_e), a, b)
    copy_part = intervals.covered(intervals.merge(*_call_ranges(trace, _COPY_CALL_RE)), a, b)
    in_comm = np.zeros(len(a), dtype=bool)
    if host_comm is not None and len(host_comm[0]):
        in_comm = intervals.covered(intervals.merge(*host_comm), a, b) >= 0.5 * (b - a)
    host = (launch[nxt] > a) & ~in_comm
    short = ((b - a) < KERNEL_WAIT_US) & ~in_comm
    queued = ~host & ~short & ~np.isnan(launch[nxt]) & ~in_comm
    host_copy = queued & (copy_part >= 0.5 * (b - a))
    is_sync = queued & ~host_copy & (sync_part >= 0.5 * (b - a))
    comm = queued & ~host_copy & ~is_sync & (kind[nxt] == COMM)
    copy = queued & ~is_sync & ~comm & (host_copy | (kind[nxt] == MEMORY))
    cause = np.full(len(a), "blocked_other", dtype=object)
    cause[copy] = "blocked_copy"
    cause[comm | in_comm] = "blocked_collective"
    cause[is_sync] = "blocked_sync"
    cause[host | short] = "host_launch"
    return {"a": a, "b": b, "data_part": data_part, "rest": rest, "cause": cause,
            "span": span}


def _call_ranges(trace: Trace, pattern: re.Pattern[str], with_sync_events: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The runtime calls whose name matches (and the cuda_sync events when asked)."""
    rt = trace.runtime
    calls = rt.matches(pattern)
    extra = trace.syncs if with_sync_events else None
    return (np.concatenate([rt.ts[calls]] + ([extra.ts] if extra is not None else [])),
            np.concatenate([rt.end[calls]] + ([extra.end] if extra is not None else [])))


def per_step(trace: Trace) -> list[dict[str, float]]:
    """The breakdown (ms) inside each analysed step's window: GPU activity clipped to the
    step's CPU range (what the per-step plot shows). Each kind's activity is merged once and
    measured in every window by prefix sums, so the cost does not grow with steps x kernels."""
    if not trace.steps:
        return []
    g, kind = trace.gpu, trace.gpu_kind
    compute = (kind != COMM) & (kind != MEMORY)
    lo = np.array([s[1] for s in trace.steps])
    hi = np.array([s[2] for s in trace.steps])

    def covered(sel: np.ndarray) -> np.ndarray:
        return intervals.covered(intervals.merge(g.ts[sel], g.end[sel]), lo, hi)

    comp = covered(compute)
    comp_comm = covered(kind != MEMORY)
    busy = covered(np.ones(len(g), dtype=bool))
    return [{"step": n, "compute": float(c) / 1e3, "communication": float(cc - c) / 1e3,
             "memory": float(max(b - cc, 0.0)) / 1e3, "idle": float(max(h - l_ - b, 0.0)) / 1e3}
            for (n, _, _), c, cc, b, l_, h in zip(trace.steps, comp, comp_comm, busy, lo, hi)]
