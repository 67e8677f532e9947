"""The planner's pipeline bubble against torch's own schedules, for every schedule the trainer
offers, under equal and unequal forward / input-gradient / weight-gradient times.

    python bench/pipeline_bubble.py [--out bench/results/pipeline_bubble.txt]

`sim` is the bubble of the action order torch's schedule class runs, timed by the event
simulation of tests/helpers/pipeline_reference.py (F = T_F/v, I = T_B/v, W = T_W/v, a full backward
(T_B + T_W)/v, communication free); `plan` is `plan.estimate.bubble_fraction` with the same
times. No timings: the numbers are exact for the stated costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaletrain.plan.estimate import bubble_fraction  # noqa: E402
from tests.helpers.pipeline_reference import torch_bubble  # noqa: E402

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2),
             ("InterleavedZeroBubble", 1), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]
COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0)]
PM = [(4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32)]


def rows() -> list[str]:
    out = [f"{'schedule':<22} {'v':>2} {'p':>2} {'m':>3} {'T_F:T_B:T_W':>12} "
           f"{'sim':>8} {'plan':>8} {'plan/sim':>8}"]
    for name, v in SCHEDULES:
        for p, m in PM:
            for costs in COSTS:
                sim = torch_bubble(name, p, m, v, *costs)
                plan = bubble_fraction(p, m, v, name, costs)
                ratio = plan / sim if sim else float("nan")
                label = ":".join(f"{c:g}" for c in costs)
                out.append(f"{name:<22} {v:>2} {p:>2} {m:>3} {label:>12} {sim:>8.4f} "
                           f"{plan:>8.4f} {ratio:>8.3f}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    a = ap.parse_args(argv)
    text = "\n".join(rows())
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
