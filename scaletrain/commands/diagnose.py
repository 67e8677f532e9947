"""`scaletrain diagnose TRACE [TRACE ...] [--json] [--html OUT] [--against OTHER ...]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scaletrain.profiling.analyze import latest_traces
from scaletrain.profiling.folders import handler_traces, run_folders
from scaletrain.profiling.trace import TraceError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletrain diagnose",
        description="Read profiler traces (Kineto/PyTorch Chrome traces, one per rank, or an "
                    "`nsys export --type sqlite` database) and report the time breakdown, top "
                    "kernels, overlap, idle causes, memory, a bottleneck verdict and remedies.")
    p.add_argument("traces", nargs="+",
                   help="trace files (.json, .json.gz, .sqlite), one per rank, or folders of them")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--html", metavar="OUT", help="also write an HTML report with plots")
    p.add_argument("--against", nargs="+", metavar="OTHER",
                   help="traces of another run to compare with (what got faster or slower)")
    p.add_argument("--memory-timeline", metavar="FILE",
                   help="an export_memory_timeline file (.raw.json.gz or .json) for the peak")
    p.add_argument("--time-unit", choices=("auto", "us", "ns"), default="auto",
                   help="timestamp unit of the traces (default: detected)")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list")
    return p


_PATTERNS = ("*.pt.trace.json.gz", "*.pt.trace.json", "*.json.gz", "*.json", "*.sqlite")


def expand(paths: list[str]) -> list[str]:
    """Files as given; a folder stands for the traces in it: a `scaletrain profile` folder or a
    `tensorboard_trace_handler` folder gives the newest trace of each rank (worker)."""
    out: list[str] = []
    for p in map(Path, paths):
        if not p.is_dir():
            out.append(str(p))
            continue
        found = latest_traces(p.parent if p.name == "traces" else p) or handler_traces(p)
        if not found:
            found = next((sorted(f for f in p.glob(g) if not f.name.startswith(
                "memory_timeline")) for g in _PATTERNS if list(p.glob(g))), [])
        if not found and run_folders(p):
            runs = ", ".join(str(r) for r in run_folders(p))
            raise TraceError(f"{p}: a TensorBoard logdir with several runs; pass one of them: "
                             f"{runs}")
        if not found:
            raise TraceError(f"{p}: no trace files (.json, .json.gz, .sqlite) in this folder")
        out.extend(str(f) for f in found)
    return out


def timelines(paths: list[str]) -> dict[int, str]:
    """The memory timelines of the profile folders given (memory_timeline_rank{R}.raw.json.gz,
    what `scaletrain profile` writes next to its traces), by rank."""
    out: dict[int, str] = {}
    for p in map(Path, paths):
        if p.is_dir():
            folder = p.parent if p.name == "traces" else p
            for f in sorted(folder.glob("memory_timeline_rank*.raw.json*")):
                rank = f.name.removeprefix("memory_timeline_rank").split(".")[0]
                if rank.isdigit():
                    out[int(rank)] = str(f)
    return out


def oom_reports(paths: list[str]) -> list[dict]:
    """The out-of-memory summaries (`oom_rank{R}.json`, plain JSON; the allocator snapshot
    beside it is a pickle and is never opened here) of the profile folders given."""
    import json

    out = []
    for p in map(Path, paths):
        folder = p.parent if p.name == "traces" else p
        for f in sorted(folder.glob("oom_rank*.json")) if p.is_dir() else []:
            try:
                info = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(info, dict):
                out.append({"file": str(f), **info})
    return out


def _add_ooms(result: dict, ooms: list[dict]) -> None:
    if not ooms:
        return
    result["oom"] = ooms
    result.setdefault("warnings", [])
    for o in ooms:
        peak = o.get("max_reserved_bytes")
        result["warnings"].append(
            f"{Path(o['file']).name}: out of memory at step {o.get('step')}"
            + (f" ({peak / 2**30:.2f} GiB reserved of {o['device_total_bytes'] / 2**30:.2f})"
               if peak and o.get("device_total_bytes") else "")
            + (f"; allocator snapshot {o['snapshot']} (open at pytorch.org/memory_viz)"
               if o.get("snapshot") else ""))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from scaletrain.profiling import compare, report
    from scaletrain.profiling.analyze import analyze

    try:
        result = analyze(expand(args.traces),
                         memory_timeline=args.memory_timeline or timelines(args.traces) or None,
                         time_unit=args.time_unit, top=args.top)
        _add_ooms(result, oom_reports(args.traces))
        if args.against:
            other = analyze(expand(args.against), memory_timeline=timelines(args.against)
                            or None, time_unit=args.time_unit, top=max(args.top, 50))
            result["against"] = compare.compare(result, other)
    except (TraceError, ValueError) as e:
        print(f"scaletrain diagnose: {e}", file=sys.stderr)
        return 2
    if args.html:
        report.write_atomic(args.html, report.to_html(result))
    if args.json:
        print(report.to_json(result))
    else:
        print(report.terminal(result))
        if "against" in result:
            print(compare.terminal(result["against"]))
        if args.html:
            print(f"HTML report: {args.html}")
    return 0
