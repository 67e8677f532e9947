"""One call from traces to the full diagnosis: per-rank analyses, across-rank spread, verdict."""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.profiling import (
    collectives,
    cpu,
    gpu,
    intervals,
    memory,
    remedies,
    stragglers,
    verdict,
    warnings,
)
from scaletrain.profiling.load import load_all
from scaletrain.profiling.trace import Trace

log = logging.getLogger(__name__)


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
        "job": trace.job,
        "steps_in_trace": trace.all_steps, "cpu": cpu.phase_times(trace),
    }
    if trace.has_gpu:
        b = gpu.breakdown(trace)
        r.update(b)
        r["idle_breakdown"] = gpu.idle_breakdown(trace)
        data, host_comm = cpu.ranges(trace, cpu.PHASES["data"]), cpu.ranges(trace,
                                                                           cpu.HOST_COMM_RE)
        gaps = gpu.classify_gaps(trace, data, host_comm)
        r["idle_causes"] = gpu.idle_causes(trace, data, host_comm, gaps)
        r["idle_by_phase"] = cpu.idle_by_phase(trace, gaps)
        r["optimizer_launches_per_step"] = cpu.launches_in(trace, "optimizer")
        r["collectives"] = collectives.collectives(trace)
        r["kernel_ms_per_step"], r["kernel_stats"] = stragglers.kernel_time(trace)
        r["idle_by_stream"] = gpu.idle_by_stream(trace)
        r["top_kernels"], r["kernels_summary"] = gpu.top_kernels(trace, top)
        r["launch"] = gpu.launches(trace)
        r["input_wait"] = r["idle_causes"]["input"]
        r["per_step"] = gpu.per_step(trace)
        r["sync_events"] = len(trace.syncs)
    elif trace.is_device_job:
        r.update(span_us=0.0, breakdown=None, top_kernels=[], overlap=None)
        r["note"] = (f"a {trace.platform.upper()} job whose trace holds no kernel timing ("
                     + ("kernels of zero length" if len(trace.gpu) else
                        f"{trace.untimed['gpu']} device activities without a duration"
                        if trace.untimed.get("gpu") else
                        "device events: " + ", ".join(trace.device_cats or ("none",)))
                     + "); the device time cannot be broken down: profile with "
                     "activities=[CPU, CUDA] (Kineto activity tracing, not a range profile)")
    else:
        r.update(cpu.cpu_only_breakdown(trace))
        r["optimizer_launches_per_step"] = cpu.launches_in(trace, "optimizer")
        r["top_kernels"], r["overlap"] = [], None
        r["note"] = "CPU-only trace: no device activity; the CPU step time is broken down instead"
    r["step_ms"] = _step_ms(trace, r)
    r["work_ms_per_step"], r["collective_ms_per_step"] = _work(trace, r)
    r["warnings"] = warnings.of_trace(trace, r)
    r["memory"] = memory.from_events(trace)
    v = verdict.decide(r)
    r.update(v)
    return r


def analyze(paths: list[str | Path],
            memory_timeline: str | Path | dict[int, str | Path] | None = None,
            time_unit: str = "auto", cfg: Any | None = None, top: int = 15) -> dict[str, Any]:
    """Analyse one trace per rank and combine them into one report."""
    if not paths:
        raise ValueError("no trace given")
    traces = []
    for i, p in enumerate(paths):
        log.debug("reading %s", p)
        traces.extend(load_all(p, rank=i, time_unit=time_unit))
    if len({t.rank for t in traces}) < len(traces):
        log.warning("traces share rank numbers; numbering them by their order on the command line")
        for i, t in enumerate(traces):
            t.rank = i
    ranks = [analyze_trace(t, top) for t in traces]
    timelines = memory_timeline if isinstance(memory_timeline, dict) else (
        {} if memory_timeline is None else {traces[0].rank: memory_timeline})
    for rank_no, path in timelines.items():
        i = next((i for i, t in enumerate(traces) if t.rank == rank_no), None)
        if i is None:
            log.warning("memory timeline %s: no trace of rank %s given; not used", path, rank_no)
            continue
        events = ranks[i].get("memory")
        ranks[i]["memory"] = memory.from_timeline(path, traces[i])
        if events:  # keep the device figures of the [memory] events beside the categories
            for k in ("peak_reserved_bytes", "device_memory_bytes", "peak_fraction_of_device",
                      "device"):
                if k in events:
                    ranks[i]["memory"].setdefault(k, events[k])
        ranks[i].update(verdict.decide(ranks[i]))
    report = combine(ranks, top)
    if cfg is not None and getattr(getattr(cfg, "precision", None), "dtype", None) == "auto":
        report["cpu_bf16"] = _cpu_bf16()
    report["remedies"] = remedies.remedies(report["verdict"], report, cfg)
    for r in [report, *ranks]:
        r.pop("kernel_stats", None)  # per-kernel totals of every rank: used, not reported
    return report


def _cpu_bf16() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_avx512_bf16_supported())
    except (ImportError, AttributeError):
        return False


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
        "idle_causes": _mean_dict([r.get("idle_causes") for r in ranks]),
        "overhead": _mean([r.get("overhead") for r in ranks]),
        "ranks_given": len(ranks),
        "warnings": warnings.across(ranks),
        "kernel_time_by_kind": _mean_dict([r.get("kernel_time_by_kind") for r in ranks]),
        "overlap": _mean([r.get("overlap") for r in ranks]),
        "input_wait": _mean([r.get("input_wait") for r in ranks]),
        "communication_us": _mean([r.get("communication_us") for r in ranks]),
        "top_kernels": _merge_kernels(ranks, top),
        "memory": max((r["memory"] for r in ranks if r.get("memory")),
                      key=lambda m: m["peak_allocated_bytes"], default=None),
        "cpu": first.get("cpu"), "cpu_rank": first["rank"], "launch": first.get("launch"),
        "kernels_summary": first.get("kernels_summary"),
        "ranks": [_rank_summary(r) for r in ranks],
        "across_ranks": across_ranks(ranks),
    }
    out.update(verdict.decide(out))
    for k in ("idle_by_phase", "optimizer_launches_per_step", "collectives"):
        out[k] = first.get(k)  # the first rank's (the straggler's when there is one, below)
    _straggler_headline(out, ranks)
    return out


def _straggler_headline(out: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """When the ranks wait for one of them, what bounds that rank's own work (its step less
    its collectives: `verdict.decide_work`) is the job's verdict."""
    ar = out["across_ranks"]
    s = ar.get("straggler_rank")
    if s is None:
        return
    slow = next(r for r in ranks if r["rank"] == s)
    own = verdict.decide_work(slow)
    work = ar["work_ms_per_step"]
    others = [k for k in work if k != s]
    out["job_verdict"] = out["verdict"]
    out["straggler_verdict"] = own["verdict"]
    out["evidence"] = [
        f"rank {s} is the straggler: {work[s]:.1f} ms of its own work per step (step time "
        f"less collectives) vs {float(np.median([work[k] for k in others])):.1f} ms on the "
        f"median other rank; the others wait for it in their collectives",
        f"rank {s}'s own work is {own['verdict']}: " + "; ".join(own.get("evidence") or [])]
    if own["verdict"] != slow["verdict"]:
        out["evidence"].append(f"rank {s}'s whole step, collectives included, is "
                               f"{slow['verdict']}: " + "; ".join(slow.get("evidence") or []))
    out["evidence"].append(f"over all ranks on average: {out['verdict']}")
    device = stragglers.device_cause(ranks, s)
    if device:
        out["straggler_device"] = device
        out["evidence"].append(device["evidence"])
    out["verdict"] = own["verdict"]
    out["cpu"], out["cpu_rank"] = slow.get("cpu"), s  # the phases of the rank that matters
    for k in ("idle_by_phase", "optimizer_launches_per_step", "collectives"):
        out[k] = slow.get(k)
    out["causes"] = own.get("causes", [])
    out["secondary"] = list(own.get("secondary", []))


def _rank_summary(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("rank", "source", "platform", "breakdown", "overlap",
                                  "verdict", "causes", "evidence", "step_ms",
                                  "work_ms_per_step", "collective_ms_per_step",
                                  "kernel_ms_per_step", "per_step", "warnings")} | {
        "step_time_ms": (r.get("cpu") or {}).get("step_time_ms"),
    }


def _step_ms(trace: Trace, r: dict[str, Any]) -> float | None:
    """Time per step: the CPU step ranges, else the device span over the steps."""
    step = (r.get("cpu") or {}).get("step_time_ms")
    if step:
        return float(step)
    span = r.get("span_us") or 0.0
    return span / max(len(trace.steps), 1) / 1e3 if span else None


def _work(trace: Trace, r: dict[str, Any]) -> tuple[float | None, float | None]:
    """HTA's straggler measure: per step, the time a rank spends on its own work, i.e. its
    step time less the time inside collectives (which includes waiting for the other ranks).
    On a device: communication kernel time; on a CPU: collective calls."""
    step, n = r.get("step_ms"), max(len(trace.steps), 1)
    if step is None:
        return None, None
    if trace.has_gpu:
        comm = trace.gpu_kind == gpu.COMM
        coll = intervals.total(trace.gpu.ts[comm], trace.gpu.end[comm]) / n / 1e3
    else:
        coll = intervals.total(*cpu.ranges(trace, cpu.COMM_RE)) / n / 1e3
    return max(step - coll, 0.0), coll


def across_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Spread of step time, idle share and work; the straggler is the rank with the most work
    per step (the rank the others wait for in their collectives), named only when its work
    exceeds the median rank's by at least STRAGGLER_GAP of a step."""
    step = {r["rank"]: r.get("step_ms") for r in ranks if r.get("step_ms") is not None}
    idle = {r["rank"]: (r.get("breakdown") or {}).get("idle") for r in ranks
            if (r.get("breakdown") or {}).get("idle") is not None}
    work = {r["rank"]: r["work_ms_per_step"] for r in ranks
            if r.get("work_ms_per_step") is not None}
    straggler, excess = None, None
    if len(work) >= 2:
        top = max(work, key=work.get)  # type: ignore[arg-type]
        others = float(np.median([v for k, v in work.items() if k != top]))
        excess = work[top] - others
        if step.get(top) and excess >= STRAGGLER_GAP * step[top]:
            straggler = top
    return {
        "step_time_ms": step,
        "step_time_spread_ms": (max(step.values()) - min(step.values())) if step else None,
        "idle": idle,
        "idle_spread": (max(idle.values()) - min(idle.values())) if idle else None,
        "work_ms_per_step": work,
        "straggler_rank": straggler,
        "straggler_excess_ms": excess if straggler is not None else None,
    }


STRAGGLER_GAP = 0.05


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
