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
