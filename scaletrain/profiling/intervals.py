"""Interval arithmetic on numpy arrays of (start, end) pairs, in microseconds."""

from __future__ import annotations

import numpy as np


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals as disjoint sorted intervals (touching ones are kept apart,
    which does not change any length)."""
    if len(starts) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    # A new group starts where an interval begins after everything before it has ended.
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    group = np.cumsum(new) - 1
    n = group[-1] + 1
    out_s = s[new]
    out_e = np.full(n, -np.inf)
    np.maximum.at(out_e, group, e)
    return out_s, out_e


def total(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union."""
    s, e = merge(starts, ends)
    return float((e - s).sum())


def intersect_length(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    a_s, a_e = merge(*a)
    b_s, b_e = merge(*b)
    if len(a_s) == 0 or len(b_s) == 0:
        return 0.0
    # Sweep over the boundaries of both disjoint sets.
    times = np.concatenate([a_s, a_e, b_s, b_e])
    delta = np.concatenate([np.ones(len(a_s)), -np.ones(len(a_e)),
                            2 * np.ones(len(b_s)), -2 * np.ones(len(b_e))])
    order = np.lexsort((delta, times))  # ends (negative) before starts at equal times
    times, delta = times[order], delta[order]
    level = np.cumsum(delta)
    widths = np.diff(times)
    return float(widths[level[:-1] == 3].sum())


def clip(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float
         ) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the intervals inside [lo, hi]."""
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    keep = e > s
    return s[keep], e[keep]


def gaps(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The holes between the merged intervals (inside their overall span)."""
    s, e = merge(starts, ends)
    return e[:-1], s[1:]


def covered(merged: tuple[np.ndarray, np.ndarray], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per window [a, b]: the length covered by the disjoint sorted intervals `merged`."""
    s, e = merged
    if len(s) == 0 or len(a) == 0:
        return np.zeros(len(a))
    cum = np.concatenate([[0.0], np.cumsum(e - s)])

    def upto(t: np.ndarray) -> np.ndarray:  # covered length in (-inf, t]
        k = np.searchsorted(s, t, side="right")  # intervals starting at or before t
        inside = np.clip(t - s[np.maximum(k - 1, 0)], 0, (e - s)[np.maximum(k - 1, 0)])
        return cum[np.maximum(k - 1, 0)] + np.where(k > 0, inside, 0.0)

    return np.maximum(upto(b) - upto(a), 0.0)
