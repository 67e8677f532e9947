"""Why a straggler's device takes longer: the same kernels running slower (a slow device), or
more kernels (extra work), compared with the median other rank."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from scaletrain.profiling.trace import COMM, MEMORY, Trace

SLOW_DEVICE_RATIO = 1.15  # identical kernels this much slower: the device is slow
SAME_COUNT = 0.1  # kernels of one name are "the same work" when their counts differ less


def kernel_time(trace: Trace) -> tuple[float | None, dict[str, tuple[int, float]]]:
    """Milliseconds per step in computation kernels (summed durations), and per kernel name
    (count, total us)."""
    g, kind = trace.gpu, trace.gpu_kind
    sel = np.flatnonzero((kind != COMM) & (kind != MEMORY))
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for i, d in zip(sel.tolist(), g.dur[sel].tolist()):
        row = stats[g.name[i]]
        row[0] += 1
        row[1] += d
    steps = max(len(trace.steps), 1)
    total = float(g.dur[sel].sum())
    return (total / steps / 1e3 if len(sel) else None,
            {k: (int(c), float(t)) for k, (c, t) in stats.items()})


def device_cause(ranks: list[dict[str, Any]], straggler: int) -> dict[str, Any] | None:
    """Compare the straggler's computation kernels with the median other rank's (by kernel
    time): `slow device` when the kernels both ran (same names, counts within 10 %) take
    SLOW_DEVICE_RATIO longer and explain most of the excess; `extra work` when the excess is
    in more or other kernels; None when kernel time does not explain the straggler (its
    excess is on the host: input, launches; the straggler verdict says which)."""
    by_rank = {r["rank"]: r for r in ranks if r.get("kernel_stats")}
    if straggler not in by_rank or len(by_rank) < 2:
        return None
    others = sorted((r for k, r in by_rank.items() if k != straggler),
                    key=lambda r: r["kernel_ms_per_step"])
    ref = others[len(others) // 2]
    slow, base = by_rank[straggler]["kernel_stats"], ref["kernel_stats"]
    n_slow = max(len((by_rank[straggler].get("cpu") or {}).get("step_numbers") or []), 1)
    n_ref = max(len((ref.get("cpu") or {}).get("step_numbers") or []), 1)
    same = [k for k in slow if k in base and abs(slow[k][0] / n_slow - base[k][0] / n_ref)
            <= SAME_COUNT * base[k][0] / n_ref]
    t_slow = sum(slow[k][1] for k in same) / n_slow / 1e3
    t_base = sum(base[k][1] for k in same) / n_ref / 1e3
    excess = by_rank[straggler]["kernel_ms_per_step"] - ref["kernel_ms_per_step"]
    step = by_rank[straggler].get("step_ms") or 0.0
    if excess <= 0.05 * step:
        return None
    ratio = t_slow / t_base if t_base > 0 else None
    out = {"rank": straggler, "compared_with": ref["rank"], "kernel_excess_ms": excess,
           "same_kernels_ratio": ratio, "same_kernels_ms": [t_slow, t_base]}
    if ratio is not None and ratio >= SLOW_DEVICE_RATIO and t_slow - t_base >= 0.5 * excess:
        out["cause"] = "slow device"
        out["evidence"] = (
            f"rank {straggler}'s device is slow: the kernels both ranks run take {ratio:.2f}x "
            f"as long as on rank {ref['rank']} ({t_slow:.1f} vs {t_base:.1f} ms per step), "
            f"which accounts for {t_slow - t_base:.1f} of its {excess:.1f} ms of extra kernel "
            "time: the same work, done slower")
    else:
        extra = sum(c for c, _ in slow.values()) / n_slow - sum(
            c for c, _ in base.values()) / n_ref
        out["cause"] = "extra work"
        out["evidence"] = (
            f"rank {straggler} does more device work: {excess:.1f} ms more kernel time per "
            f"step than rank {ref['rank']} ({extra:+.0f} kernels per step)"
            + (f", while the kernels both run the same number of times take {ratio:.2f}x as "
               "long" if ratio is not None else "")
            + ": uneven work, not a slow device")
    return out
