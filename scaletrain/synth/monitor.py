"""Run statistics from the candidate log, and the HTML report.

Computed from the log itself (not from counters kept in memory), so a resumed run reports
exactly what an uninterrupted one would: generated = kept + sum(dropped by reason).
"""

from __future__ import annotations

import html
import math
import random
from collections import Counter
from typing import Any

import numpy as np


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-gram ratio over all texts (unique word n-grams / all word n-grams)."""
    total, seen = 0, set()
    for t in texts:
        w = t.split()
        grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
        total += len(grams)
        seen.update(grams)
    return round(len(seen) / total, 4) if total else 0.0


def self_bleu(texts: list[str], max_n: int = 4, sample: int = 200, seed: int = 0) -> float:
    """Mean BLEU-`max_n` of each text against all the others as references (Zhu et al. 2018's
    Texygen measure: 1 = every text repeats the others, near 0 = no shared n-grams).

    Word n-grams; clipped counts against the largest count in any other text; brevity penalty
    from the closest other length; +0.1 smoothing of empty precisions. At most `sample` texts
    (a seeded choice), so it stays cheap on large runs.
    """
    if len(texts) > sample:
        texts = random.Random(seed).sample(texts, sample)
    words = [t.split() for t in texts]
    if len(words) < 2:
        return 0.0
    grams = [[Counter(tuple(w[i:i + n]) for i in range(len(w) - n + 1)) for n in
              range(1, max_n + 1)] for w in words]
    # For each n-gram: the largest count and its text, and the second largest count.
    top: list[dict[tuple[str, ...], tuple[int, int, int]]] = [{} for _ in range(max_n)]
    for k, per_n in enumerate(grams):
        for n, counts in enumerate(per_n):
            for g, c in counts.items():
                best, owner, second = top[n].get(g, (0, -1, 0))
                if c > best:
                    top[n][g] = (c, k, best)
                else:
                    top[n][g] = (best, owner, max(second, c))
    lengths = sorted(len(w) for w in words)
    scores = []
    for k, (w, per_n) in enumerate(zip(words, grams, strict=True)):
        if not w:
            continue
        log_p = 0.0
        for n, counts in enumerate(per_n):
            total = sum(counts.values())
            clipped = 0
            for g, c in counts.items():
                best, owner, second = top[n][g]
                clipped += min(c, second if owner == k else best)
            log_p += math.log((clipped or 0.1) / total) if total else math.log(0.1)
        others = list(lengths)
        others.remove(len(w))
        ref = min(others, key=lambda x: (abs(x - len(w)), x))
        bp = 1.0 if len(w) > ref else math.exp(1 - ref / len(w))
        scores.append(bp * math.exp(log_p / max_n))
    return round(sum(scores) / len(scores), 4) if scores else 0.0


def histogram(values: list[float], lo: float, hi: float, bins: int = 10) -> dict[str, Any]:
    if not values:
        return {"edges": [], "counts": []}
    if hi <= lo:
        hi = lo + 1
    counts, edges = np.histogram(np.clip(values, lo, hi), bins=bins, range=(lo, hi))
    return {"edges": [round(float(e), 3) for e in edges], "counts": counts.tolist()}


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    q = np.percentile(values, [0, 10, 50, 90, 100])
    return {"min": float(q[0]), "p10": float(q[1]), "p50": float(q[2]), "p90": float(q[3]),
            "max": float(q[4]), "mean": round(float(np.mean(values)), 2)}


def summarize(records: list[dict[str, Any]], topic_slot: str | None, score_range: tuple[float,
              float] = (1, 10)) -> dict[str, Any]:
    """Statistics of the run from its log records (one per candidate)."""
    kept = [r for r in records if r["kept"]]
    dropped = Counter(r["reason"] for r in records if not r["kept"])
    scores = [r["score"] for r in records if r.get("score") is not None]
    kept_scores = [r["score"] for r in kept if r.get("score") is not None]
    lo, hi = score_range
    if scores:
        lo, hi = min(lo, min(scores)), max(hi, max(scores))
    topics: dict[str, dict[str, Any]] = {}
    if topic_slot:
        gen_t = Counter(r["slots"].get(topic_slot, "?") for r in records)
        kept_t = Counter(r["slots"].get(topic_slot, "?") for r in kept)
        for t, g in sorted(gen_t.items()):
            topics[t] = {"generated": g, "kept": kept_t[t],
                         "share_generated": round(g / len(records), 4),
                         "share_kept": round(kept_t[t] / len(kept), 4) if kept else 0.0,
                         "keep_rate": round(kept_t[t] / g, 4)}
    texts = [r["candidate"] for r in kept]
    return {
        "prompts": len({r["prompt_id"] for r in records}),
        "generated": len(records), "kept": len(kept),
        "dropped": dict(sorted(dropped.items())),
        "critique_unparsable": sum(1 for r in records if r.get("critique") is not None
                                   and r.get("score") is None),
        "scores": {"all": histogram(scores, lo, hi), "kept": histogram(kept_scores, lo, hi),
                   "mean": round(float(np.mean(scores)), 3) if scores else None},
        "length_chars": {"all": _quantiles([len(r["candidate"]) for r in records]),
                         "kept": _quantiles([len(t) for t in texts])},
        "length_tokens": _quantiles([r.get("tokens", 0) for r in records]),
        "diversity_kept": {**{f"distinct_{n}": distinct_n(texts, n) for n in (1, 2, 3)},
                           "self_bleu_4": self_bleu(texts)},
        "topic_slot": topic_slot, "topics": topics,
    }


def terminal_summary(s: dict[str, Any]) -> str:
    lines = [f"{s['prompts']} prompts, {s['generated']} candidates, {s['kept']} kept"]
    for why, n in sorted(s["dropped"].items(), key=lambda x: -x[1]):
        lines.append(f"  dropped {why:<24} {n:>7,}")
    lines.append(f"  critique replies without a score: {s['critique_unparsable']}")
    if s["scores"]["mean"] is not None:
        lines.append(f"  mean score {s['scores']['mean']}")
    d = s["diversity_kept"]
    lines.append("  kept diversity: " + ", ".join(f"{k} {v}" for k, v in d.items()))
    for t, v in s["topics"].items():
        lines.append(f"  topic {t[:30]:<30} generated {v['generated']:>5} kept {v['kept']:>5} "
                     f"({v['share_kept'] * 100:.1f}% of kept, keep rate {v['keep_rate']:.2f})")
    return "\n".join(lines)


def _bars(hist: dict[str, Any]) -> str:
    if not hist["counts"]:
        return "<p>no scores</p>"
    top = max(hist["counts"]) or 1
    rows = "".join(
        f"<tr><td>{hist['edges'][i]:g}–{hist['edges'][i + 1]:g}</td><td><div class=bar>"
        f"<div style='width:{c / top * 100:.0f}%'></div></div></td><td>{c}</td></tr>"
        for i, c in enumerate(hist["counts"]))
    return f"<table>{rows}</table>"


def html_summary(s: dict[str, Any], title: str = "scaletrain data synth") -> str:
    e = html.escape
    drops = "".join(f"<tr><td>{e(k)}</td><td>{v:,}</td></tr>" for k, v in s["dropped"].items())
    topics = "".join(
        f"<tr><td>{e(t)}</td><td>{v['generated']}</td><td>{v['kept']}</td>"
        f"<td>{v['share_generated'] * 100:.1f}%</td><td>{v['share_kept'] * 100:.1f}%</td>"
        f"<td>{v['keep_rate']:.2f}</td></tr>" for t, v in s["topics"].items())
    lengths = "".join(f"<tr><td>{k}</td>" + "".join(f"<td>{v.get(q, '')}</td>" for q in (
        "min", "p10", "p50", "p90", "max", "mean")) + "</tr>"
        for k, v in (("chars, all", s["length_chars"]["all"]),
                     ("chars, kept", s["length_chars"]["kept"]),
                     ("tokens, all", s["length_tokens"])))
    div = ", ".join(f"{k} {v}" for k, v in s["diversity_kept"].items())
    return f"""<!doctype html><html><head><meta charset=utf-8><title>{e(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px}}.bar{{width:200px;height:10px;background:#eee}}
.bar div{{height:10px;background:#4a8}}</style></head><body><h1>{e(title)}</h1>
<p>{s['prompts']:,} prompts, {s['generated']:,} candidates, <b>{s['kept']:,} kept</b>;
{s['critique_unparsable']} critiques without a score; diversity of kept: {e(div)}.</p>
<h2>Dropped, by reason</h2><table>{drops or '<tr><td>none</td></tr>'}</table>
<h2>Scores (all candidates)</h2>{_bars(s['scores']['all'])}
<h2>Scores (kept)</h2>{_bars(s['scores']['kept'])}
<h2>Lengths</h2><table><tr><th></th><th>min</th><th>p10</th><th>p50</th><th>p90</th>
<th>max</th><th>mean</th></tr>{lengths}</table>
<h2>Seed topics ({e(str(s['topic_slot']))})</h2><table><tr><th>topic</th><th>generated</th>
<th>kept</th><th>share generated</th><th>share kept</th><th>keep rate</th></tr>{topics}</table>
</body></html>
"""
