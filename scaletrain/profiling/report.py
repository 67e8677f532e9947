"""The diagnosis as terminal text, JSON and a self-contained HTML page with SVG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_CATS = ("compute", "communication", "memory", "idle")
_COLORS = {"compute": "#2e7d32", "communication": "#1565c0", "memory": "#ef6c00",
           "idle": "#9e9e9e"}


def pct(x: float | None) -> str:
    return "  n/a" if x is None or x != x else f"{100 * x:5.1f} %"  # x != x: NaN


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def terminal(r: dict[str, Any]) -> str:
    """A summary readable in 40 lines."""
    lines: list[str] = []
    n = len(r.get("sources", []))
    src = r.get("source") or f"{n} traces"
    rank = f"rank {r['rank']}" if "rank" in r else f"{n} ranks"
    if r.get("world_size"):
        rank = (f"rank {r['rank']} of {r['world_size']}" if "rank" in r
                else f"{n} of {r['world_size']} ranks")
    cpu = r.get("cpu") or {}
    lines.append(f"scaletrain diagnose: {src} ({rank}, {r.get('platform')}"
                 + (f", {r['device']}" if r.get("device") else "")
                 + f"), {cpu.get('steps', 0)} steps analysed")
    b = r.get("breakdown")
    if r.get("note"):
        lines.append(f"  {r['note']}")
    lines += [f"WARNING: {w}" for w in r.get("warnings") or []]
    if b:
        what = "CPU step time" if r.get("platform") == "cpu" else "GPU time"
        span = r.get("span_us")
        lines.append(f"{what}" + (f" over {span / 1e3:.1f} ms:" if span else ":"))
        if r.get("platform") == "cpu" and r.get("overhead") is not None:
            lines.append(f"  operators {pct(b['compute'])}  communication "
                         f"{pct(b['communication'])}  input {pct(r.get('input_wait'))}  "
                         f"Python/framework overhead {pct(r['overhead'])}")
        else:
            lines.append("  " + "  ".join(f"{k} {pct(b[k])}" for k in _CATS))
    ic = r.get("idle_causes")
    if ic and b:
        lines.append("  device idle by cause (share of GPU time): " + "  ".join(
            f"{k.replace('_', ' ')} {pct(v).strip()}" for k, v in ic.items() if v >= 0.0005))
    ib = r.get("idle_breakdown")
    if ib and r.get("platform") != "cpu":
        lines.append("  idle: " + "  ".join(f"{k.replace('_', ' ')} {pct(v)}"
                                            for k, v in ib.items()))
    if r.get("overlap") is not None:
        lines.append(f"  communication overlapped by compute: {pct(r['overlap'])}")
    kt = r.get("kernel_time_by_kind")
    if kt:
        lines.append("  busy time by kind: " + ", ".join(f"{k} {pct(v)}" for k, v in kt.items()))
    tops = r.get("top_kernels") or []
    if tops:
        lines.append("Top kernels (share of kernel time):")
        for k in tops[:8]:
            lines.append(f"  {pct(k['share'])}  {short(k['name'])}  ({k['count']} x "
                         f"{k['mean_us']:.1f} us)")
        ks = r.get("kernels_summary") or {}
        if ks:
            lines.append(f"  tensor-core GEMMs {pct(ks['tensor_core_gemm_share'])} of kernel time"
                         f"; all GEMMs {pct(ks['gemm_share'])}; memory copies/sets "
                         f"{pct(ks['memory_ops_share_of_gpu_time'])} of GPU time")
    phases = cpu.get("phases") or {}
    if cpu.get("step_time_ms"):
        parts = [f"{k} {v['ms_per_step']:.1f} ms" for k, v in phases.items()]
        who = f", rank {r['cpu_rank']}" if r.get("cpu_rank") is not None else ""
        lines.append(f"CPU per step{who} ({cpu['step_time_ms']:.1f} ms): "
                     + (" | ".join(parts) or "no phase ranges"))
    outside = cpu.get("outside_phases") or []
    if outside and phases:
        lines.append("  outside those phases: " + ", ".join(
            f"{o['name']} {o['ms_per_step']:.2f} ms" for o in outside[:4]))
    launch = r.get("launch") or {}
    if launch:
        d = launch.get("launch_delay_us") or {}
        q = max((launch.get("queue_length") or {}).items(), key=lambda kv: kv[1]["launches"],
                default=None)
        s = launch["short_kernels"]
        lines.append(f"Launches: delay p50 {d.get('p50', 0):.0f} us; {pct(s['share_of_kernels'])}"
                     f" of kernels < {s['threshold_us']:.0f} us"
                     + (f"; queue length on stream {q[0]}: mean {q[1]['mean']:.1f}, "
                        f"max {q[1]['max']}" if q else ""))
    lines += _collectives(r.get("collectives"))
    m = r.get("memory")
    if m:
        text = f"Memory: peak {size(m['peak_allocated_bytes'])} allocated"
        if m.get("device"):
            text += f" on the {m['device'].upper()}"
        if m.get("peak_reserved_bytes"):
            text += f" ({size(m['peak_reserved_bytes'])} reserved"
            if m.get("peak_fraction_of_device"):
                text += f", {pct(m['peak_fraction_of_device']).strip()} of the device"
            text += ")"
        if m.get("peak_phase"):
            text += f", during {m['peak_phase']}"
        if m.get("at_peak"):  # the categories of export_memory_timeline
            text += "; at the peak: " + ", ".join(
                f"{k} {size(v)}" for k, v in m["at_peak"].items())
        lines.append(text)
    ar = r.get("across_ranks")
    if ar:
        lines.append(f"Across ranks: step-time spread {_num(ar['step_time_spread_ms'])} ms, "
                     f"idle spread {pct(ar['idle_spread']).strip()}, straggler: "
                     + (f"rank {ar['straggler_rank']} (+{ar['straggler_excess_ms']:.1f} ms of "
                        "work per step)" if ar.get("straggler_rank") is not None else "none"))
        for rk in r.get("ranks") or []:
            kernels = (f", kernels {_num(rk['kernel_ms_per_step'])} ms"
                       if rk.get("kernel_ms_per_step") is not None else "")
            lines.append(f"  rank {rk['rank']:>3}: step {_num(rk.get('step_ms'))} ms, own work "
                         f"{_num(rk.get('work_ms_per_step'))} ms{kernels}, collectives "
                         f"{_num(rk.get('collective_ms_per_step'))} ms; {rk.get('verdict')}"
                         + _causes(rk.get("causes"), 2))
    head = r["verdict"]
    if r.get("straggler_verdict") and ar:
        head += (f" (straggler rank {ar['straggler_rank']}; the other ranks wait for it; "
                 f"over all ranks: {r['job_verdict']})")
    elif r.get("secondary"):
        head += f" (also {', '.join(r['secondary'])})"
    lines.append(f"VERDICT: {head}" + ("" if r.get("straggler_verdict") else
                                       _causes(r.get("causes"), 4)))
    lines += [f"  - {e}" for e in r.get("evidence", [])]
    if r.get("remedies"):
        lines.append("Remedies:")
        for rem in r["remedies"]:
            head = rem.get("flag") or (f"{rem['key']}: {rem['value']}" if rem.get("key") else "")
            cur = f" (now {rem['current']})" if "current" in rem else ""
            tag = f"[{rem['cause']}] " if rem.get("cause") else ""
            lines.append(f"  {tag}{head}{cur}  {rem['change']}" if head
                         else f"  {tag}{rem['change']}")
    return "\n".join(lines)


def _collectives(c: dict[str, Any] | None) -> list[str]:
    """The busiest collective and its bus bandwidth; transfer or waiting on a peer."""
    if not c or not c.get("groups"):
        return []
    g = c["groups"][0]
    of = f" of {size(g['bytes'])}" if g.get("bytes") else ""
    text = (f"Collectives: {g['collective']}{of} x {g['calls']}, quickest "
            f"{g['quickest_us']:.0f} us, median {g['median_us']:.0f} us")
    if g.get("busbw_best_gbps"):
        text += (f"; bus bandwidth {g['busbw_best_gbps']:.1f} GB/s at the quickest, "
                 f"{g['busbw_median_gbps']:.1f} GB/s at the median")
    text += (f"; {pct(c['waiting_share']).strip()} of collective time beyond each size's "
             f"quickest call: {c['reading']}")
    return [text]


def _causes(causes: list[dict[str, Any]] | None, n: int) -> str:
    if not causes:
        return ""
    return " — lost: " + ", ".join(f"{c['cause']} {pct(c['share']).strip()}"
                                   for c in causes[:n])


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def to_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2, default=float)


def write_atomic(path: str | Path, text: str) -> Path:
    """Write to a temporary name next to `path`, then rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(p)
    return p


# --- HTML --------------------------------------------------------------------------------------
def to_html(r: dict[str, Any]) -> str:
    """A standalone page with plots (plotly when installed, else plain SVG)."""
    from scaletrain.profiling import html_report

    return html_report.page(r, terminal(r))
