"""What `tune` shows and writes besides `tune.json`: the terminal table, the HTML page (an
inline SVG of predicted vs measured step time), and the winner as a config file plus its
command."""

from __future__ import annotations

import html
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.tune.results import STATUS_COLORS, correlation

if TYPE_CHECKING:
    from scaletrain.tune.halving import Tuner
    from scaletrain.tune.results import Trial

GIB = 2**30


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def table(trials: list[Trial]) -> str:
    head = (f"{'#':>2} {'trial':<10} {'layout':<20} {'variant':<50} {'pred s':>7} {'meas s':>7} "
            f"{'tok/s/dev':>9} {'MFU':>6} {'GiB meas/plan':>13}  {'status':<8} verdict; first "
            "remedy")
    lines = [head]
    for i, t in enumerate(trials, 1):
        s, r = t.spec, t.result
        mem = f"{_f(r.peak_mem_bytes, '.2f', 1 / GIB)}/{_f(s.planned_peak_bytes, '.2f', 1 / GIB)}"
        note = r.verdict or ""
        if r.remedy:
            note += f"; {r.remedy}"
        if r.status != "ok":
            note = r.message or s.skip_reason or ""
        if t.reused:
            note = "(earlier run) " + note
        lines.append(f"{i:>2} {s.id:<10} {s.layout[:20]:<20} {s.variant[:50]:<50} "
                     f"{_f(s.predicted_step_s, '.3f'):>7} {_f(r.step_time_s, '.3f'):>7} "
                     f"{_f(r.tokens_per_s_per_device, '.0f'):>9} {_f(r.mfu, '.1%'):>6} "
                     f"{mem:>13}  {r.status:<8} {note}")
    return "\n".join(lines)


def summary(tuner: Tuner, winner_files: tuple[Path, str] | None) -> str:
    trials = tuner.trials
    out = [table(trials), ""]
    c = correlation(trials)
    names = {t.spec.id: t for t in trials}
    if c["pairs"]:
        out.append("search order:   " + " < ".join(c["search_order"]))
        out.append("measured order: " + " < ".join(c["measured_order"]))
        rho = "n/a (fewer than 3 measured trials)" if c["spearman"] is None \
            else f"{c['spearman']:+.2f}"
        out.append(f"rank correlation (Spearman) of the search's order and the measured step "
                   f"times over {c['pairs']} trials (stopped ones at their warm steps): {rho}")
        if c["spearman_predicted_time"] is not None:
            out.append(f"  (of the predicted and measured step times, equal predictions "
                       f"sharing a rank: {c['spearman_predicted_time']:+.2f})")
    bad = [t for t in trials if t.result.status in ("oom", "failed", "skipped")]
    for t in bad:
        out.append(f"{t.result.status}: {t.spec.id} ({t.spec.layout}, {t.spec.variant}): "
                   f"{t.result.message or t.spec.skip_reason}")
    if tuner.not_run:
        out.append("not measured (budget spent): " + "; ".join(tuner.not_run))
    win = tuner.winner()
    if win is None:
        out.append("no trial ran to the end: no winner")
    else:
        out.append(f"winner: {win.spec.id} ({win.spec.layout}, {win.spec.variant}) "
                   f"{win.result.step_time_s:.3f} s/step")
        if winner_files:
            out.append(f"config: {winner_files[0]}\ncommand: {winner_files[1]}")
    out.append(f"tuned in {tuner.elapsed():.0f} s of a {tuner.setup.budget_s:.0f} s budget; "
               f"{len(names)} trials")
    return "\n".join(out)


def winner_command(config: Path, nproc: int) -> str:
    if nproc == 1:
        return f"scaletrain train --config {shlex.quote(str(config))}"
    return (f"torchrun --standalone --nproc_per_node {nproc} -m scaletrain train "
            f"--config {shlex.quote(str(config))}")


def write_winner(tuner: Tuner) -> tuple[Path, str] | None:
    """winner.toml (the user's settings with the winner's layout, as `train --config` reads
    it) and winner.sh (the command)."""
    from scaletrain.config import load_config, to_toml
    from scaletrain.profiling.report import write_atomic
    from scaletrain.tune.flags import merge

    win = tuner.winner()
    if win is None:
        return None
    cfg = load_config(merge(tuner.setup.user_argv, win.spec.flags))
    folder = tuner.setup.folder
    path = write_atomic(folder / "winner.toml",
                        f"# scaletrain tune: trial {win.spec.id}, {win.spec.layout}, "
                        f"{win.spec.variant}; {win.result.step_time_s:.3f} s/step measured\n"
                        + to_toml(cfg))
    cmd = winner_command(path, tuner.setup.nproc)
    write_atomic(folder / "winner.sh", f"#!/bin/sh\n{cmd}\n")
    return path, cmd


# --- HTML --------------------------------------------------------------------------------------
def page(tuner: Tuner, text: str) -> str:
    """A standalone page: the chart of predicted vs measured step time and the summary."""
    svg = chart(tuner.trials)
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}"
             "pre{background:#f5f5f5;padding:8px;overflow-x:auto}")
    header = tuner.setup.header
    title = f"scaletrain tune: {header.get('model', '')} on {header.get('world_size', '')} x " \
            f"{header.get('hardware', {}).get('name', '')}"
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>scaletrain tune</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            "<h2>Predicted vs measured step time</h2>" + svg +
            "<p>Each point is a trial (green: ran to the end, orange: stopped early, at the "
            "fastest of its warm steps). On the diagonal the cost model is exact; above it "
            "the run is slower than predicted.</p><h2>Summary</h2><pre>" + html.escape(text) +
            "</pre></body></html>")


def chart(trials: list[Trial], w: int = 640, h: int = 440, pad: int = 60) -> str:
    pts = [(t.spec.predicted_step_s, t.result.step_time_s, t) for t in trials
           if t.spec.predicted_step_s and t.result.step_time_s
           and t.result.status in STATUS_COLORS]
    if not pts:
        return "<p>No trial has both a prediction and a measurement.</p>"
    hi = max(max(p, m) for p, m, _ in pts) * 1.1
    lo = 0.0

    def x(v: float) -> float:
        return pad + (v - lo) / (hi - lo) * (w - 2 * pad)

    def y(v: float) -> float:
        return h - pad - (v - lo) / (hi - lo) * (h - 2 * pad)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
             "font-family='sans-serif' font-size='11'>",
             f"<line x1='{x(lo)}' y1='{y(lo)}' x2='{x(hi)}' y2='{y(hi)}' stroke='#9e9e9e' "
             "stroke-dasharray='4 4'/>",
             f"<line x1='{pad}' y1='{h - pad}' x2='{w - pad}' y2='{h - pad}' stroke='#000'/>",
             f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{h - pad}' stroke='#000'/>",
             f"<text x='{w / 2}' y='{h - 15}' text-anchor='middle'>predicted step time (s)"
             "</text>",
             f"<text x='15' y='{h / 2}' text-anchor='middle' transform='rotate(-90 15 "
             f"{h / 2})'>measured step time (s)</text>"]
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        parts.append(f"<text x='{x(v)}' y='{h - pad + 16}' text-anchor='middle'>{v:.2f}</text>")
        parts.append(f"<text x='{pad - 6}' y='{y(v) + 4}' text-anchor='end'>{v:.2f}</text>")
    for p, m, t in pts:
        tip = html.escape(f"{t.spec.id}: {t.spec.layout}, {t.spec.variant}: predicted "
                          f"{p:.3f} s, measured {m:.3f} s ({t.result.status})")
        parts.append(f"<circle cx='{x(p):.1f}' cy='{y(m):.1f}' r='5' "
                     f"fill='{STATUS_COLORS[t.result.status]}'><title>{tip}</title></circle>")
        parts.append(f"<text x='{x(p) + 7:.1f}' y='{y(m) - 6:.1f}'>{html.escape(t.spec.id[:4])}"
                     "</text>")
    parts.append("</svg>")
    return "".join(parts)
