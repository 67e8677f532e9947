"""The run summary for people: a terminal table and a small self-contained HTML page."""

from __future__ import annotations

import html
from typing import Any


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if seconds > 0 else "-"


def _tasks(summary: dict[str, Any]) -> str:
    """'3 tasks', or per stage: '7 tasks: stage 1 3, stage 2 4'."""
    stages = summary.get("stages") or []
    total = summary["tasks"]
    if len(stages) <= 1:
        return f"{total} task{'s' if total != 1 else ''}"
    return f"{total} tasks: " + ", ".join(f"stage {st['stage']} {st['tasks']}" for st in stages)


def _samples_html(samples: dict[str, Any]) -> str:
    e = html.escape

    def items(docs: list[dict[str, str]]) -> str:
        return "".join(f"<li><b>{e(d['id'])}</b>: <small>{e(d['text'])}</small></li>"
                       for d in docs)

    out = []
    if samples.get("kept"):
        out.append(f"<h2>Kept documents (samples)</h2><ul>{items(samples['kept'])}</ul>")
    dropped = samples.get("dropped") or {}
    if dropped:
        out.append("<h2>Dropped documents (samples per reason)</h2>")
        out += [f"<h3>{e(k)}</h3><ul>{items(v)}</ul>" for k, v in dropped.items()]
    return "".join(out)


def terminal_table(summary: dict[str, Any]) -> str:
    """What each step removed and why, with throughput, as fixed-width text."""
    rows = [("step", "seen", "kept", "dropped", "docs/s", "MB/s", "why dropped / counters")]
    for s in summary["steps"]:
        dropped = sum(s["dropped"].values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items(), key=lambda x: -x[1]))
        extra = ", ".join(f"{k} {v}" for k, v in s["counters"].items())
        mbs = f"{s['bytes_in'] / 1e6 / s['seconds']:.1f}" if s["seconds"] > 0 else "-"
        rows.append(
            (
                s["name"],
                f"{s['seen']:,}",
                f"{s['kept']:,}",
                f"{dropped:,}",
                _rate(s["seen"], s["seconds"]),
                mbs,
                "; ".join(x for x in (why, extra) if x),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, 6)]
        lines.append("  ".join(cells) + "  " + r[6])
        if k == 0:
            lines.append("-" * (sum(widths) + 12 + len(r[6])))
    head = (
        f"{summary['docs_in']:,} documents in, {summary['docs_out']:,} out, "
        f"{summary['seconds']:.1f} s on {summary['executor']} ({_tasks(summary)})"
    )
    head += "\n" + accounting(summary)
    if summary.get("malformed_records"):
        head += "".join(f"\n  malformed: {e}" for e in summary["malformed_examples"][:5])
    for what, n in (summary.get("notes") or {}).items():
        head += f"\n  note: {n:,} {what}"
    head += "".join(f"\n  {line}" for line in by_kind_lines(summary))
    head += "".join(f"\n  hint: {h}" for h in summary.get("hints") or [])
    return head + "\n" + "\n".join(lines)


def by_kind_lines(summary: dict[str, Any]) -> list[str]:
    """'prose: 5,000 documents, 4,100 dropped (c4: too_few_sentences 3,900, ...)' per kind of
    input file, when the input holds more than one kind or drops any."""
    kinds = summary.get("by_kind") or {}
    if not any(k["dropped"] for k in kinds.values()):
        return []
    lines = []
    for kind, k in kinds.items():
        top = ", ".join(f"{r} {n:,}" for r, n in k["top_reasons"])
        lines.append(f"{kind}: {k['documents']:,} documents, {k['dropped']:,} dropped"
                     + (f" (top: {top})" if top else ""))
    return lines


def accounting(summary: dict[str, Any]) -> str:
    """'input 120 records = kept 80 + dropped 30 + malformed 4 + skipped 6 (binary files 6)'."""
    if "input_records" not in summary:  # a summary written before the accounting existed
        return f"{summary.get('malformed_records', 0)} malformed records"
    reasons = summary.get("skipped_reasons") or {}
    why = f" ({', '.join(f'{k} {v:,}' for k, v in reasons.items())})" if reasons else ""
    return (f"input {summary['input_records']:,} records = kept {summary['kept']:,} + dropped "
            f"{summary['dropped']:,} + malformed {summary['malformed']:,} + skipped "
            f"{summary['skipped']:,}{why}")


def html_report(summary: dict[str, Any], title: str = "scaletrain data curation") -> str:
    """A one-page HTML report: totals, a per-step table with a bar of kept documents."""
    e = html.escape
    body = []
    for s in summary["steps"]:
        kept = s["kept"] / s["seen"] if s["seen"] else 1.0
        why = "<br>".join(
            f"{e(k)}: {v:,}" for k, v in sorted(s["dropped"].items(), key=lambda x: -x[1])
        )
        extra = "<br>".join(f"{e(k)}: {v:,}" for k, v in s["counters"].items())
        body.append(
            f"<tr><td><b>{e(s['name'])}</b><br><small>{e(s.get('settings', ''))}</small></td>"
            f"<td>{s['seen']:,}</td><td>{s['kept']:,}</td>"
            f"<td><div class=bar><div style='width:{kept * 100:.1f}%'></div></div>"
            f"{kept * 100:.1f}%</td><td>{why}</td><td>{extra}</td>"
            f"<td>{s['seconds']:.2f}</td></tr>"
        )
    examples = "".join(f"<li>{e(x)}</li>" for x in summary.get("malformed_examples", []))
    kinds = "".join(f"<li>{e(x)}</li>" for x in by_kind_lines(summary))
    hints = "".join(f"<li>{e(x)}</li>" for x in summary.get("hints") or [])
    return f"""<!doctype html><html><head><meta charset=utf-8><title>{e(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}
.bar{{width:120px;height:10px;background:#eee}}.bar div{{height:10px;background:#4a8}}</style>
</head><body><h1>{e(title)}</h1>
<p>{summary["docs_in"]:,} documents in, {summary["docs_out"]:,} out;
{summary["seconds"]:.1f} s on {e(summary["executor"])} ({e(_tasks(summary))}).</p>
<p>{e(accounting(summary))}</p>
<table><tr><th>step</th><th>seen</th><th>kept</th><th>kept %</th><th>dropped (why)</th>
<th>counters</th><th>seconds</th></tr>{"".join(body)}</table>
{"<h2>Drops per kind of file</h2><ul>" + kinds + "</ul>" if kinds else ""}
{"<h2>Hints</h2><ul>" + hints + "</ul>" if hints else ""}
{"<h2>Malformed records</h2><ul>" + examples + "</ul>" if examples else ""}
{_samples_html(summary.get("samples") or {})}
</body></html>
"""
