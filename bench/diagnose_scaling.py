"""How `scaletrain diagnose` scales with the size of a trace, side by side with HTA.

    python bench/diagnose_scaling.py                          # 25, 50, 100, 250 MB and 1 GB
    python bench/diagnose_scaling.py --sizes 25 50 --no-hta   # ours only
    PYTHONPATH=/path/to/hta python bench/diagnose_scaling.py  # HTA from its own folder

For each size a plain-JSON Kineto trace is generated (`tests.helpers.profiling_traces.sized_trace`:
a data-parallel training step repeated; the event count grows linearly with the size), then each
tool analyses it in a fresh process, one process at a time: ours runs the whole diagnosis
(`scaletrain.profiling.analyze.analyze`), HTA (HolisticTraceAnalysis, when importable) loads
the trace and runs the analyses it shares with ours (temporal, kernel-type and idle-time
breakdowns, communication/computation overlap, queue length). Reported per size: the file's
size, its events, wall and CPU seconds and peak resident memory (VmHWM) of each tool, HTA's
time over ours (CPU seconds: on a shared machine the wall time also counts waiting for a core),
and our CPU seconds per MB (flat when the analysis is linear).

Memory: a case runs only when the machine has at least `--min-free-gib` (default 10 GiB for
the 1 GB case, 3 GiB otherwise) available; a skipped case is recorded with the reason. Each
tool's process is capped at `--max-gib` of address space; a tool that runs longer than
`--timeout` is killed and recorded as not finished (its time is then a lower bound).
The generated trace is deleted after its case. Prints a table and writes
bench/results/diagnose_scaling.json (and the table as .txt). Timings on a shared machine vary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "diagnose_scaling.json"
SIZES_MB = (25, 50, 100, 250, 1000)
BYTES_PER_STEP_LAYER = 1544  # measured size of one step and layer of sized_trace
LAYERS = 24

_CHILD = r"""
import json, sys, time
sys.path.insert(0, "bench")
from proc_stats import quiet_child, reset_peak, status_mib as status
tool, path = quiet_child()
if tool == "ours":
    from scaletrain.profiling.analyze import analyze
else:
    from hta.trace_analysis import TraceAnalysis

reset_peak()
t0, c0 = time.perf_counter(), time.process_time()
if tool == "ours":
    r = analyze([path])
    info = {"verdict": r["verdict"], "steps": r["cpu"]["steps"], "idle": r["breakdown"]["idle"]}
else:
    import os
    ta = TraceAnalysis(trace_dir=os.path.dirname(path))
    rank = ta.t.get_ranks()[0]
    tb = ta.get_temporal_breakdown(visualize=False)
    ta.get_gpu_kernel_breakdown(visualize=False)
    ta.get_comm_comp_overlap(visualize=False)
    ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
    ta.get_queue_length_summary(ranks=[rank])
    info = {"idle": float(tb["idle_time_pctg"].iloc[0]) / 100}
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": status("VmHWM"), **info}))
"""


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def hta_importable() -> bool:
    done = subprocess.run([sys.executable, "-c", "import hta.trace_analysis"],
                          capture_output=True, cwd=ROOT)
    return done.returncode == 0


def run(tool: str, path: Path, timeout: float, max_gib: float) -> dict[str, Any]:
    """One tool on one trace in a fresh process, its address space capped at `max_gib` (a
    tool that needs more fails with MemoryError instead of starving the machine)."""
    def limit() -> None:
        import resource

        cap = int(max_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, tool, str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit)
    except subprocess.TimeoutExpired:  # run() has killed and reaped it: its CPU time counts
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return {"error": f"did not finish in {timeout:.0f} s (killed)",
                "cpu_s_at_kill": used, "wall_s_at_kill": timeout}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def case(mb: float, folder: Path, with_hta: bool, min_free: float, timeout: float,
         max_gib: float) -> dict[str, Any]:
    from tests.helpers.profiling_traces import sized_trace

    need = min_free if mb >= 1000 else min(min_free, 3.0)
    free = available_gib()
    if free < need:
        return {"size_mb": mb, "skipped": f"{free:.1f} GiB available, {need:.0f} GiB needed"}
    steps = max(int(mb * 1e6 / BYTES_PER_STEP_LAYER / LAYERS), 2)
    sub = folder / f"{mb:g}mb"
    sub.mkdir()
    path = sized_trace(sub / "rank0.json", steps, LAYERS)
    out: dict[str, Any] = {"size_mb": path.stat().st_size / 1e6, "steps": steps,
                           "events": steps_events(steps)}
    try:
        out["ours"] = run("ours", path, timeout, max_gib)
        if with_hta:
            out["hta"] = run("hta", path, timeout, max_gib)
    finally:
        path.unlink()
        sub.rmdir()
    ours, hta = out["ours"].get("cpu_s"), (out.get("hta") or {}).get("cpu_s")
    if ours:
        out["ours_s_per_mb"] = ours / out["size_mb"]
    if ours and hta:
        out["hta_over_ours"] = hta / ours
    killed = (out.get("hta") or {}).get("cpu_s_at_kill")
    if ours and killed:  # HTA stopped unfinished: its time, and the ratio, are lower bounds
        out["hta_over_ours_at_least"] = killed / ours
    return out


def steps_events(steps: int) -> int:
    """Events sized_trace writes: per step 13 + LAYERS x 11 (+1 for the cut-off last step)."""
    return (steps + 1) * (13 + LAYERS * 11)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'size MB':>8} {'events':>10} {'ours s':>7} {'cpu s':>7} {'MiB':>6} {'cpu s/MB':>8} "
            f"{'HTA s':>7} {'cpu s':>7} {'MiB':>6} {'HTA/ours':>8}")
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['size_mb']:>8g} skipped: {r['skipped']}")
            continue
        o, h = r.get("ours") or {}, r.get("hta") or {}

        def f(x: Any, spec: str) -> str:
            return format(x, spec) if isinstance(x, (int, float)) else "-".rjust(int(spec[0]))
        if "cpu_s_at_kill" in h:  # unfinished: lower bounds
            hta = (f"{'>' + format(h['wall_s_at_kill'], '.0f'):>7} "
                   f"{'>' + format(h['cpu_s_at_kill'], '.1f'):>7} {'-':>6} "
                   f"{'>' + format(r.get('hta_over_ours_at_least', 0), '.1f'):>8}")
        else:
            hta = (f"{f(h.get('wall_s'), '7.2f')} {f(h.get('cpu_s'), '7.2f')} "
                   f"{f(h.get('peak_rss_mib'), '6.0f')} {f(r.get('hta_over_ours'), '8.1f')}")
        lines.append(f"{r['size_mb']:>8.0f} {r['events']:>10} {f(o.get('wall_s'), '7.2f')} "
                     f"{f(o.get('cpu_s'), '7.2f')} {f(o.get('peak_rss_mib'), '6.0f')} "
                     f"{f(r.get('ours_s_per_mb'), '8.3f')} {hta}"
                     + (f"  ours: {o['error']}" if "error" in o else "")
                     + (f"  HTA: {h['error']}" if "error" in h else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=list(SIZES_MB),
                    help="trace sizes in MB (default: 25 50 100 250 1000)")
    ap.add_argument("--no-hta", action="store_true", help="time ours only")
    ap.add_argument("--min-free-gib", type=float, default=10.0,
                    help="memory that must be available to run the 1 GB case")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="wall seconds per tool and size; a tool still running is killed and "
                         "recorded as not finished")
    ap.add_argument("--max-gib", type=float, default=14.0,
                    help="address-space cap of each tool's process (GiB)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the traces")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    with_hta = not args.no_hta and hta_importable()
    if not args.no_hta and not with_hta:
        print("HTA is not importable: timing ours only (install HolisticTraceAnalysis into a "
              "folder and put it on PYTHONPATH)", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mb in args.sizes:
            rows.append(case(mb, Path(tmp), with_hta, args.min_free_gib, args.timeout,
                             args.max_gib))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            save(args.out, rows, with_hta)  # after each case: a stopped run keeps its rows
    print(table(rows))
    return 0


def save(out: Path, rows: list[dict[str, Any]], with_hta: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": _cpus(), "hta": with_hta, "load_average": os.getloadavg()},
        "rows": rows}, indent=2))
    out.with_suffix(".txt").write_text(table(rows) + "\n")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
