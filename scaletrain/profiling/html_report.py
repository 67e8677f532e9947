"""The HTML report: verdict, remedies and plots made with plotly (the `plots` extra).

Plots: the per-step breakdown of device time (stacked bars, one per step and rank), the time
breakdown and own work per rank, the top kernels, and the memory over time with its axes and,
for an export_memory_timeline file, one stacked area per category. The page embeds plotly.js,
so it opens offline. Without plotly the page keeps the text and says how to get the plots.
"""

from __future__ import annotations

import html
from typing import Any

CATS = ("compute", "communication", "memory", "idle")
COLORS = {"compute": "#2e7d32", "communication": "#1565c0", "memory": "#ef6c00",
          "idle": "#9e9e9e"}
MEM_COLORS = ("#6a1b9a", "#00838f", "#f9a825", "#8d6e63", "#c62828", "#1565c0", "#9e9e9e",
              "#424242")


def page(r: dict[str, Any], summary: str) -> str:
    parts = [f"<h1>scaletrain diagnose: {html.escape(r['verdict'])}</h1>"]
    parts += [f"<p class='warn'>&#9888; {html.escape(w)}</p>" for w in r.get("warnings") or []]
    parts.append("<ul>" + "".join(f"<li>{html.escape(e)}</li>" for e in r.get("evidence", []))
                 + "</ul>")
    if r.get("remedies"):
        parts.append("<h2>Remedies</h2><ul>" + "".join(
            f"<li><code>{html.escape(x.get('flag') or x.get('key', ''))}</code> "
            f"{html.escape(x['change'])}</li>" for x in r["remedies"]) + "</ul>")
    try:
        figures = _figures(r)
    except ImportError:
        figures = []
        parts.append("<p>Plots need plotly: <code>pip install 'scaletrain[plots]'</code></p>")
    first = True
    for title, fig in figures:
        parts.append(f"<h2>{html.escape(title)}</h2>" + fig.to_html(
            full_html=False, include_plotlyjs="inline" if first else False,
            config={"displaylogo": False}))
        first = False
    parts.append("<h2>Terminal summary</h2><pre>" + html.escape(summary) + "</pre>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}"
             "pre{background:#f5f5f5;padding:8px;overflow-x:auto}.warn{color:#b71c1c}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>scaletrain diagnose"
            f"</title><style>{style}</style></head><body>" + "\n".join(parts) + "</body></html>")


def _figures(r: dict[str, Any]) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    out: list[tuple[str, Any]] = []
    ranks = r.get("ranks") or []
    steps = [(rk["rank"], s) for rk in ranks for s in rk.get("per_step") or []]
    if steps:
        fig = go.Figure()
        x = [f"step {s['step']}" + (f" r{k}" if len(ranks) > 1 else "") for k, s in steps]
        for cat in CATS:
            fig.add_bar(x=x, y=[s[cat] for _, s in steps], name=cat, marker_color=COLORS[cat])
        fig.update_layout(barmode="stack", height=360, yaxis_title="ms in the step",
                          xaxis_title="step", legend_title="device time")
        out.append(("Per-step breakdown of device time", fig))
    if any(rk.get("breakdown") for rk in ranks):
        fig = go.Figure()
        y = [f"rank {rk['rank']}" for rk in ranks]
        for cat in CATS:
            fig.add_bar(y=y, x=[100 * (rk.get("breakdown") or {}).get(cat, 0.0) for rk in ranks],
                        name=cat, orientation="h", marker_color=COLORS[cat])
        fig.update_layout(barmode="stack", height=_rows(len(ranks)),
                          xaxis_title="% of the rank's time", legend=_LEGEND)
        out.append(("Time breakdown per rank", fig))
    if len(ranks) > 1 and any(rk.get("work_ms_per_step") is not None for rk in ranks):
        s = (r.get("across_ranks") or {}).get("straggler_rank")
        fig = go.Figure()
        y = [f"rank {rk['rank']}" + (" (straggler)" if rk["rank"] == s else "") for rk in ranks]
        fig.add_bar(y=y, x=[rk.get("work_ms_per_step") or 0 for rk in ranks], orientation="h",
                    name="own work", marker_color=COLORS["compute"])
        fig.add_bar(y=y, x=[rk.get("collective_ms_per_step") or 0 for rk in ranks],
                    orientation="h", name="in collectives (incl. waiting)",
                    marker_color=COLORS["communication"])
        fig.update_layout(barmode="stack", height=_rows(len(ranks)),
                          xaxis_title="ms per step", legend=_LEGEND)
        out.append(("Own work and collectives per rank (the straggler has the most work)", fig))
    tops = r.get("top_kernels") or []
    if tops:
        fig = go.Figure(go.Bar(
            y=[f"{i + 1}. {_short(k['name'])}" for i, k in enumerate(tops)][::-1],
            x=[100 * k["share"] for k in tops][::-1],
            orientation="h", marker_color=[COLORS[_kind(k)] for k in tops][::-1]))
        fig.update_layout(height=120 + 24 * len(tops), xaxis_title="% of kernel time",
                          margin={"l": 420})
        out.append(("Top kernels", fig))
    m = r.get("memory") or {}
    if m.get("series"):
        out.append((f"Memory over time ({m['source']})", _memory(m, go)))
    return out


def _memory(m: dict[str, Any], go: Any) -> Any:
    fig = go.Figure()
    gib = 2.0 ** 30
    by_cat = m.get("series_by_category")
    if by_cat:
        t0 = by_cat["t_us"][0] if by_cat["t_us"] else 0.0
        x = [(t - t0) / 1e3 for t in by_cat["t_us"]]
        for i, (cat, ys) in enumerate(by_cat["bytes"].items()):
            fig.add_scatter(x=x, y=[v / gib for v in ys], name=cat, stackgroup="mem",
                            mode="lines", line={"width": 0.5, "color": MEM_COLORS[i % 8]})
    else:
        pts = [p for p in m["series"] if p[0] >= 0]
        t0 = pts[0][0] if pts else 0.0
        fig.add_scatter(x=[(p[0] - t0) / 1e3 for p in pts], y=[p[1] / gib for p in pts],
                        name="allocated", mode="lines", line={"color": "#c62828"})
    fig.update_layout(height=380, xaxis_title="time (ms from the first sample)",
                      yaxis_title="GiB", legend_title="category")
    return fig


_LEGEND = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0}


def _kind(kernel: dict[str, Any]) -> str:
    return "communication" if kernel.get("kind") == "communication" else "compute"


def _rows(n: int) -> int:
    return 170 + 45 * n


def _short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."
