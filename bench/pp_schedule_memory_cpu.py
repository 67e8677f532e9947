"""Does the planner's memory of the pipeline schedules match what the trainer holds?

Trains a few steps of a small model on 2 CPU ranks (gloo, PP 2, the debug preset's width with
8 layers, so each rank holds 4 blocks, in 2 virtual stages where the schedule has them), with
enough tokens per micro-batch that the activations dominate the peak, under each schedule:
GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble. For each it reports the
trainer's `peak_mem_gib` (the resident set's peak above its baseline: rank 0, which logs it,
the first stage, and rank 1, read by bench/_rank_peak.py) against each stage's `peak` that
`train --dry-run --json` plans for the same flags (its `stages` list), as
tests/plan/memory/distributed/test_cpu_peak.py compares them (glibc's mmap threshold pinned, so
freed tensors leave the resident set).

The search proposes the zero-bubble schedules because their plan is within 10 % of each
rank's measured peak here (docs/plan.md, "Pipeline memory per stage").

    python bench/pp_schedule_memory_cpu.py [--schedules ZBVZeroBubble ...]
    python bench/pp_schedule_memory_cpu.py --microbatches 32 --steps 2 \
        --results bench/results/pp_schedule_memory_cpu_m32.json

Raw output: bench/results/pp_schedule_memory_cpu.json (and _m32.json: the receive buffers and
held sends grow with the micro-batches); the table: bench/results/pp_schedule_memory_cpu.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "pp_schedule_memory_cpu.json"
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2,
             "ZBVZeroBubble": 2}
MIB = 2**20


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "MALLOC_MMAP_THRESHOLD_": "131072"}


def flags(out: Path, cache: Path, schedule: str, vpp: int, seq: int, mbs: int,
          microbatches: int, steps: int) -> list[str]:
    return ["--model.name", "debug", "--model.n_layers", "8",
            "--output", str(out), "--data.cache_dir", str(cache), "--data.max_bytes", "600000",
            "--data.seq_len", str(seq), "--data.curate", "false",
            "--training.steps", str(steps), "--training.eval_interval", "0",
            "--training.micro_batch_size", str(mbs),
            "--training.grad_accum_steps", str(microbatches),
            "--training.sample_tokens", "0", "--checkpoint.interval", "0",
            "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.log_interval", "1",
            "--parallel.pp", "2", "--parallel.pp_schedule", schedule,
            "--parallel.pp_virtual_stages", str(vpp)]


def planned(argv: list[str]) -> dict[str, Any]:
    env = {**_env(), "WORLD_SIZE": "2"}
    env.pop("LOCAL_WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--dry-run", "--json",
                           *argv], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode not in (0, 3):
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout)


def measured(argv: list[str], steps: int, env: dict[str, str] | None = None,
             world: int = 2) -> list[float]:
    """Each rank's peak above its baseline (bytes): rank 0's as the trainer logs it, checked
    against the wrapper's reading of the same quantity, which also gives the other ranks'.
    `env`: the ranks' environment (default: this bench's, glibc's mmap threshold pinned)."""
    out = Path(argv[argv.index("--output") + 1])
    peaks = out.parent / f"{out.name}-peaks"
    peaks.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(world), str(ROOT / "bench" / "_rank_peak.py"), "train", *argv]
    done = subprocess.run(cmd, env={**(env or _env()), "RANK_PEAK_DIR": str(peaks)},
                          capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == steps
    logged = max(m["peak_mem_gib"] for m in lines) * 2**30
    ranks = [json.loads((peaks / f"rank{r}.json").read_text())["peak_above_bytes"]
             for r in range(world)]
    assert abs(ranks[0] - logged) <= 0.02 * logged, (ranks[0], logged)
    return ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for schedule in a.schedules:
            vpp = SCHEDULES[schedule]
            argv = flags(Path(tmp) / schedule, cache, schedule, vpp, a.seq, a.mbs,
                         a.microbatches, a.steps)
            plan = planned(argv)
            mem = plan["memory_bytes"]
            ranks = measured(argv, a.steps)
            peak = max(ranks)
            by_stage = [s["memory_bytes"]["peak"] for s in plan["stages"]]
            rows[schedule] = {
                "vpp": vpp, "measured_peak_mib_by_rank": [r / MIB for r in ranks],
                "measured_peak_mib": peak / MIB,
                "planned_peak_mib_by_rank": [b / MIB for b in by_stage],
                "plan_over_measured_by_rank": [b / r for b, r in zip(by_stage, ranks)],
                "held_at_peak_by_rank": [s["held_at_peak"] for s in plan["stages"]],
                "planned_peak_mib": mem["peak"] / MIB,
                "planned_activations_mib": mem["activations"] / MIB,
                "planned_logits_loss_mib": mem["logits_loss"] / MIB,
                "plan_over_measured": mem["peak"] / peak,
            }
            print(f"{schedule:>22} vpp {vpp}: measured rank 0 {ranks[0] / MIB:7.1f}, rank 1 "
                  f"{ranks[1] / MIB:7.1f} MiB; planned rank 0 {by_stage[0] / MIB:7.1f}, rank 1 "
                  f"{by_stage[1] / MIB:7.1f} MiB (plan / measured {by_stage[0] / ranks[0]:.3f}, "
                  f"{by_stage[1] / ranks[1]:.3f}); most loaded: planned {mem['peak'] / MIB:.1f} "
                  f"/ measured {peak / MIB:.1f} = {mem['peak'] / peak:.3f}", flush=True)
    result = {"setup": {"model": "debug, 8 layers", "ranks": 2, "pp": 2, "seq": a.seq,
                        "mbs": a.mbs, "microbatches": a.microbatches, "steps": a.steps},
              "schedules": rows}
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
