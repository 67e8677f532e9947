"""`scaletrain launch --slurm` writes a runnable sbatch script."""

from __future__ import annotations

import subprocess
from pathlib import Path

from scaletrain.cli import main


def test_launch_writes_sbatch_script(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    rc = main(["launch", "--slurm", "--nodes", "4", "--gpus-per-node", "8", "--out", str(out),
               "--", "--parallel.tp", "8", "--output", "runs/my run"])
    assert rc == 0
    text = out.read_text()
    assert "#SBATCH --nodes=4" in text and "--nproc_per_node 8" in text
    assert "--rdzv_backend c10d" in text
    assert "-m scaletrain train --parallel.tp 8 --output 'runs/my run'" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0  # valid shell
    # The preemption loop: signal before the limit, requeue, torchrun restarts.
    assert "#SBATCH --signal=USR1@180" in text and "#SBATCH --requeue" in text
    assert "--max_restarts 3" in text and "SIGUSR1 --shutdown_timeout 150" in text
    assert "marker='runs/my run/preempted.json'" in text and 'scontrol requeue' in text
    # The log directory exists (Slurm does not create it) and is named absolutely.
    assert f"#SBATCH --output={tmp_path / 'slurm-logs'}/%x-%j.out" in text
    assert (tmp_path / "slurm-logs").is_dir()


def test_launch_checks_the_training_arguments_first(tmp_path: Path, capsys) -> None:
    out = tmp_path / "job.sbatch"
    argv = ["launch", "--slurm", "--nodes", "2", "--gpus-per-node", "8", "--out", str(out), "--"]
    assert main([*argv, "--parallel.tp", "3"]) == 2  # 16 ranks do not split into TP 3
    assert "do not run on 16 ranks" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--model.name", "llama9"]) == 2
    assert "unknown preset 'llama9'" in capsys.readouterr().err and not out.exists()
