"""`scaletrain launch --slurm --nodes N --gpus-per-node G [...] -- TRAIN_ARGS`: write an sbatch
script that starts `scaletrain train` under torchrun on every node (c10d rendezvous on the
first node). The training arguments are checked first (the config, and that its layout divides
the N x G ranks), so a typo fails here rather than after the queue. The script survives
preemption and crashes: Slurm signals the ranks before the time limit, they checkpoint and the
script requeues the job; torchrun restarts crashed ranks; every start resumes from the newest
checkpoint. Nothing is submitted: run `sbatch <script>` yourself."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from scaletrain.train.preemption import MARKER_NAME

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time}
#SBATCH --output={log_dir}/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@{grace}
#SBATCH --requeue
{partition}
# Written by `scaletrain launch`. One torchrun per node; torchrun starts {gpus} ranks there.
# Preemption: {grace} s before the time limit Slurm sends SIGUSR1 (SIGTERM when it preempts the
# job); the ranks save a checkpoint at the next step boundary and exit 75, leaving
# {marker}; this script then requeues the job, and the requeued job continues from
# that checkpoint (checkpoint.resume auto). A rank that crashes makes torchrun restart all
# ranks (up to {restarts} times), again from the newest checkpoint.
set -uo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node MASTER_PORT={port}
export OMP_NUM_THREADS=1
# A fresh rendezvous store per restart: with the shared one a restarted rank reads the previous
# start's addresses and cannot connect (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
marker={marker}
rm -f "$marker"
status=0
srun torchrun \\
  --nnodes "$SLURM_NNODES" --nproc_per_node {gpus} \\
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_node:{port}" \\
  --max_restarts {restarts} \\
  --signals_to_handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown_timeout {shutdown} \\
  -m scaletrain train {train_args} || status=$?
if [ -e "$marker" ]; then
  echo "scaletrain: stopped for preemption ($(cat "$marker")); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""


def render(nodes: int, gpus: int, train_args: list[str], *, output: str = "runs/train",
           job_name: str = "scaletrain", time: str = "24:00:00", partition: str | None = None,
           cpus: int = 16, port: int = 29500, log_dir: str = "slurm-logs", restarts: int = 3,
           grace_s: int = 180) -> str:
    """The sbatch script; `grace_s`: how long before the time limit the ranks are told to
    checkpoint and stop (torchrun waits that long, less a margin, before killing them)."""
    return TEMPLATE.format(
        job_name=job_name, nodes=nodes, gpus=gpus, cpus=cpus, time=time, port=port,
        log_dir=log_dir, partition=f"#SBATCH --partition={partition}" if partition else "",
        train_args=" ".join(shlex.quote(a) for a in train_args), restarts=restarts,
        grace=grace_s, shutdown=max(grace_s - 30, 10),
        marker=shlex.quote(str(Path(output) / MARKER_NAME)),
    )


def check_train_args(train_args: list[str], world_size: int) -> tuple[str | None, str]:
    """(why `scaletrain train TRAIN_ARGS` would stop at once on `world_size` ranks or None,
    the run's output directory). A flag the config does not know exits here with the train
    parser's message."""
    from scaletrain.config import ConfigError, load_config
    from scaletrain.plan.from_config import dims_from_config
    from scaletrain.plan.layout import PlanError

    try:
        cfg = load_config(train_args)
        dims_from_config(cfg, world_size)
    except (ConfigError, PlanError) as e:
        return str(e), ""
    if not cfg.checkpoint.signals:
        return ("checkpoint.signals is empty: the ranks could not checkpoint before Slurm stops "
                "the job; keep the default (SIGTERM, SIGUSR1)"), ""
    return None, cfg.output


def main(argv: list[str]) -> int:
    train_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="scaletrain launch", description=__doc__)
    p.add_argument("--slurm", action="store_true", required=True,
                   help="write a Slurm sbatch script (the only launcher so far)")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--partition")
    p.add_argument("--time", default="24:00:00", help="Slurm time limit")
    p.add_argument("--job-name", default="scaletrain")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    p.add_argument("--out", default="scaletrain.sbatch", help="script to write")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="torchrun restarts of all ranks after a rank fails (each resumes from "
                        "the newest checkpoint)")
    p.add_argument("--grace", type=int, default=180,
                   help="seconds before the time limit at which Slurm tells the ranks to "
                        "checkpoint and stop (SIGUSR1); the job is then requeued")
    a = p.parse_args(argv)
    if a.nodes <= 0 or a.gpus_per_node <= 0:
        print("scaletrain launch: --nodes and --gpus-per-node must be positive", file=sys.stderr)
        return 2
    if a.max_restarts < 0 or a.grace < 40:
        print("scaletrain launch: --max-restarts must not be negative and --grace must be at "
              "least 40 seconds", file=sys.stderr)
        return 2
    world = a.nodes * a.gpus_per_node
    problem, output = check_train_args(train_args, world)
    if problem:
        print(f"scaletrain launch: the training arguments do not run on {world} ranks: "
              f"{problem}", file=sys.stderr)
        return 2
    out = Path(a.out)
    # Slurm does not create the --output directory (a job whose log cannot open fails).
    log_dir = out.resolve().parent / "slurm-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    text = render(a.nodes, a.gpus_per_node, train_args, output=output, job_name=a.job_name,
                  time=a.time, partition=a.partition, port=a.port, log_dir=str(log_dir),
                  restarts=a.max_restarts, grace_s=a.grace)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    tmp.rename(out)
    print(f"wrote {out} ({a.nodes} nodes x {a.gpus_per_node} GPUs = {world} ranks, logs in "
          f"{log_dir}); submit with: sbatch {out}")
    return 0
