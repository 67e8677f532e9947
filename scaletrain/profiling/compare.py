"""`diagnose A --against B`: what got faster or slower, per category and per kernel.

Times are per analysed step, so runs profiled for different numbers of steps compare fairly.
`delta` is this run minus the other (negative = this run is faster).
"""

from __future__ import annotations

from typing import Any

from scaletrain.profiling.report import short

_CATS = ("compute", "communication", "memory", "idle")


def _steps(r: dict[str, Any]) -> int:
    return max((r.get("cpu") or {}).get("steps") or 1, 1)


def _per_step_ms(r: dict[str, Any]) -> dict[str, float]:
    b, span = r.get("breakdown") or {}, r.get("span_us") or 0.0
    out = {k: span * b.get(k, 0.0) / _steps(r) / 1e3 for k in _CATS}
    out["gpu_span"] = span / _steps(r) / 1e3
    return out


def compare(run: dict[str, Any], other: dict[str, Any], top: int = 10) -> dict[str, Any]:
    a, b = _per_step_ms(run), _per_step_ms(other)
    cats = {k: {"ms_per_step": a[k], "other_ms_per_step": b[k], "delta_ms": a[k] - b[k]}
            for k in a}
    ka = {k["name"]: k["total_us"] / _steps(run) / 1e3 for k in run.get("top_kernels") or []}
    kb = {k["name"]: k["total_us"] / _steps(other) / 1e3 for k in other.get("top_kernels") or []}
    kernels = [{"name": n, "ms_per_step": ka.get(n, 0.0), "other_ms_per_step": kb.get(n, 0.0),
                "delta_ms": ka.get(n, 0.0) - kb.get(n, 0.0)} for n in set(ka) | set(kb)]
    kernels.sort(key=lambda k: -abs(k["delta_ms"]))
    step_a = (run.get("cpu") or {}).get("step_time_ms")
    step_b = (other.get("cpu") or {}).get("step_time_ms")
    return {
        "memory": _memory(run, other),
        "step_time_ms": step_a, "other_step_time_ms": step_b,
        "speedup": step_b / step_a if step_a and step_b else None,
        "by_category": cats, "by_kernel": kernels[:top],
        "verdict": run.get("verdict"), "other_verdict": other.get("verdict"),
    }


def _memory(run: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """Peak memory of both runs and, where both have a memory timeline, bytes by category at
    the peak (what activation checkpointing or offload changes)."""
    a, b = run.get("memory") or {}, other.get("memory") or {}
    if not a and not b:
        return None
    out: dict[str, Any] = {"peak_bytes": a.get("peak_allocated_bytes"),
                           "other_peak_bytes": b.get("peak_allocated_bytes")}
    cats = dict.fromkeys(list(a.get("at_peak") or {}) + list(b.get("at_peak") or {}))
    if cats:
        out["at_peak"] = {c: {"bytes": (a.get("at_peak") or {}).get(c, 0.0),
                              "other_bytes": (b.get("at_peak") or {}).get(c, 0.0)}
                          for c in cats}
    return out


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**30:.2f} GiB"


def terminal(c: dict[str, Any]) -> str:
    lines = ["Against the other run (ms per step; negative delta = this run is faster):"]
    if c.get("speedup"):
        lines.append(f"  step time {c['step_time_ms']:.1f} ms vs {c['other_step_time_ms']:.1f} "
                     f"ms: {c['speedup']:.2f}x")
    for k, v in c["by_category"].items():
        lines.append(f"  {k:<14} {v['ms_per_step']:9.2f} vs {v['other_ms_per_step']:9.2f}  "
                     f"{v['delta_ms']:+9.2f}")
    m = c.get("memory")
    if m:
        lines.append(f"  peak memory     {_gib(m['peak_bytes'])} vs {_gib(m['other_peak_bytes'])}")
        for cat, v in (m.get("at_peak") or {}).items():
            lines.append(f"    {cat:<16} {_gib(v['bytes'])} vs {_gib(v['other_bytes'])}")
    if c["by_kernel"]:
        lines.append("  kernels that changed most:")
        for k in c["by_kernel"]:
            lines.append(f"    {k['delta_ms']:+9.3f} ms  {short(k['name'], 60)}")
    lines.append(f"  verdict: {c['verdict']} (other run: {c['other_verdict']})")
    return "\n".join(lines)
