"""Memory: the peak and the phase it falls in, from `[memory]` trace events or a memory timeline.

A memory timeline is what `torch.profiler.profile.export_memory_timeline` writes: the raw form
(`.raw.json.gz`: `[timestamp_ns, action, bytes, category]` per event) or the plot form
(`.json[.gz]`: `[times_us, sizes]`, one row of per-category bytes per time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.profiling import cpu
from scaletrain.profiling.trace import Trace, TraceError, read_json

# torch.profiler._memory_profiler's category order (_CATEGORY_TO_INDEX); None is last.
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
              "autograd_detail", "unknown")
MAX_POINTS = 400


def phase_at(trace: Trace | None, ts: float) -> str | None:
    """The training phase whose CPU range contains time `ts` (innermost-first priority)."""
    if trace is None:
        return None
    for name in ("optimizer", "backward", "forward", "data"):
        s, e = cpu.ranges(trace, cpu.PHASES[name])
        if np.any((s <= ts) & (ts <= e)):
            return name
    return None


def from_events(trace: Trace) -> dict[str, Any] | None:
    """Peak allocated/reserved memory from the profiler's `[memory]` events."""
    m = trace.memory
    if not len(m):
        return None
    i = int(np.argmax(m[:, 1]))
    peak = float(m[i, 1])
    out: dict[str, Any] = {
        "source": "profiler memory events", "device": trace.memory_device,
        "peak_allocated_bytes": peak, "peak_reserved_bytes": float(m[:, 2].max()),
        "peak_phase": phase_at(trace, float(m[i, 0])),
        "series": _downsample(m[:, 0], m[:, 1]),
    }
    if trace.device_memory and trace.memory_device == "gpu":
        out["device_memory_bytes"] = float(trace.device_memory)
        out["peak_fraction_of_device"] = float(m[:, 2].max()) / trace.device_memory
    return out


def from_timeline(path: str | Path, trace: Trace | None = None) -> dict[str, Any]:
    """Peak and its composition by category from an export_memory_timeline file."""
    p = Path(path)
    data = read_json(p)
    try:
        if (isinstance(data, list) and len(data) == 2 and isinstance(data[0], list)
                and data[1] and isinstance(data[1][0], list)):
            times = np.asarray(data[0], dtype=np.float64)
            sizes = np.asarray(data[1], dtype=np.float64)[:, 1:1 + len(CATEGORIES)]
        else:
            times, sizes = _coalesce_raw(np.asarray(data, dtype=np.float64).reshape(-1, 4))
    except (TypeError, ValueError, IndexError):
        raise TraceError(f"{p}: not a memory timeline from export_memory_timeline (expected "
                         "[[ts, action, bytes, category], ...] or [times, sizes])") from None
    total = sizes.sum(axis=1)
    i = int(np.argmax(total))
    return {
        "source": f"memory timeline {p.name}",
        "peak_allocated_bytes": float(total[i]),
        "at_peak": {c: float(v) for c, v in zip(CATEGORIES, sizes[i]) if v},
        # timeline times are epoch microseconds; trace times are offset by baseTimeNanoseconds
        "peak_phase": phase_at(trace, float(times[i]) - trace.base_us)
        if trace is not None and times[i] > 0 else None,
        "series": _downsample(times, total),
        "series_by_category": _by_category(times, sizes),
    }


def _by_category(times: np.ndarray, sizes: np.ndarray) -> dict[str, Any]:
    """Bytes per category at up to MAX_POINTS times (the samples at each bucket's peak)."""
    keep = times >= 0
    t, sz = times[keep], sizes[keep]
    if len(t) > MAX_POINTS:
        idx = np.array_split(np.arange(len(t)), MAX_POINTS)
        pick = np.array([j[np.argmax(sz[j].sum(axis=1))] for j in idx])
        t, sz = t[pick], sz[pick]
    return {"t_us": t.tolist(), "bytes": {c: sz[:, i].tolist() for i, c in
                                          enumerate(CATEGORIES) if sz[:, i].any()}}


def _coalesce_raw(ev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Running bytes per category after each raw event (timestamps ns -> us)."""
    ev = ev[np.argsort(ev[:, 0], kind="stable")]
    cat = ev[:, 3].astype(int)
    cat[(cat < 0) | (cat >= len(CATEGORIES))] = len(CATEGORIES) - 1
    delta = np.zeros((len(ev), len(CATEGORIES)))
    delta[np.arange(len(ev)), cat] = ev[:, 2]
    times = np.where(ev[:, 0] > 0, ev[:, 0] / 1e3, -1.0)
    return times, np.cumsum(delta, axis=0)


def _downsample(t: np.ndarray, v: np.ndarray) -> list[list[float]]:
    """At most MAX_POINTS (time us, bytes) points keeping each bucket's maximum."""
    if len(t) <= MAX_POINTS:
        return [[float(a), float(b)] for a, b in zip(t, v)]
    idx = np.array_split(np.arange(len(t)), MAX_POINTS)
    return [[float(t[j[np.argmax(v[j])]]), float(v[j].max())] for j in idx]
