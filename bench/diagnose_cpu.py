"""`scaletrain diagnose` against HolisticTraceAnalysis (HTA) on the shared real GPU traces.

    pip install -c constraints.txt -e ".[bench]"      # HTA, only for this benchmark
    python bench/diagnose_cpu.py                      # figures on every fixture + time/memory
    python bench/diagnose_cpu.py --repeats 5

1. Figures: for every fixture, the quantities both tools define the same way (HTA's temporal
   breakdown, kernel-type breakdown, communication/computation overlap, idle-time breakdown of
   the busiest stream, CUDA queue length) from our analyzer and from HTA, and the difference.
2. Cost: wall time and peak resident memory of our full diagnosis of the largest fixture, and of
   HTA's own analysis of the same file (load + the same analyses), each in a fresh process so
   the peak is that tool's alone; the median over --repeats runs. Peak = the process's resident
   high-water mark (VmHWM) during the analysis, reset after the imports; the RSS after the
   imports is reported beside it.

Prints a table and writes bench/results/diagnose_cpu.json. Timings on a shared machine vary.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "diagnose_cpu.json"
FIXTURES = next((p for p in (ROOT.parent / "shared" / "fixtures" / "traces",
                             Path("/work/shared/fixtures/traces")) if p.exists()), None)
GPU_FIXTURES = ["gpu_bound_v100_rank0", "host_bound_a100_allreduce_rank0",
                "comm_heavy_a100_rank0_of16", "serialized_comm_v100_memory_events_rank1",
                "rocm_mi250_minitoy_train_ROCm6_2_kineto"]
LARGEST = "serialized_comm_v100_memory_events_rank1"

# Run in a child process: time the work, report its own peak RSS.
_CHILD = r"""
import json, sys, time
sys.path.insert(0, "bench")
from proc_stats import quiet_child, reset_peak, status_mib as status
tool, path = quiet_child()
if tool == "ours":
    from scaletrain.profiling.analyze import analyze
else:
    import shutil, tempfile
    from hta.trace_analysis import TraceAnalysis

base = status("VmRSS")
reset_peak()
t0 = time.perf_counter()
if tool == "ours":
    analyze([path])
else:
    d = tempfile.mkdtemp(); shutil.copy(path, d)
    ta = TraceAnalysis(trace_dir=d)
    rank = ta.t.get_ranks()[0]
    ta.get_temporal_breakdown(visualize=False)
    ta.get_gpu_kernel_breakdown(visualize=False)
    ta.get_comm_comp_overlap(visualize=False)
    ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
    ta.get_queue_length_summary(ranks=[rank])
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "peak_rss_mib": status("VmHWM"), "baseline_rss_mib": base}))
"""


def hta_figures(path: Path) -> dict[str, Any]:
    """HTA's own numbers on one trace."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    d = tempfile.mkdtemp()
    shutil.copy(path, d)
    ta = TraceAnalysis(trace_dir=d)
    rank = ta.t.get_ranks()[0]
    tb = ta.get_temporal_breakdown(visualize=False).iloc[0]
    kinds, _ = ta.get_gpu_kernel_breakdown(visualize=False)
    total = kinds["sum"].sum()
    by_kind = {_kind_key(k): 100 * v / total for k, v in zip(kinds["kernel_type"], kinds["sum"])}
    overlap = ta.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0]
    idle = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)[0]
    queue = ta.get_queue_length_summary(ranks=[rank])
    main_stream = int(queue["queue_length"]["count"].idxmax()[1]) if queue is not None else None
    out: dict[str, Any] = {
        "span_us": float(tb["kernel_time(us)"]), "idle": float(tb["idle_time_pctg"]),
        "compute": float(tb["compute_time_pctg"]),
        "non_compute": float(tb["non_compute_time_pctg"]), "kernel_time_by_kind": by_kind,
        "overlap": None if overlap != overlap else float(overlap), "main_stream": main_stream,
    }
    if main_stream is not None:
        s = idle[idle["stream"] == main_stream]
        out["idle_main_stream"] = {c: 100 * float(s[s["idle_category"] == c]["idle_time"].sum())
                                   / max(float(s["idle_time"].sum()), 1e-9)
                                   for c in ("host_wait", "kernel_wait", "other")}
        q = queue.loc[(rank, main_stream)]["queue_length"]
        out["queue_mean"], out["queue_max"] = float(q["mean"]), float(q["max"])
    return out


def _kind_key(hta_name: str) -> str:
    parts = [p.strip().lower() for p in hta_name.split("overlapping")]
    order = ["computation", "communication", "memory"]
    return "+".join(sorted(parts, key=lambda p: order.index(p) if p in order else 9))


def our_figures(path: Path, main_stream: int | None) -> dict[str, Any]:
    from scaletrain.profiling.analyze import analyze

    r = analyze([path])
    b = r["breakdown"]
    out: dict[str, Any] = {
        "span_us": r["span_us"], "idle": 100 * b["idle"], "compute": 100 * b["compute"],
        "non_compute": 100 * (b["communication"] + b["memory"]),
        "kernel_time_by_kind": {k: 100 * v for k, v in r["kernel_time_by_kind"].items()},
        "overlap": None if r["overlap"] is None else 100 * r["overlap"],
        "verdict": r["verdict"],
    }
    streams = {s["stream"]: s for s in r["idle_by_stream"]}
    if main_stream in streams:
        s = streams[main_stream]
        out["idle_main_stream"] = {c: 100 * s[c] for c in ("host_wait", "kernel_wait", "other")}
        q = r["launch"]["queue_length"].get(str(main_stream))
        if q:
            out["queue_mean"], out["queue_max"] = q["mean"], float(q["max"])
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def cost(tool: str, path: Path, repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", _CHILD, tool, str(path)], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"wall_s_median": statistics.median(r["wall_s"] for r in runs),
            "wall_s_runs": [r["wall_s"] for r in runs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "baseline_rss_mib": statistics.median(r["baseline_rss_mib"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if FIXTURES is None:
        print("shared/fixtures/traces not found", file=sys.stderr)
        return 2
    try:
        import hta  # noqa: F401
    except ImportError:
        print("HolisticTraceAnalysis is not installed: pip install -c constraints.txt -e "
              "'.[bench]'", file=sys.stderr)
        return 2
    figures: dict[str, Any] = {}
    print(f"{'trace':<42} {'figure':<38} {'ours':>10} {'HTA':>10} {'diff pp':>8}")
    for name in GPU_FIXTURES:
        path = FIXTURES / f"{name}.json.gz"
        ref = hta_figures(path)
        ours = our_figures(path, ref.get("main_stream"))
        fo, fr = _flatten(ours), _flatten(ref)
        rows = {k: {"ours": fo.get(k), "hta": fr[k],
                    "diff": None if fo.get(k) is None else fo[k] - fr[k]}
                for k in fr if k != "main_stream"}
        for k in fo:
            if k not in rows and k.startswith("kernel_time_by_kind"):
                rows[k] = {"ours": fo[k], "hta": 0.0, "diff": fo[k]}
        figures[name] = {"rows": rows, "verdict": ours["verdict"],
                         "main_stream": ref.get("main_stream")}
        for k, v in rows.items():
            unit = "" if k.startswith(("span", "queue")) else " %"
            ours_s = "n/a" if v["ours"] is None else f"{v['ours']:.2f}"
            diff_s = "" if v["diff"] is None or unit == "" else f"{v['diff']:+.2f}"
            print(f"{name[:42]:<42} {k + unit:<38} {ours_s:>10} {v['hta']:>10.2f} {diff_s:>8}")
        print(f"{name[:42]:<42} {'verdict':<38} {ours['verdict']:>21}")
    worst = max((abs(v["diff"]) for f in figures.values() for k, v in f["rows"].items()
                 if v["diff"] is not None and not k.startswith(("span", "queue"))), default=0.0)
    print(f"largest difference in a percentage figure: {worst:.2f} pp")
    largest = FIXTURES / f"{LARGEST}.json.gz"
    costs = {tool: cost(tool, largest, args.repeats) for tool in ("ours", "hta")}
    print(f"\ncost on {largest.name} ({largest.stat().st_size / 1e6:.1f} MB gzip), median of "
          f"{args.repeats} runs, each in a fresh process:")
    for tool, c in costs.items():
        print(f"  {tool:<5} {c['wall_s_median']:6.2f} s  peak RSS {c['peak_rss_mib']:7.1f} MiB "
              f"(after imports {c['baseline_rss_mib']:6.1f} MiB, so the analysis adds "
              f"{c['peak_rss_mib'] - c['baseline_rss_mib']:6.1f} MiB)")
    import hta as hta_mod
    import pandas
    import torch

    result = {
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count(),
                    "torch": torch.__version__, "pandas": pandas.__version__,
                    "hta": getattr(hta_mod, "__version__", "0.5.0"),
                    "note": "shared machine (several developers' jobs at once)"},
        "figures": figures, "largest_difference_pp": worst,
        "cost": {"file": largest.name, "bytes": largest.stat().st_size, **costs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
