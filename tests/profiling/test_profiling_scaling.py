"""The analysis is linear in the size of a trace (bench/diagnose_scaling.py measures the
seconds; these tests count work, which does not depend on the machine), and the linear
versions of the per-range analyses give what the direct definitions give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scaletrain.profiling import analyze as analyze_mod
from scaletrain.profiling import cpu, gpu, intervals
from scaletrain.profiling.trace import Spans, Trace, load_kineto
from tests.helpers.profiling_traces import sized_trace

FIXTURES = Path("/work/shared/fixtures/traces")


class WorkCounter:
    """Elements computed by `Spans.end` (each time it is actually recomputed) and elements
    handed to the interval helpers: a loop that recomputes `end` per span, or clips every
    kernel once per step, makes these grow with the square of the trace."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        end = Spans.end.fget

        def counted_end(spans: Spans) -> np.ndarray:
            before = spans.__dict__.get("_end")
            out = end(spans)  # type: ignore[misc]
            after = spans.__dict__.get("_end")
            if after is None or after is not before:
                self.count += len(out)
            return out

        monkeypatch.setattr(Spans, "end", property(counted_end))
        for name in ("merge", "clip"):
            self._wrap(monkeypatch, intervals, name, lambda s, *_: len(s))
        self._wrap(monkeypatch, intervals, "covered", lambda m, a, b: len(m[0]) + len(a))

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str, size: Any) -> None:
        inner = getattr(module, name)

        def counted(*args: Any) -> Any:
            self.count += size(*args)
            return inner(*args)

        monkeypatch.setattr(module, name, counted)


def _work(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    trace = load_kineto(path)
    with monkeypatch.context() as m:
        counter = WorkCounter(m)
        analyze_mod.analyze_trace(trace)
    return counter.count, len(trace.cpu) + len(trace.gpu) + len(trace.runtime)


def test_doubling_the_trace_doubles_the_work(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    small, n_small = _work(sized_trace(tmp_path / "a.json", steps=30, layers=8), monkeypatch)
    big, n_big = _work(sized_trace(tmp_path / "b.json", steps=60, layers=8), monkeypatch)
    assert n_big / n_small == pytest.approx(2.0, rel=0.05)
    # linear: about 2x (quadratic code gave about 4x); and a few passes per span, not hundreds
    assert big / small < 2.3, (small, big)
    assert big < 60 * n_big, (big, n_big)


def _outside_phases_direct(trace: Trace, n_steps: int, top: int) -> dict[str, float]:
    """The definition, span by span: per step thread, ranges sorted by start (longest first),
    a range nested in the previous top-level one is skipped, one starting inside a phase
    range is not counted."""
    c = trace.cpu
    lo, hi, _ = cpu.window(trace)
    is_step = [bool(cpu._STEP_RE.search(n)) for n in c.name]
    pats = [*cpu.PHASES.values(), cpu.COMM_RE]
    phase = [any(p.search(n) for p in pats) for n in c.name]
    ph = [(c.ts[i], c.ts[i] + c.dur[i]) for i in range(len(c)) if phase[i]]
    totals: dict[str, float] = {}
    for tid in {int(c.tid[i]) for i in range(len(c)) if is_step[i]}:
        rows = sorted((i for i in range(len(c)) if c.tid[i] == tid and not is_step[i]
                       and not phase[i] and lo <= c.ts[i] < hi),
                      key=lambda i: (c.ts[i], -c.dur[i]))
        run_end = -np.inf
        for i in rows:
            if c.ts[i] < run_end:
                continue
            run_end = c.ts[i] + c.dur[i]
            if any(s <= c.ts[i] < e for s, e in ph):
                continue
            totals[c.name[i]] = totals.get(c.name[i], 0.0) + float(c.dur[i])
    return {k: v / n_steps / 1e3 for k, v in totals.items()}


def _per_step_direct(trace: Trace) -> list[dict[str, float]]:
    """Each step's window clipped out of every kernel, kind by kind."""
    g, kind, out = trace.gpu, trace.gpu_kind, []
    compute = (kind != gpu.COMM) & (kind != gpu.MEMORY)
    for n, lo, hi in trace.steps:
        def length(sel: np.ndarray, lo: float = lo, hi: float = hi) -> float:
            return intervals.total(*intervals.clip(g.ts[sel], g.end[sel], lo, hi))
        c, cc, b = length(compute), length(kind != gpu.MEMORY), length(kind >= 0)
        out.append({"step": n, "compute": c / 1e3, "communication": (cc - c) / 1e3,
                    "memory": max(b - cc, 0.0) / 1e3, "idle": max(hi - lo - b, 0.0) / 1e3})
    return out


def _traces(tmp_path: Path) -> list[Path]:
    paths = [sized_trace(tmp_path / "s.json", steps=6, layers=5)]
    if FIXTURES.exists():
        paths += sorted(FIXTURES.glob("*rank*.json.gz"))
    return paths


def test_linear_analyses_equal_their_direct_definitions(tmp_path: Path) -> None:
    checked = 0
    for path in _traces(tmp_path):
        trace = load_kineto(path)
        _, _, n = cpu.window(trace)
        got = {r["name"]: r["ms_per_step"] for r in cpu.outside_phases(trace, n, top=10_000)}
        want = _outside_phases_direct(trace, n, 10_000) if trace.steps else {}
        assert got == pytest.approx(want), path.name
        if trace.has_gpu:
            for a, b in zip(gpu.per_step(trace), _per_step_direct(trace), strict=True):
                assert a == pytest.approx(b), path.name
            checked += 1
    assert checked >= 1


def test_scaling_bench_runs_and_counts_the_events_it_wrote(tmp_path: Path) -> None:
    """bench/diagnose_scaling.py end to end on a tiny size (ours only; no timing asserted):
    the event count it reports is the one the generated file holds."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "bench_diagnose_scaling", Path(__file__).resolve().parents[2] / "bench" /
        "diagnose_scaling.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "scaling.json"
    assert bench.main(["--sizes", "0.3", "--no-hta", "--out", str(out), "--dir",
                       str(tmp_path)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["ours"]["cpu_s"] > 0 and row["ours"]["steps"] == row["steps"]  # +1 cut off
    trace = sized_trace(tmp_path / "check.json", row["steps"], bench.LAYERS)
    assert row["events"] == len(json.loads(trace.read_text())["traceEvents"])
