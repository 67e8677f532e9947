"""One call from traces to the full diagnosis: per-rank analyses, across-rank spread, verdict."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.profiling import cpu, gpu, memory, verdict
from scaletrain.profiling.trace import Trace, load

log = logging.getLogger("scaletrain.profiling")


def latest_traces(folder: str | Path) -> list[Path]:
    """The newest trace of each rank under `folder/traces` (what StepProfiler writes)."""
    newest: dict[str, tuple[int, Path]] = {}
    for p in (Path(folder) / "traces").glob("rank*.step*.pt.trace.json.gz"):
        rank, step = p.name.split(".")[:2]
        if not step.removeprefix("step").isdigit():
            continue
        n = int(step.removeprefix("step"))
        if rank not in newest or n > newest[rank][0]:
            newest[rank] = (n, p)
    return [p for _, p in sorted(newest.values(), key=lambda t: t[1].name)]


def analyze_trace(trace: Trace, top: int = 15) -> dict[str, Any]:
    """Every figure for one rank (keys documented in docs/profile.md)."""
    r: dict[str, Any] = {
        "source": trace.source, "rank": trace.rank, "world_size": trace.world_size,
        "platform": trace.platform, "device": trace.device_name, "time_unit": trace.time_unit,
        "steps_in_trace": trace.all_steps, "cpu": cpu.phase_times(trace),
    }
    if trace.has_gpu:
        b = gpu.breakdown(trace)
        r.update(b)
        r["idle_breakdown"] = gpu.idle_breakdown(trace)
        r["idle_by_stream"] = gpu.idle_by_stream(trace)
        r["top_kernels"], r["kernels_summary"] = gpu.top_kernels(trace, top)
        r["launch"] = gpu.launches(trace)
        r["input_wait"] = cpu.input_wait_on_gpu(trace, gpu.idle_intervals(trace), b["span_us"])
    else:
        r.update(cpu.cpu_only_breakdown(trace))
        r["top_kernels"], r["overlap"] = [], None
        r["note"] = "CPU-only trace: no GPU activity; the CPU step time is broken down instead"
    r["memory"] = memory.from_events(trace)
    v = verdict.decide(r)
    r.update(v)
    return r


def analyze(paths: list[str | Path], memory_timeline: str | Path | None = None,
            time_unit: str = "auto", cfg: Any | None = None, top: int = 15) -> dict[str, Any]:
    """Analyse one trace per rank and combine them into one report."""
    if not paths:
        raise ValueError("no trace given")
    traces = []
    for i, p in enumerate(paths):
        log.debug("reading %s", p)
        traces.append(load(p, rank=i, time_unit=time_unit))
    if len({t.rank for t in traces}) < len(traces):
        log.warning("traces share rank numbers; numbering them by their order on the command line")
        for i, t in enumerate(traces):
            t.rank = i
    ranks = [analyze_trace(t, top) for t in traces]
    if memory_timeline is not None:
        ranks[0]["memory"] = memory.from_timeline(memory_timeline, traces[0])
        ranks[0].update(verdict.decide(ranks[0]))
    report = combine(ranks, top)
    report["remedies"] = verdict.remedies(report["verdict"], report, cfg)
    return report


def combine(ranks: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """Top-level figures: a single rank's own, or the mean over ranks (kernels summed)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    if len(ranks) == 1:
        out = dict(ranks[0])
        out["ranks"] = [_rank_summary(ranks[0])]
        return out
    first = ranks[0]
    out: dict[str, Any] = {
        "sources": [r["source"] for r in ranks], "platform": first["platform"],
        "device": first["device"], "world_size": first["world_size"],
        "span_us": _mean([r.get("span_us") for r in ranks]),
        "breakdown": _mean_dict([r.get("breakdown") for r in ranks]),
        "idle_breakdown": _mean_dict([r.get("idle_breakdown") for r in ranks]),
        "kernel_time_by_kind": _mean_dict([r.get("kernel_time_by_kind") for r in ranks]),
        "overlap": _mean([r.get("overlap") for r in ranks]),
        "input_wait": _mean([r.get("input_wait") for r in ranks]),
        "communication_us": _mean([r.get("communication_us") for r in ranks]),
        "top_kernels": _merge_kernels(ranks, top),
        "memory": max((r["memory"] for r in ranks if r.get("memory")),
                      key=lambda m: m["peak_allocated_bytes"], default=None),
        "cpu": first.get("cpu"), "launch": first.get("launch"),
        "kernels_summary": first.get("kernels_summary"),
        "ranks": [_rank_summary(r) for r in ranks],
        "across_ranks": across_ranks(ranks),
    }
    out.update(verdict.decide(out))
    return out


def _rank_summary(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("rank", "source", "breakdown", "overlap", "verdict")} | {
        "step_time_ms": (r.get("cpu") or {}).get("step_time_ms"),
        "busy_us_per_step": _busy_per_step(r),
    }


def _busy_per_step(r: dict[str, Any]) -> float | None:
    b, steps = r.get("breakdown"), (r.get("cpu") or {}).get("steps")
    if not b or not steps:
        return None
    return r["span_us"] * (1 - b["idle"]) / steps


def across_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Spread of step time and idle share; the straggler is the rank with the most busy time
    per step (the others wait for it in each collective)."""
    step = {r["rank"]: (r.get("cpu") or {}).get("step_time_ms") for r in ranks}
    idle = {r["rank"]: (r.get("breakdown") or {}).get("idle") for r in ranks}
    busy = {r["rank"]: _busy_per_step(r) for r in ranks}
    known_step = {k: v for k, v in step.items() if v is not None}
    known_idle = {k: v for k, v in idle.items() if v is not None}
    known_busy = {k: v for k, v in busy.items() if v is not None}
    straggler = max(known_busy, key=known_busy.get) if known_busy else None  # type: ignore
    return {
        "step_time_ms": known_step,
        "step_time_spread_ms": (max(known_step.values()) - min(known_step.values()))
        if known_step else None,
        "idle": known_idle,
        "idle_spread": (max(known_idle.values()) - min(known_idle.values()))
        if known_idle else None,
        "straggler_rank": straggler,
    }


def _mean(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.mean(v)) if v else None


def _mean_dict(ds: list[dict[str, float] | None]) -> dict[str, float] | None:
    ds = [d for d in ds if d]
    if not ds:
        return None
    keys = dict.fromkeys(k for d in ds for k in d)
    return {k: float(np.mean([d.get(k, 0.0) for d in ds])) for k in keys}


def _merge_kernels(ranks: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    total: dict[str, dict[str, Any]] = defaultdict(lambda: {"total_us": 0.0, "count": 0})
    kernel_time = sum((r.get("kernels_summary") or {}).get("kernel_time_us", 0) for r in ranks)
    for r in ranks:
        for k in r.get("top_kernels") or []:
            t = total[k["name"]]
            t["total_us"] += k["total_us"]
            t["count"] += k["count"]
            t.update(kind=k["kind"], tensor_core_gemm=k["tensor_core_gemm"])
    rows = sorted(({"name": n, **v} for n, v in total.items()), key=lambda x: -x["total_us"])
    for row in rows:
        row["mean_us"] = row["total_us"] / max(row["count"], 1)
        row["share"] = row["total_us"] / kernel_time if kernel_time else 0.0
    return rows[:top]
