"""The diagnosis as terminal text, JSON and a self-contained HTML page with SVG plots."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

_CATS = ("compute", "communication", "memory", "idle")
_COLORS = {"compute": "#2e7d32", "communication": "#1565c0", "memory": "#ef6c00",
           "idle": "#9e9e9e"}


def pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f} %"


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def terminal(r: dict[str, Any]) -> str:
    """A summary readable in 40 lines."""
    lines: list[str] = []
    src = r.get("source") or f"{len(r.get('sources', []))} ranks"
    rank = f"rank {r['rank']}" if "rank" in r else "all ranks"
    if r.get("world_size"):
        rank += f" of {r['world_size']}"
    cpu = r.get("cpu") or {}
    lines.append(f"scaletrain diagnose: {src} ({rank}, {r.get('platform')}"
                 + (f", {r['device']}" if r.get("device") else "")
                 + f"), {cpu.get('steps', 0)} steps analysed")
    b = r.get("breakdown")
    if r.get("note"):
        lines.append(f"  {r['note']}")
    if b:
        what = "CPU step time" if r.get("platform") == "cpu" else "GPU time"
        span = r.get("span_us")
        lines.append(f"{what}" + (f" over {span / 1e3:.1f} ms:" if span else ":"))
        lines.append("  " + "  ".join(f"{k} {pct(b[k])}" for k in _CATS))
    ib = r.get("idle_breakdown")
    if ib:
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
        lines.append(f"CPU per step ({cpu['step_time_ms']:.1f} ms): " + (" | ".join(parts) or
                                                                        "no phase ranges"))
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
        if m.get("at_peak"):
            text += "; at the peak: " + ", ".join(
                f"{k} {size(v)}" for k, v in m["at_peak"].items())
        lines.append(text)
    ar = r.get("across_ranks")
    if ar:
        lines.append(f"Across ranks: step-time spread {_num(ar['step_time_spread_ms'])} ms, "
                     f"idle spread {pct(ar['idle_spread']).strip()}, straggler rank "
                     f"{ar['straggler_rank']}")
    lines.append(f"VERDICT: {r['verdict']}"
                 + (f" (also {', '.join(r['secondary'])})" if r.get("secondary") else ""))
    lines += [f"  - {e}" for e in r.get("evidence", [])]
    if r.get("remedies"):
        lines.append("Remedies:")
        for rem in r["remedies"]:
            head = rem.get("flag") or (f"{rem['key']}: {rem['value']}" if rem.get("key") else "")
            cur = f" (now {rem['current']})" if "current" in rem else ""
            lines.append(f"  {head}{cur}  {rem['change']}" if head else f"  {rem['change']}")
    return "\n".join(lines)


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
    """A standalone page: verdict, breakdown per rank, top kernels, memory over time."""
    parts = [f"<h1>scaletrain diagnose: {html.escape(r['verdict'])}</h1>",
             "<ul>" + "".join(f"<li>{html.escape(e)}</li>" for e in r.get("evidence", []))
             + "</ul>"]
    if r.get("remedies"):
        parts.append("<h2>Remedies</h2><ul>" + "".join(
            f"<li><code>{html.escape(x.get('flag') or x.get('key', ''))}</code> "
            f"{html.escape(x['change'])}</li>" for x in r["remedies"]) + "</ul>")
    ranks = r.get("ranks") or []
    if any(x.get("breakdown") for x in ranks):
        parts.append("<h2>Time breakdown per rank</h2>" + _stacked(ranks))
    if r.get("top_kernels"):
        parts.append("<h2>Top kernels (share of kernel time)</h2>" + _bars(r["top_kernels"]))
    m = r.get("memory")
    if m and m.get("series"):
        parts.append(f"<h2>Memory over time ({html.escape(m['source'])})</h2>"
                     + _line(m["series"]))
    parts.append("<h2>Terminal summary</h2><pre>" + html.escape(terminal(r)) + "</pre>")
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto}"
             "pre{background:#f5f5f5;padding:8px;overflow-x:auto}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>scaletrain diagnose"
            f"</title><style>{style}</style></head><body>" + "\n".join(parts) + "</body></html>")


def _stacked(ranks: list[dict[str, Any]]) -> str:
    w, row = 800, 26
    h = row * len(ranks) + 30
    out = [f"<svg width='{w + 120}' height='{h}' xmlns='http://www.w3.org/2000/svg'>"]
    for i, rk in enumerate(ranks):
        y, x = 10 + i * row, 80.0
        out.append(f"<text x='0' y='{y + 15}' font-size='12'>rank {rk['rank']}</text>")
        for cat in _CATS:
            share = (rk.get("breakdown") or {}).get(cat, 0.0)
            width = w * share
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='{row - 6}' "
                       f"fill='{_COLORS[cat]}'><title>{cat} {100 * share:.1f} %</title></rect>")
            x += width
    legend = " ".join(f"<tspan fill='{_COLORS[c]}'>&#9632; {c}</tspan>" for c in _CATS)
    out.append(f"<text x='80' y='{h - 4}' font-size='12'>{legend}</text></svg>")
    return "".join(out)


def _bars(kernels: list[dict[str, Any]]) -> str:
    w, row = 500, 20
    out = [f"<svg width='{w + 520}' height='{row * len(kernels) + 10}' "
           "xmlns='http://www.w3.org/2000/svg'>"]
    for i, k in enumerate(kernels):
        y = 5 + i * row
        color = _COLORS["communication" if k.get("kind") == "communication" else "compute"]
        out.append(f"<rect x='0' y='{y}' width='{w * k['share']:.1f}' height='{row - 4}' "
                   f"fill='{color}'/><text x='{w * k['share'] + 4:.1f}' y='{y + 13}' "
                   f"font-size='11'>{100 * k['share']:.1f} % {html.escape(short(k['name'], 80))}"
                   "</text>")
    return "".join(out) + "</svg>"


def _line(series: list[list[float]]) -> str:
    w, h = 800, 240
    t = [p[0] for p in series if p[0] >= 0] or [0.0]
    v = [p[1] for p in series if p[0] >= 0] or [0.0]
    t0, t1, top = min(t), max(t), max(v) or 1.0
    span = (t1 - t0) or 1.0
    pts = " ".join(f"{(x - t0) / span * w:.1f},{h - y / top * (h - 20):.1f}" for x, y in zip(t, v))
    return (f"<svg width='{w + 10}' height='{h + 20}' xmlns='http://www.w3.org/2000/svg'>"
            f"<polyline fill='none' stroke='#c62828' points='{pts}'/>"
            f"<text x='0' y='12' font-size='11'>peak {top / 2**30:.2f} GiB</text>"
            f"<text x='0' y='{h + 15}' font-size='11'>{span / 1e3:.1f} ms</text></svg>")
