"""`data tokenize` against the number of input files: the same lines in 1 file, in 200 files
and (tiny) in 100,000 files, each against 1 file holding the same lines.

    python bench/tokenize_files_cpu.py                     # 20,000 lines; 100,000 tiny files
    python bench/tokenize_files_cpu.py --lines 4000 --tiny 5000 --workers 2

The lines are real text (the CCNet fixture documents' lines, repeated with a counter to reach
`--lines`); tiny files hold one short line each. Each case runs `scaletrain data tokenize`
in a fresh process (as a user does, set-up included) with the GPT-NeoX tokenizer and
reports files/s, MB/s of input and the time ratio against one file holding the same lines
(the fastest of `--repeat` runs, which run interleaved so a change of load hits every case),
and the least CPU seconds of a run (workers included) with their ratio: on a loaded machine
the wall-time ratio is noise, the CPU ratio much less so. The load average is printed at the
start and the end. `--before TREE` runs a second source tree in the same repeats. Files are
written to a temporary folder first (not timed). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("SCALETRAIN_FIXTURES", ROOT.parent / "shared" / "fixtures"))
if not (FIXTURES / "data").is_dir():
    FIXTURES = Path("/work/shared/fixtures")
RESULTS = ROOT / "bench" / "results" / "tokenize_files_cpu.json"


def real_lines(n: int) -> list[str]:
    """`n` lines of real text from the CCNet fixture, a counter making each one unique."""
    base = []
    for name in ("ccnet_en_head-0091.jsonl.gz", "ccnet_en_head-0174.jsonl.gz"):
        with gzip.open(FIXTURES / "data" / name, "rt", encoding="utf-8") as f:
            for rec in f:
                base += [ln for ln in json.loads(rec)["text"].splitlines() if len(ln) > 20]
    return [f"{base[i % len(base)]} ({i})" for i in range(n)]


def write_split(folder: Path, lines: list[str], n_files: int) -> int:
    """`lines` spread over `n_files` JSONL files (in subfolders of 1,000); returns bytes."""
    folder.mkdir(parents=True)
    per = -(-len(lines) // n_files)
    total = 0
    for k in range(n_files):
        chunk = lines[k * per:(k + 1) * per]
        if not chunk:
            break
        sub = folder / f"d{k // 1000:04d}"
        sub.mkdir(exist_ok=True)
        data = "".join(json.dumps({"text": t}) + "\n" for t in chunk).encode()
        (sub / f"f{k:06d}.jsonl").write_bytes(data)
        total += len(data)
    return total


def tokenize(src: Path, out: Path, tree: Path, workers: int) -> tuple[float, dict]:
    tok = FIXTURES / "data" / "gpt-neox-tokenizer.json"
    cmd = [sys.executable, "-m", "scaletrain", "data", "tokenize", "--input", str(src),
           "--output", str(out), "--tokenizer", str(tok), "--workers", str(workers), "--json"]
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    cpu0 = _children_cpu()
    # cwd: `python -m` puts the working directory first on sys.path
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=tree)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"tokenize failed ({p.returncode}): {p.stderr[-2000:]}")
    start = p.stdout.index("{")
    return dt, {**json.loads(p.stdout[start:]), "cpu_seconds": _children_cpu() - cpu0}


def _children_cpu() -> float:
    """User + system CPU seconds of the finished child processes (workers included): the
    work done, which a shared machine's load does not inflate as it does wall time."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _row(label: str, n: int, n_files: int, size: int, runs: list, base: float,
         base_cpu: float, name: str) -> dict:
    """One printed and saved row: the fastest run (wall) and the least CPU of `runs`."""
    dt, out = min(runs, key=lambda r: r[0])
    cpu = min(r[1]["cpu_seconds"] for r in runs)
    row = {"case": f"{n:,} {label} in {n_files:,} files" + (f" ({name})" if name else ""),
           "files": n_files, "lines": n, "mbytes": round(size / 1e6, 3),
           "seconds": round(dt, 2), "files_per_s": round(n_files / dt, 1),
           "mb_per_s": round(size / 1e6 / dt, 3), "ratio_vs_1_file": round(dt / base, 2),
           "cpu_seconds": round(cpu, 2), "cpu_ratio_vs_1_file": round(cpu / base_cpu, 2),
           "all_seconds": [round(r[0], 2) for r in runs], "documents": out["documents"],
           "tokens": out["tokens"], "parts": out.get("parts")}
    print(f"{row['case']:<43} {dt:8.2f} s {row['files_per_s']:>10,.1f} files/s "
          f"{row['mb_per_s']:>8.3f} MB/s  x{row['ratio_vs_1_file']} of 1 file  cpu "
          f"{cpu:.2f} s x{row['cpu_ratio_vs_1_file']}  parts {row['parts']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=20_000, help="lines of the 1 vs 200 files")
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--tiny", type=int, default=100_000, help="tiny one-line files")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest counts "
                    "(a shared machine's load only ever adds time)")
    ap.add_argument("--tree", default=str(ROOT), help="source tree to run (PYTHONPATH), e.g. "
                    "another checkout for a before/after comparison")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--before", default=None, help="a second source tree (e.g. `git archive "
                    "main` unpacked) run in the same repeats, interleaved, for a before/after "
                    "on the same load")
    args = ap.parse_args()
    trees = [("", Path(args.tree))] + ([("before", Path(args.before))] if args.before else [])
    rows = []
    print(f"load average at start: {_load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tokfiles-") as tmp:
        work = Path(tmp)
        cases = [("lines", args.lines, [1, args.files])]
        if args.tiny:
            cases.append(("tiny", args.tiny, [1, args.tiny]))
        for label, n, counts in cases:
            lines = (real_lines(n) if label == "lines"
                     else [f"tiny document {i}." for i in range(n)])
            sizes = {k: write_split(work / f"{label}-{k}", lines, k) for k in counts}
            runs: dict[tuple[str, int], list] = {(t, k): [] for t, _ in trees for k in counts}
            for _ in range(args.repeat):  # interleaved: a change of load hits every case
                for name, tree in trees:
                    for k in counts:
                        runs[name, k].append(tokenize(work / f"{label}-{k}",
                                                      work / f"out-{label}-{k}-{name}", tree,
                                                      args.workers))
            for name, _ in trees:
                base = min(r[0] for r in runs[name, counts[0]])
                base_cpu = min(r[1]["cpu_seconds"] for r in runs[name, counts[0]])
                for k in counts:
                    rows.append(_row(label, n, k, sizes[k], runs[name, k], base, base_cpu, name))
    print(f"load average at end: {_load()}", flush=True)
    body = {"bench": "tokenize_files_cpu", "tree": args.tree, "before": args.before,
            "workers": args.workers, "load_average_end": _load(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(body, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
