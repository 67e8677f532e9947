"""Predicted against published TFLOP/s per GPU for every row of the calibration table, and where
the search ranks each published layout among the layouts it evaluates.

    python bench/plan_calibration.py [--rank] [--json bench/results/plan_calibration.json]

`--rank` runs the layout search for each run's model, cluster and batch and prints the rank the
published layout's predicted step time would take among the fitting layouts (1 = the search's
first choice); it takes a few seconds per row.
"""

from __future__ import annotations

import argparse
import json
import time

from scaletrain.plan.calibration import BAND, load_runs, predict
from scaletrain.plan.estimate import Layout
from scaletrain.plan.search import search


def search_rank(pred) -> tuple[int, int, float]:
    """(rank of the published layout among the fitting layouts, how many fit, search seconds)."""
    run = pred.run
    t0 = time.perf_counter()
    fitting, _ = search(run.model_args(), run.cluster(), run.seq_len, run.gbs * run.seq_len,
                        Layout(precision="bf16"))
    elapsed = time.perf_counter() - t0
    faster = sum(1 for c in fitting if c.step_time_s < pred.step_time_s * 0.995)
    return faster + 1, len(fitting), elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    print(f"band {BAND[0]}-{BAND[1]}")
    print(f"{'run':<44} {'gpu':<15} {'meas':>6} {'pred':>6} {'ratio':>6}"
          + ("  rank/fit" if a.rank else ""))
    for run in load_runs():
        pred = predict(run)
        row = {"name": run.name, "gpu": run.gpu, "gpus": run.gpus, "measured": pred.measured_tflops,
               "predicted": round(pred.predicted_tflops, 1), "ratio": round(pred.ratio, 3),
               "flops": run.flops, "source": run.source,
               "times_s": {k: round(v, 4) for k, v in pred.times.items()}}
        line = (f"{run.name:<44} {run.gpu:<15} {pred.measured_tflops:>6.0f} "
                f"{pred.predicted_tflops:>6.0f} {pred.ratio:>6.2f}")
        if a.rank:
            rank, fit, secs = search_rank(pred)
            row.update(rank=rank, fitting=fit, search_s=round(secs, 2))
            line += f"  {rank}/{fit}"
        print(line, flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
