"""The bottleneck verdict and the config changes that address it.

Every share is of the device's span (GPU time), or of the CPU step time for CPU-only runs, so
the shares of compute and of each loss add up to one and the verdict can cite them as is.
On a device the time is split into:
- compute: computation kernels running;
- communication: communication kernels not overlapped with compute (exposed), plus idle time
  whose next work was already queued behind a collective;
- memory: exposed copies/sets plus idle time queued behind a copy (or a peak near capacity);
- input: idle time while the host is in a data-loading range;
- cpu/launch: idle time waiting for the host to launch the next work;
- sync: idle time with queued work held by a stream/event synchronization;
- unattributed: idle with queued work and no visible cause (not a verdict on its own).
On a CPU-only run: compute (operators), communication, input and overhead (Python/framework
code between operators).
The verdict is the largest loss when it costs at least `LOSS_THRESHOLD`; several losses each
below it that together cost at least `MIXED_THRESHOLD` are `mixed` (each listed with its
share); otherwise the run is compute-bound. `causes` lists every loss of at least
`CAUSE_THRESHOLD`, largest first.
"""

from __future__ import annotations

from typing import Any

LOSS_THRESHOLD = 0.15
MIXED_THRESHOLD = 0.30
SECONDARY_THRESHOLD = 0.08
CAUSE_THRESHOLD = 0.05
MEMORY_CAPACITY_THRESHOLD = 0.92
VERDICTS = ("compute-bound", "memory-bound", "communication-bound", "input-bound",
            "cpu/launch-bound", "sync-bound", "overhead-bound", "mixed", "no kernel timing")
LOSS_NAMES = {
    "communication": "exposed communication", "memory": "memory copies", "input": "input",
    "cpu/launch": "host launch", "sync": "synchronization", "overhead": "Python/framework overhead",
    "unattributed": "queued work, cause not visible",
}


def scores(r: dict[str, Any]) -> dict[str, float]:
    """Share of the span per category for one rank's analysis (compute and the losses)."""
    b = r.get("breakdown") or {}
    if r.get("platform") == "cpu":
        return {"compute": b.get("compute", 0.0), "communication": b.get("communication", 0.0),
                "input": r.get("input_wait", 0.0), "overhead": r.get("overhead", 0.0)}
    ic = r.get("idle_causes") or {}
    mem = b.get("memory", 0.0) + ic.get("blocked_copy", 0.0)
    cap = (r.get("memory") or {}).get("peak_fraction_of_device") or 0.0
    if cap >= MEMORY_CAPACITY_THRESHOLD:
        mem = max(mem, cap)
    return {
        "compute": b.get("compute", 0.0),
        "communication": b.get("communication", 0.0) + ic.get("blocked_collective", 0.0),
        "memory": mem,
        "input": ic.get("input", r.get("input_wait", 0.0)),
        "cpu/launch": ic.get("host_launch", 0.0),
        "sync": ic.get("blocked_sync", 0.0),
        "unattributed": ic.get("blocked_other", 0.0),
    }


def decide(r: dict[str, Any]) -> dict[str, Any]:
    """{'verdict', 'scores', 'causes', 'evidence', 'secondary'} for one analysis."""
    if r.get("platform") != "cpu" and not r.get("breakdown"):
        return {"verdict": "no kernel timing", "scores": {}, "causes": [], "secondary": [],
                "evidence": [r.get("note") or "the trace holds no kernel timing"]}
    return _decide(r, scores(r))


def decide_work(r: dict[str, Any]) -> dict[str, Any]:
    """`decide` for a straggler's own work: its step less its collectives. The others wait
    for the straggler's work, not for its collectives (which they share), so its
    communication is left out and the other shares are taken of the rest."""
    if r.get("platform") != "cpu" and not r.get("breakdown"):
        return decide(r)
    s = scores(r)
    rest = 1.0 - s.get("communication", 0.0)
    if rest <= 0.0:
        return decide(r)
    work = {k: 0.0 if k == "communication" else v / rest for k, v in s.items()}
    return _decide(r, work, "of its own work")


def _decide(r: dict[str, Any], s: dict[str, float], where: str | None = None
            ) -> dict[str, Any]:
    losses = {k: v for k, v in s.items() if k not in ("compute", "unattributed")}
    worst = max(losses, key=losses.get)  # type: ignore[arg-type]
    causes = [{"cause": k, "share": v} for k, v in sorted(
        ((k, v) for k, v in s.items() if k != "compute"), key=lambda kv: -kv[1])
        if v >= CAUSE_THRESHOLD]
    big = [c for c in causes if c["cause"] in losses]
    if losses[worst] >= LOSS_THRESHOLD:
        verdict = f"{worst}-bound"
    elif sum(c["share"] for c in big) >= MIXED_THRESHOLD:
        verdict = "mixed"
    else:
        verdict = "compute-bound"
    main = verdict.removesuffix("-bound")
    secondary = [f"{k}-bound" for k, v in sorted(losses.items(), key=lambda kv: -kv[1])
                 if k != main and v >= SECONDARY_THRESHOLD and verdict != "mixed"]
    return {"verdict": verdict, "scores": s, "causes": causes,
            "evidence": evidence(main, r, s, causes, where), "secondary": secondary}


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f} %"  # x != x: NaN


def evidence(kind: str, r: dict[str, Any], s: dict[str, float],
             causes: list[dict[str, Any]], where: str | None = None) -> list[str]:
    """The numbers the verdict rests on, as sentences (the same numbers as `scores`, shares
    `where`: of each step / of the device's time by default)."""
    b = r.get("breakdown") or {}
    ic = r.get("idle_causes") or {}
    cpu_only = r.get("platform") == "cpu"
    where = where or ("of each step" if cpu_only else "of the device's time")
    lost = sum(c["share"] for c in causes if c["cause"] != "unattributed")
    out: list[str] = []
    if kind == "mixed":
        out.append(f"no single cause costs {_pct(LOSS_THRESHOLD)}, but together "
                   f"{_pct(lost)} {where} is lost: " + ", ".join(
                       f"{LOSS_NAMES[c['cause']]} {_pct(c['share'])}" for c in causes))
    elif kind == "input":
        data = ((r.get("cpu") or {}).get("phases") or {}).get("data")
        out.append(f"{_pct(s['input'])} {where} waits for the data loader"
                   + (f" ({data['ms_per_step']:.1f} ms per step in data loading)" if data else ""))
    elif kind == "cpu/launch":
        out.append(f"{_pct(s['cpu/launch'])} {where} is idle waiting for the host to launch the "
                   f"next work (the device is idle {_pct(b.get('idle'))} in all)")
        q = _main_queue(r)
        if q is not None:
            out.append(f"launch queue: {q['mean']:.1f} outstanding launches on average "
                       f"(max {q['max']})")
        short = (r.get("launch") or {}).get("short_kernels")
        if short:
            out.append(f"{_pct(short['share_of_kernels'])} of kernels run under "
                       f"{short['threshold_us']:.0f} us")
    elif kind == "overhead":
        out.append(f"{_pct(s['overhead'])} {where} runs outside PyTorch operators, "
                   f"collectives and data loading (Python and framework overhead); operators "
                   f"take {_pct(s['compute'])}")
    elif kind == "communication" and cpu_only:
        out.append(f"collective calls take {_pct(s['communication'])} of each step")
    elif kind == "communication":
        out.append(f"{_pct(s['communication'])} {where} is lost to communication: "
                   f"{_pct(b.get('communication'))} in communication kernels not overlapped "
                   f"with compute, {_pct(ic.get('blocked_collective'))} idle with work queued "
                   "behind a collective")
        if r.get("overlap") is not None:
            out.append(f"{_pct(r.get('overlap'))} of communication time overlaps computation")
    elif kind == "sync":
        out.append(f"{_pct(s['sync'])} {where} is idle with work queued but held by a "
                   "stream/event synchronization")
        if r.get("sync_events"):
            out.append(f"{r['sync_events']} synchronization events in the trace")
    elif kind == "memory":
        m = r.get("memory") or {}
        if (m.get("peak_fraction_of_device") or 0) >= MEMORY_CAPACITY_THRESHOLD:
            out.append(f"peak reserved memory is {_pct(m['peak_fraction_of_device'])} of the "
                       "device")
        out.append(f"{_pct(s['memory'])} {where} is lost to memory copies: "
                   f"{_pct(b.get('memory'))} in copies/sets not overlapped with compute, "
                   f"{_pct(ic.get('blocked_copy'))} idle with work queued while the host sits "
                   "in a blocking copy call (e.g. .to('cpu') into pageable memory) or a copy "
                   "waits to run")
    else:
        device = "CPU's operators" if cpu_only else "device's computation kernels"
        out.append(f"the {device} take {_pct(s['compute'])} {where}; the largest loss is "
                   + (f"{LOSS_NAMES[causes[0]['cause']]} {_pct(causes[0]['share'])}"
                      if causes else f"under {_pct(CAUSE_THRESHOLD)}"))
        q = _main_queue(r)
        if q is not None and queue_full(q):
            out.append(f"the launch queue is full ({q['mean']:.0f} outstanding on average, max "
                       f"{q['max']} of {QUEUE_DEPTH}): the CPU waits on the GPU")
        elif q is not None and q["mean"] > 100:
            out.append(f"the host runs ahead of the device: {q['mean']:.0f} launches outstanding "
                       f"on average (max {q['max']} of {QUEUE_DEPTH})")
        ks = r.get("kernels_summary") or {}
        if ks:
            out.append(f"tensor-core GEMMs take {_pct(ks.get('tensor_core_gemm_share'))} of "
                       f"kernel time (all GEMMs {_pct(ks.get('gemm_share'))})")
    if kind not in ("compute", "mixed") and len(causes) > 1:
        out.append("also lost: " + ", ".join(f"{LOSS_NAMES[c['cause']]} {_pct(c['share'])}"
                                             for c in causes if c["cause"] != kind))
    return out


QUEUE_DEPTH = 1024  # CUDA's launch queue per stream (HTA's reference for a full queue)


def queue_full(q: dict[str, Any]) -> bool:
    """The host blocks on launches: the queue reaches its depth, or stays half full."""
    return q["max"] >= 0.95 * QUEUE_DEPTH or q["mean"] >= 0.5 * QUEUE_DEPTH


def _main_queue(r: dict[str, Any]) -> dict[str, Any] | None:
    q = (r.get("launch") or {}).get("queue_length") or {}
    if not q:
        return None
    return max(q.values(), key=lambda v: v["launches"])
