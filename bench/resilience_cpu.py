"""Seconds of training lost to a preemption and to a killed rank, under torchrun on CPU.

    python bench/resilience_cpu.py [--ranks 2] [--steps 24] [--interval 8] [--at 12]

Three runs of the same job (the `debug` model on the standard-library corpus, gloo):
- uninterrupted;
- a rank killed with SIGKILL before step `--at`: torchrun (`--max_restarts 1`) restarts every
  rank, which resume from the newest checkpoint (`--interval` steps apart) and redo the steps
  since;
- SIGTERM to torchrun once step `--at` is logged: the ranks checkpoint at the next step and exit
  75; the same command is run again and finishes.
"Lost" is each run's total wall time (both commands for the preemption) minus the
uninterrupted run's. The kill and stop go through tests/helpers/resilience_driver.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(out: Path, a: argparse.Namespace, restarts: int, *driver: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(a.ranks), "--max_restarts", str(restarts), "-m", "tests.helpers.resilience_driver",
            *driver, "--train", "--output", str(out), "--training.steps", str(a.steps),
            "--checkpoint.interval", str(a.interval), "--metrics.progress_bar", "false",
            "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
            "--training.eval_sequences", "16", "--data.cache_dir", str(a.cache)]


def run(cmd: list[str], log: Path, stop_after_step: int | None = None) -> tuple[float, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t0 = time.perf_counter()
    with open(log, "a") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=err, stderr=subprocess.STDOUT)
    if stop_after_step is not None:
        metrics = Path(cmd[cmd.index("--output") + 1]) / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= stop_after_step:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)
    code = proc.wait()
    return time.perf_counter() - t0, code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--interval", type=int, default=8)
    p.add_argument("--at", type=int, default=12)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="resilience-"))
    a.cache = root / "cache"
    log = root / "runs.log"
    warm, _ = run(command(root / "warm", a, 0), log)  # builds the corpus cache once
    base, code = run(command(root / "base", a, 0), log)
    assert code == 0, log
    killed, code = run(command(root / "killed", a, 1, "--kill", f"1:{a.at}"), log)
    assert code == 0, log
    first, code1 = run(command(root / "preempted", a, 0), log, stop_after_step=a.at)
    marker = json.loads((root / "preempted" / "preempted.json").read_text())
    second, code2 = run(command(root / "preempted", a, 0), log)
    assert code2 == 0, log
    result = {
        "ranks": a.ranks, "steps": a.steps, "checkpoint_interval": a.interval, "at_step": a.at,
        "uninterrupted_s": round(base, 1),
        "killed_rank": {"total_s": round(killed, 1), "lost_s": round(killed - base, 1),
                        "steps_redone": a.at - 1 - (a.at - 1) // a.interval * a.interval},
        "preemption": {"stopped_after_step": marker["step"], "first_exit": code1,
                       "total_s": round(first + second, 1),
                       "lost_s": round(first + second - base, 1)},
        "step_time_s": round(base / a.steps, 2), "log": str(log)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
