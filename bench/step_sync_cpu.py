"""Training-loop throughput with and without a host synchronization in every step.

Runs `Trainer.train()` of a scaletrain source tree (`--root`) in a subprocess and reads the
step times it wrote to `metrics.jsonl`; the steps after `--warmup` are counted. Give two trees
to compare: the tree before the step path stopped reading the loss and gradient norm back every
step, and this one. Runs alternate A, B, A, B so drifts in machine load hit both alike.

    git archive <commit-before> | tar -x -C /tmp/before
    python bench/step_sync_cpu.py --root before=/tmp/before --root after=.

Prints a table and writes raw JSON (default bench/results/step_sync_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "step_sync_cpu.json"

CHILD = """
import json, sys, time
from pathlib import Path
from scaletrain.config import load_config
from scaletrain.train.trainer import Trainer
argv = json.loads(sys.argv[1])
trainer = Trainer(load_config(argv))
trainer.train()
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", required=True,
                   help="LABEL=PATH of a scaletrain source tree (give two)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (warmup included)")
    p.add_argument("--warmup", type=int, default=10, help="first steps not counted")
    p.add_argument("--repeats", type=int, default=2, help="runs per tree (alternating)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--cache-dir", default=None, help="data cache (default: data.cache_dir's)")
    p.add_argument("--extra", default="", help="more config flags, space-separated")
    p.add_argument("--json", default=str(RESULTS))
    return p.parse_args(argv)


def config_argv(out: Path, args: argparse.Namespace) -> list[str]:
    """The demo's model and data (the `debug` preset), small evaluation, no checkpoints."""
    cache = ["--data.cache_dir", args.cache_dir] if args.cache_dir else []
    return ["--output", str(out), *cache,
            "--training.steps", str(args.steps), "--training.eval_interval", "0",
            "--training.sample_tokens", "0", "--checkpoint.interval", "0",
            "--checkpoint.save_final", "false", "--metrics.tensorboard", "false",
            "--metrics.progress_bar", "false", "--metrics.log_interval", str(args.log_interval),
            "--precision.dtype", "fp32", *args.extra.split()]


def eval_flag(root: Path) -> list[str]:
    """The tree's flag for a small evaluation (renamed from eval_batches to eval_sequences)."""
    text = (root / "scaletrain" / "config_sections.py").read_text()
    return (["--training.eval_sequences", "8"] if "eval_sequences" in text
            else ["--training.eval_batches", "1"])


def run(root: Path, argv: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], env=env, cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run in {root} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    roots = dict(r.split("=", 1) for r in args.root)
    tmp = Path(tempfile.mkdtemp(prefix="step-sync-"))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in roots}
    for rep in range(args.repeats):
        for label, path in roots.items():
            root = Path(path).resolve()
            out = tmp / f"{label}-{rep}"
            argv_ = config_argv(out, args) + eval_flag(root)
            lines = run(root, argv_, out)
            counted = [m for m in lines if m["step"] > args.warmup]
            seconds = sum(m["step_time_s"] for m in counted)
            tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in counted)
            runs[label].append({"steps": len(counted), "seconds": seconds,
                                "tokens_per_s": tokens / seconds,
                                "losses": [m["loss"] for m in lines]})
    summary = {label: statistics.median(r["tokens_per_s"] for r in rs)
               for label, rs in runs.items()}
    print(f"{'tree':10s} {'tokens/s (median)':>18s}  runs")
    for label, rs in runs.items():
        print(f"{label:10s} {summary[label]:18.0f}  "
              + ", ".join(f"{r['tokens_per_s']:.0f}" for r in rs))
    report = {"config": vars(args), "roots": roots, "summary_tokens_per_s": summary,
              "runs": runs, "environment": {"python": platform.python_version(),
                                            "cpu_count": os.cpu_count(),
                                            "load_average_at_end": os.getloadavg()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
