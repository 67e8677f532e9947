"""The diagnosis reduced to what an experiment tracker shows: a one-line verdict and scalars.

Keys of `scalars` (all under `profile/`): `step_ms`, `breakdown/<category>` (compute,
communication, memory, idle: shares of the device's span, or of the CPU step time on a
CPU-only run), `scores/<category>` (each loss the verdict weighed), `phase_ms/<phase>`
(forward, backward, optimizer, data, ... per step, CPU side), `peak_memory_gib`, and
`verdict_is/<class>` = 1 for the verdict (trackers plot numbers; the verdict's name is also sent
as text).
"""

from __future__ import annotations

from typing import Any

from scaletrain.profiling.verdict import VERDICTS


def headline(result: dict[str, Any]) -> str:
    """`VERDICT: evidence` in one line."""
    evidence = "; ".join(result.get("evidence") or [])
    also = result.get("secondary") or []
    return (f"{result['verdict']}" + (f" (also {', '.join(also)})" if also else "")
            + (f": {evidence}" if evidence else ""))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def scalars(result: dict[str, Any], prefix: str = "profile/") -> dict[str, float]:
    out: dict[str, float] = {}
    if _finite(result.get("step_ms")):
        out["step_ms"] = float(result["step_ms"])
    for group in ("breakdown", "scores"):
        for k, v in (result.get(group) or {}).items():
            if _finite(v):
                out[f"{group}/{k.replace('/', '_')}"] = float(v)
    for k, v in ((result.get("cpu") or {}).get("phases") or {}).items():
        if _finite(v.get("ms_per_step")):
            out[f"phase_ms/{k}"] = float(v["ms_per_step"])
    peak = (result.get("memory") or {}).get("peak_allocated_bytes")
    if _finite(peak):
        out["peak_memory_gib"] = float(peak) / 2**30
    for v in VERDICTS:
        out[f"verdict_is/{v.replace('/', '_').replace(' ', '_')}"] = float(
            result.get("verdict") == v)
    return {prefix + k: v for k, v in out.items()}
